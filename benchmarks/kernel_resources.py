"""Registers, spills and shared memory of the decode and cascade kernels on a Hopper GPU, without
one: `python benchmarks/kernel_resources.py` compiles them for sm_90 on any machine (Triton's own
ptxas) and reads the cubin with Triton's cuobjdump.

Decode attention is bound by memory latency when few programs share an SM, so what limits the
programs per SM (registers: 65,536 per SM; shared memory: 228 KB) is worth knowing before a GPU
is at hand. Qwen3-0.6B's shapes: 2 query heads per KV head, head_dim 128, bf16, 256-token blocks.
`--variants` adds the launches prepared in benchmarks/cascade_fold_merge.py and
benchmarks/packed_decode.py, each also capped at 128 registers (`maxnreg`); `--fp8` counts the
instructions of the decode kernel's key-tile loop (from its SASS) over bf16 and FP8 caches.

The figures depend on Triton's version: run it with the GPU host's (3.6 in these sessions; e.g. in
a venv with the system's packages, `pip install triton==3.6.0`), whose cascade launch holds 128
registers as the H200 reported, where Triton 3.9 gives 154 (results/offline_sm90_resources.log).
"""
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanovllm.kernels.cascade import _cascade_kernel, members_per_tile
from nanovllm.kernels.decode import _decode_split_kernel

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
INT_POINTERS = ("cu_seqlens", "context_lens", "block_tables", "key_starts", "tiles", "counts")


def signature(fn, constexprs: dict) -> dict:
    """Triton types of fn's arguments: bf16 tensors, int32 metadata, float32 scratch."""
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in ("partial_ptr", "lse_ptr"):
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*i32" if name.startswith(INT_POINTERS) else "*bf16"
        else:
            types[name] = "fp32" if "scale" in name else "i32"
    return types


def aligned(fn, types: dict) -> dict:
    """What the JIT knows at a real launch: every pointer, and every integer it specializes on
    (all strides of these shapes are multiples of 16), divisible by 16. Without it the loads
    compile to 2-byte scalar loads, not the 16-byte vectors a GPU run gets."""
    skip = set(fn.do_not_specialize) | {fn.arg_names[i] for i in fn.do_not_specialize
                                        if isinstance(i, int)}
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if types[name] != "constexpr" and types[name] != "fp32" and name not in skip}


def compiled(fn, constexprs: dict, num_warps: int, num_stages: int = 2,
             maxnreg: int | None = None, cache: str = "*bf16"):
    types = signature(fn, constexprs)
    types.update({name: cache for name in ("k_cache_ptr", "v_cache_ptr") if name in types})
    src = ASTSource(fn=fn, signature=types, constexprs=constexprs, attrs=aligned(fn, types))
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(kernel, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([CUOBJDUMP, flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def resources(fn, constexprs: dict, num_warps: int, num_stages: int = 2,
              maxnreg: int | None = None, kernel=None) -> tuple:
    """(registers per thread, stack bytes per thread, shared bytes, programs per SM)."""
    kernel = kernel or compiled(fn, constexprs, num_warps, num_stages, maxnreg)
    usage = cuobjdump(kernel, "--dump-resource-usage")
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = kernel.metadata.shared
    per_sm = min(65536 // (regs * 32 * num_warps), 233472 // max(shared, 1), 32)
    return regs, stack, shared, per_sm


def main():
    group, members = 2, members_per_tile(2)
    common = dict(GROUP=group, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=256, NUM_SPLITS=1,
                  DOT_DTYPE=tl.bfloat16, FP8_ASM=False)
    print("sm_90 (compiled here), Qwen3-0.6B shapes\n\n| kernel | BLOCK_N | warps | registers | "
          "stack bytes | shared bytes | programs per SM |\n|---|---|---|---|---|---|---|")
    for block_n in (64, 32):
        for warps in (4, 8):
            rows = [("decode", _decode_split_kernel, dict(common, CASCADE=False)),
                    ("cascade (one launch)", _cascade_kernel,
                     dict(common, MEMBERS=members, ROWS_PAD=max(16, members * group),
                          NUM_KV_HEADS=8, PREFIX_SPLITS=3))]
            for name, fn, constexprs in rows:
                regs, stack, shared, per_sm = resources(fn, dict(constexprs, BLOCK_N=block_n),
                                                        warps)
                print(f"| {name} | {block_n} | {warps} | {regs} | {stack} | {shared} | {per_sm} |",
                      flush=True)


def loop_body(kernel) -> list[str]:
    """The opcodes of the kernel's longest loop (from a backward branch to its target): a key
    tile's work, per thread of a warp."""
    lines = re.findall(r"/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);",
                       cuobjdump(kernel, "-sass"))
    loops = [(int(m.group(1), 16), int(address, 16)) for address, op, rest in lines
             if op.startswith("BRA") and (m := re.search(r"0x([0-9a-f]+)", rest))
             and int(m.group(1), 16) < int(address, 16)]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return [op.split(".")[0] for address, op, _ in lines if start <= int(address, 16) <= end]


def fp8_decode():
    """Instructions a key tile costs the decode kernel over bf16 and FP8 caches, for the engine's
    configs and benchmarks/fp8_kernel_variants.py's variants: where the FP8 cache's time goes
    (half the bytes, more instructions a byte)."""
    import sys
    from collections import Counter
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fp8_kernel_variants as fv

    import nanovllm.kernels.decode as engine
    rows = [("bf16 (the engine's)", engine, 64, 4, None, tl.bfloat16, False, 16),
            ("FP8 .to() (the engine's)", engine, 128, 4, 128, tl.float16, False, 16),
            ("asm", engine, 64, 4, None, tl.float16, True, 16),
            ("asm", engine, 64, 2, None, tl.float16, True, 16),
            ("asm", engine, 128, 4, 128, tl.float16, True, 16),
            ("asmkv", fv.DECODE_ASMKV, 64, 4, None, tl.float16, True, 16),
            ("asmkv", fv.DECODE_ASMKV, 128, 4, 128, tl.float16, True, 16),
            ("swap", fv.DECODE_SWAP, 64, 2, None, tl.float16, True, 8),
            ("swap", fv.DECODE_SWAP, 64, 4, None, tl.float16, True, 8),
            ("swap", fv.DECODE_SWAP, 128, 4, 128, tl.float16, True, 8)]
    print(f"\ndecode kernel, sm_90 (compiled here, Triton {triton.__version__}), 2 stages\n\n"
          "| kind | BLOCK_N | warps | register cap | registers | shared bytes | programs per SM |"
          " instructions a tile (a thread) | warp instructions a KB of cache | most common |\n"
          + "|---" * 10 + "|")
    for name, module, block_n, warps, cap, dot, asm, group_pad in rows:
        constexprs = dict(GROUP=2, GROUP_PAD=group_pad, HEAD_DIM=128, BLOCK_SIZE=256,
                          NUM_SPLITS=1, CASCADE=False, BLOCK_N=block_n, DOT_DTYPE=dot,
                          FP8_ASM=asm)
        fp8 = name.startswith("bf16") is False
        kernel = compiled(module._decode_split_kernel, constexprs, warps, maxnreg=cap,
                          cache="*fp8e4nv" if fp8 else "*bf16")
        regs, _, shared, per_sm = resources(None, None, warps, kernel=kernel)
        body = loop_body(kernel)
        kb = block_n * 128 * 2 * (1 if fp8 else 2) / 1024  # K and V of a tile
        top = ", ".join(f"{op} {n}" for op, n in Counter(body).most_common(4))
        print(f"| {name} | {block_n} | {warps} | {cap or '-'} | {regs} | {shared} | {per_sm} | "
              f"{len(body)} | {len(body) * warps / kb:.0f} | {top} |", flush=True)


def variants():
    """The launches prepared for the next GPU session, with and without a 128-register cap."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cascade_fold_merge import _cascade_fold_kernel
    from packed_decode import _cascade_packed_kernel
    cascade = dict(GROUP=2, MEMBERS=members_per_tile(2), ROWS_PAD=32, HEAD_DIM=128,
                   BLOCK_SIZE=256, BLOCK_N=64, NUM_KV_HEADS=8, NUM_SPLITS=1, PREFIX_SPLITS=3,
                   DOT_DTYPE=tl.bfloat16, FP8_ASM=False)
    rows = [("cascade (the engine's)", _cascade_kernel, dict(cascade, GROUP_PAD=16)),
            ("cascade, merge folded in", _cascade_fold_kernel,
             dict(cascade, GROUP_PAD=16, OWN_FIRST=False))]
    rows += [(f"cascade, own keys {h} KV heads x {n} keys a program", _cascade_packed_kernel,
              dict(cascade, KV_HEADS=h, HEADS_PAD=max(16, 2 * h), OWN_BLOCK_N=n))
             for h, n in ((1, 64), (2, 32), (4, 16), (8, 8), (8, 16))]
    print(f"\nsm_90 (compiled here, Triton {triton.__version__}), 4 warps, 2 stages\n\n"
          "| launch | register cap | registers | stack bytes | shared bytes | programs per SM |\n"
          "|---|---|---|---|---|---|")
    for name, fn, constexprs in rows:
        for cap in (None, 128):
            regs, stack, shared, per_sm = resources(fn, constexprs, 4, maxnreg=cap)
            print(f"| {name} | {cap or '-'} | {regs} | {stack} | {shared} | {per_sm} |",
                  flush=True)


if __name__ == "__main__":
    import sys
    main()
    if "--variants" in sys.argv:
        variants()
    if "--fp8" in sys.argv:
        fp8_decode()
