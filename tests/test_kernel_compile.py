"""Every Triton kernel compiles for Hopper (sm_90), on a machine without a GPU.

The kernels' other tests run them in Triton's interpreter, which executes their Python: an error
only the compiler finds (a variable that changes type across a branch taken at run time, a value
where a constant is wanted) would first show on a GPU. Here a child process, without
TRITON_INTERPRET, calls each kernel's launcher on CPU tensors with Triton's launch replaced by a
compile for sm_90 (to PTX and a cubin, by the ptxas that Triton ships), with programmatic dependent
launch on as on Hopper (kernels/pdl.py).
"""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

CHILD = r'''
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
         torch.float8_e4m3fn: "fp8e4nv"}
OPTIONS = {"num_warps", "num_stages", "maxnreg", "launch_pdl"}


def compile_for_hopper(self, *args, grid, warmup=False, **kwargs):
    """In place of a launch: the kernel's signature from its arguments, compiled for sm_90."""
    values = {**dict(zip([p.name for p in self.params], args)),
              **{k: v for k, v in kwargs.items() if k not in OPTIONS}}
    signature, constants = {}, {}
    for p in self.params:
        value = values[p.name]
        if p.is_constexpr:
            signature[p.name], constants[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + TYPES[value.dtype]
        else:
            signature[p.name] = {bool: "i1", int: "i32", float: "fp32"}[type(value)]
    options = {k: v for k, v in kwargs.items() if k in OPTIONS and k != "launch_pdl"}
    triton.compile(ASTSource(self, signature, constants), target=GPUTarget("cuda", 90, 32),
                   options=options)
    print("compiled", self.fn.__name__, flush=True)


JITFunction.run = compile_for_hopper
import nanovllm.kernels.pdl  # noqa: E402

nanovllm.kernels.pdl.use_pdl = lambda device: True  # as on Hopper: launched with PDL, at any
nanovllm.kernels.pdl.PDL_MAX_ROWS = 1 << 30  # size

from nanovllm.kernels import decode_attention, prefill_attention, rope_store  # noqa: E402
from nanovllm.kernels.cascade import cascade_attention, members_per_tile  # noqa: E402
from nanovllm.kernels.elementwise import add_rms_norm, silu_and_mul  # noqa: E402
from nanovllm.kernels.gemv import NORM, SILU, gemv  # noqa: E402
from nanovllm.kernels.host_copy import copy  # noqa: E402
from nanovllm.kernels.sample import gumbel_max_sample  # noqa: E402

bf16, i32 = torch.bfloat16, torch.int32
x = torch.zeros(4, 256, dtype=bf16)
add_rms_norm(x, x, torch.ones(256, dtype=bf16), 1e-6)
add_rms_norm(x, None, torch.ones(256, dtype=bf16), 1e-6)
silu_and_mul(torch.zeros(4, 512, dtype=bf16))
gemv(x[:2], torch.zeros(64, 256, dtype=bf16), None, NORM, x[:2], torch.ones(256, dtype=bf16), 1e-6)
gemv(torch.zeros(2, 512, dtype=bf16), torch.zeros(64, 256, dtype=bf16), prologue=SILU)
gumbel_max_sample(torch.zeros(3, 1000, dtype=bf16), torch.ones(3), seed=1)
copy(torch.zeros(5, dtype=torch.int32), torch.zeros(5, dtype=torch.int32))
q = torch.zeros(8, 4, 128, dtype=bf16)
cu, lens = torch.arange(9, dtype=i32), torch.ones(8, dtype=i32)
tables = torch.zeros(8, 4, dtype=i32)
for cache_dtype in (bf16, torch.float8_e4m3fn):
    cache = torch.zeros(10, 16, 2, 128, dtype=cache_dtype)
    rope_store(torch.zeros(8, 8, 128, dtype=bf16), lens, torch.zeros(64, 128), 4, cache, cache,
               lens, torch.ones(128, dtype=bf16), torch.ones(128, dtype=bf16), 1e-6)
    prefill_attention(q, cache, cache, cu, lens, tables, torch.zeros(8, 2, dtype=i32), 16, 0.1)
    for splits in (1, 5):
        decode_attention(q, cache, cache, cu, lens, tables, 0.1, num_splits=splits)
    tiles = torch.zeros(2, 2 + members_per_tile(2), dtype=i32)
    cascade_attention(q, cache, cache, cu, lens, tables, lens, tiles, 0.1, 3, 2)
'''


def test_every_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env,
                         cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    compiled = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("compiled")}
    assert compiled >= {"_add_rms_norm_kernel", "_silu_and_mul_kernel", "_gemv_kernel",
                        "_decode_split_kernel", "_merge_splits_kernel", "_cascade_kernel",
                        "_prefill_kernel", "_rope_store_kernel", "_chunk_stats_kernel",
                        "_pick_kernel", "_copy_kernel"}, compiled
