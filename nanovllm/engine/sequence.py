"""A request's token sequence and its block table (the logical-to-physical map of PagedAttention)."""
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
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
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int) -> list[int]:
        """The token ids stored in the sequence's i-th block."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
