"""Cascade attention's merge with 1 to 16 query heads a program, on a GPU
(`python benchmarks/cascade_merge_variants.py`, from the repository root).

The merge (kernels/decode.py `_merge_splits_kernel`, launched by kernels/cascade.py) combines each
decode row's partial outputs (its own-key splits and its tile's prefix splits) by log-sum-exp.
It was one program per (row, query head) with 2 warps: about 6.5 us a layer on an H200 at the
bench workload's shared-prefix shape beside 65.5 us for the cascade launch, ~5% of a cascade decode
step. Here each program takes HEADS query heads of one row ([HEADS, slots, head_dim]): fewer,
bigger programs; on an H200 4 heads with 4 warps took 2.9 us instead of 5.6
(results/h200_session13_merge_variants.log), which kernels/cascade.py now launches. Each runs 28
times in one CUDA graph (a model's layers) on the partials of a real cascade launch, and must
equal its output.
"""
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels.decode import _merge_splits_kernel  # noqa: E402

LAYERS = 28


def merge_args(partial, lse, out, cu, ctx, key_starts):
    """The merge's arguments, as kernels/cascade.py passes them."""
    return (partial, lse, out, cu, ctx, key_starts, partial.stride(0), partial.stride(1),
            partial.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1))


def merge(partial, lse, out, cu, ctx, key_starts, num_splits, prefix_splits, block_n,
          heads=1, num_warps=2):
    """The merge as kernels/cascade.py launches it, with `heads` query heads a program (before
    this benchmark: 1 head, 2 warps; now MERGE_HEADS, 4 warps)."""
    num_seqs, num_heads = ctx.shape[0], out.shape[1]
    _merge_splits_kernel[(num_seqs, triton.cdiv(num_heads, heads))](
        *merge_args(partial, lse, out, cu, ctx, key_starts), NUM_HEADS=num_heads, HEADS=heads,
        HEAD_DIM=out.shape[2], BLOCK_N=block_n, NUM_SPLITS=num_splits,
        PREFIX_SPLITS=prefix_splits, PREFIX_BLOCK_N=block_n,
        SPLITS_PAD=triton.next_power_of_2(num_splits + prefix_splits), num_warps=num_warps)
    return out


def per_layer_us(fn) -> float:
    """Median time of LAYERS launches of fn in one CUDA graph, per launch (us)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    return statistics.median(times)


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cascade_kernels import HQ, D, cascade_inputs

    from nanovllm.kernels.cascade import cascade_attention, cascade_config, cascade_scratch
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: cascade attention's merge, Qwen3-0.6B heads (16 q, 8 kv, d 128), "
          f"{LAYERS} launches in a CUDA graph, us per launch, median of 30\n")
    print("| rows per group | shared keys | own keys | prefix splits | variant | us | vs merge |"
          " max abs diff |\n|---|---|---|---|---|---:|---:|---:|")
    block_n = cascade_config(D)["BLOCK_N"]
    for group, shared, own in ((16, 1024, 64), (16, 1024, 160), (16, 1024, 288), (8, 1792, 336)):
        inputs, _ = cascade_inputs(256, group, shared, own, props.multi_processor_count)
        q, _, _, cu, ctx, _, ks, _, _, splits, psplits = inputs
        slots = splits + psplits
        scratch = cascade_scratch(256, slots, HQ, D, q.device)
        expected = cascade_attention(*inputs, scratch=scratch)
        partial = scratch[0].view(256, slots, HQ, D)
        lse = scratch[1].view(256, slots, HQ, 1)
        args = (partial, lse, torch.empty_like(q), cu, ctx, ks, splits, psplits, block_n)
        base = per_layer_us(lambda: merge(*args))
        variants = [("1 head, 2 warps (before)", lambda: merge(*args))] + [
            (f"{h} heads, {w} warps", lambda h=h, w=w: merge(*args, heads=h, num_warps=w))
            for h, w in ((2, 2), (4, 2), (4, 4), (8, 4), (16, 4), (16, 8))]
        for name, fn in variants:
            us = per_layer_us(fn)
            diff = (fn().float() - expected.float()).abs().max().item()
            print(f"| {group} | {shared} | {own} | {psplits} | {name} | {us:.1f} | "
                  f"{base / us:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
