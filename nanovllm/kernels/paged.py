"""The paged-KV address rule, shared by the prefill and decode kernels.

The cache of one layer is a pool of blocks, `cache[num_blocks, block_size, num_kv_heads, head_dim]`;
key `i` of a sequence lives in block `block_table[i // block_size]` at offset `i % block_size`.
A tile of keys may span several blocks (block_size < tile) or sit inside one (block_size >= tile):
looking up the block of every key on its own handles both with one code path, and the lookups of
one tile mostly hit the same few block-table entries in L1.
"""
import triton
import triton.language as tl


@triton.jit
def kv_row_offsets(block_table_row, keys, key_mask, stride_block, stride_slot,
                   BLOCK_SIZE: tl.constexpr):
    """Element offset of each key's row (for one KV head) in the cache; int64 since the pool can
    pass 2**31."""
    block_ids = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    return block_ids * stride_block + (keys % BLOCK_SIZE) * stride_slot  # [BLOCK_N]
