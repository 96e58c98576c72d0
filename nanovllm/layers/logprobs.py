"""Log-probabilities of the sampled tokens and the most likely ones (SamplingParams.logprobs); the
model runner computes them only for batches where some request asks."""
import torch


def logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
             num_logprobs: list[int | None]) -> list | None:
    """For each row with a number m: {token: log-probability} of the chosen token and the m most
    likely ones.

    They are the log-softmax of the raw logits, the model's own distribution (what vLLM reports and
    what beam search scores), not of the temperature-scaled, truncated distribution the token was
    drawn from.
    """
    if all(m is None for m in num_logprobs):
        return None
    logp = logits.float().log_softmax(-1)  # [B, vocab]
    chosen = logp.gather(-1, token_ids[:, None])[:, 0].tolist()
    top_logp, top_ids = logp.topk(max(m or 0 for m in num_logprobs), dim=-1)  # [B, max m]
    top_logp, top_ids, token_ids = top_logp.tolist(), top_ids.tolist(), token_ids.tolist()
    return [None if m is None
            else {token_ids[i]: chosen[i], **dict(zip(top_ids[i][:m], top_logp[i][:m]))}
            for i, m in enumerate(num_logprobs)]
