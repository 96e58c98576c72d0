"""Truncated sampling: min-p, top-k and top-p (nucleus), applied in that order as vLLM does, so
top-p counts probability among the tokens that min-p and top-k left. The model runner builds a
Truncation only for batches where some request asks for one; the others sample from the full
distribution."""
from dataclasses import dataclass

import torch


@dataclass
class Truncation:
    top_ks: torch.Tensor | None  # [B] int64, vocab size = off; None when no row truncates
    top_ps: torch.Tensor | None  # [B] float32
    min_ps: torch.Tensor | None  # [B] float32

    @classmethod
    def of(cls, params: list, vocab: int, device: torch.device) -> "Truncation":
        """The tensors of the rows' SamplingParams, each only where some row uses it."""
        top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]

        def tensor(values, dtype, used):
            return torch.tensor(values, dtype=dtype, device=device) if used else None
        top_ps, min_ps = [p.top_p for p in params], [p.min_p for p in params]
        return cls(tensor(top_ks, torch.int64, min(top_ks) < vocab),
                   tensor(top_ps, torch.float32, any(p < 1 for p in top_ps)),
                   tensor(min_ps, torch.float32, any(p > 0 for p in min_ps)))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Set to -inf the logits outside each row's min-p floor, top-k and top-p nucleus."""
        if self.min_ps is not None:
            probs = logits.softmax(-1)
            floor = self.min_ps[:, None] * probs.amax(-1, keepdim=True)
            logits = logits.masked_fill(probs < floor, float("-inf"))
        if self.top_ks is None and self.top_ps is None:
            return logits
        sorted_logits, order = logits.sort(-1, descending=True)
        if self.top_ks is not None:
            outside = torch.arange(logits.size(-1), device=logits.device) >= self.top_ks[:, None]
            sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        if self.top_ps is not None:
            probs = sorted_logits.softmax(-1)
            # the smallest prefix reaching top_p
            outside = probs.cumsum(-1) - probs > self.top_ps[:, None]
            sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
