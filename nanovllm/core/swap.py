"""Swap preemption (the vLLM paper, section 4.5): a preempted group's KV blocks move to a pool of
CPU blocks and come back later, instead of being recomputed.

`Swapper` is the scheduler's side: a CPU block pool with reference counts (a block shared inside the
group moves once, and sharing is restored when it comes back), the swapped groups oldest first, and
each swapped sequence's CPU block table. Swapped groups come back before any new request is
admitted, as soon as their blocks and the blocks their next step appends fit. When the CPU pool is
full, the group is recomputed instead. `SwapSpace` is the model runner's side: the CPU tensor
(pinned on CUDA) and the copies of each step, one batched index copy per direction over all layers.
"""
from collections import deque

import torch

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence, SequenceStatus


class Swapper:
    def __init__(self, block_manager: BlockManager, num_cpu_blocks: int):
        self.block_manager = block_manager
        self.cpu_ref_counts = [0] * num_cpu_blocks
        self.free_cpu_blocks = list(range(num_cpu_blocks))
        self.swapped: deque[list[Sequence]] = deque()  # while swapped, block tables hold CPU blocks
        self.num_swapped_out_blocks = self.num_swapped_in_blocks = self.num_swapped_out_groups = 0

    def swap_out(self, group: list[Sequence], batch) -> bool:
        """Move a running group's blocks to the CPU pool (False, and nothing moved, if they don't
        fit)."""
        if len({b for seq in group for b in seq.block_table}) > len(self.free_cpu_blocks):
            return False
        to_cpu = {}
        for seq in group:
            for block_id in seq.block_table:
                if block_id not in to_cpu:
                    to_cpu[block_id] = self.free_cpu_blocks.pop()
                self.cpu_ref_counts[to_cpu[block_id]] += 1
            table = [to_cpu[b] for b in seq.block_table]
            self.block_manager.free(seq)
            seq.block_table = table
            seq.status = SequenceStatus.SWAPPED
        batch.swap_out += to_cpu.items()
        self.num_swapped_out_blocks += len(to_cpu)
        self.num_swapped_out_groups += 1
        self.swapped.append(group)
        return True

    def swap_in(self, scheduler, batch):
        """Bring swapped groups back, oldest first, while their blocks and their next step's blocks
        fit beside those of the groups already brought back; they run first."""
        back, reserved = [], 0
        while self.swapped:
            group = self.swapped[0]
            cpu_blocks = {b for seq in group for b in seq.block_table}
            need = self.block_manager.num_blocks_to_append(group, self.cpu_ref_counts)
            if len(cpu_blocks) + need + reserved > self.block_manager.num_free_blocks:
                break
            self.swapped.popleft()
            to_gpu = {}
            for seq in group:
                for cpu_id in seq.block_table:
                    if cpu_id in to_gpu:
                        self.block_manager.blocks[to_gpu[cpu_id]].ref_count += 1
                    else:
                        to_gpu[cpu_id] = self.block_manager.take_free_block()
                    self._unref(cpu_id)
                seq.block_table = [to_gpu[b] for b in seq.block_table]
                seq.status = SequenceStatus.RUNNING
            batch.swap_in += to_gpu.items()
            self.num_swapped_in_blocks += len(to_gpu)
            reserved += need
            back += group
        scheduler.running.extendleft(reversed(back))

    def drop(self, seq: Sequence):
        """Free a swapped sequence's CPU blocks (it ended while swapped out)."""
        for cpu_id in seq.block_table:
            self._unref(cpu_id)
        seq.block_table = []
        for group in self.swapped:
            if seq in group:
                group.remove(seq)
        self.swapped = deque(g for g in self.swapped if g)

    def _unref(self, cpu_id: int):
        self.cpu_ref_counts[cpu_id] -= 1
        if self.cpu_ref_counts[cpu_id] == 0:
            self.free_cpu_blocks.append(cpu_id)


class SwapSpace:
    """The CPU copy of the KV cache's blocks: [2, num_layers, num_cpu_blocks, block_size, heads,
    dim]."""

    def __init__(self, kv_cache: torch.Tensor, swap_space_gib: float):
        shape = list(kv_cache.shape)
        block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        shape[2] = int(swap_space_gib * (1 << 30) // block_bytes)
        if shape[2] < 1:
            raise ValueError(f"swap_space={swap_space_gib} GiB holds no KV block "
                             f"({block_bytes} bytes)")
        self.kv_cache = kv_cache
        self.cpu_cache = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=kv_cache.is_cuda)
        self.num_blocks = shape[2]

    def move(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]):
        """Swap in first (its CPU blocks may be reused by a swap out), then swap out (its GPU blocks
        may be reused by a copy-on-write that follows)."""
        if swap_in:
            cpu, gpu = map(list, zip(*swap_in))
            self.kv_cache[:, :, gpu] = self.cpu_cache[:, :, cpu].to(self.kv_cache.device)
        if swap_out:
            gpu, cpu = map(list, zip(*swap_out))
            self.cpu_cache[:, :, cpu] = self.kv_cache[:, :, gpu].cpu()
