"""Causal varlen prefill attention over the paged KV cache (FlashAttention-2 with online softmax).

One program owns a tile of BLOCK_M queries of one sequence and one query head (the tiles are listed
by the caller, so a CUDA graph launches a fixed number of programs) and walks the keys BLOCK_N at a
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

from nanovllm.kernels.paged import kv_row_offsets, widen_config, widen_v
from nanovllm.kernels.pdl import pdl_launch, wait_for_inputs

QUERY_TILE = 64  # queries per program (BLOCK_M): the caller lists the tiles in these


def query_tiles(cu_seqlens_q: list[int], first: int) -> list[int]:
    """(sequence, tile) pairs, flattened, of the sequences from `first` on: QUERY_TILE queries each,
    the last tile of a sequence first (it sees the most keys, so it starts first)."""
    return [x for s in range(first, len(cu_seqlens_q) - 1)
            for t in reversed(range(-(-(cu_seqlens_q[s + 1] - cu_seqlens_q[s]) // QUERY_TILE)))
            for x in (s, t)]


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, block_table_row, start_n, k_len, q_pos, qk_scale,
                 stride_kb, stride_ks, dims,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                 FP8_ASM: tl.constexpr):
    """Fold keys start_n..start_n+BLOCK_N into the running (acc, m_i, l_i) of BLOCK_M queries."""
    keys = start_n + tl.arange(0, BLOCK_N)
    key_mask = keys < k_len
    rows = kv_row_offsets(block_table_row, keys, key_mask, stride_kb, stride_ks, BLOCK_SIZE)
    # an FP8 cache is widened to DOT_DTYPE here, in registers (paged.py); K's scale: qk_scale
    # [BLOCK_N, D]
    k = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
    k = k.to(q.dtype)
    # log2 units; ieee: float32 inputs stay float32, not TF32 (16- and 8-bit ones ignore it)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
    if CAUSAL_MASK:
        s = tl.where((keys[None, :] <= q_pos[:, None]) & key_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + rows[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
    v = widen_v(v, q.dtype, FP8_ASM)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt"])  # the table width changes from step to step
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr,
    cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr, query_tiles_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FP8_ASM: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(query_tiles_ptr + 2 * tile)  # tile = BLOCK_M queries of one sequence
    if seq < 0:
        return  # an unused tile of a CUDA graph
    m_block = tl.load(query_tiles_ptr + 2 * tile + 1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    k_len = tl.load(context_lens_ptr + seq)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = k_len - q_len + rows  # absolute position of each query in its sequence
    dims = tl.arange(0, HEAD_DIM)
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, D]

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
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, block_table_row, start_n,
                                     k_len, q_pos, qk_scale, stride_kb, stride_ks, dims, BLOCK_SIZE,
                                     BLOCK_N, False, FP8_ASM)
    for start_n in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, block_table_row, start_n,
                                     k_len, q_pos, qk_scale, stride_kb, stride_ks, dims, BLOCK_SIZE,
                                     BLOCK_N, True, FP8_ASM)

    # Every real row saw at least key 0, so l_i > 0 there; rows past q_len are not stored.
    out = acc * (v_scale / l_i)[:, None]  # v_scale: an FP8 cache's V scale (1 otherwise)
    tl.store(o_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])


def prefill_config(head_dim: int, cache_dtype: torch.dtype | None = None) -> dict:
    """Key tiles, measured on an H100: 32 keys (head_dim 128) or 64, 4 warps, 2 stages; over an FP8
    cache 64 keys (an H200: docs/fp8.md). The query tile (BLOCK_M) is the
    caller's: 64 queries a program, small enough that the causal triangle's uneven work spreads
    over the SMs."""
    fp8 = cache_dtype == torch.float8_e4m3fn
    return dict(BLOCK_N=32 if head_dim > 64 and not fp8 else 64, num_warps=4, num_stages=2)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, query_tiles: torch.Tensor, tile_size: int,
                      scale: float, out: torch.Tensor | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of the query tiles over each sequence's keys, read from the cache.

    q [num_tokens, Hq, D]; sequence s owns tokens cu_seqlens_q[s]:[s + 1] and has context_lens[s]
    keys, its queries being the last ones. query_tiles [num_tiles, 2] int32 lists (sequence, tile
    index) of `tile_size` queries each, sequence -1 for an unused tile. Writes those queries' rows
    of `out` (a mixed step's decode kernel writes the others). An FP8 cache holds K / k_scale and
    V / v_scale (attention/fp8.py).
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride() and block_tables.stride(-1) == 1
    assert query_tiles.is_contiguous() and query_tiles.shape[1:] == (2,)
    out = torch.empty_like(q) if out is None else out
    if query_tiles.shape[0] == 0:
        return out
    _prefill_kernel[(num_heads, query_tiles.shape[0])](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, query_tiles,
        scale * k_scale * math.log2(math.e), v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=tile_size, **widen_config(q.dtype, k_cache.dtype),
        **prefill_config(head_dim, k_cache.dtype), **pdl_launch(q.device, q.shape[0]),
    )
    return out
