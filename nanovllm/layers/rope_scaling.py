"""Llama 3's rope scaling (the `rope_scaling` of its config.json, rope_type "llama3"): slow down the
low frequencies by `factor`, keep the high ones, and blend in between, so a model trained on
`original_max_position_embeddings` positions reads longer contexts. Only Llama 3.x checkpoints reach
this module."""
import math

import torch


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """The inverse frequencies of RoPE after Llama 3's rope scaling."""
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"rope_scaling={scaling} is not supported (only llama3 and default)")
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    kept = torch.where(wavelen < old_len / high, inv_freq, blended)
    return torch.where(wavelen > old_len / low, inv_freq / factor, kept)
