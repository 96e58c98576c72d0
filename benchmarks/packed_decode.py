"""Decode attention with every KV head of a row in one program ("heads packed"), timed against the
engine's decode kernel on a GPU (`python benchmarks/packed_decode.py`, from the repository root).

The engine's decode kernel (kernels/decode.py) runs one program per (row, KV head, split): its GROUP
query heads, padded to 16 rows for `tl.dot`, against a tile of that head's keys, each key's 256
bytes (bfloat16, head_dim 128) 2 KB from the next one's, since the cache is [block, slot, KV head,
dim]. Here one program per (row, split) takes all the row's query heads (16 for Qwen3-0.6B) against
a tile of BLOCK_N keys x all KV heads, which lie contiguous in the cache (BLOCK_N x 2 KB): the
scores of query head h against the columns of other KV heads are masked out. The tensor cores do
the same work as the 16-row padding does (8x the real rows either way); the reads are whole
contiguous runs, and a program's fixed costs (its row's bounds, block table, output) are paid once
per row instead of once per KV head.

Measured on one H200 (results/h200_session13_packed_decode.log): bfloat16, batch 256, 16 keys a
tile: 1.06x to 1.14x the decode kernel at contexts 64 to 1,024 (4.46 TB/s at 1,024), but 0.96x at
batch 64 x 2,048 and slower with an FP8 cache past 288 keys (0.85x at 1,024; faster below: 1.89x at
64). As the own-key programs of cascade attention's one launch (kernels/cascade.py) it was slower,
0.90x to 0.98x (results/h200_session13_cascade_anatomy.log): 150 to 190 registers a thread against
128 leave fewer programs per SM for the shared-prefix programs beside them. Not in the engine;
`packed_decode` is checked equal to decode_attention in Triton's interpreter
(tests/test_triton_kernels.py).
"""
import itertools
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels.decode import _merge_splits_kernel, _split_range  # noqa: E402
from nanovllm.kernels.paged import widen_config, widen_v  # noqa: E402


@triton.jit(do_not_specialize=["stride_bt"])
def _packed_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    key_starts_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, CASCADE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FP8_ASM: tl.constexpr,
):
    _packed_split(tl.program_id(0), tl.program_id(1), q_ptr, k_cache_ptr, v_cache_ptr,
                  cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
                  key_starts_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
                  stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                  stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
                  NUM_HEADS, HEADS_PAD, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_SPLITS,
                  CASCADE, DOT_DTYPE, FP8_ASM)


@triton.jit
def _packed_split(
    seq, split, q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    block_tables_ptr, key_starts_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, CASCADE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FP8_ASM: tl.constexpr,
):
    token = tl.load(cu_seqlens_q_ptr + seq)
    next_token = tl.load(cu_seqlens_q_ptr + seq + 1)
    context_len = tl.load(context_lens_ptr + seq)
    if next_token - token != 1:
        return
    key_start = 0
    if CASCADE:
        key_start = tl.load(key_starts_ptr + seq)
    start, end = _split_range(key_start, context_len, split, NUM_SPLITS, BLOCK_N)
    if start >= end:
        return
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    COLS: tl.constexpr = BLOCK_N * NUM_KV_HEADS
    rows = tl.arange(0, HEADS_PAD)
    row_mask = rows < NUM_HEADS
    row_head = tl.minimum(rows // GROUP, NUM_KV_HEADS - 1)  # padding rows copy the last head
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + rows[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)
    cols = tl.arange(0, COLS)
    col_key = cols // NUM_KV_HEADS
    col_head = cols % NUM_KV_HEADS
    same_head = row_head[:, None] == col_head[None, :]
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    l_i = tl.full([HEADS_PAD], 0.0, tl.float32)
    acc = tl.full([HEADS_PAD, HEAD_DIM], 0.0, tl.float32)
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + col_key
        key_mask = keys < end
        block_ids = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_mask, other=0)
        kv_rows = (block_ids.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_ks
                   + col_head * stride_kh)
        offsets = kv_rows[:, None] + dims[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=key_mask[:, None], other=0.0).to(DOT_DTYPE)
        v = widen_v(tl.load(v_cache_ptr + offsets, mask=key_mask[:, None], other=0.0), DOT_DTYPE,
                    FP8_ASM)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [HEADS_PAD, COLS]
        s = tl.where(same_head & key_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc * (v_scale / l_i)[:, None]
    if NUM_SPLITS == 1 and not CASCADE:
        dst = out_ptr + token.to(tl.int64) * stride_ot + rows[:, None] * stride_oh + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        dst = (partial_ptr + seq * stride_pb + split * stride_ps + rows[:, None] * stride_ph
               + dims[None, :])
        tl.store(dst, out, mask=row_mask[:, None])
        tl.store(lse_ptr + seq * stride_lb + split * stride_ls + rows, m_i + tl.log2(l_i),
                 mask=row_mask)


def packed_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                  num_splits=1, out=None, k_scale=1.0, v_scale=1.0, block_n=8, num_warps=4,
                  num_stages=2):
    """decode_attention's result (kernels/decode.py) with one program per (row, split)."""
    num_heads, head_dim = q.shape[1:]
    num_seqs, num_kv_heads = context_lens.shape[0], k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    partial = lse = out.new_empty(0, 1, 1, 1)
    if num_splits > 1:
        partial = torch.empty(num_seqs, num_splits, num_heads, head_dim, dtype=torch.float32,
                              device=q.device)
        lse = torch.empty(num_seqs, num_splits, num_heads, 1, dtype=torch.float32, device=q.device)
    _packed_kernel[(num_seqs, num_splits)](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, context_lens, out, partial,
        lse, scale * k_scale * math.log2(math.e), v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        NUM_HEADS=num_heads, HEADS_PAD=max(16, triton.next_power_of_2(num_heads)),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=block_n, NUM_SPLITS=num_splits, CASCADE=False,
        **widen_config(q.dtype, k_cache.dtype), num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, triton.cdiv(num_heads, 4))](
            partial, lse, out, cu_seqlens_q, context_lens, context_lens,
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEADS=4, HEAD_DIM=head_dim,
            BLOCK_N=block_n, NUM_SPLITS=num_splits, PREFIX_SPLITS=0, PREFIX_BLOCK_N=1,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4)
    return out


def main():
    from cascade_merge_variants import per_layer_us

    from nanovllm.attention.fp8 import quantize
    from nanovllm.kernels.decode import decode_attention, num_decode_splits
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    hq, hkv, dim, block = 16, 8, 128, 256
    print(f"{props.name}: decode attention of one layer, Qwen3-0.6B heads (16 q, 8 kv, d 128), "
          "28 launches in a CUDA graph, us per launch\n")
    print("| cache | batch | context | kernel | us | TB/s | max abs diff | vs decode |\n"
          "|---|---|---|---|---:|---:|---:|---:|")
    cases = ((256, 64), (256, 160), (256, 288), (256, 640), (256, 1024), (64, 2048))
    for fp8, (batch, ctx) in itertools.product((False, True), cases):
        blocks = -(-ctx // block)
        k = torch.randn(batch * blocks + 1, block, hkv, dim, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        if fp8:
            k, v = quantize(k, 1.0), quantize(v, 1.0)
        tables = (torch.randperm(batch * blocks, device="cuda").int() + 1).view(batch, blocks)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, hq, dim, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(q)
        gb = batch * ctx * hkv * dim * 2 * k.element_size() / 1e9
        splits = num_decode_splits(batch, hkv, dim, 4096, num_sms)
        ref = decode_attention(q, k, v, cu, lens, tables, dim ** -0.5, splits).float()
        base = per_layer_us(lambda: decode_attention(q, k, v, cu, lens, tables, dim ** -0.5,
                                                     splits, out=out))
        name = "fp8" if fp8 else "bf16"
        print(f"| {name} | {batch} | {ctx} | decode, {splits} split(s) | {base:.1f} | "
              f"{gb / base * 1e3:.2f} | - | 1.00x |", flush=True)
        for s, (n, w) in itertools.product((1, 2, 4), ((8, 4), (16, 4), (16, 8))):
            if batch * s < num_sms // 2:
                continue

            def fn(s=s, n=n, w=w):
                return packed_decode(q, k, v, cu, lens, tables, dim ** -0.5, s, out=out,
                                     block_n=n, num_warps=w)
            us = per_layer_us(fn)
            diff = (fn().float() - ref).abs().max().item()
            print(f"| {name} | {batch} | {ctx} | packed, {s} split(s), {n} keys, {w} warps | "
                  f"{us:.1f} | {gb / us * 1e3:.2f} | {diff:.1e} | {base / us:.2f}x |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
