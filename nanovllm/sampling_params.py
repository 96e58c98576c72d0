"""How one request is decoded (vLLM's SamplingParams): temperature, truncation, penalties, stopping,
seeding, the number of parallel samples, the log-probabilities to report, and how its outputs
stream."""
import math
from dataclasses import dataclass, field
from typing import Literal

from nanovllm.utils.checks import check_fields

RULES = {  # argument: (test, what is allowed), after the field's type (nanovllm/utils/checks.py)
    "n": (lambda v: v >= 1, "an integer >= 1"),
    "temperature": (lambda v: 0 <= v < math.inf, "a finite number >= 0 (0 means greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: v >= -1, "-1 or 0 (all tokens) or a positive integer"),
    "min_p": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "a number in [-2, 2] (0 is off)"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "a number in [-2, 2] (0 is off)"),
    "repetition_penalty": (lambda v: 0 < v < math.inf, "a finite number > 0 (1 is off)"),
    "max_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "min_tokens": (lambda v: v >= 0, "an integer >= 0"),
    "logprobs": (lambda v: v is None or v >= 0, "None or an integer >= 0"),
    "stop": (lambda v: all(isinstance(s, str) and s for s in v),
             "a string or a list of non-empty strings"),
    "stop_token_ids": (lambda v: all(type(t) is int and t >= 0 for t in v),
                       "a list of token ids >= 0"),
}


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                      # parallel samples of the prompt; they share its KV blocks
    temperature: float = 1.0        # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                 # -1 (or 0): all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0   # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # transformers': logits of seen tokens divided (or times) by it
    seed: int | None = None         # the same seed, the same tokens (whatever else is in the batch)
    stop: list[str] = field(default_factory=list)  # strings that end the text (not included in it)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int = 64
    min_tokens: int = 0             # no end-of-sequence or stop token before this many tokens
    logprobs: int | None = None     # per token: the chosen token's log-probability and the top ones
    skip_special_tokens: bool = True
    # what step() reports: the text so far, only what is new, or only the end
    output_kind: Literal["cumulative", "delta", "final"] = "cumulative"

    def __post_init__(self):
        if isinstance(self.stop, str):  # one stop string
            self.stop = [self.stop]
        check_fields(self, RULES)  # a tuple passes for a list: it becomes one
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens="
                             f"{self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (nanovllm/layers/penalties.py)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0 or self.min_tokens > 0)
