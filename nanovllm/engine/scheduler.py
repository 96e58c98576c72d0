"""The scheduler: iteration-level (continuous) batching with chunked prefill and preemption.

Each step is either a prefill (waiting sequences, first come first served, within the token and
sequence budgets; a prompt longer than the token budget is prefilled in chunks over several
steps) or a decode (one new token for every running sequence). The sequences of one request
(parallel samples, the beams of a beam search) form a group, admitted and preempted as a whole.
When a decode step finds no free block, the newest running group is preempted: by recomputation
(its blocks are freed and it goes back to the front of the waiting queue; its prefix may still be
found in the cache) or, with preemption_mode="swap", by moving its blocks to the CPU pool; swapped
groups come back before any new request is admitted. The block copies a step needs (swap out,
swap in, copy-on-write) travel in its batch to the model runner.

A step is recorded in two halves, because the engine schedules the next step before this one's
tokens reach the host: `advance` when it is launched (progress, and a placeholder for each token it
samples), `postprocess` when its tokens arrive (they replace the placeholders).
"""
from collections import deque
from dataclasses import dataclass, field

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one step runs: the sequences, how many new tokens each computes and how many tokens each samples
    (n for the prompt of an n-sample request: its other samples fork from it), and the block copies to make
    before the forward, in the order they were made: swap in, swap out, copy-on-write."""
    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    num_samples: list[int] = field(default_factory=list)          # empty: one per sequence
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu block, gpu block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)    # copy-on-write (src block, dst block)
    sampled: list[tuple[Sequence, int, int]] = field(default_factory=list)  # by advance: (seq, row, token position)

    def __post_init__(self):
        self.num_samples = self.num_samples or [1] * len(self.seqs)


class Scheduler:
    def __init__(self, config: Config, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.preemption_mode = getattr(config, "preemption_mode", "recompute")  # unit tests pass a bare namespace
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.swapped: deque[list[Sequence]] = deque()  # groups whose blocks are in the CPU pool, oldest first
        self.num_preemptions = 0
        self.num_swapped_out_blocks = self.num_swapped_in_blocks = 0

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledBatch:
        """Swap in the groups that fit, then pick a prefill if any waiting sequence fits, else a decode."""
        self._swap_in, self._swap_out, self._copies = [], [], []  # filled while scheduling, in this order
        self._schedule_swap_in()
        batch = self._schedule_prefill() or self._schedule_decode()
        batch.swap_in, batch.swap_out, batch.copies = self._swap_in, self._swap_out, self._copies
        return batch

    def _schedule_swap_in(self):
        """Bring swapped groups back, oldest first, while their blocks and their next step's blocks fit."""
        back, reserved = [], 0
        while self.swapped and self.block_manager.can_swap_in(self.swapped[0], reserved):
            group = self.swapped.popleft()
            pairs = self.block_manager.swap_in(group)
            self._swap_in += pairs
            self.num_swapped_in_blocks += len(pairs)
            for seq in group:
                seq.status = SequenceStatus.RUNNING
            reserved += self.block_manager.num_blocks_to_append(*group)
            back += group
        self.running.extendleft(reversed(back))  # first in line: the blocks they append next are reserved

    def _schedule_prefill(self) -> ScheduledBatch | None:
        seqs, num_new, num_samples, budget = [], [], [], self.max_num_batched_tokens
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            fresh = len(seq.group) == 1  # a new request: an n-sample one (or a beam search) forks later
            # a fully scheduled prompt joins `running` at once, so running already counts this batch's sequences
            if len(self.running) + (seq.max_group_size if fresh else 1) > self.max_num_seqs:
                break
            if not seq.block_table and (self.swapped or not self._allocate_group(seq)):
                break  # swapped groups come back before anything new takes blocks
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            budget -= chunk
            seqs.append(seq)
            num_new.append(chunk)
            num_samples.append(seq.params.n if fresh else 1)
            if seq.num_computed_tokens + chunk < seq.num_tokens:
                break  # a partial prefill stays first in line and goes on next step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return ScheduledBatch(seqs, num_new, is_prefill=True, num_samples=num_samples) if seqs else None

    def _allocate_group(self, seq: Sequence) -> bool:
        """Blocks for all the waiting members of the sequence's group, or for none: beams admitted one by one
        could each hold blocks while waiting for a sibling that no longer fits."""
        members = [s for s in seq.group if s.status == SequenceStatus.WAITING and not s.block_table]
        for i, member in enumerate(members):
            if not self.block_manager.allocate(member):
                for done in members[:i]:
                    self.block_manager.free(done)
                return False
        return True

    def _running_groups(self) -> deque[list[Sequence]]:
        """The running sequences, group by group, oldest group first."""
        groups: dict[int, list[Sequence]] = {}
        for seq in self.running:
            groups.setdefault(id(seq.group), []).append(seq)
        return deque(groups.values())

    def _schedule_decode(self) -> ScheduledBatch:
        groups, scheduled = self._running_groups(), []
        while groups:
            group = groups.popleft()
            while self.block_manager.num_blocks_to_append(*group) > self.block_manager.num_free_blocks:
                victim = groups.pop() if groups else group  # the newest group gives way
                self.preempt(victim)
                if victim is group:
                    break
            else:
                scheduled += group
                for seq in group:
                    if seq.num_computed_tokens < seq.num_tokens:  # a beam waiting for beam search runs nothing
                        self._copies += self.block_manager.append_blocks(seq)
        self.running = deque(scheduled)
        seqs = [seq for seq in scheduled if seq.num_computed_tokens < seq.num_tokens]
        assert seqs, "no sequence can run: the request admission check should have prevented this"
        seqs.sort(key=len, reverse=True)  # longest context first: attention kernels finish with the short ones
        return ScheduledBatch(seqs, [1] * len(seqs), is_prefill=False)

    def preempt(self, group: list[Sequence]):
        """Preempt a running group as a whole: swap its blocks out (swap mode, while the CPU pool has room),
        else free them and requeue its sequences at the front of the waiting queue, to be recomputed."""
        self.num_preemptions += 1
        if self.preemption_mode == "swap" and self.block_manager.can_swap_out(group):
            pairs = self.block_manager.swap_out(group)
            self._swap_out += pairs
            self.num_swapped_out_blocks += len(pairs)
            for seq in group:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return
        for seq in reversed(group):
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def fork(self, seq: Sequence) -> Sequence:
        """A new running member of the sequence's group that shares all its blocks (the paper's fork)."""
        child = seq.fork()
        self.block_manager.fork(seq, child)
        self.running.append(child)
        return child

    def advance(self, batch: ScheduledBatch):
        """Record a launched step before its tokens are known: each sequence's progress, and a placeholder for
        each token it samples (the other samples of a new n-sample request fork now, each with its own row).
        A partial prefill samples nothing; a beam gets candidates instead, and no placeholder."""
        row = 0
        for seq, n, k in zip(batch.seqs, batch.num_new_tokens, batch.num_samples):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                position = seq.num_tokens
                for j, sample in enumerate([seq] + [self.fork(seq) for _ in range(k - 1)]):
                    batch.sampled.append((sample, row + j, position))
                    if not sample.beam_width:
                        sample.token_ids.append(-(row + j + 1))
            row += k

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int], logprobs: list | None = None):
        """Put a step's sampled tokens in place of their placeholders (beams get their candidates) and register
        newly computed blocks in the prefix cache; returns (sequence, position) of each new token."""
        new_tokens = []
        for seq, row, position in batch.sampled:
            if seq.is_finished:
                continue  # it ended at the step before, while this one ran
            if seq.beam_width:
                seq.candidates = logprobs[row]
            else:
                seq.set_token(position, token_ids[row], logprobs[row] if logprobs else None)
                new_tokens.append((seq, position))
        for seq in batch.seqs:
            if seq.status == SequenceStatus.RUNNING:  # not preempted meanwhile
                self.block_manager.cache_computed_blocks(seq)
        return new_tokens

    def finish(self, seqs: list[Sequence]):
        """Free finished sequences and drop them from the queues (one preempted while its last token was being
        sampled is waiting or swapped)."""
        for seq in seqs:
            self.block_manager.free(seq)  # before the status changes: a swapped sequence frees CPU blocks
            seq.status = SequenceStatus.FINISHED
        if seqs:
            self.running = deque(s for s in self.running if not s.is_finished)
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
            self.swapped = deque(g for g in ([s for s in g if not s.is_finished] for g in self.swapped) if g)
