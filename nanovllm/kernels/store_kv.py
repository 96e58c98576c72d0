"""Write side of PagedAttention, with the rotary embedding fused in: one kernel per layer turns the
qkv projection into rotated queries and writes the rotated keys and the values into their cache
slots.

The scheduler gives every new token a flat slot, `block_id * block_size + offset`, in
`slot_mapping`; slot -1 marks padding (the unused rows of a CUDA-graph batch) and is skipped. Rotary
(neox layout) and Qwen3's per-head RMSNorm before it are elementwise per head, so each head is read
once and written once. nanovllm/layers/rotary.py holds the plain PyTorch version (the CPU path and
the reference of the tests).
"""
import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_for_inputs


@triton.jit
def _rope_store_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, q_ptr, k_cache_ptr,
    v_cache_ptr, slot_mapping_ptr, eps, stride_t, inv_k_scale, inv_v_scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    QK_PAD: tl.constexpr, KV_PAD: tl.constexpr, HAS_NORM: tl.constexpr, FP8: tl.constexpr,
    ROUND: tl.constexpr, PDL: tl.constexpr = False,
):
    # One program per token: its query and key heads as one [QK_PAD, HEAD_DIM / 2] tile per half
    # of a head.
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, QK_PAD)[:, None]  # query heads, then key heads
    dims = tl.arange(0, HALF)[None, :]
    is_qk, is_q = heads < NUM_HEADS + NUM_KV_HEADS, heads < NUM_HEADS
    row = qkv_ptr + token * stride_t + heads * HEAD_DIM + dims
    x1 = tl.load(row, mask=is_qk, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF, mask=is_qk, other=0.0).to(tl.float32)
    if HAS_NORM:  # RMSNorm of each head, its weight chosen by the head's kind
        scale = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1))[:, None] / HEAD_DIM + eps)
        x1 *= scale * tl.where(is_q, tl.load(q_weight_ptr + dims),
                               tl.load(k_weight_ptr + dims)).to(tl.float32)
        x2 *= scale * tl.where(is_q, tl.load(q_weight_ptr + HALF + dims),
                               tl.load(k_weight_ptr + HALF + dims)).to(tl.float32)
    angles = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * HEAD_DIM + dims
    cos, sin = tl.load(angles), tl.load(angles + HALF)
    y1 = (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty)
    q_out = q_ptr + token * NUM_HEADS * HEAD_DIM + heads * HEAD_DIM + dims
    tl.store(q_out, y1, mask=is_q)
    tl.store(q_out + HALF, y2, mask=is_q)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * row size can pass 2**31
    if slot >= 0:
        is_k = is_qk & (heads >= NUM_HEADS)
        k_out = k_cache_ptr + slot * NUM_KV_HEADS * HEAD_DIM + (heads - NUM_HEADS) * HEAD_DIM + dims
        tl.store(k_out, _to_cache(y1, inv_k_scale, k_cache_ptr, FP8, ROUND), mask=is_k)
        tl.store(k_out + HALF, _to_cache(y2, inv_k_scale, k_cache_ptr, FP8, ROUND), mask=is_k)
        kv_heads = tl.arange(0, KV_PAD)[:, None]
        full = tl.arange(0, HEAD_DIM)[None, :]
        is_v = kv_heads < NUM_KV_HEADS
        v_row = qkv_ptr + token * stride_t + (NUM_HEADS + NUM_KV_HEADS + kv_heads) * HEAD_DIM
        v = tl.load(v_row + full, mask=is_v)
        tl.store(v_cache_ptr + slot * NUM_KV_HEADS * HEAD_DIM + kv_heads * HEAD_DIM + full,
                 _to_cache(v, inv_v_scale, v_cache_ptr, FP8, ROUND), mask=is_v)


@triton.jit
def _to_cache(x, inv_scale, cache_ptr, FP8: tl.constexpr, ROUND: tl.constexpr):
    """x as the cache stores it: itself, or in an FP8 cache x / scale, saturated and rounded to
    nearest (fp8.py): by the cast on a GPU, by _round_to_e4m3 first in the interpreter (ROUND)."""
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)
        if ROUND:
            x = _round_to_e4m3(x)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, halves away from zero, in float32.

    For Triton's CPU interpreter, whose cast truncates (and loses the carry of 127.5 -> 128): the
    cast that follows is then exact. e4m3 has 3 mantissa bits: the step between values of exponent
    e is 2^(e - 3), and below 2^-6 (subnormals) it stays 2^-9. A GPU's cast rounds to nearest, ties
    to even, as torch does; this function there (its exp2 and division are approximate) left 1% of
    values a step off torch's at scales of 0.7 and 1.3, and cost 0.7-6 us a layer more
    (benchmarks/results/h100_fp8_store_cast.log)."""
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = tl.exp2((exponent - 3).to(tl.float32))
    return tl.where(x < 0, -1.0, 1.0) * tl.floor(tl.abs(x) / step + 0.5) * step


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
               q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
               eps: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """qkv [N, num_heads + 2 * num_kv_heads, D] (queries, keys, values): rotate the query and key
    heads by the angles of their positions (cos_sin [max_position, D]: cos | sin), after RMSNorms
    with q_weight and k_weight if given; write keys and values to cache slots `slot_mapping` [N] (-1
    = skip); return the queries [N, num_heads, D] (an FP8 cache gets keys / k_scale and values /
    v_scale, saturated: attention/fp8.py)."""
    num_tokens, num_all_heads, head_dim = qkv.shape
    num_kv_heads = (num_all_heads - num_heads) // 2
    assert qkv.stride(2) == 1 and qkv.stride(1) == head_dim and slot_mapping.shape == (num_tokens,)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and cos_sin.shape[1] == head_dim
    assert head_dim & (head_dim - 1) == 0, "tl.arange needs a power-of-two head_dim"
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    has_norm = q_weight is not None
    _rope_store_kernel[(num_tokens,)](
        qkv, positions, cos_sin, q_weight if has_norm else qkv, k_weight if has_norm else qkv, q,
        k_cache, v_cache, slot_mapping, eps, qkv.stride(0), 1 / k_scale, 1 / v_scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        QK_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
        KV_PAD=triton.next_power_of_2(num_kv_heads),
        HAS_NORM=has_norm, FP8=k_cache.dtype == torch.float8_e4m3fn,
        ROUND=os.environ.get("TRITON_INTERPRET") == "1", **pdl_launch(qkv.device, num_tokens),
    )
    return q
