"""Cascade attention's kernels against plain split-KV decode on a GPU
(`python benchmarks/cascade_kernels.py [--sweep]`).

Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128, bfloat16, 256-token blocks)
at batch 256: each case is a number of groups sharing a prefix and each row's own keys. Both paths
run as CUDA graphs (as the engine runs them), median of repeats; the table gives the saved share of
key reads (the rule's measure, attention/cascade.py) beside the speedup, to set MIN_SAVED_FRACTION.
It also checks the two outputs agree. For the two bench workloads it gives each kernel's time
(torch.profiler) and other prefix splits; `--sweep` tries other tile sizes of the cascade launch.
"""
import statistics

import torch

from nanovllm.attention.cascade import plan_tiles, prefix_splits
from nanovllm.kernels import cascade
from nanovllm.kernels.cascade import cascade_attention, members_per_tile
from nanovllm.kernels.decode import decode_attention, num_decode_splits

HQ, HKV, D, BS = 16, 8, 128, 256


def build(batch, group, shared, own, device="cuda"):
    """A cache where rows come in groups of `group` sharing `shared` keys, each with `own` more."""
    blocks_shared, blocks_own = shared // BS, -(-own // BS) + 1
    num_groups = batch // group
    num_blocks = num_groups * blocks_shared + batch * blocks_own + 1
    k = torch.randn(num_blocks, BS, HKV, D, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    tables, nxt = [], 0
    for g in range(num_groups):
        prefix = list(range(nxt, nxt + blocks_shared))
        nxt += blocks_shared
        for _ in range(group):
            tables.append(prefix + list(range(nxt, nxt + blocks_own)))
            nxt += blocks_own
    lens = [shared + own] * batch
    return k, v, tables, lens


def timed(fn, reps=50):
    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_times(fn, reps=20) -> dict:
    """Microseconds per call of each kernel fn launches (torch.profiler, eager launches)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:40]] += e.time_range.elapsed_us() / reps
    return dict(times)


def cascade_inputs(batch, group, shared, own, num_sms, psplits=None, device="cuda"):
    """cascade_attention's arguments over a `build` cache (queries, caches, rows, tables, the
    host's plan, scale, splits and prefix splits as the engine picks them, or psplits), and the
    share of the decode key reads the plan saves (the rule's measure)."""
    k, v, tables, lens = build(batch, group, shared, own, device)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                      device=device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=device)
    key_starts, tiles, saved = plan_tiles(tables, lens, batch, BS, members_per_tile(HQ // HKV))
    ks = torch.tensor(key_starts, dtype=torch.int32, device=device)
    tt = torch.tensor(tiles, dtype=torch.int32, device=device).view(len(tiles), -1)
    splits = num_decode_splits(batch, HKV, D, 4096, num_sms)
    psplits = psplits or prefix_splits(len(tiles), HKV, num_sms, shared)
    return (q, k, v, cu, ctx, bt, ks, tt, D ** -0.5, splits, psplits), saved / sum(lens)


def case(batch, group, shared, own, num_sms, psplits=None, breakdown=False):
    args, frac = cascade_inputs(batch, group, shared, own, num_sms, psplits)
    q, k, v, cu, ctx, bt, ks, tl_, scale, splits, psplits = args
    out_plain, out_casc = torch.empty_like(q), torch.empty_like(q)
    plain = timed(lambda: decode_attention(q, k, v, cu, ctx, bt, scale, splits, out=out_plain))
    casc = timed(lambda: cascade_attention(q, k, v, cu, ctx, bt, ks, tl_, scale, splits, psplits,
                                           out=out_casc))
    err = ((out_casc.float() - out_plain.float()).norm() / out_plain.float().norm()).item()
    print(f"| {batch} | {group} | {shared} | {own} | {frac:.2f} | {plain * 1e3:.0f} | "
          f"{casc * 1e3:.0f} | {plain / casc:.2f}x | {err:.1e} | {psplits} |", flush=True)
    if breakdown:
        for name, fn in (("plain", lambda: decode_attention(q, k, v, cu, ctx, bt, scale, splits,
                                                            out=out_plain)),
                         ("cascade", lambda: cascade_attention(q, k, v, cu, ctx, bt, ks, tl_,
                                                               scale, splits, psplits,
                                                               out=out_casc))):
            print(f"  {name}: " + ", ".join(f"{n} {t:.1f} us"
                                            for n, t in kernel_times(fn).items()), flush=True)
    return err


def main():
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also other tile sizes")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: attention of one layer, Qwen3-0.6B heads (16 q, 8 kv, d 128), bf16, "
          f"block 256; microseconds, CUDA graphs, median of 50\n")
    print("| batch | rows per group | shared keys | own keys | saved share | plain us | "
          "cascade us | speedup | rel diff | prefix splits |\n" + "|---" * 10 + "|")
    errs = []
    cases = [(256, 16, 1024, 160), (256, 8, 1792, 336),  # the two bench workloads, mid-decode
             (256, 2, 256, 1024), (256, 2, 512, 512), (256, 2, 1024, 256), (256, 4, 256, 1024),
             (256, 4, 256, 512), (256, 16, 256, 2048), (256, 16, 256, 1024), (256, 2, 256, 256),
             (64, 8, 1024, 256), (16, 8, 1024, 256), (8, 8, 2048, 100), (512, 16, 1024, 512)]
    for c in cases[:2]:  # the bench workloads: per kernel, and other prefix splits
        errs.append(case(*c, props.multi_processor_count, breakdown=True))
        for psplits in (1, 2, 4, 8):
            errs.append(case(*c, props.multi_processor_count, psplits))
    for c in cases[2:]:
        errs.append(case(*c, props.multi_processor_count))
    if args.sweep:  # the launch's tile sizes
        default = cascade.cascade_config
        for block_n, warps in ((64, 8), (32, 4), (32, 8)):
            cascade.cascade_config = lambda d, b=block_n, w=warps: dict(BLOCK_N=b, num_warps=w,
                                                                         num_stages=2)
            print(f"BLOCK_N {block_n}, {warps} warps:")
            for c in cases[:2]:
                for psplits in (None, 1):
                    errs.append(case(*c, props.multi_processor_count, psplits))
        cascade.cascade_config = default
    assert max(errs) < 2e-2, errs


if __name__ == "__main__":
    main()
