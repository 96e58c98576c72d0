"""Run-ahead (vLLM's async scheduling, `async_scheduling=True`, the default on CUDA): the engine
launches step t + k before it reads the tokens of step t (k = run_ahead_steps, 2 by default), so
the GPU does not wait while the host schedules, and a host late now and then by less than k steps'
slack costs the GPU nothing.

A token that a step samples is unknown on the host until the engine reads the step. It stands in
its sequence as a placeholder: -(i + 1) for index i of the model runner's `sampled` tokens, flat
([k + 1, max_num_seqs], a slot a row; `placeholder` in nanovllm/core/sequence.py). The t-th step
launched writes its samples into slot t mod (k + 1), at row r the r-th of its samples (index i =
slot * max_num_seqs + r): never a slot that a step not read yet holds, as at most k are. The
inputs of the steps after it may hold its placeholders: the model runner fills them on the device
(`fill_placeholders`). When the engine reads a step's tokens (`SampledTokens`), the scheduler puts
them in place of the placeholders. A sequence that ended at a step has wasted a token of each step
launched after it. Steps whose tokens the host needs at once (beam candidates, log-probabilities)
are read at once (LLMEngine.step).
"""
import torch


def fill_placeholders(input_ids: torch.Tensor, sampled: torch.Tensor):
    """Replace (in place) each placeholder in input_ids by its token in `sampled` (flattened)."""
    rows = (-1 - input_ids).clamp(min=0)
    torch.where(input_ids < 0, sampled.view(-1)[rows].to(input_ids.dtype), input_ids, out=input_ids)


class SampledTokens:
    """A launched step's sampled token ids on their way to the host (and their
    log-probabilities)."""

    def __init__(self, token_ids: torch.Tensor, logprobs: list | None):
        """token_ids: on CUDA in pinned memory that the step fills (the model runner's, a slot
        each), read once the step reaches `ready`; else a copy (their slot takes a later step's)."""
        self.ready, self.logprobs = None, logprobs
        self.host = token_ids if token_ids.is_pinned() else token_ids.clone()
        if token_ids.is_pinned():
            self.ready = torch.cuda.Event()
            self.ready.record()

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # waits for that step only, not for one launched after it
        return self.host.tolist()
