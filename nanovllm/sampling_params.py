"""How one request is decoded: temperature, truncation (top-k, top-p, min-p), stopping, seeding,
the number of parallel samples and the log-probabilities to report."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0      # 0 means greedy
    top_k: int = -1               # -1 (or 0): all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # strings that end the text (not included in it)
    seed: int | None = None       # the same seed gives the same tokens, whatever else is in the batch
    n: int = 1                    # parallel samples of the prompt; they share the prompt's KV blocks
    logprobs: int | None = None   # per token: the chosen token's log-probability and the top-`logprobs` ones

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off), 0 (off) or a positive integer")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be an integer >= 1")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n} must be an integer >= 1")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs={self.logprobs} must be None or an integer >= 0")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids} must be non-negative integers")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop} must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
