"""The scheduler: iteration-level (continuous) batching with chunked prefill and preemption.

Each step is either a prefill (waiting sequences, first come first served, within the token and
sequence budgets; a prompt longer than the token budget is prefilled in chunks over several
steps) or a decode (one new token for every running sequence). When a decode step finds no free
block, the newest running sequence is preempted by recomputation: its blocks are freed and it
goes back to the front of the waiting queue (its prefix may still be found in the cache).
"""
from collections import deque
from dataclasses import dataclass

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one step runs: the sequences and how many new tokens each computes."""
    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool


class Scheduler:
    def __init__(self, config: Config, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick the next step's batch: a prefill if any waiting sequence fits, else a decode."""
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        seqs, num_new, budget = [], [], self.max_num_batched_tokens
        # a fully scheduled prompt joins `running` at once, so running already counts this batch's sequences
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table and not self.block_manager.allocate(seq):
                break
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= chunk
            seqs.append(seq)
            num_new.append(chunk)
            if seq.num_computed_tokens + chunk < seq.num_tokens:
                break  # a partial prefill stays first in line and goes on next step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return ScheduledBatch(seqs, num_new, is_prefill=True) if seqs else None

    def _schedule_decode(self) -> ScheduledBatch:
        seqs = []
        while self.running:
            seq = self.running.popleft()
            while self.block_manager.num_blocks_to_append(seq) > self.block_manager.num_free_blocks:
                if not self.running:
                    self.preempt(seq)
                    break
                self.preempt(self.running.pop())
            else:
                self.block_manager.append_blocks(seq)
                seqs.append(seq)
        self.running.extend(seqs)
        assert seqs, "no sequence can run: the request admission check should have prevented this"
        return ScheduledBatch(seqs, [1] * len(seqs), is_prefill=False)

    def preempt(self, seq: Sequence):
        """Preemption by recomputation: free the blocks, requeue at the front."""
        self.num_preemptions += 1
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int]) -> list[Sequence]:
        """Record the step: advance progress, append sampled tokens; return sequences that got one."""
        sampled = []
        for seq, n, token_id in zip(batch.seqs, batch.num_new_tokens, token_ids):
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:  # not a partial prefill
                seq.append_token(token_id)
                sampled.append(seq)
        return sampled

    def finish(self, seqs: list[Sequence]):
        """Free finished sequences and drop them from the running queue."""
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            self.block_manager.free(seq)
        if seqs:
            self.running = deque(s for s in self.running if not s.is_finished)
