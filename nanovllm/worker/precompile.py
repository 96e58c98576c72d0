"""Triton's compiles all at once, in parallel, when the engine starts (vLLM's and SGLang's warm-up
compile, done with Triton's own JITFunction.warmup and AsyncCompileMode).

A Triton kernel compiles at its first launch with each new specialization (its constexprs, which
integer arguments are 1 or multiples of 16, its pointers' alignment). Starting the engine meets a
few dozen: the memory profile's step and samplers, then each CUDA graph's warm-up forward (and its
cascade twin's and its sampler's), each compiling in turn before it runs. Before all that, a dry
pass runs the same forwards with every Triton launch made a compile request (`run(...,
warmup=True)`: compile and cache, launch nothing), which AsyncCompileMode hands to a pool of
threads, once per specialization; most of a compile (MLIR passes, ptxas) runs outside the GIL.
Each thread then builds the kernel's launcher too (Triton 3.6 builds a C module per signature with
gcc at a kernel's first launch, and keeps it in its disk cache). When the pool is done, every
launch of the warm-ups finds its kernel in Triton's cache. The dry
pass's kernels write nothing, so its outputs are garbage: no forward reads a kernel's output on
the host, nor uses one as an index.
"""
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import triton
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

logger = logging.getLogger(__name__)


class CompilePool(ThreadPoolExecutor):
    """Threads that compile a kernel, then build its launcher."""

    def submit(self, compile_kernel):
        return super().submit(lambda: with_launcher(compile_kernel()))


def with_launcher(kernel):
    driver.active.launcher_cls(kernel.src, kernel.metadata)  # its first launch builds it too
    return kernel


@contextmanager
def compile_only(workers: int):
    """Within it, a Triton launch compiles its kernel on one of `workers` threads (once per
    specialization) and launches nothing; leaving it waits for every compile. A kernel that fails
    to compile here is left to compile, and fail, at its first launch."""
    launch = JITFunction.run

    def compile_request(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_request
    try:
        with (CompilePool(workers) as pool,
              triton.AsyncCompileMode(pool, ignore_errors=True)):
            yield
    finally:
        JITFunction.run = launch


def dry_pass(runner):
    """The forwards that starting the engine warms up with (ModelRunner.__init__), without their
    results: the memory profile's, then each CUDA graph's, with a one-block KV cache."""
    from nanovllm.worker.memory_profile import peak_step
    runner.kv_cache.allocate(1)
    if runner.config.num_kvcache_blocks <= 0:  # ModelRunner.num_kv_blocks profiles
        peak_step(runner)
    if not runner.config.enforce_eager:
        from nanovllm.worker.cuda_graphs import CUDAGraphs
        CUDAGraphs(runner, capture=False)
    runner.kv_cache.allocate(0)


def precompile(runner, workers: int | None = None):
    """Compile the Triton kernels that starting the engine launches, in parallel, before it
    launches them. If that fails, they compile at their first launch, as without it."""
    workers = workers or len(os.sched_getaffinity(0))
    start = time.perf_counter()
    try:
        with compile_only(workers):
            dry_pass(runner)
    except Exception:
        logger.warning("compiling the Triton kernels ahead failed; each compiles at its first "
                       "launch", exc_info=True)
        return
    logger.info("Triton kernels compiled ahead in %.1f s (%d threads)",
                time.perf_counter() - start, workers)
