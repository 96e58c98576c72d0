"""Request timings and the engine's token counts, kept with `log_stats=True` (vLLM v1 keeps them
only when it logs stats; the server turns them on): each RequestOutput's `metrics` (arrival, first
scheduled, first and last token, finished; queue time, TTFT, TPOT, end-to-end latency), and the
prompt, cached and generated token totals that `get_stats()` reports.
"""
import time
from dataclasses import dataclass


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



class Stats:
    """The engine's hooks: a request queued, a step launched, a step's tokens read."""

    def __init__(self):
        self.num_prompt_tokens = self.num_cached_tokens = self.num_generation_tokens = 0  # so far

    def arrived(self, seq):
        seq.metrics = RequestMetrics(time.monotonic())

    def launched(self, batch):
        """Note the requests that a step schedules for the first time."""
        for seq in batch.seqs:
            if seq.metrics is not None and seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
                self.num_prompt_tokens += seq.num_prompt_tokens
                self.num_cached_tokens += seq.num_cached_tokens

    def read(self, new_tokens: list, outputs: list):
        """Time the new tokens (a request's follow its first sample) and the requests that ended."""
        self.num_generation_tokens += len(new_tokens)
        now = time.monotonic()
        for seq, _ in new_tokens:
            metrics = seq.group[0].metrics
            if seq is seq.group[0] and metrics is not None:
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                metrics.num_output_tokens += 1
        for out in outputs:
            if out.finished and out.metrics is not None:
                out.metrics.finished_time = now


def engine_counts(engine) -> Stats | None:
    """The engine's token counts: its Stats observer (log_stats=True), or None."""
    return next((o for o in engine.observers if isinstance(o, Stats)), None)
