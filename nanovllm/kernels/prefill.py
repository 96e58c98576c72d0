"""Causal varlen prefill attention over the paged KV cache (FlashAttention-2 with online softmax).

One program owns BLOCK_M queries of one sequence and one query head and walks the keys BLOCK_N at a
time, keeping a running max `m`, sum `l` and unnormalized output `acc` (online softmax), so the
[q_len, k_len] score matrix never exists. Scores are kept in base 2: log2(e) is folded into the
softmax scale once, and exp2 is the cheap instruction.

Every key is read through the block table, the ones cached by an earlier step (prefix-cache hit,
earlier chunk of a chunked prefill) and this step's (already written by `rope_store`) alike. So a
sequence may have q_len < k_len: its query j sits at position k_len - q_len + j and sees keys
0..that position. Keys past the last query of the tile are never loaded (the loop stops at the
causal diagonal), and only the tiles that straddle the diagonal pay for the mask.
"""
import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.paged import kv_row_offsets


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, block_table_row, start_n, k_len, q_pos, qk_scale,
                 stride_kb, stride_ks, dims,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr):
    """Fold keys start_n..start_n+BLOCK_N into the running (acc, m_i, l_i) of BLOCK_M queries."""
    keys = start_n + tl.arange(0, BLOCK_N)
    key_mask = keys < k_len
    rows = kv_row_offsets(block_table_row, keys, key_mask, stride_kb, stride_ks, BLOCK_SIZE)
    k = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)  # [BLOCK_N, D]
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if CAUSAL_MASK:
        s = tl.where((keys[None, :] <= q_pos[:, None]) & key_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + rows[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)  # [BLOCK_N, D]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt"])  # the table width changes from step to step
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr,
    cu_seqlens_q_ptr, cu_seqlens_k_ptr, block_tables_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    # The last query tiles see the most keys: launch them first so the short ones fill the tail.
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - tl.load(cu_seqlens_k_ptr + seq)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = k_len - q_len + rows  # absolute position of each query in its sequence
    dims = tl.arange(0, HEAD_DIM)
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)  # [BLOCK_M, D]

    kv_head = head // GROUP  # grouped-query attention: GROUP query heads share one KV head
    k_ptr = k_cache_ptr + kv_head * stride_kh
    v_ptr = v_cache_ptr + kv_head * stride_kh
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)

    # Keys below the first query's position + 1 are visible to every row of the tile: no mask.
    first_pos = k_len - q_len + m_block * BLOCK_M
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(first_pos + BLOCK_M, k_len)  # one past the last query's position
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, block_table_row, start_n, k_len, q_pos,
                                     qk_scale, stride_kb, stride_ks, dims, BLOCK_SIZE, BLOCK_N, False)
    for start_n in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, block_table_row, start_n, k_len, q_pos,
                                     qk_scale, stride_kb, stride_ks, dims, BLOCK_SIZE, BLOCK_N, True)

    # Every real row saw at least key 0, so l_i > 0 there; rows past q_len are not stored.
    out = acc / l_i[:, None]
    tl.store(o_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])


def prefill_config(head_dim: int) -> dict:
    """Tile sizes, measured on an H100: 64 queries a program (4 warps, 2 stages) x 32 keys (head_dim 128) or 64 keys.

    Small query tiles give more programs, which balances the causal triangle's uneven work across SMs.
    """
    return dict(BLOCK_M=64, BLOCK_N=32 if head_dim > 64 else 64, num_warps=4, num_stages=2)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, max_seqlen_q: int) -> torch.Tensor:
    """Causal attention of the packed queries q [Nq, Hq, D] over all keys of each sequence, read from the cache."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride() and block_tables.stride(-1) == 1
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)  # [Nq, Hq, D]
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = prefill_config(head_dim)
    grid = (num_heads, num_seqs, triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_k, block_tables, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], **cfg,
    )
    return out
