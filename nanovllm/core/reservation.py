"""Reserved KV memory: the Orca baselines of the vLLM paper's evaluation (sections 3 and 6.1).

Before PagedAttention, a serving system kept a request's KV cache in one chunk, sized when the
request was admitted for the longest the request might grow. The paper compares vLLM with three
versions of Orca that differ only in how much they reserve (`kv_reservation`):

  "oracle"  the prompt and the true output length (here max_tokens, which a request that ignores
            the end-of-sequence token generates exactly);
  "pow2"    the prompt and the output length rounded up to a power of two (25 tokens reserve 32);
  "max"     the model's maximum sequence length (max_model_len, the prompt included).

`ReservingBlockManager` allocates a request's whole reservation when the scheduler admits it, so a
request is admitted only when its reservation fits, never needs another block while it runs (and so
is never preempted for one), and gives the reservation back when it ends. The blocks need not be
adjacent: this models the memory a reservation holds unused (the paper's Figure 2: reserved slots
and internal fragmentation), not the external fragmentation of Orca's buddy allocator.
"""
from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence, num_blocks_for


def reserved_tokens(mode: str, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """KV slots a request reserves at admission: its prompt and the output set aside for it."""
    if mode == "max":
        return max_model_len
    output = max_tokens if mode == "oracle" else 1 << (max_tokens - 1).bit_length()
    return min(num_prompt_tokens + output, max_model_len)


class ReservingBlockManager(BlockManager):
    """A block manager that gives each sequence its whole reservation when it is admitted."""

    def __init__(self, num_blocks: int, config: Config):
        super().__init__(num_blocks, config.kvcache_block_size, config.enable_prefix_caching)
        self.mode, self.max_model_len = config.kv_reservation, config.max_model_len
        need = num_blocks_for(self.max_model_len, self.block_size)
        if need > num_blocks:  # else a long request could wait forever for room it never finds
            raise ValueError(
                f"kv_reservation={self.mode!r} needs a KV cache that holds a request of "
                f"max_model_len={self.max_model_len} tokens ({need} blocks), but it has "
                f"{num_blocks} blocks; raise num_kvcache_blocks or lower max_model_len")

    def reservation(self, seq: Sequence) -> int:
        return reserved_tokens(self.mode, seq.num_prompt_tokens, seq.params.max_tokens,
                               self.max_model_len)

    def allocate(self, seq: Sequence, num_slots: int = 0) -> bool:
        """Blocks for the sequence's whole reservation; False (and none taken) if they don't fit."""
        return super().allocate(seq, max(num_slots, self.reservation(seq)))
