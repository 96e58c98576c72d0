"""A step crossing from the CPU side to the GPU side: the scheduler's batch as plain lists
(`StepInputs`, all that a tensor-parallel worker receives, built by `step_inputs`), and their layout
as one flat int32 tensor (`field_sizes`, `unpack`): the model runner uploads a step in one copy, and
a CUDA graph reads its inputs at fixed addresses in the same layout, padded to its sizes.
"""
from dataclasses import dataclass, field

import torch

from nanovllm.attention import QUERY_TILE, AttentionMetadata
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import slot_mapping


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

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """Tokens, sequences, query tiles and block table width of this step."""
        cu = self.cu_seqlens_q[self.num_decodes:]
        num_tiles = sum(-(-(b - a) // QUERY_TILE) for a, b in zip(cu, cu[1:]))
        width = max(map(len, self.block_tables))
        return len(self.input_ids), len(self.context_lens), num_tiles, width


def step_inputs(batch: ScheduledBatch, block_size: int) -> StepInputs:
    """Each sequence's new tokens (from batch.starts), their positions and slots, its context."""
    step = StepInputs([], [], [], [0], [], [s.block_table for s in batch.seqs], batch.num_decodes,
                      [], batch.copies, batch.swap_in, batch.swap_out)
    for seq, start, n, k in zip(batch.seqs, batch.starts, batch.num_new_tokens, batch.num_samples):
        step.input_ids += seq.token_ids[start:start + n]
        step.positions += range(start, start + n)
        if n == 1:  # a decode: its one slot, without a function call (hundreds per step)
            block = seq.block_table[start // block_size]
            step.slot_mapping.append(block * block_size + start % block_size)
        else:
            step.slot_mapping += slot_mapping(seq.block_table, start, start + n, block_size)
        step.cu_seqlens_q.append(step.cu_seqlens_q[-1] + n)
        step.context_lens.append(start + n)
        step.sample_rows += [step.cu_seqlens_q[-1] - 1] * k
    return step


def field_sizes(num_tokens: int, num_seqs: int, num_tiles: int, width: int) -> list[int]:
    """Sizes of the fields of a step's upload: token ids, positions, slots, cu_seqlens_q,
    cu_seqlens_k, context_lens, query tiles, block tables; each rounded up to 16 bytes (Triton
    compiles a kernel once per alignment of its pointers: keep it to one)."""
    sizes = [num_tokens] * 3 + [num_seqs + 1] * 2 + [num_seqs, 2 * num_tiles, num_seqs * width]
    return [size + -size % 4 for size in sizes]


def unpack(flat: torch.Tensor, layout: tuple, lengths: tuple, num_decodes: int,
           step: StepInputs | None = None):
    """Token ids, positions and attention metadata of `lengths` (tokens, sequences, tiles, table
    width): views of a flat upload laid out by `layout` (the same sizes, or a CUDA graph's,
    padded)."""
    sizes = field_sizes(*layout)
    ids, positions, slots, cu_q, cu_k, lens, tiles, tables = flat[:sum(sizes)].split(sizes)
    n, num_seqs, num_tiles, width = lengths
    meta = AttentionMetadata(slots[:n], cu_q[:num_seqs + 1], cu_k[:num_seqs + 1], lens[:num_seqs],
                             tables[:num_seqs * layout[3]].view(num_seqs, layout[3])[:, :width],
                             tiles[:2 * num_tiles].view(-1, 2), num_decodes,
                             step.cu_seqlens_q if step else [], step.context_lens if step else [])
    return ids[:n], positions[:n], meta
