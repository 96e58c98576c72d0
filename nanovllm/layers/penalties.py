"""Penalties and min_tokens: logits processors that look at the tokens a request already has.

- repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor, CTRL's): the logit of every
  token in the prompt or the output is divided by the penalty if positive, multiplied if negative;
- presence_penalty and frequency_penalty (OpenAI's): from the logit of every token of the output,
  subtract presence_penalty once and frequency_penalty once per occurrence;
- min_tokens: while the output is shorter, end-of-sequence and stop tokens cannot be drawn.

They apply to the logits before sampling (temperature, truncation); log-probabilities are still
those of the model. A request's last tokens may still be on the GPU (run-ahead: their placeholders
are filled on the device, as the model runner fills its inputs). The model runner calls `apply`
only for batches where some request uses one of these.
"""
import torch

from nanovllm.worker.run_ahead import fill_placeholders


def apply(logits: torch.Tensor, rows: list, positions: list[int], eos_token_ids: set[int],
          sampled: torch.Tensor) -> torch.Tensor:
    """logits [R, V] of sampled rows (sequence, sample index), each sampling the token at
    positions[i]; `sampled`, the tokens of the steps not read yet (worker/run_ahead.py)."""
    num_rows, vocab = logits.shape
    device = logits.device
    width = max(positions)
    # padded with id V
    history = [seq.token_ids[:p] + [vocab] * (width - p) for (seq, _), p in zip(rows, positions)]
    ids = torch.tensor(history, dtype=torch.int64, device=device)  # [R, width]
    fill_placeholders(ids, sampled)
    prompt_lens = torch.tensor([seq.num_prompt_tokens for seq, _ in rows], device=device)
    output = (torch.arange(width, device=device) >= prompt_lens[:, None]) & (ids < vocab)
    counts = torch.zeros(num_rows, vocab + 1, device=device)
    counts = counts.scatter_add_(1, ids.where(output, vocab), output.float())[:, :vocab]
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=device)
    seen = seen.scatter_(1, ids, True)[:, :vocab]
    params = [seq.params for seq, _ in rows]

    def column(name):
        values = [getattr(p, name) for p in params]
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]
    logits = logits.float()
    repetition = column("repetition_penalty")
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = (logits - column("presence_penalty") * (counts > 0)
              - column("frequency_penalty") * counts)
    for i, (p, position) in enumerate(zip(params, positions)):
        if position - rows[i][0].num_prompt_tokens < p.min_tokens:
            banned = [t for t in (*eos_token_ids, *p.stop_token_ids) if t < vocab]
            logits[i, banned] = float("-inf")
    return logits
