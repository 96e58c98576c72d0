"""Rotary position embedding (neox layout: the two halves of each head rotate together)."""
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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate q [N, Hq, D] and k [N, Hkv, D] by the angles of their positions."""
        return apply_rotary(positions, q, k, self.cos_sin)


@fused
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor):
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [N, 1, D / 2] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
