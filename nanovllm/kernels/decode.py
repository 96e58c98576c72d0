"""Paged decode attention with split-KV ("flash decoding").

A decode step has one query per sequence, so one program per (sequence, KV head) leaves most of the
GPU idle when the batch is small. The keys of each sequence are therefore cut into num_splits
chunks, one program per (sequence, KV head, chunk); each writes a partial output normalized by its
own softmax sum plus its log-sum-exp, and a second kernel merges the chunks: with
lse_i = m_i + log2(l_i), out = sum_i 2^(lse_i - max lse) * o_i / sum_i 2^(lse_i - max lse).

Grouped-query attention: the GROUP query heads that share a KV head sit in one tile of rows (padded
to 16 for `tl.dot`), so each K/V tile is read from memory once per group, not once per query head.

One launch serves a whole step: program row s (the grid's second axis; the KV heads are its
first, so the programs resident at once read every head of the same keys) is sequence s, whose
query token is cu_seqlens_q[s].
Rows that are not decodes (a prefill chunk of a mixed step, or a CUDA graph's padding, whose query
length is 0) return at once, so a graph can launch a fixed number of rows and the data says which
run.

CUDA graphs: num_splits comes from static numbers (rows, KV heads, SM count), the chunk length is
computed inside the kernel from the sequence's context length, the partials go into preallocated
scratch, and nothing here reads a device value on the host. num_splits is an argument, not a
constant of the kernel: one compiled kernel serves every batch size (the engine starts with one
compile, not one per split count).
"""
import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.paged import kv_row_offsets, widen_config, widen_v
from nanovllm.kernels.pdl import pdl_launch, wait_for_inputs

# more splits than this only adds merge work: 64 chunks of a long context already fill the GPU
MAX_SPLITS = 64


@triton.jit
def _split_range(key_start, context_len, split, num_splits, BLOCK_N: tl.constexpr):
    """Keys [start, end) of one split: keys key_start..context_len-1 cut into num_splits chunks,
    each a whole number of tiles."""
    per_split = (context_len - key_start + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = key_start + split * chunk
    return start, tl.minimum(start + chunk, context_len)


# the table width changes from step to step; the split count with the batch size
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    key_starts_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, CASCADE: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    _decode_split(
        tl.program_id(1), tl.program_id(0), tl.program_id(2), q_ptr, k_cache_ptr, v_cache_ptr,
        cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr, key_starts_ptr, out_ptr, partial_ptr,
        lse_ptr, qk_scale, v_scale, num_splits, stride_qt, stride_qh, stride_kb, stride_ks,
        stride_kh, stride_bt, stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb,
        stride_ls, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, CASCADE, DOT_DTYPE, FP8_ASM)


@triton.jit
def _decode_split(
    seq, kv_head, split, q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    block_tables_ptr, key_starts_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
    num_splits, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, CASCADE: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr,
):
    """One (sequence, KV head, split) of decode attention (the cascade kernel runs it too)."""
    token = tl.load(cu_seqlens_q_ptr + seq)
    next_token = tl.load(cu_seqlens_q_ptr + seq + 1)
    context_len = tl.load(context_lens_ptr + seq)  # loaded with the others: one round trip, not two
    if next_token - token != 1:
        return  # not a decode: a prefill chunk (the prefill kernel's) or a padding row
    key_start = 0
    if CASCADE:  # keys before key_start are a shared prefix's, read once (kernels/cascade.py)
        key_start = tl.load(key_starts_ptr + seq)
    start, end = _split_range(key_start, context_len, split, num_splits, BLOCK_N)
    if start >= end:
        return

    rows = tl.arange(0, GROUP_PAD)  # query heads kv_head * GROUP + rows; rows >= GROUP are padding
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)  # [GROUP_PAD, D]
    k_ptr = k_cache_ptr + kv_head * stride_kh
    v_ptr = v_cache_ptr + kv_head * stride_kh
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM], 0.0, tl.float32)
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        kv_rows = kv_row_offsets(block_table_row, keys, key_mask, stride_kb, stride_ks, BLOCK_SIZE)
        # an FP8 cache is widened to DOT_DTYPE here, in registers (paged.py); its K scale is in
        # qk_scale
        kv_offsets = kv_rows[:, None] + dims[None, :]  # [BLOCK_N, D]
        k = tl.load(k_ptr + kv_offsets, mask=key_mask[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_ptr + kv_offsets, mask=key_mask[:, None], other=0.0)
        v = widen_v(v, q.dtype, FP8_ASM)
        # log2 units; ieee: float32 inputs stay float32, not TF32 (16- and 8-bit ones ignore it)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(key_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has at least one key < end
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc * (v_scale / l_i)[:, None]  # v_scale: an FP8 cache's V scale (1 otherwise)
    if (num_splits == 1) & (not CASCADE):  # the one split is the answer: straight to the output
        final = (out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + dims[None, :])
        tl.store(final, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        part = (partial_ptr + seq * stride_pb + split * stride_ps + heads[:, None] * stride_ph
                + dims[None, :])
        tl.store(part, out, mask=row_mask[:, None])
        tl.store(lse_ptr + seq * stride_lb + split * stride_ls + heads, m_i + tl.log2(l_i),
                 mask=row_mask)


@triton.jit(do_not_specialize=["num_splits", "prefix_splits"])
def _merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, cu_seqlens_q_ptr, context_lens_ptr, key_starts_ptr,
    num_splits, prefix_splits, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls, stride_ot,
    stride_oh, NUM_HEADS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, CASCADE: tl.constexpr, PREFIX_BLOCK_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per (decode row, HEADS of its query heads): their splits' partial outputs
    merged by log-sum-exp."""
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    token = tl.load(cu_seqlens_q_ptr + seq)
    next_token = tl.load(cu_seqlens_q_ptr + seq + 1)
    context_len = tl.load(context_lens_ptr + seq)
    if next_token - token != 1:
        return
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    head_mask = heads < NUM_HEADS
    heads = tl.minimum(heads, NUM_HEADS - 1)  # padding heads read the last one's, never stored
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    key_start = 0
    if CASCADE:
        key_start = tl.load(key_starts_ptr + seq)
    start, end = _split_range(key_start, context_len, splits, num_splits, BLOCK_N)
    live = (splits < num_splits) & (start < end)  # the splits that ran; the rest: stale scratch
    if CASCADE:  # then slots of the shared prefix's prefix_splits splits (kernels/cascade.py)
        prefix = splits - num_splits
        start, end = _split_range(0, key_start, prefix, prefix_splits, PREFIX_BLOCK_N)
        live |= (prefix >= 0) & (prefix < prefix_splits) & (start < end)
    lse = tl.load(lse_ptr + seq * stride_lb + splits[None, :] * stride_ls + heads[:, None],
                  mask=live[None, :], other=float("-inf"))  # [HEADS, SPLITS_PAD]
    weight = tl.exp2(lse - tl.max(lse, 1)[:, None])  # 2^-inf = 0 for the dead splits
    partial = tl.load(partial_ptr + seq * stride_pb + splits[None, :, None] * stride_ps
                      + heads[:, None, None] * stride_ph + dims[None, None, :],
                      mask=live[None, :, None], other=0.0)  # [HEADS, SPLITS_PAD, D]
    out = tl.sum(weight[:, :, None] * partial, 1) / tl.sum(weight, 1)[:, None]
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
             + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])


def splits_pad(num_slots: int) -> int:
    """The merge's tile of split slots: a power of two, at least 16, so that a few compiled
    merges serve every split count."""
    return max(16, triton.next_power_of_2(num_slots))


def decode_config(head_dim: int, fp8: bool = False) -> dict:
    """Tile sizes, measured on an H100 for head_dim 64 and 128: 64 keys a tile, 4 warps, 2-stage
    pipeline.

    Decode is bound by reading K/V; a small footprint per program (two 64-key tiles in flight) lets
    several programs share an SM, which hides latency better than deeper pipelines or bigger tiles
    did. An FP8 cache's tiles are half the bytes: 128 keys a tile, widened by `.to()` (not
    widen_v's PTX), with at most 128 registers a thread so that more programs share an SM: on an
    H200 1.09x to 1.21x the 64-key tiles at batch 16 to 256
    (docs/fp8.md).
    """
    if fp8:
        return dict(BLOCK_N=128, num_warps=4, num_stages=2, maxnreg=128, FP8_ASM=False)
    return dict(BLOCK_N=64, num_warps=4, num_stages=2)


def num_decode_splits(batch_size: int, num_kv_heads: int, head_dim: int, max_model_len: int,
                      num_sms: int) -> int:
    """Static split count from the batch shape and the GPU, never from the data (CUDA graphs replay
    it).

    With >= 2 (sequence, KV head) programs per SM the GPU is busy and splitting only adds merge
    work; below that, split so there are ~4 programs per SM, but no more splits than tiles in
    max_model_len.
    """
    programs = batch_size * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    max_useful = triton.cdiv(max_model_len, decode_config(head_dim)["BLOCK_N"])
    return max(1, min(triton.cdiv(4 * num_sms, programs), max_useful, MAX_SPLITS))


def decode_scratch(max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   max_model_len: int, num_sms: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Preallocate the split partials for every batch size up to max_num_seqs (one flat buffer
    each)."""
    rows = max(b * num_decode_splits(b, num_kv_heads, head_dim, max_model_len, num_sms)
               for b in range(1, max_num_seqs + 1))
    # [B * S * Hq * D]
    partial = torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(rows * num_heads, dtype=torch.float32, device=device)  # [B * S * Hq]
    return partial, lse


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                     block_tables: torch.Tensor,
                     scale: float, num_splits: int = 1, scratch: tuple | None = None,
                     out: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """Attention of every sequence with one query token (a decode) over its context_lens[s] cached
    keys.

    q [num_tokens, Hq, D] holds the step's queries; sequence s owns tokens cu_seqlens_q[s]:[s + 1].
    Rows with any other query length are left alone (a prefill chunk, or padding): writes out[token]
    of the decodes only, so a mixed step's prefill kernel fills the rest of the same `out`. An FP8
    cache holds K / k_scale and V / v_scale (attention/fp8.py).
    """
    num_heads, head_dim = q.shape[1:]
    num_seqs, num_kv_heads = context_lens.shape[0], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride() and block_tables.stride(-1) == 1
    assert 1 <= num_splits <= MAX_SPLITS and cu_seqlens_q.shape[0] == num_seqs + 1
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    cfg = decode_config(head_dim, k_cache.dtype == torch.float8_e4m3fn)
    group = num_heads // num_kv_heads
    # [B, S, Hq, D] and [B, S, Hq], needed with splits only
    partial = lse = out.new_empty(0, 1, 1, 1)
    if num_splits > 1:
        size = num_seqs * num_splits * num_heads
        if scratch is None:
            scratch = (torch.empty(size * head_dim, dtype=torch.float32, device=q.device),
                       torch.empty(size, dtype=torch.float32, device=q.device))
        assert scratch[0].numel() >= size * head_dim, "scratch sized for fewer splits"
        partial = scratch[0][:size * head_dim].view(num_seqs, num_splits, num_heads, head_dim)
        lse = scratch[1][:size].view(num_seqs, num_splits, num_heads, 1)
    _decode_split_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, context_lens, out, partial,
        lse, scale * k_scale * math.log2(math.e), v_scale, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], CASCADE=False,
        **{**widen_config(q.dtype, k_cache.dtype), **cfg}, **pdl_launch(q.device, num_seqs),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            partial, lse, out, cu_seqlens_q, context_lens, context_lens, num_splits, 0,
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEADS=1, HEAD_DIM=head_dim,
            BLOCK_N=cfg["BLOCK_N"], CASCADE=False, PREFIX_BLOCK_N=1,
            SPLITS_PAD=splits_pad(num_splits), num_warps=4, **pdl_launch(q.device, num_seqs),
        )
    return out
