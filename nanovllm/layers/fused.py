"""torch.compile, applied at one visible place.

A decode step of a small model spends much of its time in tiny elementwise kernels (norms,
rotary, the SwiGLU gate). On CUDA each function marked `@fused` is compiled into one fused kernel;
on CPU it runs as the plain PyTorch written below it.
"""
import functools

import torch


def fused(fn):
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def run(x, *args):
        return compiled(x, *args) if x.is_cuda else fn(x, *args)
    return run
