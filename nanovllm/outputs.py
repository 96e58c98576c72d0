"""What the engine returns, shaped like vLLM's: a RequestOutput per request, holding a
CompletionOutput per generated sample, and the request's timings. `out["text"]` and
`out["token_ids"]` (nano-vllm's dicts) still work: they read the first sample."""
from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int                  # which sample of the request (n > 1), or which beam, best first
    text: str
    token_ids: list[int]        # generated only (an end-of-sequence token included)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per token, when SamplingParams.logprobs is set
    finish_reason: str | None = None   # "stop", "length" or "abort"; None while it runs
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def __getitem__(self, key: str):
        return getattr(self, key)  # nano-vllm's dict access


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic) of one request, and the latencies made from them."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0  # of the first sample

    @property
    def queue_time(self) -> float | None:
        scheduled = self.first_scheduled_time
        return None if scheduled is None else scheduled - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (TPOT)."""
        if self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics = field(repr=False, default=None)

    def __getitem__(self, key: str):
        """nano-vllm's dict access: the first sample's fields, or the request's."""
        return getattr(self.outputs[0] if hasattr(self.outputs[0], key) else self, key)
