"""Requests that end early, and steps whose tokens are lost.

A caller may abort a request wherever it is (`abort`). A step that failed to launch (an exception,
or Ctrl-C, inside the model runner), or whose tokens the host was interrupted waiting for, leaves
what scheduling it recorded: placeholders for tokens nobody will read, progress that does not count,
blocks registered in the prefix cache, block copies and swaps to forget. Its sequences, and the
groups it swapped in or out, are preempted by recomputation (the vLLM paper, section 4.5): they wait
again with their real tokens and no KV, so requests that other callers queued go on with the tokens
they would have had.
"""
import time
from collections import deque

from nanovllm.core.scheduler import ScheduledBatch, Scheduler
from nanovllm.core.sequence import SequenceStatus


def requeue(scheduler: Scheduler, batches: list[ScheduledBatch]):
    """Undo what scheduling the batches recorded (in launch order), for batches whose tokens will
    never be read: never launched, or lost while the host waited for them."""
    blocks = scheduler.block_manager
    size = blocks.block_size
    for batch in batches:
        for seq, _, position in batch.sampled:  # the steps' placeholders
            del seq.token_ids[position:]
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            forget(blocks, seq.block_table[start // size:(start + n) // size])
    groups = {id(seq.group): seq.group for batch in batches for seq in batch.seqs}
    swapped_in = {gpu for batch in batches for _, gpu in batch.swap_in}  # blocks they filled
    swapped_out = {cpu for batch in batches for _, cpu in batch.swap_out}
    for seq in scheduler.running:
        if swapped_in.intersection(seq.block_table):
            groups[id(seq.group)] = seq.group
    for group in scheduler.swap.swapped if scheduler.swap else []:
        if any(swapped_out.intersection(seq.block_table) for seq in group):
            groups[id(group)] = group
    for group in groups.values():
        for seq in reversed(group):
            if seq.is_finished or seq.status == SequenceStatus.WAITING:
                continue
            if seq.status == SequenceStatus.SWAPPED:
                scheduler.swap.drop(seq)
            scheduler.block_manager.free(seq)
            seq.block_table, seq.num_computed_tokens = [], 0
            seq.status = SequenceStatus.WAITING
            scheduler.waiting.appendleft(seq)
    scheduler.running = deque(s for s in scheduler.running if s.status == SequenceStatus.RUNNING)


def forget(blocks, block_ids: list[int]):
    """Take out of the prefix cache the blocks a step registered as it was scheduled
    (BlockManager.cache_computed_blocks): their K/V may never be computed."""
    for block in (blocks.blocks[b] for b in block_ids):
        if block.key is not None and blocks.cached_blocks.get(block.key) == block.block_id:
            del blocks.cached_blocks[block.key]
        block.key = block.content_id = None


def abort(engine, request_id) -> bool:
    """End a request at once with finish_reason "abort" and free its blocks (LLMEngine's
    abort_request)."""
    root = engine.requests.pop(request_id, None)
    if root is None:
        return False
    live = [seq for seq in root.group if not seq.is_finished]
    for seq in live:
        seq.finish_reason = "abort"
        while seq.token_ids[-1] < 0:  # placeholders of steps in flight: never filled now
            seq.token_ids.pop()
    engine.scheduler.finish(live)
    # nothing more of it
    engine.held = [out for out in engine.held if out.request_id != request_id]
    if root.metrics is not None:
        root.metrics.finished_time = time.monotonic()
    return True


def abort_all(engine) -> list:
    """After a step failed: end every request (`abort`) and drop what was launched and held; the
    ids of the requests ended."""
    ended = list(engine.requests)
    for request_id in ended:
        abort(engine, request_id)
    engine.in_flight.clear()
    engine.held = []
    return ended


def lose(engine, batches: list[ScheduledBatch], outputs: list):
    """Steps whose tokens will not be read (the one the host waited for, and those launched after
    it, which took those tokens on the device): their sequences start over; the outputs so far wait
    for the next step()."""
    requeue(engine.scheduler, batches)
    engine.in_flight.clear()
    engine.held = outputs
