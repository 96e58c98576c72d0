"""Sampling the next token: greedy, temperature, top-k / top-p / min-p, per-request seeds.

Sampling draws argmax(p / q) with q ~ Exponential(1), which picks token i with probability p_i
(the Gumbel-max trick in another form) and needs no multinomial. In logarithms that is
argmax(logits / T - log q): no softmax either, so plain temperature sampling of a whole batch is one
pass over the logits (on CUDA, Triton kernels that read them once: nanovllm/kernels/sample.py). A seeded request draws
its own q from a generator seeded by (seed, sample index, position), so its tokens do not depend on the
rest of the batch, and the n samples of one request differ. Logits come in the model's dtype; the
arithmetic is float32.
"""
from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """Per-row sampling settings of one batch, built by the model runner."""
    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_ks: torch.Tensor | None  # [B] int64, vocab size = off; None when no row truncates
    top_ps: torch.Tensor | None  # [B] float32
    min_ps: torch.Tensor | None  # [B] float32
    seeds: list[tuple[int, int]]  # (row, seed for this step) of the seeded rows
    all_greedy: bool


def truncate(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Set to -inf the logits outside each row's min-p floor, top-k and top-p nucleus, applied in that order
    (as vLLM does): top-p counts probability among the tokens that min-p and top-k left."""
    if t.min_ps is not None:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < t.min_ps[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    if t.top_ks is None and t.top_ps is None:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    if t.top_ks is not None:
        outside = torch.arange(logits.size(-1), device=logits.device) >= t.top_ks[:, None]
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    if t.top_ps is not None:
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs > t.top_ps[:, None]  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Next token per row of logits [B, vocab]."""
    if t.all_greedy:
        return logits.argmax(-1)
    if t.top_ks is None and t.top_ps is None and t.min_ps is None and not t.seeds:
        if logits.is_cuda:
            from nanovllm.kernels.sample import gumbel_max_sample  # imports triton: only where it runs
            return gumbel_max_sample(logits, t.temperatures, seed=int(torch.randint(2**31 - 1, ())))
        return sample_temperature(logits, t.temperatures)
    greedy = logits.argmax(-1)
    logits = logits.float()
    temps = torch.where(t.temperatures > 0, t.temperatures, 1.0)
    probs = truncate(logits / temps[:, None], t).softmax(-1)
    q = torch.empty_like(probs).exponential_()
    for row, seed in t.seeds:
        gen = torch.Generator(device=probs.device).manual_seed(seed)
        q[row].exponential_(generator=gen)
    sampled = (probs / q).argmax(-1)
    return torch.where(t.temperatures > 0, sampled, greedy)


def sample_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Plain temperature sampling: argmax(logits / T - log q), q ~ Exponential(1) (= -log u, u ~ U[0, 1));
    rows with T = 0 take the argmax. (CPU; on CUDA nanovllm.kernels.sample draws from the same distribution in one read of the logits.)"""
    x = logits.float()
    scaled = x / torch.where(temperatures > 0, temperatures, 1.0)[:, None]
    sampled = (scaled - torch.log(-torch.log(torch.rand_like(x)))).argmax(-1)
    return torch.where(temperatures > 0, sampled, x.argmax(-1))


def logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]) -> list | None:
    """For each row with a number m: {token: log-probability} of the chosen token and the m most likely ones.

    They are the log-softmax of the raw logits, the model's own distribution (what vLLM reports and what beam
    search scores), not of the temperature-scaled, truncated distribution the token was drawn from.
    """
    if all(m is None for m in num_logprobs):
        return None
    logp = logits.float().log_softmax(-1)  # [B, vocab]
    chosen = logp.gather(-1, token_ids[:, None])[:, 0].tolist()
    top_logp, top_ids = logp.topk(max(m or 0 for m in num_logprobs), dim=-1)  # [B, max m]
    top_logp, top_ids, token_ids = top_logp.tolist(), top_ids.tolist(), token_ids.tolist()
    return [None if m is None else {token_ids[i]: chosen[i], **dict(zip(top_ids[i][:m], top_logp[i][:m]))}
            for i, m in enumerate(num_logprobs)]
