"""Linear layers that load from a checkpoint through a `weight_loader` (vLLM's idea): a packed
projection (q, k and v in one matrix, gate and up in another) copies each checkpoint tensor into its
own rows, so one GEMM computes them all. The embedding and the LM head load the same way. Tensor
parallelism shards these layers after they are built (nanovllm/layers/tensor_parallel.py).
"""
import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int | list[int], bias: bool = False):
        """out_features: the output size, or the sizes of the projections packed in it."""
        super().__init__()
        self.parts = out_features if isinstance(out_features, list) else [out_features]
        rows = sum(self.parts)
        self.weight = nn.Parameter(torch.empty(rows, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None
        for param in (self.weight, self.bias) if bias else (self.weight,):
            param.weight_loader = self.weight_loader  # the checkpoint's tensors come through it

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: int = 0):
        """Copy a checkpoint tensor into the rows of projection `part`."""
        param.data.narrow(0, sum(self.parts[:part]), self.parts[part]).copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(Linear):
    """A [vocab, hidden] table: the row of each token id."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
