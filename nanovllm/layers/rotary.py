"""Rotary position embedding (RoPE, neox layout: the two halves of each head rotate together).

`RotaryEmbedding` holds the cos | sin table of every position, one table for all layers; `norm_rope`
rotates query and key heads (after Qwen3's per-head RMSNorm) in plain PyTorch. PagedAttention's
write step applies it (on CUDA fused with the cache write: nanovllm/kernels/store_kv.py).
"""
import torch
from torch import nn

from nanovllm.layers.norm import plain_rms_norm


def rope_config(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling or None) from config.json, in the older (rope_theta, rope_scaling) or newer
    (rope_parameters) form."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or params.get("rope_theta", 10000.0)
    scaled = params.get("rope_type", params.get("type")) not in (None, "default")
    return theta, params if scaled else None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if scaling:
            from nanovllm.layers.rope_scaling import scaled_inv_freq
            inv_freq = scaled_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)  # [pos, D / 2]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False)


def norm_rope(qk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
              q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float):
    """The query and key heads qk [N, heads, D] rotated, after their RMSNorm if the weights are
    given."""
    x = qk.float()
    if q_weight is not None:  # RMSNorm of each head, with the query weight for heads h < num_heads
        is_q = torch.arange(qk.size(1), device=qk.device)[:, None] < num_heads
        x = plain_rms_norm(x, torch.where(is_q, q_weight, k_weight).float(), eps)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [N, 1, D / 2] each
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(qk.dtype)
