"""The elementwise layers between the projections, one kernel each: RMSNorm with the residual add
fused in, and SwiGLU's gate.

A decode step of a small model spends much of its time in such tiny kernels; written out in PyTorch
each is several (the add, the square, the mean, the rsqrt, the products). These are what
torch.compile would generate, written once here, so that nothing is traced or compiled while the
engine starts (a Triton kernel compiles in about a second and is cached on disk). The plain PyTorch
in nanovllm/layers/norm.py and models/llama.py is the CPU path and the reference of the tests.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_for_inputs


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, eps,
                         HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
                         PDL: tl.constexpr = False):
    # One program per token: x (+ residual), its RMS in float32, times the weight.
    row = tl.program_id(0).to(tl.int64) * HIDDEN
    cols = tl.arange(0, BLOCK)
    inside = cols < HIDDEN
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0)  # no step's output: before the wait
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + row + cols, mask=inside, other=0.0)
    if ADD:  # the sum is rounded to the model's dtype, as in PyTorch, and is the next residual
        x = x + tl.load(residual_ptr + row + cols, mask=inside, other=0.0)
        tl.store(new_residual_ptr + row + cols, x, mask=inside)
    y = x.to(tl.float32)
    y = y * tl.rsqrt(tl.sum(y * y, 0) / HIDDEN + eps)
    tl.store(out_ptr + row + cols, weight * y.to(x.dtype), mask=inside)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); without a residual, (RMSNorm(x), x)."""
    hidden = x.size(-1)
    x = x.contiguous()
    out = torch.empty_like(x)
    new_residual = x if residual is None else torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 256, 1), 16)  # 8 columns a thread
    _add_rms_norm_kernel[(x.numel() // hidden,)](
        x, x if residual is None else residual.contiguous(), weight, out, new_residual, eps,
        HIDDEN=hidden, BLOCK=block, ADD=residual is not None, num_warps=num_warps,
        **pdl_launch(x.device, x.numel() // hidden))
    return out, new_residual


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    # Program (token, chunk): silu(gate) * up over BLOCK columns of the token's [gate | up] row.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < WIDTH
    gate = tl.load(x_ptr + token * 2 * WIDTH + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * 2 * WIDTH + WIDTH + cols, mask=inside, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + token * WIDTH + cols, silu * up, mask=inside)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate on a packed [gate | up] tensor [N, 2 * width]: silu(gate) * up [N, width]."""
    width = x.size(-1) // 2
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], width)
    block = min(triton.next_power_of_2(width), 1024)
    _silu_and_mul_kernel[(x.numel() // (2 * width), triton.cdiv(width, block))](
        x, out, WIDTH=width, BLOCK=block, num_warps=4)
    return out
