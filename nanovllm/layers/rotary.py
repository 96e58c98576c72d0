"""Rotary position embedding (neox layout: the two halves of each head rotate together).

It takes the qkv projection as one tensor, [N, num_heads + 2 * num_kv_heads, head_dim], can apply Qwen3's
per-head RMSNorm first, and writes the rotated keys and the values into the paged KV cache: on CUDA the
norm, the rotation and the cache write of every head are one Triton kernel per layer.
"""
import math

import torch
from torch import nn

from nanovllm.layers.norm import plain_rms_norm


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

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, q_norm: nn.Module | None,
                k_norm: nn.Module | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> torch.Tensor:
        """qkv [N, num_heads + 2 * num_kv_heads, D]: rotate the query and key heads by the angles of their positions
        (after the RMSNorms q_norm and k_norm if given), write the keys and values to their cache slots
        (slot_mapping [N], -1 = skip) and return the queries [N, num_heads, D]. The cache write sits here because
        on CUDA it is the same kernel as the rotation (nanovllm/kernels/store_kv.py); on CPU it is plain PyTorch."""
        weights = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else (None, None, 0.0)
        if qkv.is_cuda:
            from nanovllm.kernels.store_kv import rope_store  # imports triton: only where it runs
            return rope_store(qkv, positions, self.cos_sin, num_heads, k_cache, v_cache, slot_mapping, *weights)
        num_kv_heads = (qkv.size(1) - num_heads) // 2
        q, k = norm_rope(qkv[:, :num_heads + num_kv_heads], positions, self.cos_sin, num_heads, *weights).split(
            [num_heads, num_kv_heads], dim=1)
        store_kv(k, qkv[:, num_heads + num_kv_heads:], k_cache, v_cache, slot_mapping)
        return q


def norm_rope(qk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
              q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The query and key heads qk [N, heads, D] rotated, after their RMSNorm if the weights are given."""
    x = qk.float()
    if q_weight is not None:  # RMSNorm of each head, with the query weight for heads h < num_heads
        is_q = torch.arange(qk.size(1), device=qk.device)[:, None] < num_heads
        x = plain_rms_norm(x, torch.where(is_q, q_weight, k_weight).float(), eps)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [N, 1, D / 2] each
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(qk.dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """Write k, v [N, num_kv_heads, D] into the flattened cache at slot_mapping (skipping -1)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v
