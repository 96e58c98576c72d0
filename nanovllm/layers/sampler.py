"""Sampling the next token: temperature, per-request seeds (truncation: layers/truncation.py); a
batch of greedy rows takes the argmax in the model runner and never comes here.

Sampling draws argmax(p / q) with q ~ Exponential(1), which picks token i with probability p_i (the
Gumbel-max trick in another form) and needs no multinomial. In logarithms that is argmax(logits / T
- log q): no softmax either, so on CUDA plain temperature sampling of a whole batch reads the logits
once (Triton kernels: nanovllm/kernels/sample.py). A seeded request draws its own q from a generator
seeded by (seed, sample index, position), so its tokens do not depend on the rest of the batch, and
the n samples of one request differ. Logits come in the model's dtype; the arithmetic is float32.
"""
from dataclasses import dataclass

import torch

from nanovllm.utils.pinned import host_tensor


@dataclass
class SamplingTensors:
    """Per-row sampling settings of one batch, built by the model runner."""
    temperatures: torch.Tensor     # [B] float32, 0 = greedy
    seeds: list[tuple[int, int]]   # (row, seed for this step) of the seeded rows
    all_greedy: bool
    truncation: object = None      # top-k / top-p / min-p, if a row asks (layers/truncation.py)

    @property
    def one_pass(self) -> bool:
        """Whether the one-pass kernel samples every row: no truncation and no seeded row."""
        return self.truncation is None and not self.seeds

    @classmethod
    def of(cls, rows: list, vocab_size: int, device: torch.device) -> "SamplingTensors":
        """The settings of (sequence, sample index) rows; truncation only where some row asks."""
        params = [seq.params for seq, _ in rows]
        temperatures = [0.0 if p.greedy else p.temperature for p in params]
        host = host_tensor(temperatures, torch.float32, pin=device.type == "cuda")
        truncation = None
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            from nanovllm.layers.truncation import Truncation
            truncation = Truncation.of(params, vocab_size, device)
        seeds = [(i, hash((p.seed, k, len(seq))) & (2**63 - 1))  # ints: the same in every process
                 for i, (p, (seq, k)) in enumerate(zip(params, rows))
                 if p.seed is not None and not p.greedy]
        return cls(host.to(device, non_blocking=True), seeds, all(t == 0 for t in temperatures),
                   truncation)


def sample_batch(logits: torch.Tensor, batch, runner) -> tuple[torch.Tensor, list | None]:
    """The model runner's sampling for a batch where some request does more than take the argmax:
    the next token of each sample row (a row per sampling sequence, n rows for the prompt of a new
    n-sample request), after penalties (layers/penalties.py), and the log-probabilities asked for
    (layers/logprobs.py)."""
    rows = [(seq, seq.sample_index + j)
            for seq, k in zip(batch.seqs, batch.num_samples) for j in range(k)]
    scores = logits
    if any(seq.params.penalized for seq, _ in rows):
        from nanovllm.layers import penalties
        positions = [p for _, _, p in batch.sampled]
        scores = penalties.apply(logits, rows, positions, runner.eos_token_ids, runner.sampled)
    vocab_size = runner.config.hf_config["vocab_size"]
    t = SamplingTensors.of(rows, vocab_size, logits.device)
    # a decode step's logits from its CUDA graph: sampled by a graph too (worker/cuda_graphs.py)
    token_ids = runner.graphs.sample(scores, t, batch.slot) if runner.graphs is not None else None
    if token_ids is None:
        token_ids = sample(scores, t, runner.one_pass_sample)
    top = None
    if any(seq.params.logprobs is not None for seq, _ in rows):
        from nanovllm.layers.logprobs import logprobs
        top = logprobs(logits, token_ids, [seq.params.logprobs for seq, _ in rows])
    return token_ids, top


def sample(logits: torch.Tensor, t: SamplingTensors, one_pass_sample=None) -> torch.Tensor:
    """Next token per row of logits [B, vocab]; `one_pass_sample(logits, temperatures)`, the
    kernel that reads the logits once (kernels/sample.py, on CUDA), where it samples every row."""
    if t.all_greedy:
        return logits.argmax(-1)
    if one_pass_sample is not None and t.one_pass:
        return one_pass_sample(logits, t.temperatures)
    greedy = logits.argmax(-1)
    scaled = logits.float() / torch.where(t.temperatures > 0, t.temperatures, 1.0)[:, None]
    probs = (scaled if t.truncation is None else t.truncation.apply(scaled)).softmax(-1)
    q = torch.empty_like(probs).exponential_()
    for row, seed in t.seeds:
        gen = torch.Generator(device=probs.device).manual_seed(seed)
        q[row].exponential_(generator=gen)
    sampled = (probs / q).argmax(-1)
    return torch.where(t.temperatures > 0, sampled, greedy)
