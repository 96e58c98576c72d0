"""GPU sweep behind the FP8 KV cache's kernel choices (kernels/paged.py dot_dtype, decode_config,
prefill_config): each variant of the decode and prefill kernels timed over an FP8 cache beside the
bfloat16 cache, in one process, with its error against the bfloat16 cache's output.

    python benchmarks/fp8_kernel_variants.py [--kinds asm k8 k8x2] [--no-prefill]

Variants: "f16" widens e4m3 to float16 (one packed conversion per two values) with .to() and runs
the dots in float16; "asm" widens V by widen_v's inline PTX (kernels/paged.py: the conversion stays
before V's transpose in shared memory); "asmkv" K too. Each with its tile (BLOCK_N), warps and
pipeline stages. (A first sweep also had "bf16", the widening to bfloat16 of the first FP8 cache,
and "bits", float16 built from the e4m3 bits with integer ops: both slower; 128-key tiles were the
main win of "f16" there.) "k8" and "k8x2" (decode only) run q @ K^T on FP8 tensor cores, with q
quantized to e4m3 per row (k8x2: as the sum of two e4m3 parts, two dots, about bfloat16's precision)
and K never widened: on an H100 no faster than "asm" (h100_session9_fp8_k8_variants.log), so K's
widening is not what bounds the FP8 decode kernel.
"""
import importlib.util
import math
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import nanovllm.kernels.decode as decode_mod  # noqa: E402
import nanovllm.kernels.prefill as prefill_mod  # noqa: E402
from bench_kernels import bench_graph, make_pool  # noqa: E402
from nanovllm.kernels.prefill import QUERY_TILE, query_tiles  # noqa: E402
from nanovllm.attention.fp8 import quantize  # noqa: E402
from nanovllm.kernels.decode import decode_scratch, num_decode_splits  # noqa: E402

HEADS = {"Qwen3-0.6B": (16, 8, 128), "SmolLM2": (9, 3, 64)}
def asm_kv_module(mod, old, new, suffix="asmkv"):
    """A copy of a kernel module with `old` replaced by `new` (each a string or a list of them):
    for "asmkv", K tiles widened by widen_v too (its inline PTX)."""
    src = Path(mod.__file__).read_text()
    for o, n in zip(*([old, new] if isinstance(old, list) else [[old], [new]])):
        assert o in src, o
        src = src.replace(o, n)
    path = Path(tempfile.mkdtemp()) / f"{mod.__name__.split('.')[-1]}_{suffix}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DECODE_ASMKV = asm_kv_module(
    decode_mod, "k = tl.load(k_ptr + kv_offsets, mask=key_mask[:, None], other=0.0).to(q.dtype)",
    "k = widen_v(tl.load(k_ptr + kv_offsets, mask=key_mask[:, None], other=0.0), q.dtype, FP8_ASM)")
PREFILL_ASMKV = asm_kv_module(prefill_mod, "k = k.to(q.dtype)", "k = widen_v(k, q.dtype, FP8_ASM)")
# "k8": q @ K^T on FP8 tensor cores (mma e4m3 x e4m3 -> float32, sm_89+): q is quantized per row
# (its max to 448) and K is never widened; V is widened by PTX as in "asm"
DECODE_K8 = asm_kv_module(decode_mod, [
    "mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)  # [GROUP_PAD, D]",
    "k = tl.load(k_ptr + kv_offsets, mask=key_mask[:, None], other=0.0).to(q.dtype)",
    "v = widen_v(v, q.dtype, FP8_ASM)",
    's = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [GROUP_PAD, BLOCK_N]'], [
    "mask=row_mask[:, None], other=0.0).to(tl.float32)\n"
    "    q_scale = tl.maximum(tl.max(tl.abs(q), 1), 1e-30) / 448.0\n"
    "    q = (q / q_scale[:, None]).to(tl.float8e4nv)",
    "k = tl.load(k_ptr + kv_offsets, mask=key_mask[:, None], other=0.0)",
    "v = widen_v(v, tl.float16, FP8_ASM)",
    "s = tl.dot(q, tl.trans(k)) * (qk_scale * q_scale)[:, None]"], "k8")
# "k8x2": as "k8", with q as the sum of two e4m3 parts (q_hi + q_lo, each scaled per row) and two
# FP8 dots: about bfloat16's precision for q at twice the (cheap, M = 16) tensor-core work
DECODE_K8X2 = asm_kv_module(decode_mod, [
    "mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)  # [GROUP_PAD, D]",
    "k = tl.load(k_ptr + kv_offsets, mask=key_mask[:, None], other=0.0).to(q.dtype)",
    "v = widen_v(v, q.dtype, FP8_ASM)",
    's = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [GROUP_PAD, BLOCK_N]'], [
    "mask=row_mask[:, None], other=0.0).to(tl.float32)\n"
    "    hi_scale = tl.maximum(tl.max(tl.abs(q), 1), 1e-30) / 448.0\n"
    "    q_hi = (q / hi_scale[:, None]).to(tl.float8e4nv)\n"
    "    q = q - q_hi.to(tl.float32) * hi_scale[:, None]\n"
    "    lo_scale = tl.maximum(tl.max(tl.abs(q), 1), 1e-30) / 448.0\n"
    "    q_lo = (q / lo_scale[:, None]).to(tl.float8e4nv)\n"
    "    hi_scale *= qk_scale\n"
    "    lo_scale *= qk_scale",
    "k = tl.load(k_ptr + kv_offsets, mask=key_mask[:, None], other=0.0)",
    "v = widen_v(v, tl.float16, FP8_ASM)",
    "s = (tl.dot(q_hi, tl.trans(k)) * hi_scale[:, None]\n"
    "             + tl.dot(q_lo, tl.trans(k)) * lo_scale[:, None])"], "k8x2")


def variant(mod, kind, cfg):
    """Patch mod's config and widening (for 'asmkv' a copy that widens K by PTX too)."""
    target = {"asmkv": DECODE_ASMKV if mod is decode_mod else PREFILL_ASMKV,
              "k8": DECODE_K8, "k8x2": DECODE_K8X2}.get(kind, mod)
    name = "decode_config" if mod is decode_mod else "prefill_config"
    setattr(target, name, lambda head_dim, cache_dtype=None: dict(cfg))
    widen = dict(DOT_DTYPE=tl.bfloat16 if kind == "bf16" else tl.float16,
                 FP8_ASM=kind in ("asm", "asmkv", "k8", "k8x2"))
    setattr(target, "widen_config", lambda q_dtype, cache_dtype: dict(widen))
    return target


DECODE_VARIANTS = [("f16", 64, 4, 2), ("f16", 128, 4, 2), ("asm", 64, 4, 2), ("asm", 64, 4, 3),
                   ("asm", 128, 4, 2), ("asm", 128, 4, 3), ("asm", 128, 8, 2), ("asm", 256, 4, 2),
                   ("asm", 32, 4, 2), ("asmkv", 64, 4, 2), ("asmkv", 128, 4, 2),
                   ("k8", 64, 4, 2), ("k8", 128, 4, 2), ("k8x2", 64, 4, 2), ("k8x2", 64, 4, 3),
                   ("k8x2", 128, 4, 2), ("k8x2", 128, 8, 2)]
PREFILL_VARIANTS = [("f16", 64, 4, 2), ("asm", 32, 4, 2), ("asm", 64, 4, 2), ("asm", 64, 4, 3),
                    ("asm", 128, 8, 2), ("asmkv", 64, 4, 2), ("asmkv", 32, 4, 2)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep_decode(name, batch, ctx, num_sms, l2_bytes, kinds):
    num_heads, num_kv_heads, head_dim = HEADS[name]
    scale = head_dim ** -0.5
    kv_bytes = batch * ctx * num_kv_heads * head_dim * 2 * 2
    copies = max(1, math.ceil(4 * l2_bytes / kv_bytes))
    k_cache, v_cache, tables = make_pool(copies, batch, ctx, num_kv_heads, head_dim, 256)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    splits = num_decode_splits(batch, num_kv_heads, head_dim, 8192, num_sms)
    scratch = decode_scratch(batch, num_heads, num_kv_heads, head_dim, 8192, num_sms, "cuda")

    def calls(mod, kc, vc):
        return [lambda t=t: mod.decode_attention(q, kc, vc, cu, lens, t, scale, splits, scratch)
                for t in tables]

    mod = variant(decode_mod, "bf16", dict(BLOCK_N=64, num_warps=4, num_stages=2))
    ref = mod.decode_attention(q, k_cache, v_cache, cu, lens, tables[0], scale, splits, scratch)
    base = bench_graph(calls(mod, k_cache, v_cache))
    print(f"| {name} b{batch} ctx{ctx} s{splits} | bf16 cache | {base:.1f} | "
          f"{kv_bytes / base / 1e6:.2f} | 1.00 | - |", flush=True)
    k8, v8 = quantize(k_cache, 1.0), quantize(v_cache, 1.0)
    del k_cache, v_cache
    first = None
    for kind, bn, warps, stages in [v for v in DECODE_VARIANTS if v[0] in kinds]:
        mod = variant(decode_mod, kind, dict(BLOCK_N=bn, num_warps=warps, num_stages=stages))
        try:
            out = mod.decode_attention(q, k8, v8, cu, lens, tables[0], scale, splits, scratch)
            first = out if first is None else first
            us = bench_graph(calls(mod, k8, v8))
        except Exception as e:  # a variant that does not compile (shared memory): say so
            print(f"| {name} b{batch} ctx{ctx} | {kind} {bn}/{warps}/{stages} | "
                  f"{type(e).__name__}: {str(e)[:80]} |", flush=True)
            continue
        print(f"| {name} b{batch} ctx{ctx} s{splits} | fp8 {kind} {bn}/{warps}/{stages} | {us:.1f} "
              f"| {kv_bytes / 2 / us / 1e6:.2f} | {base / us:.2f} | {rel(out, ref):.1e} "
              f"(vs fp8 bf16: {rel(out, first):.1e}) |", flush=True)
    torch.cuda.empty_cache()


def sweep_prefill(name, num_seqs=4, seq_len=2048):
    num_heads, num_kv_heads, head_dim = HEADS[name]
    scale, tokens = head_dim ** -0.5, num_seqs * seq_len
    q = torch.randn(tokens, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache, tables = make_pool(1, num_seqs, seq_len, num_kv_heads, head_dim, 256)
    cu = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32, device="cuda")
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    tiles = torch.tensor(query_tiles(cu.tolist(), 0), dtype=torch.int32, device="cuda").view(-1, 2)
    k8, v8 = quantize(k_cache, 1.0), quantize(v_cache, 1.0)

    def us(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    def call(mod, kc, vc):
        return lambda: mod.prefill_attention(q, kc, vc, cu, lens, tables[0], tiles, QUERY_TILE,
                                             scale)
    mod = variant(prefill_mod, "bf16", dict(BLOCK_N=32 if head_dim > 64 else 64, num_warps=4,
                                            num_stages=2))
    ref = call(mod, k_cache, v_cache)()
    base = us(call(mod, k_cache, v_cache))
    print(f"| {name} {num_seqs}x{seq_len} | bf16 cache | {base:.1f} | 1.00 | - |", flush=True)
    first = None
    for kind, bn, warps, stages in PREFILL_VARIANTS:
        mod = variant(prefill_mod, kind, dict(BLOCK_N=bn, num_warps=warps, num_stages=stages))
        try:
            out = call(mod, k8, v8)()
            first = out if first is None else first
            t = us(call(mod, k8, v8))
        except Exception as e:
            print(f"| {name} | {kind} {bn}/{warps}/{stages} | {type(e).__name__}: {str(e)[:80]} |",
                  flush=True)
            continue
        print(f"| {name} {num_seqs}x{seq_len} | fp8 {kind} {bn}/{warps}/{stages} | {t:.1f} "
              f"| {base / t:.2f} | {rel(out, ref):.1e} (vs fp8 bf16: {rel(out, first):.1e}) |",
              flush=True)
    torch.cuda.empty_cache()


def main():
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", nargs="+", default=sorted({v[0] for v in DECODE_VARIANTS}),
                        help="decode variants to time (default: all)")
    parser.add_argument("--no-prefill", action="store_true")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print("\n## Decode: us per call, TB/s of the cache's bytes, bf16 time / time, rel err vs the "
          "bf16 cache\n")
    print("| case | variant kind BLOCK_N/warps/stages | us | TB/s | speedup | rel err |")
    print("|---|---|---|---|---|---|")
    for name, batch, ctx in [("Qwen3-0.6B", 64, 2048), ("Qwen3-0.6B", 256, 1024),
                             ("Qwen3-0.6B", 1, 2048), ("Qwen3-0.6B", 16, 2048),
                             ("SmolLM2", 64, 2048)]:
        sweep_decode(name, batch, ctx, props.multi_processor_count, l2, args.kinds)
    if args.no_prefill:
        return
    print("\n## Prefill (causal): us, bf16 time / time, rel err vs the bf16 cache\n")
    print("| case | variant | us | speedup | rel err |")
    print("|---|---|---|---|---|")
    for name in HEADS:
        sweep_prefill(name)


if __name__ == "__main__":
    main()
