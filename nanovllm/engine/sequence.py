"""A request's token sequence and its block table (the logical-to-physical map of PagedAttention).

While a step runs, each token it samples is a placeholder in `token_ids`: -(r + 1), row r of the
step's output, which the next step reads on the device (the engine schedules one step ahead).

A request with several outputs (parallel samples, or the beams of a beam search) is a *group* of
sequences made by `fork`: a child starts as a copy of its parent's tokens and, through
`BlockManager.fork`, shares its parent's KV blocks.
"""
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()   # its blocks sit in the CPU pool; its block table holds CPU block ids
    FINISHED = auto()


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens."""
    return (num_tokens + block_size - 1) // block_size


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The KV-cache slot of the token at `position`: its block's first slot plus its offset."""
    return block_table[position // block_size] * block_size + position % block_size


class Sequence:
    """Token ids, progress and the block table of one generation."""
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0    # prompt tokens served from the prefix cache
        self.num_hashed_blocks = 0    # leading full blocks registered in the prefix cache
        self.finish_reason: str | None = None
        self.group: list[Sequence] = [self]  # the request's sequences, shared by all of them; [0] is the root
        self.sample_index = 0         # which of the request's samples (seeds the sampler with the request seed)
        self.beam_width = 0           # > 0: a beam; the engine reports next-token candidates, beam search appends
        self.candidates: dict[int, float] | None = None  # a beam's next tokens -> log-probability
        self.logprobs: list[dict[int, float]] = []  # per generated token, when params.logprobs is set
        self.cumulative_logprob = 0.0

    def fork(self) -> "Sequence":
        """A new member of the group with this sequence's tokens and progress (blocks: BlockManager.fork)."""
        child = Sequence(self.token_ids, self.params, self.block_size)
        child.num_prompt_tokens, child.status = self.num_prompt_tokens, self.status
        child.num_computed_tokens, child.num_cached_tokens = self.num_computed_tokens, self.num_cached_tokens
        child.num_hashed_blocks, child.beam_width = self.num_hashed_blocks, self.beam_width
        child.logprobs, child.cumulative_logprob = list(self.logprobs), self.cumulative_logprob
        child.group, child.sample_index = self.group, len(self.group)
        self.group.append(child)
        return child

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_group_size(self) -> int:
        """How many sequences the request may run at once: its samples, or its beams."""
        return max(self.params.n, self.beam_width)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int) -> list[int]:
        """The token ids stored in the sequence's i-th block."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None):
        self.token_ids.append(-1)
        self.set_token(len(self.token_ids) - 1, token_id, logprobs)

    def set_token(self, position: int, token_id: int, logprobs: dict[int, float] | None = None):
        """Put a sampled token where its placeholder is (see Scheduler.advance)."""
        self.token_ids[position] = token_id
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]
