"""Cascade attention's kernels against plain split-KV decode on a GPU
(`python benchmarks/cascade_kernels.py`).

Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128, bfloat16, 256-token blocks)
at batch 256: each case is a number of groups sharing a prefix and each row's own keys. Both paths
run as CUDA graphs (as the engine runs them), median of repeats; the table gives the saved share of
key reads (the rule's measure, attention/cascade.py) beside the speedup, to set MIN_SAVED_FRACTION.
It also checks the two outputs agree.
"""
import statistics

import torch

from nanovllm.attention.cascade import cascade_splits, plan_tiles
from nanovllm.kernels.cascade import cascade_attention, cascade_scratch, members_per_tile
from nanovllm.kernels.decode import decode_attention, num_decode_splits

HQ, HKV, D, BS = 16, 8, 128, 256


def build(batch, group, shared, own):
    """A cache where rows come in groups of `group` sharing `shared` keys, each with `own` more."""
    blocks_shared, blocks_own = shared // BS, -(-own // BS) + 1
    num_groups = batch // group
    num_blocks = num_groups * blocks_shared + batch * blocks_own + 1
    k = torch.randn(num_blocks, BS, HKV, D, dtype=torch.bfloat16, device="cuda")
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


def case(batch, group, shared, own, num_sms, csplits=None, breakdown=False):
    k, v, tables, lens = build(batch, group, shared, own)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                      device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    members = members_per_tile(HQ // HKV)
    tiles, saved = plan_tiles(tables, lens, batch, BS, members)
    splits = num_decode_splits(batch, HKV, D, 4096, num_sms)
    csplits = csplits or cascade_splits(len(tiles), HKV, num_sms, 4096)
    tl_ = torch.tensor(tiles, dtype=torch.int32, device="cuda").view(len(tiles), -1)
    out_plain, out_casc = torch.empty_like(q), torch.empty_like(q)
    scale = D ** -0.5
    plain = timed(lambda: decode_attention(q, k, v, cu, ctx, bt, scale, splits, out=out_plain))
    scratch = cascade_scratch(batch, 16, HQ, D, "cuda")
    casc = timed(lambda: cascade_attention(q, k, v, cu, ctx, bt, tl_, scale, csplits, scratch,
                                           out=out_casc))
    err = ((out_casc.float() - out_plain.float()).norm() / out_plain.float().norm()).item()
    frac = saved / sum(lens)
    print(f"| {batch} | {group} | {shared} | {own} | {frac:.2f} | {plain * 1e3:.0f} | "
          f"{casc * 1e3:.0f} | {plain / casc:.2f}x | {err:.1e} | {csplits} |", flush=True)
    if breakdown:
        for name, fn in (("plain", lambda: decode_attention(q, k, v, cu, ctx, bt, scale, splits,
                                                            out=out_plain)),
                         ("cascade", lambda: cascade_attention(q, k, v, cu, ctx, bt, tl_, scale,
                                                               csplits, scratch, out=out_casc))):
            print(f"  {name}: " + ", ".join(f"{n} {t:.1f} us"
                                            for n, t in kernel_times(fn).items()), flush=True)
    return err


def main():
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: attention of one layer, Qwen3-0.6B heads (16 q, 8 kv, d 128), bf16, "
          f"block 256; microseconds, CUDA graphs, median of 50\n")
    print("| batch | rows per group | shared keys | own keys | saved share | plain us | "
          "cascade us | speedup | rel diff | splits |\n" + "|---" * 10 + "|")
    errs = []
    cases = [(256, 16, 1024, 160), (256, 8, 1792, 336),  # the two bench workloads, mid-decode
             (256, 2, 256, 1024), (256, 2, 512, 512), (256, 2, 1024, 256), (256, 4, 256, 1024),
             (256, 4, 256, 512), (256, 16, 256, 2048), (256, 16, 256, 1024), (256, 2, 256, 256),
             (64, 8, 1024, 256), (16, 8, 1024, 256), (8, 8, 2048, 100), (512, 16, 1024, 512)]
    for c in cases[:2]:  # the bench workloads: per kernel, and other prefix splits
        errs.append(case(*c, props.multi_processor_count, breakdown=True))
        for csplits in (1, 2, 3, 4, 6, 8, 12, 16):
            errs.append(case(*c, props.multi_processor_count, csplits))
    for c in cases[2:]:
        errs.append(case(*c, props.multi_processor_count))
    assert max(errs) < 2e-2, errs


if __name__ == "__main__":
    main()
