"""Megatron-style tensor parallelism, applied to a built model (as gpt-fast applies it): each rank
keeps its shard of every large weight, and the layers meet in collectives.

- Column-parallel (qkv_proj, gate_up_proj): each rank holds a slice of the output features of each
  packed projection and needs no communication. The attention heads split with them; KV heads fewer
  than the ranks are replicated (several ranks hold the same one).
- Row-parallel (o_proj, down_proj): each rank holds a slice of the input features; an all-reduce
  sums the partial outputs (a bias is added on rank 0 only).
- Vocabulary-parallel (embed_tokens, lm_head): each rank holds a slice of the vocabulary; the
  embedding all-reduces (other ranks' tokens give 0), the head gathers the logits to rank 0.

`shard_model` swaps the layers before the weights load, so each rank copies only its shard out of
the checkpoint's tensors (through the layers' weight_loader).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import Linear


def heads_per_rank(num_heads: int, tp_size: int) -> int:
    """Attention heads on each rank; KV heads fewer than the ranks are replicated (one per rank)."""
    return max(1, num_heads // tp_size)


class ColumnParallel(Linear):
    def __init__(self, full: Linear, group, replicas: list[int]):
        """replicas[i]: ranks that hold the same slice of packed projection i."""
        self.slice_of = [group.rank() // r for r in replicas]  # which slice of each projection
        parts = [p * r // group.size() for p, r in zip(full.parts, replicas)]
        super().__init__(full.weight.size(1), parts, full.bias is not None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: int = 0):
        size = self.parts[part]
        super().weight_loader(param, loaded.narrow(0, self.slice_of[part] * size, size), part)


class RowParallel(Linear):
    def __init__(self, full: Linear, group):
        self.group, self.rank = group, group.rank()
        super().__init__(full.weight.size(1) // group.size(), full.weight.size(0),
                         full.bias is not None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: int = 0):
        if param.dim() == 1:  # the bias: added once, on rank 0
            param.data.copy_(loaded if self.rank == 0 else torch.zeros_like(loaded))
        else:
            param.data.copy_(loaded.narrow(1, self.rank * param.size(1), param.size(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallel(Linear):
    def __init__(self, full: Linear, group):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.vocab_size = full.weight.size(0)
        shard = -(-self.vocab_size // self.size)
        self.start = self.rank * shard
        super().__init__(full.weight.size(1), shard)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: int = 0):
        piece = loaded[self.start:self.start + param.size(0)]
        param.data[:len(piece)].copy_(piece)
        param.data[len(piece):].zero_()  # the last rank's padding rows past the vocabulary


class VocabEmbedding(VocabParallel):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mask = (local >= 0) & (local < self.weight.size(0))
        # other ranks' tokens give 0
        y = F.embedding(local * mask, self.weight) * mask.unsqueeze(-1)
        dist.all_reduce(y, group=self.group)
        return y


class VocabHead(VocabParallel):
    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, vocab] on rank 0 (None on the other ranks)."""
        logits = F.linear(x, self.weight)
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(logits, parts, group=self.group, group_dst=0)
        return torch.cat(parts, -1)[:, :self.vocab_size] if self.rank == 0 else None


def shard_model(model: nn.Module, group, num_kv_heads: int):
    """Swap the model's layers for this rank's shards (before its weights load)."""
    size = group.size()
    kv_replicas = max(1, size // num_kv_heads)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for module in list(model.modules()):
        if hasattr(module, "qkv_proj"):  # an attention layer: its heads on this rank
            module.qkv_proj = ColumnParallel(module.qkv_proj, group, [1, kv_replicas, kv_replicas])
            module.o_proj = RowParallel(module.o_proj, group)
            module.num_heads = module.attn.num_heads = heads_per_rank(module.num_heads, size)
            kv_heads = heads_per_rank(module.num_kv_heads, size)
            module.num_kv_heads = module.attn.num_kv_heads = kv_heads
        elif hasattr(module, "gate_up_proj"):
            module.gate_up_proj = ColumnParallel(module.gate_up_proj, group, [1, 1])
            module.down_proj = RowParallel(module.down_proj, group)
    model.model.embed_tokens = VocabEmbedding(model.model.embed_tokens, group)
    model.lm_head = VocabHead(model.lm_head, group)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
