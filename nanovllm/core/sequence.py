"""A request's sequence: its token ids, its progress and its block table (the logical-to-physical
map of PagedAttention, the vLLM paper's section 4.2).

A request with several outputs (parallel samples, or the beams of a beam search) is a *group* of
sequences that share KV blocks (nanovllm/core/sharing.py). A token that a step samples stands in
`token_ids` as a placeholder until the engine reads the step's tokens: `placeholder(i)` for its
index i among the model runner's sampled tokens (with async_scheduling the next steps are launched
meanwhile and fill them on the device: nanovllm/worker/run_ahead.py).
"""
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()   # its blocks sit in the CPU pool (nanovllm/core/swap.py)
    FINISHED = auto()


def placeholder(i: int) -> int:
    """What stands for the token at index i of the sampled tokens of the steps not read yet."""
    return -(i + 1)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens."""
    return (num_tokens + block_size - 1) // block_size


class Sequence:
    """Token ids, progress and the block table of one generation."""
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int,
                 max_model_len: int = 1 << 62, prompt: str | None = None):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.max_len = min(len(token_ids) + params.max_tokens, max_model_len)  # it ends there
        self.params = params
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0    # prompt tokens served from the prefix cache
        self.num_hashed_blocks = 0    # leading full blocks registered in the prefix cache
        self.finish_reason = self.stop_reason = None  # CompletionOutput's (nanovllm/outputs.py)
        self.stream = None            # its text as it goes, if it streams (engine/streaming.py)
        self.request_id: int | str = self.seq_id  # the root's: the request's id, prompt and timings
        self.prompt, self.prompt_token_ids, self.metrics = prompt, list(token_ids), None
        self.group: list[Sequence] = [self]  # the request's sequences; [0] is the root
        self.sample_index = 0   # which sample of the request (seeds its sampler with the seed)
        self.beam_width = 0     # > 0: a beam; the engine reports candidates, beam search appends
        self.candidates: dict[int, float] | None = None  # a beam's next tokens -> log-probability
        self.logprobs: list[dict[int, float]] = []  # per generated token, if params.logprobs
        self.cumulative_logprob = 0.0

    def __len__(self):
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int) -> list[int]:
        """The token ids stored in the sequence's i-th block."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def set_token(self, position: int, token_id: int, logprobs: dict[int, float] | None = None):
        """Put a sampled token where its placeholder is (nanovllm/worker/run_ahead.py)."""
        self.token_ids[position] = token_id
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]
