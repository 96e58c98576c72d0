"""Programmatic dependent launch (PDL, NVIDIA Hopper and later), for the kernels of small steps.

A decode step of one sequence is a chain of some 200 short kernels, each reading what the one
before wrote. Launched plainly, a kernel starts only once the one before has finished, and the GPU
idles between the two while the next one's programs are set up. Launched with PDL, a kernel starts
while the one before runs its last programs and waits inside (`gdc_wait`, PTX
griddepcontrol.wait) until that kernel has finished and its writes are visible: the gap overlaps
the kernel before. A kernel launched so must wait before it reads or writes anything the step's
kernels make (the weights it may read first); a plain kernel after it waits for it as usual.

Only where a kernel has at most PDL_MAX_ROWS rows (tokens or sequences), as in the steps of
layers/fused_decode.py: there the GPU has room for the programs that wait. In bigger steps they
take SMs from the kernels they wait on. On an H200, with PDL at any size decode ran 5-9% slower at
batch 4 to 16 and 4% at 64, against 8% faster at batch 1 and 3% at 2 (docs/benchmarks.md).
"""
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_MAX_ROWS = 2


@functools.cache
def use_pdl(device: torch.device) -> bool:
    """Whether the GPU has PDL (Hopper and later); never on the CPU."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device, rows: int) -> dict:
    """The launch options of a kernel of `rows` rows: the kernel's PDL constexpr and Triton's
    launch_pdl, on for at most PDL_MAX_ROWS rows where the GPU has PDL."""
    on = rows <= PDL_MAX_ROWS and use_pdl(device)
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """In a kernel launched with PDL: wait for the kernel before (its outputs are this one's
    inputs), then let the kernel after start launching."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
