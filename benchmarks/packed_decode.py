"""Decode attention with several KV heads of a row in one program ("heads packed"), timed against
the engine's decode kernel and inside cascade attention's launch on a GPU
(`python benchmarks/packed_decode.py`, from the repository root).

The engine's decode kernel (kernels/decode.py) runs one program per (row, KV head, split): its GROUP
query heads, padded to 16 rows for `tl.dot`, against a tile of that head's keys, each key's 256
bytes (bfloat16, head_dim 128) 2 KB from the next one's, since the cache is [block, slot, KV head,
dim]. Here one program per (row, KV_HEADS KV heads, split) takes their KV_HEADS x GROUP query heads
against a tile of BLOCK_N keys x KV_HEADS heads, which lie contiguous in the cache: the scores of a
query head against the columns of other KV heads are masked out. The tensor cores do the same work
as the 16-row padding does (8x Qwen3-0.6B's real rows either way); the reads are longer contiguous
runs, and a program's fixed costs (its row's bounds, block table lookups, output) are paid once per
KV_HEADS heads. Those fixed costs matter for short programs: cascade's own-key programs at the
shared-prefix workload read 1 to 5 tiles each (results/h200_session13_cascade_anatomy.log).

Measured on one H200 with all 8 KV heads a program (results/h200_session13_packed_decode.log):
bfloat16, batch 256, 16 keys a tile: 1.05x to 1.14x the decode kernel at contexts 64 to 1,024
(4.34-4.46 TB/s at 1,024), but 0.96x at batch 64 x 2,048, and over an FP8 cache 1.86x at 64 keys
but 0.85x at 1,024. As the own-key programs of cascade attention's one launch it was slower, 0.90x
to 0.98x (h200_session13_cascade_anatomy.log): 150 to 190 registers a thread against 128 leave
fewer programs per SM for the prefix programs beside them. KV_HEADS of 2 or 4 (tiles of 64 rows,
as the engine's) are not measured yet; compiled offline for sm_90 with the GPU host's Triton 3.6,
the launch holds 150 registers a thread with 2, 4 or 8 KV heads a program, and 128 with no spills
when capped (`maxnreg`), so `main` times both. Not in the engine; `packed_decode` and
`cascade_packed_attention` are checked against float64 and kernels/cascade.py in Triton's
interpreter (tests/test_triton_kernels.py, tests/test_cascade.py).
"""
import itertools
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels.cascade import (  # noqa: E402
    _shared_prefix,
    cascade_config,
    cascade_scratch,
    members_per_tile,
)
from nanovllm.kernels.decode import _merge_splits_kernel, _split_range  # noqa: E402
from nanovllm.kernels.paged import widen_config, widen_v  # noqa: E402


@triton.jit(do_not_specialize=["stride_bt"])
def _packed_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    key_starts_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr,
):
    _packed_split(tl.program_id(0), tl.program_id(2), tl.program_id(1), q_ptr, k_cache_ptr,
                  v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
                  key_starts_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
                  stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                  stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
                  GROUP, KV_HEADS, HEADS_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_SPLITS, False,
                  DOT_DTYPE, FP8_ASM)


@triton.jit
def _packed_split(
    seq, kv_group, split, q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    block_tables_ptr, key_starts_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    CASCADE: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr,
):
    """One (row, KV_HEADS KV heads from kv_group * KV_HEADS, split) of decode attention: their
    KV_HEADS x GROUP query heads against tiles of BLOCK_N keys x KV_HEADS heads."""
    token = tl.load(cu_seqlens_q_ptr + seq)
    next_token = tl.load(cu_seqlens_q_ptr + seq + 1)
    context_len = tl.load(context_lens_ptr + seq)
    if next_token - token != 1:
        return
    key_start = 0
    if CASCADE:  # keys before key_start are a shared prefix's (kernels/cascade.py)
        key_start = tl.load(key_starts_ptr + seq)
    start, end = _split_range(key_start, context_len, split, NUM_SPLITS, BLOCK_N)
    if start >= end:
        return
    rows = tl.arange(0, HEADS_PAD)  # query head kv_group * KV_HEADS * GROUP + rows
    row_mask = rows < KV_HEADS * GROUP
    row_head = tl.minimum(rows // GROUP, KV_HEADS - 1)  # padding rows copy the last KV head
    heads = kv_group * KV_HEADS * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + dims[None, :], mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)
    cols = tl.arange(0, BLOCK_N * KV_HEADS)  # column c: key c // KV_HEADS, KV head c % KV_HEADS
    col_key = cols // KV_HEADS
    col_head = cols % KV_HEADS
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
                   + (kv_group * KV_HEADS + col_head) * stride_kh)
        offsets = kv_rows[:, None] + dims[None, :]  # contiguous runs of KV_HEADS x D per key
        k = tl.load(k_cache_ptr + offsets, mask=key_mask[:, None], other=0.0).to(DOT_DTYPE)
        v = widen_v(tl.load(v_cache_ptr + offsets, mask=key_mask[:, None], other=0.0), DOT_DTYPE,
                    FP8_ASM)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [HEADS_PAD, COLS]
        s = tl.where(same_head & key_mask[None, :], s, float("-inf"))  # a head's own keys only
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc * (v_scale / l_i)[:, None]
    if NUM_SPLITS == 1 and not CASCADE:
        dst = out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        dst = (partial_ptr + seq * stride_pb + split * stride_ps + heads[:, None] * stride_ph
               + dims[None, :])
        tl.store(dst, out, mask=row_mask[:, None])
        tl.store(lse_ptr + seq * stride_lb + split * stride_ls + heads, m_i + tl.log2(l_i),
                 mask=row_mask)


def heads_pad(kv_heads: int, group: int) -> int:
    return max(16, triton.next_power_of_2(kv_heads * group))


def packed_decode(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                  num_splits=1, out=None, k_scale=1.0, v_scale=1.0, block_n=8, num_warps=4,
                  num_stages=2, kv_heads=None, maxnreg=None):
    """decode_attention's result (kernels/decode.py) with one program per (row, kv_heads KV heads,
    split); kv_heads=None: all of them."""
    num_heads, head_dim = q.shape[1:]
    num_seqs, num_kv_heads = context_lens.shape[0], k_cache.shape[2]
    kv_heads = kv_heads or num_kv_heads
    group = num_heads // num_kv_heads
    assert num_kv_heads % kv_heads == 0
    out = torch.empty_like(q) if out is None else out
    partial = lse = out.new_empty(0, 1, 1, 1)
    if num_splits > 1:
        partial = torch.empty(num_seqs, num_splits, num_heads, head_dim, dtype=torch.float32,
                              device=q.device)
        lse = torch.empty(num_seqs, num_splits, num_heads, 1, dtype=torch.float32, device=q.device)
    _packed_kernel[(num_seqs, num_splits, num_kv_heads // kv_heads)](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, context_lens, out, partial,
        lse, scale * k_scale * math.log2(math.e), v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, KV_HEADS=kv_heads, HEADS_PAD=heads_pad(kv_heads, group), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n, NUM_SPLITS=num_splits,
        **widen_config(q.dtype, k_cache.dtype), num_warps=num_warps, num_stages=num_stages,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, triton.cdiv(num_heads, 4))](
            partial, lse, out, cu_seqlens_q, context_lens, context_lens,
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEADS=4, HEAD_DIM=head_dim,
            BLOCK_N=block_n, NUM_SPLITS=num_splits, PREFIX_SPLITS=0, PREFIX_BLOCK_N=1,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4)
    return out


@triton.jit(do_not_specialize=["stride_bt", "num_prefix_programs"])
def _cascade_packed_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    key_starts_ptr, tiles_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
    num_prefix_programs, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    GROUP: tl.constexpr, MEMBERS: tl.constexpr, ROWS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr, KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr, OWN_BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FP8_ASM: tl.constexpr,
):
    """kernels/cascade.py's one launch with the own-key programs of _packed_split."""
    pid = tl.program_id(0)
    if pid < num_prefix_programs:
        _shared_prefix(
            pid // (NUM_KV_HEADS * PREFIX_SPLITS), pid // PREFIX_SPLITS % NUM_KV_HEADS,
            pid % PREFIX_SPLITS, q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr,
            block_tables_ptr, tiles_ptr, partial_ptr, lse_ptr, qk_scale, v_scale,
            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
            stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
            GROUP, MEMBERS, ROWS_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_SPLITS, PREFIX_SPLITS,
            DOT_DTYPE, FP8_ASM)
    else:
        pid -= num_prefix_programs
        groups: tl.constexpr = NUM_KV_HEADS // KV_HEADS
        _packed_split(
            pid // (groups * NUM_SPLITS), pid // NUM_SPLITS % groups, pid % NUM_SPLITS, q_ptr,
            k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
            key_starts_ptr, out_ptr, partial_ptr, lse_ptr, qk_scale, v_scale, stride_qt,
            stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
            stride_pb, stride_ps, stride_ph, stride_lb, stride_ls, GROUP, KV_HEADS, HEADS_PAD,
            HEAD_DIM, BLOCK_SIZE, OWN_BLOCK_N, NUM_SPLITS, True, DOT_DTYPE, FP8_ASM)


def cascade_packed_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                             key_starts, tiles, scale, num_splits, prefix_splits, kv_heads,
                             own_block_n, scratch=None, out=None, k_scale=1.0, v_scale=1.0,
                             maxnreg=None):
    """kernels/cascade.py's cascade_attention with the rows' own keys read kv_heads KV heads a
    program, own_block_n keys a tile."""
    num_heads, head_dim = q.shape[1:]
    num_seqs, num_kv_heads = context_lens.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    members = members_per_tile(group)
    out = torch.empty_like(q) if out is None else out
    slots = num_splits + prefix_splits
    if scratch is None:
        scratch = cascade_scratch(num_seqs, slots, num_heads, head_dim, q.device)
    size = num_seqs * slots * num_heads
    partial = scratch[0][:size * head_dim].view(num_seqs, slots, num_heads, head_dim)
    lse = scratch[1][:size].view(num_seqs, slots, num_heads, 1)
    cfg = cascade_config(head_dim)
    num_prefix_programs = tiles.shape[0] * num_kv_heads * prefix_splits
    num_own = num_seqs * num_kv_heads // kv_heads * num_splits
    strides = (partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
               lse.stride(1))
    _cascade_packed_kernel[(num_prefix_programs + num_own,)](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, key_starts, tiles, out,
        partial, lse, scale * k_scale * math.log2(math.e), v_scale, num_prefix_programs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *strides,
        GROUP=group, MEMBERS=members, ROWS_PAD=max(16, triton.next_power_of_2(members * group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads,
        NUM_SPLITS=num_splits, PREFIX_SPLITS=prefix_splits, KV_HEADS=kv_heads,
        HEADS_PAD=heads_pad(kv_heads, group), OWN_BLOCK_N=own_block_n,
        **widen_config(q.dtype, k_cache.dtype), **cfg, **({"maxnreg": maxnreg} if maxnreg else {}))
    _merge_splits_kernel[(num_seqs, triton.cdiv(num_heads, 4))](
        partial, lse, out, cu_seqlens_q, context_lens, key_starts, *strides, out.stride(0),
        out.stride(1), NUM_HEADS=num_heads, HEADS=4, HEAD_DIM=head_dim, BLOCK_N=own_block_n,
        NUM_SPLITS=num_splits, PREFIX_SPLITS=prefix_splits, PREFIX_BLOCK_N=cfg["BLOCK_N"],
        SPLITS_PAD=triton.next_power_of_2(slots), num_warps=4)
    return out


def main():
    from cascade_kernels import cascade_inputs
    from cascade_merge_variants import per_layer_us

    from nanovllm.attention.fp8 import quantize
    from nanovllm.kernels.cascade import cascade_attention
    from nanovllm.kernels.decode import decode_attention, num_decode_splits
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    hq, hkv, dim, block = 16, 8, 128, 256
    print(f"{props.name}: attention of one layer, Qwen3-0.6B heads (16 q, 8 kv, d 128), "
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
        # (KV heads a program, keys a tile, register cap): 64- and 128-row tiles, 4 warps; an
        # FP8 tile of 128 rows holds 190 registers a thread uncapped, 128 capped with no spills
        for s, (h, n, r) in itertools.product((1, 2, 4), (
                (1, 64, None), (2, 32, None), (2, 64, None), (8, 8, None), (8, 16, None),
                (8, 16, 128), (4, 32, 128))):
            if batch * s * hkv // h < num_sms // 2 or r and not fp8:
                continue

            def fn(s=s, h=h, n=n, r=r):
                return packed_decode(q, k, v, cu, lens, tables, dim ** -0.5, s, out=out,
                                     block_n=n, kv_heads=h, maxnreg=r)
            us = per_layer_us(fn)
            diff = (fn().float() - ref).abs().max().item()
            regs = f", at most {r} registers" if r else ""
            print(f"| {name} | {batch} | {ctx} | packed, {s} split(s), {h} KV heads x {n} keys"
                  f"{regs} | {us:.1f} | {gb / us * 1e3:.2f} | {diff:.1e} | {base / us:.2f}x |",
                  flush=True)
    print("\n| cascade: batch | rows per group | shared keys | own keys | own-key programs | us |"
          " max abs diff | vs the engine's |\n|---|---|---|---|---|---:|---:|---:|")
    for batch, group, shared, own in ((256, 16, 1024, 64), (256, 16, 1024, 160),
                                      (256, 16, 1024, 288), (256, 8, 1792, 336)):
        args, _ = cascade_inputs(batch, group, shared, own, num_sms)  # Qwen3-0.6B's heads too
        out = torch.empty_like(args[0])
        ref = cascade_attention(*args).float()
        base = per_layer_us(lambda: cascade_attention(*args, out=out))
        print(f"| {batch} | {group} | {shared} | {own} | the engine's (1 KV head x 64 keys) | "
              f"{base:.1f} | - | 1.00x |", flush=True)
        for (h, n), r in itertools.product(((1, 64), (2, 32), (4, 16), (8, 8), (8, 16)),
                                           (None, 128)):
            def fn(h=h, n=n, r=r):
                return cascade_packed_attention(*args, h, n, out=out, maxnreg=r)
            us = per_layer_us(fn)
            diff = (fn().float() - ref).abs().max().item()
            regs = f", at most {r} registers" if r else ""
            print(f"| {batch} | {group} | {shared} | {own} | {h} KV heads x {n} keys{regs} | "
                  f"{us:.1f} | {diff:.1e} | {base / us:.2f}x |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
