"""Write side of PagedAttention: copy each new token's K and V into its slot of the block pool.

The scheduler gives every new token a flat slot, `block_id * block_size + offset`, in `slot_mapping`;
slot -1 marks padding (the unused rows of a CUDA-graph batch) and is skipped.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
):
    # One program per token: all its KV heads at once, HEADS_PAD x HEAD_DIM, a contiguous row of the cache.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * row size can pass 2**31
    if slot < 0:  # a padding token
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    mask = heads[:, None] < NUM_KV_HEADS
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    cache_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(k_cache_ptr + cache_offs, k, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k, v [N, num_kv_heads, head_dim] to the cache slots `slot_mapping` [N] (-1 = skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert head_dim & (head_dim - 1) == 0, "tl.arange needs a power-of-two head_dim"
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
    )
