"""Megatron-style tensor-parallel linear layers.

A column-parallel layer splits its output features across ranks (no communication); a
row-parallel layer splits its input features and sums the partial outputs with an all-reduce.
Each parameter carries a `weight_loader` that copies this rank's shard out of the full
checkpoint tensor, so packed projections (qkv, gate_up) load through one small loop.
The group a layer is split across is the one given to `tensor_parallel(...)` while it is built:
each engine has its own group, so two engines can share a process.
"""
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


_building_group: ContextVar[dist.ProcessGroup | None] = ContextVar("tp_group", default=None)


@contextmanager
def tensor_parallel(group: dist.ProcessGroup | None):
    """Layers built inside this block split their weights across `group`'s ranks (None: one rank)."""
    token = _building_group.set(group)
    try:
        yield
    finally:
        _building_group.reset(token)


def tp_group() -> dist.ProcessGroup | None:
    """The tensor-parallel group of the layers being built (None: not split)."""
    return _building_group.get()


def tp_rank_size() -> tuple[int, int]:
    """This rank and the number of ranks of the layers being built ((0, 1) when not split)."""
    group = _building_group.get()
    return (group.rank(), group.size()) if group is not None else (0, 1)


def heads_per_rank(num_heads: int, tp_size: int) -> int:
    """Attention heads on each rank; KV heads fewer than the ranks are replicated (one per rank)."""
    return max(1, num_heads // tp_size)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.tp_group = tp_group()
        self.tp_rank, self.tp_size = tp_rank_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Each rank holds a slice of the output features."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp_size = tp_rank_size()[1]
        assert out_features % tp_size == 0
        super().__init__(in_features, out_features // tp_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        shard = param.size(0)
        param.data.copy_(loaded.narrow(0, self.tp_rank * shard, shard))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matrix (gate_up_proj); shard_id picks which."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, split by heads; KV heads are replicated when fewer than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size = tp_rank_size()[1]
        self.head_dim = head_dim
        self.num_heads = heads_per_rank(num_heads, tp_size)
        self.num_kv_heads = heads_per_rank(num_kv_heads, tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)  # ranks sharing one KV head
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Each rank holds a slice of the input features; partial outputs are summed across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp_size = tp_rank_size()[1]
        assert in_features % tp_size == 0
        super().__init__(in_features // tp_size, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        if param.dim() == 1:  # the bias is added once, on rank 0
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        shard = param.size(1)
        param.data.copy_(loaded.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        return y
