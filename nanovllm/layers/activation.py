"""SwiGLU's gate: silu(gate) * up on a packed [gate | up] tensor."""
import torch
import torch.nn.functional as F

from nanovllm.layers.fused import fused


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up
