"""Vocabulary-parallel embedding and LM head: each rank holds a slice of the vocabulary."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import tp_group, tp_rank_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_group = tp_group()
        self.tp_rank, self.tp_size = tp_rank_size()
        self.shard = (vocab_size + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        part = loaded[self.vocab_start:self.vocab_start + self.shard]
        param.data[:part.size(0)].copy_(part)
        param.data[part.size(0):].zero_()  # the last rank's padding rows past the vocabulary

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mask = (local >= 0) & (local < self.shard)
        y = F.embedding(local * mask, self.weight) * mask.unsqueeze(-1)  # other ranks' tokens give 0
        dist.all_reduce(y, group=self.tp_group)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, vocab] on rank 0 (None on other ranks)."""
        logits = F.linear(x, self.weight)
        if self.tp_size == 1:
            return logits[:, :self.vocab_size]
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, group=self.tp_group, group_dst=0)
        return torch.cat(parts, -1)[:, :self.vocab_size] if self.tp_rank == 0 else None
