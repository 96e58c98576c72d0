"""Rotary position embedding (neox layout: the two halves of each head rotate together).

It takes the query and key heads as one tensor, [N, num_heads + num_kv_heads, head_dim] (how the qkv
projection lays them out), and can apply Qwen3's per-head RMSNorm first: on CUDA the norm and the
rotation of every head are one torch.compile'd function, a few microseconds per layer of a decode step.
"""
import math

import torch
from torch import nn

from nanovllm.layers.fused import fused


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's rope scaling: slow down low frequencies, keep high ones, blend in between."""
    factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > old_len / low, inv_freq / factor, torch.where(wavelen < old_len / high, inv_freq, blended))


def rope_config(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from config.json, in the older (rope_theta, rope_scaling) or newer (rope_parameters) form."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or params.get("rope_theta", 10000.0)
    return theta, cfg.get("rope_scaling") or params or None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling={scaling} is not supported (only llama3 and default)")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)  # [max_position, head_dim / 2]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, qk: torch.Tensor, num_heads: int, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the heads qk [N, num_heads + num_kv_heads, D] by the angles of their positions, after the
        RMSNorms q_norm and k_norm if given; returns q [N, num_heads, D] and k [N, num_kv_heads, D] (views)."""
        weights = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else (None, None, 0.0)
        return norm_rope(qk, positions, self.cos_sin, num_heads, *weights).split_with_sizes(
            [num_heads, qk.size(1) - num_heads], dim=1)


@fused
def norm_rope(qk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
              q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x, scale = qk.float(), 1.0
    if q_weight is not None:  # RMSNorm: weight * x * scale, head h < num_heads being a query head
        is_q = torch.arange(qk.size(1), device=qk.device)[:, None] < num_heads
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [N, heads, 1]
        x = x * torch.where(is_q, q_weight, k_weight).float()
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [N, 1, D / 2] each
    x1, x2 = x.chunk(2, dim=-1)
    # The rotation is linear, so the norm's per-head scale can follow it: each head is then read once (one kernel).
    return (torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1) * scale).to(qk.dtype)
