"""What the engine returns, shaped like vLLM's: a RequestOutput per request, holding a
CompletionOutput per generated sample (and the request's timings, with log_stats). `out["text"]` and
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
class RequestOutput:
    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: object = field(repr=False, default=None)  # with log_stats: engine/metrics.py

    def __getitem__(self, key: str):
        """nano-vllm's dict access: the first sample's fields, or the request's."""
        return getattr(self.outputs[0] if hasattr(self.outputs[0], key) else self, key)
