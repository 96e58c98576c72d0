"""Cascade attention: a shared prefix read once for all the decodes that share it (FlashInfer's
cascade attention, vLLM's cascade attention, and Hydragen, "High-Throughput LLM Inference with
Shared Prefixes").

When decode rows share a leading run of KV blocks (a system prompt hit in the prefix cache, the n
samples of one request, the beams of a beam search), plain decode reads those keys once per row.
Here a *tile* of rows that share `shared_len` leading keys is one program per (tile, KV head,
split): the queries of all its members times the GROUP query heads of that KV head form one block
of rows, so each K/V tile of the prefix is read once and multiplied with a real matrix (Hydragen's
point: many queries, one read). It writes a partial output and log-sum-exp per (row, head), as one
more split of the decode kernel (kernels/decode.py), which reads each row's own keys
[shared_len, context_len); the merge kernel then combines all the splits by log-sum-exp.
The prefix programs and the decode programs are one launch (the prefixes first): each kind alone
leaves the GPU half idle (few long prefix programs; many short decode programs that wait on
memory), and together they overlap, with no idle tail between two kernels.

Tiles come from the host (attention/cascade.py): per tile, the row whose block table holds the
shared blocks, `shared_len` (0: an unused tile, which returns at once) and its member rows (-1:
none). A CUDA graph launches a fixed number of tiles and the data says which run.
"""
import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode import (
    _decode_split,
    _merge_splits_kernel,
    _split_range,
    splits_pad,
)
from nanovllm.kernels.paged import kv_row_offsets, widen_config, widen_v
from nanovllm.kernels.pdl import pdl_launch, wait_for_inputs

ROWS = 32  # query rows of a prefix tile: members x GROUP heads (tl.dot wants >= 16)
MERGE_HEADS = 4  # query heads of a row that one merge program combines


def cascade_config(head_dim: int) -> dict:
    """Tile sizes of the one launch (the best of a sweep on an H200: docs/cascade.md)."""
    return dict(BLOCK_N=64, num_warps=4, num_stages=2)


def members_per_tile(group: int) -> int:
    """Decode rows one prefix tile holds, for GROUP query heads per KV head (at least 2)."""
    return max(2, ROWS // group)


# the split counts are arguments: one compiled kernel serves every batch size
@triton.jit(do_not_specialize=["stride_bt", "num_prefix_programs", "num_splits", "prefix_splits"])
def _cascade_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    key_starts_ptr, tiles_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
    num_prefix_programs, num_splits, prefix_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, MEMBERS: tl.constexpr, ROWS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One launch, two kinds of programs: first one per (tile, KV head, prefix split), then one
    per (decode row, KV head, split) of the rows' own keys; the two overlap on the GPU."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    if pid < num_prefix_programs:
        _shared_prefix(
            pid // (NUM_KV_HEADS * prefix_splits), pid // prefix_splits % NUM_KV_HEADS,
            pid % prefix_splits, q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr,
            block_tables_ptr, tiles_ptr, partial_ptr, lse_ptr, qk_scale, v_scale, num_splits,
            prefix_splits, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
            stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
            GROUP, MEMBERS, ROWS_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, FP8_ASM)
    else:
        pid -= num_prefix_programs
        _decode_split(
            pid // (NUM_KV_HEADS * num_splits), pid // num_splits % NUM_KV_HEADS,
            pid % num_splits, q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr,
            context_lens_ptr, block_tables_ptr, key_starts_ptr, out_ptr, partial_ptr, lse_ptr,
            qk_scale, v_scale, num_splits, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
            stride_bt, stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb,
            stride_ls, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_DTYPE, FP8_ASM)


@triton.jit
def _shared_prefix(
    tile, kv_head, split, q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, block_tables_ptr,
    tiles_ptr, partial_ptr, lse_ptr, qk_scale, v_scale, num_splits, prefix_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    GROUP: tl.constexpr, MEMBERS: tl.constexpr, ROWS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FP8_ASM: tl.constexpr,
):
    """One (tile, KV head, split) of a tile's shared prefix: all members' queries at once."""
    tile_ptr = tiles_ptr + tile * (2 + MEMBERS)  # [first row, shared_len, members...]
    first = tl.load(tile_ptr)
    shared_len = tl.load(tile_ptr + 1)
    start, end = _split_range(0, shared_len, split, prefix_splits, BLOCK_N)
    if start >= end:
        return  # an unused tile (shared_len 0), or a split past the prefix's end

    rows = tl.arange(0, ROWS_PAD)  # row r: member r // GROUP, query head r % GROUP of the group
    member = rows // GROUP
    seq = tl.load(tile_ptr + 2 + member, mask=member < MEMBERS, other=-1)  # its decode row
    row_mask = seq >= 0
    seq = tl.where(row_mask, seq, 0)
    token = tl.load(cu_seqlens_q_ptr + seq, mask=row_mask, other=0)  # the row's query token
    heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
                + dims[None, :], mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)  # [ROWS_PAD, D]
    k_ptr = k_cache_ptr + kv_head * stride_kh
    v_ptr = v_cache_ptr + kv_head * stride_kh
    block_table_row = block_tables_ptr + first.to(tl.int64) * stride_bt  # every member's blocks

    m_i = tl.full([ROWS_PAD], float("-inf"), tl.float32)
    l_i = tl.full([ROWS_PAD], 0.0, tl.float32)
    acc = tl.full([ROWS_PAD, HEAD_DIM], 0.0, tl.float32)
    for start_n in range(start, end, BLOCK_N):  # no mask by position: the prefix precedes all
        keys = start_n + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        kv_rows = kv_row_offsets(block_table_row, keys, key_mask, stride_kb, stride_ks, BLOCK_SIZE)
        kv_offsets = kv_rows[:, None] + dims[None, :]  # [BLOCK_N, D]
        k = tl.load(k_ptr + kv_offsets, mask=key_mask[:, None], other=0.0).to(DOT_DTYPE)
        v = widen_v(tl.load(v_ptr + kv_offsets, mask=key_mask[:, None], other=0.0), DOT_DTYPE,
                    FP8_ASM)
        # log2 units; ieee: float32 inputs stay float32, not TF32 (16- and 8-bit ones ignore it)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [ROWS_PAD, BLOCK_N]
        s = tl.where(key_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    slot = num_splits + split  # after the row's own splits
    dst = (partial_ptr + seq[:, None] * stride_pb + slot * stride_ps + heads[:, None] * stride_ph
           + dims[None, :])
    tl.store(dst, acc * (v_scale / l_i)[:, None], mask=row_mask[:, None])
    tl.store(lse_ptr + seq * stride_lb + slot * stride_ls + heads, m_i + tl.log2(l_i),
             mask=row_mask)


def cascade_scratch(num_seqs: int, num_slots: int, num_heads: int, head_dim: int,
                    device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials [B * slots * Hq * D] and log-sum-exps [B * slots * Hq], float32."""
    size = num_seqs * num_slots * num_heads
    return (torch.empty(size * head_dim, dtype=torch.float32, device=device),
            torch.empty(size, dtype=torch.float32, device=device))


def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, key_starts: torch.Tensor, tiles: torch.Tensor,
                      scale: float, num_splits: int, prefix_splits: int,
                      scratch: tuple | None = None, out: torch.Tensor | None = None,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """decode_attention's result for the decode rows, reading each tile's shared prefix once.

    key_starts [B]: keys of row s before key_starts[s] are its tile's shared prefix (0: none).
    tiles [T, 2 + members_per_tile(GROUP)]: (first row, shared_len, member rows padded with -1);
    every member of a tile has key_starts == shared_len. num_splits cuts each row's own keys,
    prefix_splits each tile's prefix.
    """
    num_heads, head_dim = q.shape[1:]
    num_seqs, num_kv_heads = context_lens.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    members = members_per_tile(group)
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride() and block_tables.stride(-1) == 1
    assert tiles.shape[1] == 2 + members and tiles.is_contiguous() and prefix_splits >= 1
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    slots = num_splits + prefix_splits
    if scratch is None:
        scratch = cascade_scratch(num_seqs, slots, num_heads, head_dim, q.device)
    size = num_seqs * slots * num_heads
    assert scratch[0].numel() >= size * head_dim, "scratch sized for fewer splits"
    partial = scratch[0][:size * head_dim].view(num_seqs, slots, num_heads, head_dim)
    lse = scratch[1][:size].view(num_seqs, slots, num_heads, 1)
    cfg = cascade_config(head_dim)
    qk_scale = scale * k_scale * math.log2(math.e)
    common = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              block_tables.stride(0))
    partial_strides = (partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
                       lse.stride(1))
    num_prefix_programs = tiles.shape[0] * num_kv_heads * prefix_splits
    _cascade_kernel[(num_prefix_programs + num_seqs * num_kv_heads * num_splits,)](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, key_starts, tiles, out,
        partial, lse, qk_scale, v_scale, num_prefix_programs, num_splits, prefix_splits, *common,
        out.stride(0), out.stride(1), *partial_strides,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), MEMBERS=members,
        ROWS_PAD=max(16, triton.next_power_of_2(members * group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads,
        **widen_config(q.dtype, k_cache.dtype), **cfg, **pdl_launch(q.device, num_seqs),
    )
    # 4 query heads a program: 1.8x to 2.2x faster than one on an H200 at batch 256
    # (benchmarks/results/h200_cascade_merge.log)
    _merge_splits_kernel[(num_seqs, triton.cdiv(num_heads, MERGE_HEADS))](
        partial, lse, out, cu_seqlens_q, context_lens, key_starts, num_splits, prefix_splits,
        *partial_strides, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEADS=MERGE_HEADS,
        HEAD_DIM=head_dim, BLOCK_N=cfg["BLOCK_N"], CASCADE=True, PREFIX_BLOCK_N=cfg["BLOCK_N"],
        SPLITS_PAD=splits_pad(slots), num_warps=4, **pdl_launch(q.device, num_seqs),
    )
    return out
