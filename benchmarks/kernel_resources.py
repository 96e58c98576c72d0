"""Registers, spills and shared memory of the decode and cascade kernels on a Hopper GPU, without
one: `python benchmarks/kernel_resources.py` compiles them for sm_90 on any machine (Triton's own
ptxas) and reads the cubin with Triton's cuobjdump.

Decode attention is bound by memory latency when few programs share an SM, so what limits the
programs per SM (registers: 65,536 per SM; shared memory: 228 KB) is worth knowing before a GPU
is at hand. Qwen3-0.6B's shapes: 2 query heads per KV head, head_dim 128, bf16, 256-token blocks.
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
INT_POINTERS = ("cu_seqlens", "context_lens", "block_tables", "key_starts", "tiles")


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


def resources(fn, constexprs: dict, num_warps: int, num_stages: int = 2) -> tuple:
    """(registers per thread, stack bytes per thread, shared bytes, programs per SM)."""
    types = signature(fn, constexprs)
    src = ASTSource(fn=fn, signature=types, constexprs=constexprs, attrs=aligned(fn, types))
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
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


if __name__ == "__main__":
    main()
