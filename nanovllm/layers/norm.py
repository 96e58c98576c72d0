"""RMSNorm, with the residual add fused in (one pass instead of two).

On CUDA it is one Triton kernel (nanovllm/kernels/elementwise.py); on CPU the plain PyTorch below,
also the kernel's test reference.
"""
import torch
from torch import nn


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float()
    return weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); without a residual, (RMSNorm(x), x)."""
    if residual is not None:
        x = x + residual
    return plain_rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.add_rms_norm = add_rms_norm
        if self.weight.is_cuda:  # built on the GPU: the kernel (importing triton only there)
            from nanovllm.kernels.elementwise import add_rms_norm as kernel
            self.add_rms_norm = kernel

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(normalized, new residual): x normalized and x; with a residual, x + residual's."""
        return self.add_rms_norm(x, residual, self.weight, self.eps)
