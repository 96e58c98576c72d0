"""Compiling Triton's kernels ahead (nanovllm/worker/precompile.py), on a machine without a GPU.

A child process, without TRITON_INTERPRET and with an empty Triton cache, stands in a driver that
reports a Hopper GPU (sm_90): Triton's own launch path then runs up to the launch, which
`warmup=True` skips. The child launches the kernels a Qwen3-0.6B-shaped engine's graph sizes launch
inside `compile_only`, then the same launches again through Triton's launch path, counting the
compiles each asks for (Triton's compile, wrapped): the second round must ask for none, and the
first must have compiled each specialization once.
"""
import os
import subprocess
import sys
import tempfile

CHILD = r'''
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from nanovllm.kernels import decode_attention, num_decode_splits, prefill_attention, rope_store
from nanovllm.kernels.cascade import cascade_attention, members_per_tile
from nanovllm.kernels.elementwise import add_rms_norm, silu_and_mul
from nanovllm.kernels.gemv import NORM, SILU, gemv
from nanovllm.kernels.prefill import QUERY_TILE
from nanovllm.kernels.sample import gumbel_max_sample
from nanovllm.worker.cuda_graphs import token_ladder
from nanovllm.worker.precompile import compile_only


class Hopper:
    """What Triton's launch path asks its driver, answered for an sm_90 GPU."""
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def launcher_cls(self, src, metadata):  # a launch's C launcher, which needs a GPU to build
        launchers.append(src.fn.__name__)


launchers = []

driver.set_active(Hopper())
compiles = []  # (kernel, specialization, options) of each compile, in any thread
compile = triton.compiler.compile


def counted_compile(src, target=None, options=None, **kwargs):
    compiles.append((src.fn.__name__, src.hash(), str(sorted(options.items()))))
    return compile(src, target=target, options=options, **kwargs)


triton.compiler.compile = counted_compile  # what JITFunction compiles with (create_binder)
launch = JITFunction.run
JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launch(
    self, *args, grid=grid, warmup=True, **kwargs)  # a launch as far as a CPU can go
sizes = [int(s) for s in sys.argv[2].split(",")]

# Qwen3-0.6B's layer: hidden 1024, 16 query and 8 KV heads of 128, MLP 3072; blocks of 256
bf16, i32 = torch.bfloat16, torch.int32
hidden, heads, kv_heads, head_dim, inter, vocab = 1024, 16, 8, 128, 3072, 151936
cache = torch.empty(1, 256, kv_heads, head_dim, dtype=bf16)
cos_sin, ones = torch.empty(4096, head_dim), torch.ones(head_dim, dtype=bf16)
norm, w = torch.ones(hidden, dtype=bf16), torch.empty(4096, hidden, dtype=bf16)
w_down = torch.empty(hidden, inter, dtype=bf16)


def layer(tokens: int, seqs: int, decode: bool):
    """The kernels of one decoder layer of a graph of `tokens` tokens and `seqs` sequences, then
    its sampler (as the engine's warm-ups launch them)."""
    x = torch.empty(tokens, hidden, dtype=bf16)
    cu, lens = torch.zeros(seqs + 1, dtype=i32), torch.zeros(seqs, dtype=i32)
    tables = torch.zeros(seqs, 16, dtype=i32)
    if decode and tokens <= 2:  # the fused small-batch path (layers/fused_decode.py)
        qkv, res = gemv(x, w, None, NORM, x, norm, 1e-6, pdl=True)
        gemv(torch.empty(tokens, 2 * inter, dtype=bf16), w_down, prologue=SILU)
        gemv(x, w[:hidden], pdl=True)
    else:
        add_rms_norm(x, x, norm, 1e-6)
        silu_and_mul(torch.empty(tokens, 2 * inter, dtype=bf16))
    qkv = torch.empty(tokens, heads + 2 * kv_heads, head_dim, dtype=bf16)
    q = rope_store(qkv, lens[:1].expand(tokens), cos_sin, heads, cache, cache,
                   torch.zeros(tokens, dtype=i32), ones, ones, 1e-6)
    splits = num_decode_splits(seqs, kv_heads, head_dim, 4096, 132)
    decode_attention(q, cache, cache, cu, lens, tables, 0.1, num_splits=splits)
    if decode:
        logits = torch.empty(tokens, vocab, dtype=bf16)
        gumbel_max_sample(logits, torch.ones(tokens), out=torch.empty(tokens, dtype=torch.int64))
        if tokens >= 2:  # its cascade twin (attention/cascade.py)
            members = members_per_tile(heads // kv_heads)
            tiles = torch.zeros(max(1, tokens // 4), 2 + members, dtype=i32)
            cascade_attention(q, cache, cache, cu, lens, tables, lens, tiles, 0.1, splits, 2)
    else:
        tiles = torch.zeros(tokens // QUERY_TILE + seqs, 2, dtype=i32)
        prefill_attention(q, cache, cache, cu, lens, tables, tiles, QUERY_TILE, 0.1)


def engine_launches():
    for size in sizes:
        layer(size, size, decode=True)
    for size in token_ladder(max(sizes)):
        layer(size, min(size, max(sizes)), decode=False)


start = time.perf_counter()
if sys.argv[1] == "launch":  # compiled one at a time, at each launch
    engine_launches()
else:
    with compile_only(int(sys.argv[1])):
        engine_launches()
seconds = time.perf_counter() - start
ahead = len(compiles)
engine_launches()
kernels = sorted({name for name, _, _ in compiles[:ahead]})
print("launchers", len(launchers), "compiled", ahead, "after", len(compiles) - ahead,
      "seconds", round(seconds, 2), "distinct", len(set(compiles[:ahead])),
      "kernels", ",".join(kernels))
'''


def compile_in_child(mode: str, sizes: list[int]) -> dict:
    """Run CHILD with an empty Triton cache: its counts, seconds and the kernels it compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        out = subprocess.run([sys.executable, "-c", CHILD, mode, ",".join(map(str, sizes))],
                             capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    result = dict(zip(words[:-2:2], map(float, words[1:-2:2])))
    result["kernels"] = words[-1].split(",")
    return result


def test_compile_only_compiles_what_the_launches_use():
    # decode graphs of 1, 2, 8, 16 and 24 rows, mixed graphs of 16 and 24 tokens: sizes that
    # Triton specializes differently (1, multiples of 16 or not, the fused small-batch path)
    result = compile_in_child("2", [1, 2, 8, 16, 24])
    assert result["after"] == 0, result  # every launch found its kernel compiled
    assert result["distinct"] == result["compiled"], result  # each specialization compiled once
    assert result["launchers"] == result["compiled"], result  # and its launcher built
    assert set(result["kernels"]) >= {
        "_add_rms_norm_kernel", "_silu_and_mul_kernel", "_gemv_kernel", "_rope_store_kernel",
        "_decode_split_kernel", "_merge_splits_kernel", "_cascade_kernel", "_prefill_kernel",
        "_chunk_stats_kernel", "_pick_kernel"}, result
