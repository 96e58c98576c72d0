"""A step crossing from the CPU side to the GPU side (vLLM v1's SchedulerOutput): the scheduler's
batch as plain lists (`StepInputs`, all that a tensor-parallel worker receives, built by
`step_inputs`), then as tensors on the device (`to_tensors`).
"""
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from nanovllm.attention import AttentionMetadata
from nanovllm.core.scheduler import ScheduledBatch


@dataclass
class StepInputs:
    """One forward pass as plain lists."""
    input_ids: list[int]     # the new tokens of all sequences, packed; placeholders included
    positions: list[int]
    slot_mapping: list[int]  # the cache slot of each new token
    cu_seqlens_q: list[int]  # sequence s owns new tokens cu_seqlens_q[s]:cu_seqlens_q[s + 1]
    context_lens: list[int]  # per sequence: keys after this step (cached + new)
    block_tables: list[list[int]]
    num_decodes: int         # leading sequences with one new token
    sample_rows: list[int]   # per sampled row, the token whose logits it takes
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)


def step_inputs(batch: ScheduledBatch, block_size: int) -> StepInputs:
    """Each sequence's new tokens (from batch.starts), their positions and slots, its context."""
    num_decodes = batch.num_new_tokens.count(1)  # the scheduler puts them first
    step = StepInputs([], [], [], [0], [], [s.block_table for s in batch.seqs], num_decodes, [],
                      batch.copies, batch.swap_in, batch.swap_out)
    for seq, start, n, k in zip(batch.seqs, batch.starts, batch.num_new_tokens, batch.num_samples):
        step.input_ids += seq.token_ids[start:start + n]
        step.positions += range(start, start + n)
        step.slot_mapping += [seq.block_table[i // block_size] * block_size + i % block_size
                              for i in range(start, start + n)]  # each token's block, then offset
        step.cu_seqlens_q.append(step.cu_seqlens_q[-1] + n)
        step.context_lens.append(start + n)
        step.sample_rows += [step.cu_seqlens_q[-1] - 1] * k
    return step


def to_tensors(step: StepInputs, device: torch.device):
    """Token ids, positions, attention metadata and sampled rows as tensors on `device`, a copy per
    field (a CUDA graph takes them in one flat copy instead: worker/cuda_graphs.py)."""
    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)
    width = max(map(len, step.block_tables))
    tables = tensor([table + [0] * (width - len(table)) for table in step.block_tables])
    meta = AttentionMetadata(tensor(step.slot_mapping), tensor(step.cu_seqlens_q),
                             tensor([0, *accumulate(step.context_lens)]), tensor(step.context_lens),
                             tables, step.num_decodes, step.cu_seqlens_q, step.context_lens)
    return tensor(step.input_ids), tensor(step.positions), meta, tensor(step.sample_rows)
