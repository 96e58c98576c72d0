"""GPU benchmark of the paged attention kernels: triton vs flash-attn vs torch sdpa, in one run.

Decode: one query per sequence over `ctx` cached keys, read through a shuffled block table. Each
method is captured in a CUDA graph that calls it once per "layer copy" (disjoint KV regions, enough
of them to exceed L2, as a model's layers would), and the median replay time is divided by the
number of calls. Bandwidth counts the K and V bytes that must be read: sum(context_lens) * Hkv * D *
2 bytes * 2. Prefill: 4 sequences of 2048 tokens, causal. Triton runs over a bf16 cache and over
the same keys and values in an FP8 cache (kv_cache_dtype="fp8": half the bytes, widened in
registers).

    python benchmarks/bench_kernels.py [--quick]

flash-attn is optional (its rows say "n/a" without it); its paged KV needs a block size that is a
multiple of 256, so triton is timed at 256 (and at 16 as a second column) on the same logical data.
"""
import argparse
import math
import statistics
import sys
import time
import traceback

from pathlib import Path

import torch
import triton

# run from anywhere without installing nanovllm
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.kernels.prefill import QUERY_TILE, query_tiles  # noqa: E402
from nanovllm.attention.fp8 import quantize  # noqa: E402
from nanovllm.kernels import (  # noqa: E402
    decode_attention,
    num_decode_splits,
    prefill_attention,
)
from nanovllm.kernels.decode import decode_scratch  # noqa: E402

try:
    import flash_attn
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError as e:
    flash_attn, FLASH_ERROR = None, repr(e)

HEADS = {"Qwen3-0.6B": (16, 8, 128), "SmolLM2": (9, 3, 64)}  # query heads, KV heads, head dim
DTYPE = torch.bfloat16
# what a server would be configured with; the split count depends on it, not on ctx
MAX_MODEL_LEN = 8192


def fmt(x, spec=".1f"):
    return x if isinstance(x, str) else format(x, spec)


def bench_graph(calls, min_ms=50.0):
    """Median microseconds per call: capture all `calls` (repeated to reach ~min_ms) in one CUDA
    graph."""
    for fn in calls:  # warm-up: compile, allocate
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in calls:
        fn()
    end.record()
    torch.cuda.synchronize()
    repeats = max(1, min(50, math.ceil(min_ms / max(start.elapsed_time(end), 1e-3))))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(repeats):
                for fn in calls:
                    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (repeats * len(calls)))
    del graph
    return statistics.median(times)


def guarded(fn, notes, label):
    """Run fn(); 'OOM' when memory runs out, 'err' (with a note) on any other failure."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "OOM"
    except Exception as e:  # keep the table going; say what broke
        first = str(e).splitlines()[0][:200] if str(e) else ""
        notes.append(f"{label}: {type(e).__name__}: {first}")
        if "--verbose" in sys.argv:
            traceback.print_exc()
        torch.cuda.empty_cache()
        return "err"


def make_pool(num_copies, batch, ctx, num_kv_heads, head_dim, block_size):
    """Random K/V pool holding num_copies x batch sequences of ctx keys, and one shuffled table
    per copy."""
    blocks_per_seq = triton.cdiv(ctx, block_size)
    num_blocks = num_copies * batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).to(torch.int32)
    tables = perm.view(num_copies, batch, blocks_per_seq)  # [copies, batch, blocks per sequence]
    return k_cache, v_cache, tables


def relayout(k_cache, v_cache, tables, block_size):
    """The same logical keys in pools of smaller blocks, shuffled again: (k pool, v pool,
    tables)."""
    ratio = k_cache.shape[1] // block_size
    # big block b = small blocks b*ratio .. +ratio-1
    k_small = k_cache.view(-1, block_size, *k_cache.shape[2:])
    v_small = v_cache.view(-1, block_size, *v_cache.shape[2:])
    perm = torch.randperm(k_small.shape[0], device="cuda")
    k_pool, v_pool = torch.empty_like(k_small), torch.empty_like(v_small)
    k_pool[perm], v_pool[perm] = k_small, v_small
    # [copies, batch, blocks, ratio]
    idx = tables.long()[..., None] * ratio + torch.arange(ratio, device="cuda")
    return k_pool, v_pool, perm[idx].flatten(-2).to(torch.int32)


def sdpa_decode(q, k_cache, v_cache, table, context_lens, scale):
    """Gather each sequence's K/V through its block table into a padded batch, mask, and call
    sdpa."""
    batch, num_heads, head_dim = q.shape
    k = k_cache[table].flatten(1, 2).transpose(1, 2)  # [B, Hkv, blocks * block_size, D]
    v = v_cache[table].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0]  # [B, Hq, D]


def bench_decode(name, batch, ctx, num_sms, l2_bytes, notes):
    num_heads, num_kv_heads, head_dim = HEADS[name]
    scale = head_dim ** -0.5
    kv_bytes = batch * ctx * num_kv_heads * head_dim * 2 * 2
    copies = max(1, math.ceil(4 * l2_bytes / kv_bytes))  # enough layer copies to defeat L2
    k_cache, v_cache, tables = make_pool(copies, batch, ctx, num_kv_heads, head_dim, 256)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")  # one query token per sequence
    q = torch.randn(batch, num_heads, head_dim, dtype=DTYPE, device="cuda")
    splits = num_decode_splits(batch, num_kv_heads, head_dim, MAX_MODEL_LEN, num_sms)
    scratch = decode_scratch(batch, num_heads, num_kv_heads, head_dim, MAX_MODEL_LEN, num_sms,
                             "cuda")
    tag = f"{name} b{batch} ctx{ctx}"
    row = {"splits": splits}

    def triton_call(kc, vc, t):
        return lambda: decode_attention(q, kc, vc, cu, lens, t, scale, splits, scratch)

    ref = decode_attention(q, k_cache, v_cache, cu, lens, tables[0], scale, splits, scratch)
    row["triton"] = guarded(lambda: bench_graph([triton_call(k_cache, v_cache, t) for t in tables]),
                            notes, f"triton {tag}")
    k8, v8 = quantize(k_cache, 1.0), quantize(v_cache, 1.0)  # the same keys in an FP8 cache
    out8 = decode_attention(q, k8, v8, cu, lens, tables[0], scale, splits, scratch)
    row["fp8_err"] = ((out8.float() - ref.float()).norm() / ref.float().norm()).item()
    row["fp8"] = guarded(lambda: bench_graph([triton_call(k8, v8, t) for t in tables]), notes,
                         f"triton fp8 {tag}")
    k8 = v8 = None  # freed before the relayout below
    row["flash"], row["diff"] = "n/a", "-"
    if flash_attn is not None:
        def flash_call(t):
            return lambda: flash_attn_with_kvcache(q[:, None], k_cache, v_cache,
                                                   cache_seqlens=lens, block_table=t,
                                                   softmax_scale=scale)
        flash_out = guarded(lambda: flash_call(tables[0])()[:, 0], notes, f"flash {tag}")
        if isinstance(flash_out, torch.Tensor):
            row["diff"] = (ref.float() - flash_out.float()).abs().max().item()
            row["flash"] = guarded(lambda: bench_graph([flash_call(t) for t in tables]), notes,
                                   f"flash {tag}")
        else:
            row["flash"] = flash_out
    sdpa_calls = [lambda t=t: sdpa_decode(q, k_cache, v_cache, t, lens, scale) for t in tables]
    row["sdpa"] = guarded(lambda: bench_graph(sdpa_calls), notes, f"sdpa {tag}")
    if row["diff"] == "-":  # no flash-attn: check against sdpa instead
        sdpa_out = guarded(lambda: sdpa_decode(q, k_cache, v_cache, tables[0], lens, scale), notes,
                           f"sdpa {tag}")
        if isinstance(sdpa_out, torch.Tensor):
            row["diff"] = (ref.float() - sdpa_out.float()).abs().max().item()

    k_cache, v_cache, tables = relayout(k_cache, v_cache, tables, 16)  # frees the 256-block ones
    out16 = decode_attention(q, k_cache, v_cache, cu, lens, tables[0], scale, splits, scratch)
    row["diff16"] = (ref.float() - out16.float()).abs().max().item()
    row["triton16"] = guarded(
        lambda: bench_graph([triton_call(k_cache, v_cache, t) for t in tables]), notes,
        f"triton bs16 {tag}")
    return row, kv_bytes


def bench_prefill(name, num_seqs, seq_len, notes):
    """Causal prefill of num_seqs fresh sequences: triton (keys read from the paged cache) vs flash
    varlen vs sdpa."""
    num_heads, num_kv_heads, head_dim = HEADS[name]
    scale = head_dim ** -0.5
    tokens = num_seqs * seq_len
    q = torch.randn(tokens, num_heads, head_dim, dtype=DTYPE, device="cuda")
    k_cache, v_cache, tables = make_pool(1, num_seqs, seq_len, num_kv_heads, head_dim, 256)
    table = tables[0]
    pos = torch.arange(seq_len, device="cuda")
    # [tokens]: this step's keys, as stored
    slots = (table.long()[:, pos // 256] * 256 + pos % 256).flatten()
    k = k_cache.flatten(0, 1)[slots]  # [tokens, Hkv, D]: the contiguous k, v a model hands flash
    v = v_cache.flatten(0, 1)[slots]
    cu = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32, device="cuda")
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    tiles = torch.tensor(query_tiles(cu.tolist(), 0), dtype=torch.int32, device="cuda").view(-1, 2)
    k8, v8 = quantize(k_cache, 1.0), quantize(v_cache, 1.0)
    # QK^T and PV, causal half
    flops = 4 * num_seqs * seq_len * (seq_len + 1) / 2 * head_dim * num_heads
    row = {"flops": flops}

    def time_us(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    def triton_fn(kc=k_cache, vc=v_cache):
        return prefill_attention(q, kc, vc, cu, lens, table, tiles, QUERY_TILE, scale)

    ref = triton_fn()
    row["triton"] = guarded(lambda: time_us(triton_fn), notes, f"triton prefill {name}")
    out8 = triton_fn(k8, v8)
    row["fp8_err"] = ((out8.float() - ref.float()).norm() / ref.float().norm()).item()
    row["fp8"] = guarded(lambda: time_us(lambda: triton_fn(k8, v8)), notes,
                         f"triton fp8 prefill {name}")
    row["flash"], row["diff"] = "n/a", "-"
    if flash_attn is not None:
        def flash_fn():
            return flash_attn_varlen_func(q, k, v, cu, cu, seq_len, seq_len, softmax_scale=scale,
                                          causal=True)
        flash_out = guarded(flash_fn, notes, f"flash prefill {name}")
        if isinstance(flash_out, torch.Tensor):
            row["diff"] = (ref.float() - flash_out.float()).abs().max().item()
            row["flash"] = guarded(lambda: time_us(flash_fn), notes, f"flash prefill {name}")

    def sdpa_fn():  # all sequences have one length here, so the padded batch needs no extra mask
        qb, kb, vb = (x.view(num_seqs, seq_len, -1, head_dim).transpose(1, 2) for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                                               scale=scale, enable_gqa=True)
        return out.transpose(1, 2).flatten(0, 1)
    row["sdpa"] = guarded(lambda: time_us(sdpa_fn), notes, f"sdpa prefill {name}")
    if row["diff"] == "-":
        sdpa_out = guarded(sdpa_fn, notes, f"sdpa prefill {name}")
        if isinstance(sdpa_out, torch.Tensor):
            row["diff"] = (ref.float() - sdpa_out.float()).abs().max().item()
    return row


def ratio(a, b):
    """a / b where both are numbers, else '-'."""
    return a / b if isinstance(a, float) and isinstance(b, float) else "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smaller grid (batch 1 and 64, context 2048)")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of failed rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    flash_version = (flash_attn.__version__ if flash_attn is not None
                     else f"not installed ({FLASH_ERROR})")
    print(f"# {torch.cuda.get_device_name()} ({props.multi_processor_count} SMs), torch "
          f"{torch.__version__}, triton {triton.__version__}, flash-attn {flash_version}, "
          f"{str(DTYPE).split('.')[-1]}")
    batches, contexts = (((1, 64), (2048,)) if args.quick
                         else ((1, 8, 64, 256), (512, 2048, 8192)))
    notes, started = [], time.time()

    print("\n## Decode (paged KV, shuffled block table, CUDA-graph replays)\n")
    print("| heads (q/kv/dim) | batch | ctx | splits | triton us | triton@16 us | flash us "
          "| sdpa us | triton TB/s | flash TB/s | triton/flash BW | max diff | triton fp8 us "
          "| fp8 TB/s | bf16/fp8 time | fp8 rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (num_heads, num_kv_heads, head_dim) in HEADS.items():
        for batch in batches:
            for ctx in contexts:
                result = guarded(lambda: bench_decode(name, batch, ctx, props.multi_processor_count,
                                                      l2_bytes, notes),
                                 notes, f"decode {name} b{batch} ctx{ctx}")
                row, kv_bytes = result if isinstance(result, tuple) else ({}, 1)
                cell = {m: row.get(m, "err") for m in ("splits", "triton", "triton16", "flash",
                                                       "sdpa", "fp8", "fp8_err")}
                tbps = {m: kv_bytes / cell[m] / 1e6 if isinstance(cell[m], float) else "-"
                        for m in ("triton", "flash")}
                fp8_us = cell["fp8"]
                tbps["fp8"] = kv_bytes / 2 / fp8_us / 1e6 if isinstance(fp8_us, float) else "-"
                diffs = [x for x in (row.get("diff"), row.get("diff16")) if isinstance(x, float)]
                print(f"| {name} {num_heads}/{num_kv_heads}/{head_dim} | {batch} | {ctx} "
                      f"| {cell['splits']} | {fmt(cell['triton'])} | {fmt(cell['triton16'])} "
                      f"| {fmt(cell['flash'])} | {fmt(cell['sdpa'])} "
                      f"| {fmt(tbps['triton'], '.2f')} | {fmt(tbps['flash'], '.2f')} "
                      f"| {fmt(ratio(cell['flash'], cell['triton']), '.2f')} "
                      f"| {fmt(max(diffs, default='-'), '.1e')} "
                      f"| {fmt(fp8_us)} | {fmt(tbps['fp8'], '.2f')} "
                      f"| {fmt(ratio(cell['triton'], fp8_us), '.2f')} "
                      f"| {fmt(cell['fp8_err'], '.1e')} |", flush=True)
                torch.cuda.empty_cache()

    print("\n## Prefill (4 sequences x 2048 tokens, causal)\n")
    print("| heads (q/kv/dim) | triton us | flash us | sdpa us | triton TFLOP/s | flash TFLOP/s "
          "| triton/flash time | max diff | triton fp8 us | bf16/fp8 time | fp8 rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (num_heads, num_kv_heads, head_dim) in HEADS.items():
        row = guarded(lambda: bench_prefill(name, 4, 2048, notes), notes, f"prefill {name}")
        row = row if isinstance(row, dict) else {"flops": 0.0}
        cell = {m: row.get(m, "err") for m in ("triton", "flash", "sdpa", "diff", "fp8", "fp8_err")}
        tflops = {m: row["flops"] / cell[m] / 1e6 if isinstance(cell[m], float) else "-"
                  for m in ("triton", "flash")}
        print(f"| {name} {num_heads}/{num_kv_heads}/{head_dim} | {fmt(cell['triton'])} "
              f"| {fmt(cell['flash'])} | {fmt(cell['sdpa'])} | {fmt(tflops['triton'])} "
              f"| {fmt(tflops['flash'])} "
              f"| {fmt(ratio(cell['triton'], cell['flash']), '.2f')} | {fmt(cell['diff'], '.1e')} "
              f"| {fmt(cell['fp8'])} | {fmt(ratio(cell['triton'], cell['fp8']), '.2f')} "
              f"| {fmt(cell['fp8_err'], '.1e')} |", flush=True)
        torch.cuda.empty_cache()

    print("\nNotes: decode times are per call (one layer), median of CUDA-graph replays over "
          "enough KV copies to defeat L2; triton and flash use block size 256, triton@16 the same "
          "data in 16-token blocks. TB/s = K+V bytes that must be read / time; triton/flash BW = "
          "flash time / triton time (> 1: triton faster); prefill triton/flash time = triton time "
          "/ flash time (< 1: triton faster). max diff = max |triton - flash| (or - sdpa without "
          "flash-attn), "
          "also covering triton@16; bf16 outputs agree to ~1e-2. sdpa gathers K/V into a padded "
          "batch each call (that copy is timed). "
          "Prefill times: triton.testing.do_bench medians; triton reads K/V through the block "
          "table, flash and sdpa take contiguous K/V. "
          "triton fp8: the same keys and values in an FP8 cache (scale 1); "
          "fp8 TB/s counts its bytes (half of bf16's); bf16/fp8 time > 1: fp8 faster; "
          "fp8 rel err = ||fp8 out - bf16 out|| / ||bf16 out||.")
    for note in notes:
        print(f"- {note}")
    print(f"\n(total {time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
