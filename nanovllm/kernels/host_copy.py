"""Copies between the GPU and pinned host memory by a kernel (CUDA's zero-copy access to mapped
pinned memory), not by the copy engine.

Each step uploads its inputs (a few KB) and brings its sampled tokens down (a few hundred bytes).
As cudaMemcpyAsync calls, each is a copy-engine operation between two kernels, and a step's trace
shows the GPU idle 4-13 us at each switch between the engines (three a step: the argmax to the
tokens' copy, that copy to the next step's upload, the upload to the graph). Pinned memory is
mapped into the GPU's address space (unified addressing), so a kernel reads and writes it over PCIe
directly, and the step stays a chain of kernels. The host buffers must outlive the kernel that
reads or writes them: the model runner keeps the tokens', a row per run-ahead slot, and its CUDA
graphs the uploads' (worker/cuda_graphs.py).
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024


# neither the sizes nor the addresses specialized: one compiled kernel per dtype serves every copy
@triton.jit(do_not_specialize=["src_ptr", "dst_ptr", "n"])
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=inside), mask=inside)


def copy(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst[:] = src by a kernel on the current stream, either of them in pinned host memory; dst."""
    assert src.dtype == dst.dtype and src.numel() == dst.numel()
    assert src.is_contiguous() and dst.is_contiguous()
    if src.numel():
        _copy_kernel[(triton.cdiv(src.numel(), BLOCK),)](src, dst, src.numel(), BLOCK=BLOCK)
    return dst
