"""A trace of every engine step: the paged KV cache's block tables and block events, as the vLLM
paper draws them (Figures 6 to 9: logical to physical blocks, sharing by reference count, copy on
write, swapping), recorded from a real run. `nanovllm.viz` draws a trace as a page.

    with llm.trace("run.json"):
        llm.generate(...)       # any engine driving inside the block is traced

While a trace is open it is one of the engine's observers: the engine calls
`Trace.launched(batch)` once per step, once the scheduler has built the batch and the model runner
has launched it. The trace reads the engine's state (the running, waiting and swapped sequences'
block tables, the prefix cache) and works out the events by comparing it with the state it read at
the step before: only changes are stored. With no trace open (and no log_stats) what the engine
does for observers is loop over an empty list.

The file (JSON, one object):

    format       "nanovllm-trace", version 1
    num_blocks, block_size, num_cpu_blocks (0 without swap), preemption_mode, model
    start        the state when the trace opened: {"tables", "cpu_tables", "cached"} (as below)
    seqs         {seq id: {"request": request id, "sample": index in its request,
                  "parent": seq id it forked from or null, "beam": bool, "prompt": its first
                  120 characters (text, or token ids), "num_prompt_tokens"}}
    steps        a list, one entry per step:
      step       the step's index
      t, dt      seconds since the trace opened, and since the step before (launch to launch, host
                 time: with run-ahead the GPU time of a step is not known when the next launches)
      batch      [[seq id, "prefill" or "decode", new tokens, start position, tokens sampled]]
      tables     {seq id: block table (physical block ids, logical order) or null (dropped)}: the
                 GPU tables that changed since the step before
      cpu_tables the same for swapped-out sequences' tables of CPU blocks
      events     [[kind, block or null, seq id or null, extra]], in this order of kinds:
                   finish   a sequence ended; extra: its finish reason ("pruned": a beam let go)
                   preempt  one per sequence of the preempted group; extra: "recompute" (its
                            blocks freed) or "swap"
                   free     a table let go of the block; extra: the block's reference count
                            after the step
                   swap_out the block moved to the CPU pool; extra: its CPU block
                   swap_in  a CPU block came back; extra: the CPU block
                   fork     a sequence forked; extra: its parent (seq-level, block null)
                   share    the fork shares the block with its parent; extra: the parent
                   evict    the block's cached prefix was dropped (the block was taken for new data)
                   hit      a prefix-cache hit: the block's K/V are reused, not computed
                   alloc    a fresh block for new tokens
                   cow      copy on write: the block is a copy of the block in extra
                   cached   the block was registered in the prefix cache (as the step that
                            computes its K/V is scheduled: sequences admitted after it, in that
                            step too, hit it)
      num_free   free GPU blocks after the step's scheduling (cached free ones included)
      running, waiting, swapped  sequences in each queue
    end          a last entry like a step's (no batch): what changed after the last step

State at step i = `start` with the tables of steps 0..i applied; a block's reference count is the
number of GPU tables that hold it, a block is free at count 0, and `cached` is the set of blocks
the prefix cache can find (the cached-free blocks are both). `replay(trace, i)` computes it.
Events are the net change between two steps: a block registered in the cache and taken for new
data between the same two steps shows as allocated only.
"""
import json
import time

from nanovllm.core.sequence import SequenceStatus, num_blocks_for

EVENT_ORDER = ("finish", "preempt", "free", "swap_out", "swap_in", "fork", "share", "evict", "hit",
               "alloc", "cow", "cached")


class EngineState:
    """What the trace reads from the engine at one step."""

    def __init__(self, engine):
        scheduler, bm = engine.scheduler, engine.block_manager
        swapped = [s for g in scheduler.swap.swapped for s in g] if scheduler.swap else []
        live = list(scheduler.running) + list(scheduler.waiting) + swapped
        self.seqs = {s.seq_id: s for s in live}
        self.tables = {s.seq_id: tuple(s.block_table) for s in live
                       if s.block_table and s.status != SequenceStatus.SWAPPED}
        self.cpu_tables = {s.seq_id: tuple(s.block_table) for s in swapped}
        # block -> the name of what it caches: one taken for new data and registered again in a
        # step (the scheduler registers blocks as it schedules them) is evicted, then cached
        self.cached = {b: bm.blocks[b].content_id for b in bm.cached_blocks.values()}
        self.num_free = bm.num_free_blocks
        self.counts = len(scheduler.running), len(scheduler.waiting), len(swapped)


class Trace:
    """Records every step of `engine` while open, and writes the trace to `path` when closed."""

    def __init__(self, engine, path):
        self.engine, self.path = engine, path

    def __enter__(self):
        if any(isinstance(o, Trace) for o in self.engine.observers):
            raise RuntimeError("a trace is already open on this engine")
        config, swap = self.engine.config, self.engine.scheduler.swap
        self.state = EngineState(self.engine)
        self.data = {
            "format": "nanovllm-trace", "version": 1,
            "num_blocks": len(self.engine.block_manager.blocks),
            "block_size": config.kvcache_block_size,
            "num_cpu_blocks": len(swap.cpu_ref_counts) if swap else 0,
            "preemption_mode": config.preemption_mode, "model": str(config.model),
            "start": {"tables": _lists(self.state.tables),
                      "cpu_tables": _lists(self.state.cpu_tables),
                      "cached": sorted(self.state.cached)},
            "seqs": {}, "steps": [], "end": None,
        }
        for seq in self.state.seqs.values():
            self._describe(seq, None)
        self.t0 = self.last_t = time.perf_counter()
        self.engine.observers.append(self)
        return self

    def __exit__(self, *exc):
        self.engine.observers.remove(self)
        if self.engine.scheduler is not None:
            self.data["end"] = self._diff(None)
        with open(self.path, "w") as f:
            json.dump(self.data, f, separators=(",", ":"))

    def arrived(self, seq):
        """A request queued: its sequence shows at the next step."""

    def read(self, new_tokens, outputs):
        """A step's tokens read: what they change shows at the next step."""

    def launched(self, batch):
        """Record a step (the engine calls this once the step is launched)."""
        now = time.perf_counter()
        entry = {"step": len(self.data["steps"]), "t": round(now - self.t0, 6),
                 "dt": round(now - self.last_t, 6)}
        self.last_t = now
        entry.update(self._diff(batch))
        self.data["steps"].append(entry)

    def _describe(self, seq, parent):
        prompt = seq.prompt if seq.prompt is not None else str(seq.prompt_token_ids[:40])
        self.data["seqs"][str(seq.seq_id)] = {
            "request": seq.request_id, "sample": seq.sample_index, "parent": parent,
            "beam": bool(seq.beam_width), "prompt": prompt[:120],
            "num_prompt_tokens": seq.num_prompt_tokens}

    def _diff(self, batch) -> dict:
        """The changes from the state read at the step before to the engine's state now."""
        old, new = self.state, EngineState(self.engine)
        self.state = new
        copies = {dst: src for src, dst in batch.copies} if batch else {}
        swapped_in = {gpu for _, gpu in batch.swap_in} if batch else set()
        events = []
        for seq_id, seq in old.seqs.items():  # sequences that ended or were preempted
            if seq.status == SequenceStatus.FINISHED:
                events.append(["finish", None, seq_id, seq.finish_reason or "pruned"])
            elif seq_id in old.tables and seq_id not in new.tables:
                mode = "swap" if seq_id in new.cpu_tables else "recompute"
                events.append(["preempt", None, seq_id, mode])
        refs = {}
        for table in new.tables.values():
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        for seq_id, table in old.tables.items():  # blocks let go (swapped out ones: below)
            kept = new.tables.get(seq_id, ())
            for i, b in enumerate(table):
                if seq_id in new.cpu_tables or (i < len(kept) and (kept[i] == b
                                                                 or kept[i] in copies)):
                    continue  # kept, swapped out (below), or a copy's source (see cow)
                events.append(["free", b, seq_id, refs.get(b, 0)])
        if batch:
            events += [["swap_out", gpu, None, cpu] for gpu, cpu in batch.swap_out]
            events += [["swap_in", gpu, None, cpu] for cpu, gpu in batch.swap_in]
        # blocks a sequence admitted in this step found cached: those before its first new token
        size, hits = self.data["block_size"], {}
        for seq, start in zip(batch.seqs, batch.starts) if batch else ():
            hits[seq.seq_id] = num_blocks_for(start, size)
        for seq_id, table in new.tables.items():  # blocks taken
            events += self._taken(new.seqs[seq_id], old, table, copies, swapped_in,
                                  hits.get(seq_id, 0))
        events += [["evict", b, None, None] for b in sorted(old.cached)
                   if new.cached.get(b) != old.cached[b]]
        events += [["cached", b, None, None] for b in sorted(new.cached)
                   if old.cached.get(b) != new.cached[b]]
        events.sort(key=lambda e: EVENT_ORDER.index(e[0]))
        entry = {"tables": _changed(old.tables, new.tables),
                 "cpu_tables": _changed(old.cpu_tables, new.cpu_tables), "events": events,
                 "num_free": new.num_free, "running": new.counts[0], "waiting": new.counts[1],
                 "swapped": new.counts[2]}
        if batch is not None:
            entry["batch"] = [
                [seq.seq_id, "prefill" if start < seq.num_prompt_tokens else "decode", n, start, k]
                for seq, n, start, k in zip(batch.seqs, batch.num_new_tokens, batch.starts,
                                            batch.num_samples)]
        for seq in new.seqs.values():
            if str(seq.seq_id) not in self.data["seqs"]:
                self._describe(seq, None)
        return entry

    def _taken(self, seq, old, table, copies, swapped_in, num_hits: int) -> list:
        """Events of the blocks in a sequence's table now that were not there at the step before."""
        seq_id, events = seq.seq_id, []
        before = old.tables.get(seq_id, ())
        parent = None
        new_fork = seq is not seq.group[0] and str(seq_id) not in self.data["seqs"]
        if new_fork and seq_id not in old.seqs:
            parent = self._parent(seq, old, table, copies)
            self._describe(seq, parent)
            events.append(["fork", None, seq_id, parent])
        origin = [copies.get(b, b) for b in table]
        parent_table = old.tables.get(parent) or self.state.tables.get(parent, ())
        shared = _common_prefix(origin, parent_table)
        admitted = not before and seq_id not in old.cpu_tables and parent is None
        for i, b in enumerate(table):
            if i < len(before) and before[i] == b or b in swapped_in:
                continue
            if b in copies:  # a copy's destination is a fresh block in one table: this one
                events.append(["cow", b, seq_id, copies[b]])
            elif parent is not None and i < shared:
                events.append(["share", b, seq_id, parent])
            elif admitted and i < num_hits:
                events.append(["hit", b, seq_id, None])
            else:
                events.append(["alloc", b, seq_id, None])
        return events

    def _parent(self, seq, old, table, copies):
        """The group member a new fork shares the longest run of leading blocks with."""
        origin = [copies.get(b, b) for b in table]
        best, best_len = None, -1
        for member in seq.group:
            if member is seq or member.seq_id == seq.seq_id:
                continue
            theirs = old.tables.get(member.seq_id) or self.state.tables.get(member.seq_id, ())
            n = _common_prefix(origin, theirs)
            if n > best_len:
                best, best_len = member.seq_id, n
        return best


def _common_prefix(a, b) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _lists(tables: dict) -> dict:
    return {str(k): list(v) for k, v in tables.items()}


def _changed(old: dict, new: dict) -> dict:
    """Tables that differ: the new table, or None where a sequence's table was dropped."""
    out = {str(k): list(v) for k, v in new.items() if old.get(k) != v}
    out.update({str(k): None for k in old if k not in new})
    return out


def replay(trace: dict, step: int) -> dict:
    """The state after step `step` (-1: at the start; len(steps): after `end`): GPU and CPU tables,
    each block's reference count, the cached blocks and the free ones."""
    tables, cpu_tables = dict(trace["start"]["tables"]), dict(trace["start"]["cpu_tables"])
    cached = set(trace["start"]["cached"])
    entries = trace["steps"][:step + 1] + ([trace["end"]] if step >= len(trace["steps"]) else [])
    for entry in entries:
        for dest, changes in ((tables, entry["tables"]), (cpu_tables, entry["cpu_tables"])):
            for seq_id, table in changes.items():
                if table is None:
                    dest.pop(seq_id, None)
                else:
                    dest[seq_id] = table
        for kind, block, _, _ in entry["events"]:
            if kind == "evict":
                cached.discard(block)
            elif kind == "cached":
                cached.add(block)
    refs = [0] * trace["num_blocks"]
    for table in tables.values():
        for b in table:
            refs[b] += 1
    return {"tables": tables, "cpu_tables": cpu_tables, "ref_counts": refs, "cached": cached,
            "free": {b for b, r in enumerate(refs) if r == 0}}
