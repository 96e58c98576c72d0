"""The scheduler: iteration-level (continuous) batching, one kind of step (vLLM v1's unified
scheduler, Sarathi-Serve's stall-free batching).

A step has a budget of max_num_batched_tokens new tokens. It takes the running sequences first,
oldest first: a decode computes its one pending token, a prompt being prefilled in chunks its next
chunk. New requests then fill what is left, first come first served; a prompt longer than what is
left is cut, and its next chunk runs in the next step. So a long prompt never stalls the decodes:
they share its steps. With prefill_first=True (vLLM v0's order) a step that can prefill runs only
prefills, and decodes wait.

The sequences of one request (parallel samples, the beams of a beam search) form a group, admitted
and preempted as a whole; max_num_seqs bounds both the sequences admitted (a group counts its n
samples or beams from the start) and a step's sample rows (a group may fork after others came in).
When a running group finds no free block, the newest running group is preempted: its blocks are
freed and it goes back to the front of the waiting queue, to be recomputed (its prefix may still be
in the cache), or with preemption_mode="swap" its blocks move to a CPU pool
(nanovllm/core/swap.py). The block copies a step needs travel in its batch to the model runner.

`schedule` records each step's progress at once, with a placeholder for every token it samples (with
async_scheduling the engine launches a step before the tokens of the step before are known:
nanovllm/worker/run_ahead.py); `update` puts the tokens in place when they arrive and frees the
sequences that end.
"""
from collections import deque
from dataclasses import dataclass, field

from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence, SequenceStatus, placeholder


@dataclass
class ScheduledBatch:
    """One step. Sequence i computes num_new_tokens[i] tokens from position starts[i] and samples
    num_samples[i] tokens: 0 for a chunk short of the prompt's end, n for the end of a new n-sample
    request's prompt (its other samples fork from it). Sequences with one new token come first. The
    block copies run before the forward pass, in the order they were made."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)
    sampled: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, row, position)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu block, gpu block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)    # copy-on-write (src, dst)
    slot: int = 0  # where its samples go among the model runner's (worker/run_ahead.py)


def runnable(seq: Sequence, decodes: bool) -> bool:
    """Whether the sequence has a token to compute (with decodes=False: one that is not a decode,
    i.e. not only the token it sampled last). One whose pending token is its last (it reached
    max_tokens or max_model_len) has none: `update` ends it when the token arrives."""
    num_tokens = len(seq.token_ids)
    if num_tokens - seq.num_computed_tokens != 1 or num_tokens == seq.num_prompt_tokens:
        return seq.num_computed_tokens < num_tokens
    return decodes and num_tokens < seq.max_len


class Scheduler:
    def __init__(self, config: Config, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.swap = None  # a Swapper (nanovllm/core/swap.py) with preemption_mode="swap"
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_launched = 0  # steps the engine launched (worker/run_ahead.py's slots)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or (self.swap and self.swap.swapped))

    def schedule(self) -> ScheduledBatch:
        """The next step's sequences, with their progress recorded."""
        batch = ScheduledBatch()
        self.budget = self.config.max_num_batched_tokens
        self.rows = self.config.max_num_seqs  # sample rows left (forks may outgrow admission's)
        if self.swap is not None:
            self.swap.swap_in(self, batch)
        self._schedule_running(batch, decodes=not self.config.prefill_first)
        self._schedule_waiting(batch)
        if self.config.prefill_first and not batch.seqs:  # nothing to prefill: a decode step
            self._schedule_running(batch, decodes=True)
        self._record(batch)
        return batch

    def _add(self, batch: ScheduledBatch, seq: Sequence):
        n = min(len(seq.token_ids) - seq.num_computed_tokens, self.budget)
        self.budget -= n
        self.rows -= seq.params.n if len(seq.group) == 1 else 1  # n: its samples fork at the end
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        self.block_manager.cache_computed_blocks(seq, seq.num_computed_tokens + n)

    def _schedule_running(self, batch: ScheduledBatch, decodes: bool):
        """Every running sequence with a token to compute, while the budget lasts; a group without
        blocks for its next tokens preempts the newest group (itself, if it is the newest)."""
        by_group: dict[Sequence, list[Sequence]] = {}  # by group's root, oldest group first
        for seq in self.running:
            by_group.setdefault(seq.group[0], []).append(seq)
        groups, kept, blocks = deque(by_group.values()), [], self.block_manager
        # blocks for every running sequence's tokens: then no group needs checking on its own
        fits = blocks.num_blocks_to_append(self.running) <= blocks.num_free_blocks
        while groups:
            group = groups.popleft()
            kept.append(group)
            seqs = [s for s in group if runnable(s, decodes)]
            rows = len(seqs) if len(group[0].group) > 1 else group[0].params.n
            if not seqs or self.budget < len(seqs) or self.rows < rows:
                continue
            while not fits and blocks.num_blocks_to_append(seqs) > blocks.num_free_blocks:
                victim = groups.pop() if groups else kept.pop()
                self.preempt(victim, batch)
                if victim is group:
                    break
            else:
                for seq in seqs:
                    batch.copies += self.block_manager.append_blocks(seq)
                    self._add(batch, seq)
        self.running = deque(s for group in kept for s in group)

    def _schedule_waiting(self, batch: ScheduledBatch):
        """Admit waiting sequences, first come first served, while the budget, max_num_seqs and the
        free blocks last (swapped groups come back before anything new takes blocks)."""
        while self.waiting and self.budget > 0 and not (self.swap and self.swap.swapped):
            seq = self.waiting[0]
            width = max(seq.params.n, seq.beam_width) if len(seq.group) == 1 else 1  # forks later
            if (len(self.running) + width > self.config.max_num_seqs or width > self.rows
                    or not seq.block_table and not self.allocate(seq)):
                break  # no room for its sequences, or no blocks for its tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq)

    def allocate(self, seq: Sequence) -> bool:
        if len(seq.group) == 1:
            return self.block_manager.allocate(seq)
        from nanovllm.core.sharing import allocate_group  # a group of samples or beams
        return allocate_group(self.block_manager, seq)

    def _record(self, batch: ScheduledBatch):
        """Order the batch (one-token sequences first, longest context first: the attention kernels
        finish with the short ones) and record its progress, with a placeholder for each sampled
        token; the other samples of a new n-sample request fork now, each with its own row."""
        batch.slot = self.num_launched % (self.config.steps_ahead + 1)  # (run_ahead.py)
        first = batch.slot * self.config.max_num_seqs  # its first sample's index there
        pairs = list(zip(batch.seqs, batch.num_new_tokens))
        decodes = sorted((s for s, n in pairs if n == 1), key=len, reverse=True)
        batch.seqs = decodes + [s for s, n in pairs if n > 1]
        batch.num_new_tokens = [1] * len(decodes) + [n for _, n in pairs if n > 1]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            batch.starts.append(seq.num_computed_tokens)
            seq.num_computed_tokens += n
            position = len(seq.token_ids)
            samples = [seq] if seq.num_computed_tokens == position else []  # at its last token
            if samples and len(seq.group) == 1 and seq.params.n > 1:  # the other samples fork now
                from nanovllm.core.sharing import fork
                samples += [fork(seq, self.block_manager) for _ in range(seq.params.n - 1)]
                self.running.extend(samples[1:])
            for sample in samples:
                row = len(batch.sampled)
                batch.sampled.append((sample, row, position))
                if not sample.beam_width:  # a beam gets candidates instead
                    sample.token_ids.append(placeholder(first + row))
            batch.num_samples.append(len(samples))

    def preempt(self, group: list[Sequence], batch: ScheduledBatch):
        """Preempt a running group as a whole: swap it out (swap mode, while the CPU pool has room),
        else free its blocks and requeue it at the front of the waiting queue, to be recomputed."""
        self.num_preemptions += 1
        if self.swap is not None and self.swap.swap_out(group, batch):
            return
        for seq in reversed(group):
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def update(self, batch: ScheduledBatch, token_ids: list[int], logprobs: list | None,
               is_finished) -> list[tuple[Sequence, int]]:
        """Put a step's sampled tokens in place of their placeholders (a beam gets its candidates),
        register newly computed blocks in the prefix cache, and free the sequences that
        `is_finished(seq, position)` ends. Returns (sequence, position) of each new token."""
        new_tokens, finished = [], []
        for seq, row, position in batch.sampled:
            if seq.is_finished:
                continue  # it ended at a step before, while this one ran
            if seq.beam_width:
                seq.candidates = logprobs[row]
                continue
            seq.set_token(position, token_ids[row], logprobs[row] if logprobs else None)
            new_tokens.append((seq, position))
            if is_finished(seq, position):
                del seq.token_ids[position + 1:]  # the placeholders of the steps launched after it
                finished.append(seq)
        for seq in batch.seqs:
            if seq.status == SequenceStatus.RUNNING:  # not preempted meanwhile
                self.block_manager.cache_computed_blocks(seq, seq.num_computed_tokens)
        self.finish(finished)
        return new_tokens

    def finish(self, seqs: list[Sequence]):
        """Free finished sequences and drop them from the queues (one preempted while its last token
        was being sampled, or aborted before it ran, is waiting or swapped). The waiting queue,
        thousands long under load, is walked only when one of them waited."""
        waited = any(seq.status == SequenceStatus.WAITING for seq in seqs)
        for seq in seqs:
            if seq.status == SequenceStatus.SWAPPED:
                self.swap.drop(seq)
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
        if seqs:
            self.running = deque(s for s in self.running if not s.is_finished)
        if waited:
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
