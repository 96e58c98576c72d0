"""RMSNorm, with the residual add fused in (one pass instead of two)."""
import torch
from torch import nn

from nanovllm.layers.fused import fused


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float()
    return weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


rms_norm = fused(plain_rms_norm)


@fused
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return plain_rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(normalized, new residual): x normalized and x; with a residual, x + residual's."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps), x
        return add_rms_norm(x, residual, self.weight, self.eps)
