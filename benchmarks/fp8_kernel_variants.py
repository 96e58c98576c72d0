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
widening is not what bounds the FP8 decode kernel. Three more from session 11 (one H200,
h200_session11_fp8_variants.log; the first sweeps: h200_session11_fp8_prefetch.log, _swap.log):
"pf" loads V one tile ahead into registers (Triton's pipeliner does not see through widen_v's
inline PTX), "pfk" K too: both slower; "swap" runs the dots the other way round, S^T = K q^T and
O^T = V^T P^T, so the keys are the MMA's M (64: Hopper's wgmma) and the GROUP query heads its N,
padded to 8: 1.04-1.06x "asm" at batch 64-256 and 1.18x at batch 16, still at most 3.0 TB/s.
Stages written (n, r) cap the registers at r (maxnreg): "f16" 128/4/(2, 128), the FP8 decode config
since, is 1.09-1.21x "asm" 64/4/2 (h200_session11_fp8_occupancy.log). Compiled offline (session
13, `kernel_resources.py --fp8`, results/offline_sm90_resources.log), that config's key-tile loop
is 1,312 instructions a thread for 32 KB of cache (41 a KB; bfloat16's 13.2): V widened after its
transpose reads shared memory a byte at a time (177 LDS). "asm" 128/4/(2, 128) runs the same tile
in 797 (24.9 a KB) with no spills, at 3 programs an SM instead of 4 (72 KB of shared memory), and
"swap" 128/4/(2, 128) in 649: both added, not yet timed. Instructions alone do not decide it:
"swap" 64/2/2 issues half the engine config's a KB and took as long. Session 14 (one H200,
h200_session14_fp8_variants.log): asm and swap 128/4/(2, 128) timed, neither beats f16 128/4/(2,
128) (192.2 and 182.2 against 169.2 us at 256 x 1,024). "p8" runs p @ V on FP8 tensor cores (p
scaled by 256 into e4m3, V never widened): slower at every shape (188.1 us at best) and 2.4% more
error (h200_session14_fp8_p8.log): Triton still moves V through shared memory byte by byte for the
dot, now in e4m3. "tail" reads a split's last keys, if at most half a tile, as a half tile: on one
H100 slower at every shape, by 5% even with no tail to read (h100_session14_fp8_tail.log).
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

# "pf": V loaded one tile ahead into registers; "pfk": K too (both through widen_v / .to())
LOOP = "    for start_n in range(start, end, BLOCK_N):\n        keys = start_n"
FIRST = ("    first_keys = start + tl.arange(0, BLOCK_N)\n"
         "    first_rows = kv_row_offsets(block_table_row, first_keys, first_keys < end,\n"
         "                                stride_kb, stride_ks, BLOCK_SIZE)\n"
         "    first = first_rows[:, None] + dims[None, :]\n"
         "    v_next = tl.load(v_ptr + first, mask=(first_keys < end)[:, None], other=0.0)\n")
NEXT = ("        next_mask = keys + BLOCK_N < end\n"
        "        next_rows = kv_row_offsets(block_table_row, keys + BLOCK_N, next_mask,\n"
        "                                   stride_kb, stride_ks, BLOCK_SIZE)\n"
        "        nxt = next_rows[:, None] + dims[None, :]\n")
K_LOAD = "        k = tl.load(k_ptr + kv_offsets, mask=key_mask[:, None], other=0.0).to(q.dtype)\n"
V_LOAD = ("        v = tl.load(v_ptr + kv_offsets, mask=key_mask[:, None], other=0.0)\n"
          "        v = widen_v(v, q.dtype, FP8_ASM)\n")
DECODE_PF = asm_kv_module(decode_mod, [LOOP, V_LOAD], [FIRST + LOOP, NEXT + (
    "        v = v_next\n"
    "        v_next = tl.load(v_ptr + nxt, mask=next_mask[:, None], other=0.0)\n"
    "        v = widen_v(v, q.dtype, FP8_ASM)\n")], "pf")
DECODE_PFK = asm_kv_module(decode_mod, [LOOP, K_LOAD + V_LOAD], [
    FIRST + "    k_next = tl.load(k_ptr + first, mask=(first_keys < end)[:, None], other=0.0)\n"
    + LOOP, NEXT + (
        "        k = k_next\n        v = v_next\n"
        "        k_next = tl.load(k_ptr + nxt, mask=next_mask[:, None], other=0.0)\n"
        "        v_next = tl.load(v_ptr + nxt, mask=next_mask[:, None], other=0.0)\n"
        "        k = k.to(q.dtype)\n        v = widen_v(v, q.dtype, FP8_ASM)\n")], "pfk")
# "swap": S^T = K q^T [BLOCK_N, GROUP_PAD] and O^T = V^T P^T [D, GROUP_PAD], GROUP_PAD = 8
DECODE_SWAP = asm_kv_module(decode_mod, [
    "heads[:, None] * stride_qh + dims[None, :],\n"
    "                mask=row_mask[:, None], other=0.0).to(DOT_DTYPE)  # [GROUP_PAD, D]",
    "    acc = tl.full([GROUP_PAD, HEAD_DIM], 0.0, tl.float32)",
    '''        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(key_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has at least one key < end
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")''',
    "    out = acc * (v_scale / l_i)[:, None]",
    "heads[:, None] * stride_oh + dims[None, :]\n"
    "        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])",
    "heads[:, None] * stride_ph\n               + dims[None, :])\n"
    "        tl.store(dst, out, mask=row_mask[:, None])",
    "GROUP_PAD=max(16, triton.next_power_of_2(group))"], [
    "heads[None, :] * stride_qh + dims[:, None],\n"
    "                mask=row_mask[None, :], other=0.0).to(DOT_DTYPE)  # q^T [D, GROUP_PAD]",
    "    acc = tl.full([HEAD_DIM, GROUP_PAD], 0.0, tl.float32)",
    '''        s = tl.dot(k, q, input_precision="ieee") * qk_scale  # S^T [BLOCK_N, GROUP_PAD]
        s = tl.where(key_mask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(v.dtype), input_precision="ieee")''',
    "    out = acc * (v_scale / l_i)[None, :]",
    "heads[None, :] * stride_oh + dims[:, None]\n"
    "        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[None, :])",
    "heads[None, :] * stride_ph\n               + dims[:, None])\n"
    "        tl.store(dst, out, mask=row_mask[None, :])",
    "GROUP_PAD=max(8, triton.next_power_of_2(group))"], "swap")

# "p8": p @ V on FP8 tensor cores: V never widened, p (in [0, 1]) scaled by 256 into e4m3, the
# scale taken out of the output (e4m3 keeps 3 bits of p's mantissa, as V's own quantization does)
DECODE_P8 = asm_kv_module(decode_mod, [
    "        v = widen_v(v, q.dtype, FP8_ASM)\n",
    'acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")',
    "out = acc * (v_scale / l_i)[:, None]"], [
    "",
    "acc = acc * alpha[:, None] + tl.dot((p * 256.0).to(tl.float8e4nv), v)",
    "out = acc * (v_scale / 256.0 / l_i)[:, None]"], "p8")


def tail_module():
    """"tail": the keys past a split's last whole tile, if at most half a tile, read as one tile of
    BLOCK_N // 2 keys (a second copy of the loop) rather than a mostly masked BLOCK_N tile: an
    instruction-bound kernel (FP8) pays for masked keys as for real ones."""
    src = Path(decode_mod.__file__).read_text()
    begin = src.index("    for start_n in range(start, end, BLOCK_N):")
    finish = src.index("        m_i = m_new\n", begin) + len("        m_i = m_new\n")
    loop = src[begin:finish]
    half = loop.replace("range(start, end, BLOCK_N)", "range(body_end, end, HALF)").replace(
        "tl.arange(0, BLOCK_N)", "tl.arange(0, HALF)")
    assert half != loop and "HALF)" in half
    head = ("    HALF: tl.constexpr = BLOCK_N // 2\n"
            "    body_end = end - (end - start) % BLOCK_N\n"
            "    if end - body_end > HALF:\n"
            "        body_end = end\n")
    return asm_kv_module(decode_mod, loop, head + loop.replace("range(start, end, BLOCK_N)",
                                                                "range(start, body_end, BLOCK_N)")
                         + half, "tail")


DECODE_TAIL = tail_module()


def variant(mod, kind, cfg):
    """Patch mod's config and widening (for 'asmkv' a copy that widens K by PTX too); stages may be
    (stages, maxnreg): a cap on registers per thread."""
    cfg = dict(cfg)
    if isinstance(cfg["num_stages"], tuple):
        cfg["num_stages"], cfg["maxnreg"] = cfg["num_stages"]
    target = {"asmkv": DECODE_ASMKV if mod is decode_mod else PREFILL_ASMKV,
              "k8": DECODE_K8, "k8x2": DECODE_K8X2, "pf": DECODE_PF, "pfk": DECODE_PFK,
              "swap": DECODE_SWAP, "p8": DECODE_P8,
              "tail": DECODE_TAIL}.get(kind, mod)
    name = "decode_config" if mod is decode_mod else "prefill_config"
    setattr(target, name, lambda *args, **kwargs: dict(cfg))
    widen = dict(DOT_DTYPE=tl.bfloat16 if kind == "bf16" else tl.float16,
                 FP8_ASM=kind in ("asm", "asmkv", "k8", "k8x2", "pf", "pfk", "swap"))
    setattr(target, "widen_config", lambda q_dtype, cache_dtype: dict(widen))
    return target


DECODE_VARIANTS = [("f16", 64, 4, 2), ("f16", 128, 4, 2), ("asm", 64, 4, 2), ("asm", 64, 4, 3),
                   ("asm", 128, 4, 2), ("asm", 128, 4, 3), ("asm", 128, 8, 2), ("asm", 256, 4, 2),
                   ("asm", 32, 4, 2), ("asmkv", 64, 4, 2), ("asmkv", 128, 4, 2),
                   ("k8", 64, 4, 2), ("k8", 128, 4, 2), ("k8x2", 64, 4, 2), ("k8x2", 64, 4, 3),
                   ("k8x2", 128, 4, 2), ("k8x2", 128, 8, 2), ("pf", 64, 4, 2), ("pfk", 64, 4, 2),
                   ("swap", 64, 4, 2), ("swap", 64, 4, 3), ("swap", 128, 4, 3), ("swap", 64, 2, 2),
                   ("asm", 64, 2, 2), ("asm", 64, 4, (2, 96)), ("f16", 128, 4, (2, 128)),
                   ("asm", 128, 4, (2, 128)), ("swap", 128, 4, (2, 128)),
                   ("p8", 64, 4, 2), ("p8", 128, 4, 2), ("p8", 64, 4, (2, 128)),
                   ("p8", 128, 4, (2, 128)), ("p8", 128, 8, 2), ("p8", 64, 2, 2),
                   ("tail", 128, 4, (2, 128)), ("tail", 128, 4, 2), ("tail", 64, 4, 2)]
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
                             ("Qwen3-0.6B", 256, 256),
                             ("Qwen3-0.6B", 256, 288), ("Qwen3-0.6B", 256, 1000),
                             ("Qwen3-0.6B", 64, 1990),
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
