"""Cascade attention with the merge folded into its one launch, timed against the engine's launch +
merge on a GPU (`python benchmarks/cascade_fold_merge.py`, from the repository root).

The engine (kernels/cascade.py) launches the prefix and own-key programs, then a merge kernel that
combines each decode row's partial outputs by log-sum-exp: in a shared-prefix decode step on an
H200 the merge takes 4.1 us a layer beside 53 us for the launch
(results/h200_session13_shared_prefix_profile.log), and the step misses 2x cascade off by about
that much (README, cascade attention). Here there is no second kernel: every program, when it has
written its partials (or found its split empty), adds one to a counter per (row, query head) it
covers, and the program whose addition completes a row's count (its own-key splits, plus its
tile's prefix splits) merges that row there and then, and sets the counter back to 0 for the next
launch ("last block done" reductions, as in split-K GEMMs). A barrier before the addition orders
the program's stores before it, the addition is acquire-release at GPU scope, and the partials are
read past L1 (`.cg`), which is not coherent between SMs.

The prefix and own-key programs are the engine's (`_shared_prefix`, `_decode_split`); only the
arrival and the merge are new. Checked equal to kernels/cascade.py in Triton's interpreter
(tests/test_cascade.py); not yet run on a GPU. Compiled offline for sm_90 with the GPU host's
Triton 3.6 (scratch, ptxas via cuobjdump -res-usage), it holds 160 registers a thread against the
engine launch's 128 (3 programs per SM instead of 4); capped at 128 (`maxnreg`) it needs no
spills, so `main` times both.
"""
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
from nanovllm.kernels.decode import _decode_split, _split_range  # noqa: E402
from nanovllm.kernels.paged import widen_config  # noqa: E402


@triton.jit(do_not_specialize=["stride_bt", "num_prefix_programs"])
def _cascade_fold_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
    key_starts_ptr, tiles_ptr, out_ptr, partial_ptr, lse_ptr, counts_ptr, qk_scale, v_scale,
    num_prefix_programs, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, MEMBERS: tl.constexpr, ROWS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FP8_ASM: tl.constexpr, OWN_FIRST: tl.constexpr,
):
    """kernels/cascade.py's launch, each program then arriving at its rows' counters. OWN_FIRST
    numbers the own-key programs first (the interpreter runs programs in order: so the test sees
    prefix programs merge too)."""
    pid = tl.program_id(0)
    if OWN_FIRST:
        num_own = tl.num_programs(0) - num_prefix_programs
        pid = tl.where(pid < num_own, pid + num_prefix_programs, pid - num_own)
    if pid < num_prefix_programs:
        tile = pid // (NUM_KV_HEADS * PREFIX_SPLITS)
        kv_head = pid // PREFIX_SPLITS % NUM_KV_HEADS
        _shared_prefix(
            tile, kv_head, pid % PREFIX_SPLITS, q_ptr, k_cache_ptr, v_cache_ptr,
            cu_seqlens_q_ptr, block_tables_ptr, tiles_ptr, partial_ptr, lse_ptr, qk_scale,
            v_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
            stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
            GROUP, MEMBERS, ROWS_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_SPLITS, PREFIX_SPLITS,
            DOT_DTYPE, FP8_ASM)
        tile_ptr = tiles_ptr + tile * (2 + MEMBERS)
        if tl.load(tile_ptr + 1) > 0:  # a used tile: its members' rows arrive
            rows = tl.arange(0, ROWS_PAD)  # row r: member r // GROUP, query head r % GROUP
            member = rows // GROUP
            seq = tl.load(tile_ptr + 2 + member, mask=member < MEMBERS, other=-1)
            row_mask = seq >= 0
            _arrive_and_merge(
                tl.where(row_mask, seq, 0), kv_head * GROUP + rows % GROUP, row_mask,
                NUM_SPLITS + PREFIX_SPLITS, counts_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                key_starts_ptr, partial_ptr, lse_ptr, out_ptr, stride_ot, stride_oh, stride_pb,
                stride_ps, stride_ph, stride_lb, stride_ls, NUM_KV_HEADS * GROUP, HEAD_DIM,
                BLOCK_N, NUM_SPLITS, PREFIX_SPLITS)
    else:
        pid -= num_prefix_programs
        seq = pid // (NUM_KV_HEADS * NUM_SPLITS)
        kv_head = pid // NUM_SPLITS % NUM_KV_HEADS
        _decode_split(
            seq, kv_head, pid % NUM_SPLITS, q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr,
            context_lens_ptr, block_tables_ptr, key_starts_ptr, out_ptr, partial_ptr, lse_ptr,
            qk_scale, v_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
            stride_ot, stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
            GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_SPLITS, True, DOT_DTYPE,
            FP8_ASM)
        token = tl.load(cu_seqlens_q_ptr + seq)
        if tl.load(cu_seqlens_q_ptr + seq + 1) - token == 1:  # a decode row: its heads arrive
            rows = tl.arange(0, GROUP_PAD)
            row_mask = rows < GROUP
            seqs = tl.full([GROUP_PAD], 0, tl.int32) + seq
            shared = tl.load(key_starts_ptr + seqs) > 0  # in a tile: its prefix splits count too
            _arrive_and_merge(
                seqs, kv_head * GROUP + tl.minimum(rows, GROUP - 1), row_mask,
                NUM_SPLITS + tl.where(shared, PREFIX_SPLITS, 0), counts_ptr, cu_seqlens_q_ptr,
                context_lens_ptr, key_starts_ptr, partial_ptr, lse_ptr, out_ptr, stride_ot,
                stride_oh, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
                NUM_KV_HEADS * GROUP, HEAD_DIM, BLOCK_N, NUM_SPLITS, PREFIX_SPLITS)


@triton.jit
def _arrive_and_merge(
    seq, heads, row_mask, expected, counts_ptr, cu_seqlens_q_ptr, context_lens_ptr, key_starts_ptr,
    partial_ptr, lse_ptr, out_ptr, stride_ot, stride_oh, stride_pb, stride_ps, stride_ph,
    stride_lb, stride_ls, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
):
    """Count one arrival for each (seq[r], heads[r]) of row_mask; merge the rows whose count this
    completes (`expected` arrivals), as kernels/decode.py's _merge_splits_kernel would."""
    tl.debug_barrier()  # every thread's partials are stored before any arrival
    counter = counts_ptr + seq * NUM_HEADS + heads
    old = tl.atomic_add(counter, 1, mask=row_mask, sem="acq_rel", scope="gpu")
    last = row_mask & (old == expected - 1)
    tl.debug_barrier()  # every thread's reads come after the arrivals that acquired them
    if tl.max(last.to(tl.int32), 0) > 0:
        tl.store(counter, 0, mask=last)  # for the next launch; no one else adds to it now
        token = tl.load(cu_seqlens_q_ptr + seq, mask=last, other=0)
        context_len = tl.load(context_lens_ptr + seq, mask=last, other=0)
        key_start = tl.load(key_starts_ptr + seq, mask=last, other=0)
        dims = tl.arange(0, HEAD_DIM)
        m = tl.full(heads.shape, float("-inf"), tl.float32)
        total = tl.full(heads.shape, 0.0, tl.float32)
        acc = tl.full([heads.shape[0], HEAD_DIM], 0.0, tl.float32)
        for slot in tl.static_range(NUM_SPLITS + PREFIX_SPLITS):
            if slot < NUM_SPLITS:  # the row's own keys' splits, then its prefix's
                start, end = _split_range(key_start, context_len, slot, NUM_SPLITS, BLOCK_N)
            else:
                start, end = _split_range(0, key_start, slot - NUM_SPLITS, PREFIX_SPLITS, BLOCK_N)
            live = last & (start < end)  # the splits that ran; the rest: stale scratch
            lse = tl.load(lse_ptr + seq * stride_lb + slot * stride_ls + heads, mask=live,
                          other=float("-inf"), cache_modifier=".cg")
            part = tl.load(partial_ptr + seq[:, None] * stride_pb + slot * stride_ps
                           + heads[:, None] * stride_ph + dims[None, :], mask=live[:, None],
                           other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, lse)
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no live split yet: no NaN
            alpha = tl.exp2(m - base)
            weight = tl.exp2(lse - base)
            acc = acc * alpha[:, None] + weight[:, None] * part
            total = total * alpha + weight
            m = m_new
        out = acc / tl.where(last, total, 1.0)[:, None]
        tl.store(out_ptr + token.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=last[:, None])


def cascade_fold_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                           key_starts, tiles, scale, num_splits, prefix_splits, counts,
                           scratch=None, out=None, k_scale=1.0, v_scale=1.0, own_first=False,
                           maxnreg=None):
    """kernels/cascade.py's cascade_attention in one launch; counts: int32 zeros [B * Hq] (left
    zero)."""
    num_heads, head_dim = q.shape[1:]
    num_seqs, num_kv_heads = context_lens.shape[0], k_cache.shape[2]
    group = num_heads // num_kv_heads
    members = members_per_tile(group)
    assert counts.dtype == torch.int32 and counts.numel() >= num_seqs * num_heads
    out = torch.empty_like(q) if out is None else out
    slots = num_splits + prefix_splits
    if scratch is None:
        scratch = cascade_scratch(num_seqs, slots, num_heads, head_dim, q.device)
    size = num_seqs * slots * num_heads
    partial = scratch[0][:size * head_dim].view(num_seqs, slots, num_heads, head_dim)
    lse = scratch[1][:size].view(num_seqs, slots, num_heads, 1)
    num_prefix_programs = tiles.shape[0] * num_kv_heads * prefix_splits
    _cascade_fold_kernel[(num_prefix_programs + num_seqs * num_kv_heads * num_splits,)](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, key_starts, tiles, out,
        partial, lse, counts, scale * k_scale * math.log2(math.e), v_scale, num_prefix_programs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), partial.stride(0),
        partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), MEMBERS=members,
        ROWS_PAD=max(16, triton.next_power_of_2(members * group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, NUM_SPLITS=num_splits,
        PREFIX_SPLITS=prefix_splits, **widen_config(q.dtype, k_cache.dtype),
        **cascade_config(head_dim), OWN_FIRST=own_first,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    return out


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cascade_kernels import HQ, D, cascade_inputs
    from cascade_merge_variants import per_layer_us

    from nanovllm.kernels.cascade import cascade_attention
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: cascade attention of one layer, Qwen3-0.6B heads (16 q, 8 kv, d 128), "
          "bf16, 28 launches in a CUDA graph, us per launch\n")
    print("| batch | rows per group | shared keys | own keys | launch + merge us | one launch us |"
          " speedup | 128 registers us | speedup | own-key programs first us | max abs diff |"
          " counters left |\n|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, group, shared, own in ((256, 16, 1024, 64), (256, 16, 1024, 160),
                                      (256, 16, 1024, 288), (256, 8, 1792, 336),
                                      (64, 8, 1024, 256), (16, 8, 1024, 256)):
        args, _ = cascade_inputs(batch, group, shared, own, props.multi_processor_count)
        q, splits, psplits = args[0], args[-2], args[-1]
        scratch = cascade_scratch(batch, splits + psplits, HQ, D, q.device)
        counts = torch.zeros(batch * HQ, dtype=torch.int32, device="cuda")
        outs = [torch.empty_like(q), torch.empty_like(q)]

        def two():
            return cascade_attention(*args, scratch=scratch, out=outs[0])

        def one(own_first=False, maxnreg=None):
            return cascade_fold_attention(*args, counts, scratch=scratch, out=outs[1],
                                          own_first=own_first, maxnreg=maxnreg)
        base, us = per_layer_us(two), per_layer_us(one)
        capped, first = per_layer_us(lambda: one(maxnreg=128)), per_layer_us(lambda: one(True))
        diff = max((one(f, r).float() - two().float()).abs().max().item()
                   for f, r in ((False, None), (False, 128), (True, None)))
        print(f"| {batch} | {group} | {shared} | {own} | {base:.1f} | {us:.1f} | "
              f"{base / us:.2f}x | {capped:.1f} | {base / capped:.2f}x | {first:.1f} | "
              f"{diff:.1e} | {int(counts.count_nonzero())} |", flush=True)


if __name__ == "__main__":
    main()
