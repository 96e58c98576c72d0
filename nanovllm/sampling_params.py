"""How one request is decoded (vLLM's SamplingParams): temperature, truncation, penalties, stopping,
seeding, the number of parallel samples, the log-probabilities to report, and how its outputs
stream.

Every value is bounded here, or against the model when the request is added
(nanovllm/engine/input_processor.py: top_k, logprobs and stop_token_ids against the vocabulary), so
that no request can make the batch tensors of a step it shares overflow or turn to NaN.
"""
from dataclasses import dataclass
from typing import Literal

from nanovllm.utils.checks import at_least, check_fields, rule

# temperatures below it sample greedily (vLLM's _SAMPLING_EPS): logits divided by less overflow
# float32, and a softmax of infinities is NaN
SAMPLING_EPS = 1e-5
FLOAT32_MAX = 3.4028234663852886e38  # temperatures land in a float32 tensor; -inf / inf is NaN


@dataclass(slots=True)
class SamplingParams:
    # parallel samples of the prompt; they share its KV blocks
    n: int = at_least(1, default=1)
    temperature: float = rule(1.0, lambda v: 0 <= v <= FLOAT32_MAX,
                              "a number in [0, 3.4e38] (below 1e-05: greedy)")
    top_p: float = rule(1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k: int = rule(-1, lambda v: v >= -1, "-1 or 0 (all tokens) or a positive integer")
    min_p: float = rule(0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    # OpenAI's: subtracted once from every token already generated
    presence_penalty: float = rule(0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0 is off)")
    # OpenAI's: subtracted per occurrence in the generated tokens
    frequency_penalty: float = rule(0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0 is off)")
    # transformers': logits of seen tokens divided (or multiplied) by it; bounded so that a
    # logit divided by it and by the temperature stays a finite float32
    repetition_penalty: float = rule(1.0, lambda v: 1e-3 <= v <= 1e3,
                                     "a number in [0.001, 1000] (1 is off)")
    # the same seed, the same tokens (whatever else is in the batch); 64 bits, signed or not
    seed: int | None = rule(None, lambda v: v is None or -2**63 <= v < 2**64,
                            "None or an integer in [-2**63, 2**64)")
    # strings that end the text (not included in it)
    stop: list[str] = rule([], lambda v: all(isinstance(s, str) and s for s in v),
                           "a string or a list of non-empty strings")
    stop_token_ids: list[int] = rule([], lambda v: all(type(t) is int and t >= 0 for t in v),
                                     "a list of token ids >= 0")
    ignore_eos: bool = False
    max_tokens: int = at_least(1, default=64)
    # no end-of-sequence or stop token before this many tokens
    min_tokens: int = at_least(0, default=0)
    # per token: the chosen token's log-probability and the top ones
    logprobs: int | None = rule(None, lambda v: v is None or v >= 0, "None or an integer >= 0")
    skip_special_tokens: bool = True
    # what step() reports: the text so far, only what is new, or only the end
    output_kind: Literal["cumulative", "delta", "final"] = "cumulative"

    def __post_init__(self):
        if isinstance(self.stop, str):  # one stop string
            self.stop = [self.stop]
        check_fields(self)  # a tuple passes for a list: it becomes one
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens="
                             f"{self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (nanovllm/layers/penalties.py)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0 or self.min_tokens > 0)
