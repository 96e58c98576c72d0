"""Random weights for benchmarks (load_format="dummy"): throughput does not depend on the values."""
import torch
from torch import nn


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int):
    """Random weights for benchmarks: small normal matrices, unit norms, zero biases.

    Each tensor-parallel rank draws its own shard, so the weights differ from those of one rank."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() > 1:
            p.normal_(0, 0.02, generator=gen)
        else:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
