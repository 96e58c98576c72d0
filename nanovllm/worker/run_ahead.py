"""Run-ahead (vLLM's async scheduling, `async_scheduling=True`, the default on CUDA): the engine
launches step t+1 before it reads step t's tokens, so the GPU does not wait while the host
schedules.

A token that step t samples is unknown on the host when step t+1 is scheduled. It stands in its
sequence as a placeholder, -(r + 1) for row r of step t's samples (`placeholder` in
nanovllm/core/sequence.py). Step t+1's inputs may hold placeholders: the model runner fills them
on the device from the tokens step t left there (`fill_placeholders`). When the engine reads step
t's tokens (`SampledTokens`), the scheduler puts them in place of the placeholders. A sequence that
ended at step t has wasted one token of step t+1. Steps whose tokens the host needs at once (beam
candidates, log-probabilities) are read at once (LLMEngine.step).
"""
import torch


def fill_placeholders(input_ids: torch.Tensor, last_tokens: torch.Tensor):
    """Replace (in place) each placeholder in input_ids by the token the last step sampled at its
    row."""
    rows = (-1 - input_ids).clamp(min=0)
    torch.where(input_ids < 0, last_tokens[rows].to(input_ids.dtype), input_ids, out=input_ids)


class SampledTokens:
    """A launched step's sampled token ids on their way to the host (and their
    log-probabilities)."""

    def __init__(self, token_ids: torch.Tensor, logprobs: list | None):
        self.host, self.ready, self.logprobs = token_ids, None, logprobs
        if token_ids.is_cuda:  # a pinned copy, filled once the step reaches `ready`
            self.host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self.host.copy_(token_ids, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # waits for that step only, not for one launched after it
        return self.host.tolist()
