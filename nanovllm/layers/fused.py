"""torch.compile, applied at one visible place.

A decode step of a small model spends much of its time in tiny elementwise kernels (norms,
rotary, the SwiGLU gate). On CUDA each function marked `@fused` is compiled, on its first call,
into one fused kernel; on CPU it runs as the plain PyTorch written below it.
"""
import functools

import torch


def fused(fn):
    compiled = None

    @functools.wraps(fn)
    def run(x, *args):
        nonlocal compiled
        if not x.is_cuda:
            return fn(x, *args)
        if compiled is None:  # lazily: compiling imports triton, which must not happen on import
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args)
    return run
