"""Triton kernels compiled ahead, many at once (Triton's AsyncCompileMode).

A Triton kernel compiles on its first launch, and an engine that starts with empty caches meets
some thirty of them, one after another, in its warm-up forwards. Within `compile_ahead()` a launch
runs nothing: it hands its compile to a pool of threads and returns. On leaving, every compile is
done and cached, in memory and on disk, so the same launches run at once afterwards. The engine
runs the warm-up forwards of its memory profile and of every CUDA graph so first
(worker/memory_profile.py, worker/cuda_graphs.py, attention/cascade.py): their outputs are garbage,
their shapes the real ones. On an H200 host (16 cores) the 29 compiles of a cold Qwen3-0.6B took
11-14 s one after another and 4 s on 8 threads, and a cold `LLM(path)` 16.3-20.0 s instead of
22.5-23.2 (docs/benchmarks.md).
"""
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

from triton.runtime.jit import JITFunction

try:
    from triton import AsyncCompileMode  # Triton 3.4 and later
except ImportError:  # the kernels then compile as they first run, within the pass too
    AsyncCompileMode = None


def compile_only(kernel: JITFunction, grid):
    """What `kernel[grid]` is within compile_ahead: a launch that compiles and runs nothing."""
    return lambda *args, **kwargs: kernel.warmup(*args, grid=grid, **kwargs)


@contextlib.contextmanager
def first_layer_only(model):
    """Within: the model keeps its first decoder layer only (the others launch the same kernels)."""
    layers = model.model.layers
    model.model.layers = layers[:1]
    try:
        yield
    finally:
        model.model.layers = layers


@contextlib.contextmanager
def compile_ahead(model, threads: int = min(8, os.cpu_count() or 1)):
    """Within: `kernel[grid](*args)` compiles the kernel for these arguments on a thread and runs
    nothing, and the model keeps its first decoder layer only (such a launch costs the host 10x a
    real one: Triton builds and hashes the kernel's source for each). On exit, waits for every
    compile."""
    with first_layer_only(model):
        if AsyncCompileMode is None:
            yield
        else:
            with (mock.patch.object(JITFunction, "__getitem__", compile_only),
                  ThreadPoolExecutor(threads) as pool, AsyncCompileMode(pool)):
                yield
