"""Helpers of the trace tests: the demo's workload traced, with the engine's own state read at every
step beside the trace (what replaying the trace must give back)."""
import math
import random

from benchmarks.trace_demo import DEMO_OPTIONS, SWAP_OPTIONS, run_workload  # noqa: F401
from nanovllm.core.sequence import SequenceStatus
from nanovllm.trace import EVENT_ORDER, Trace


def engine_truth(engine) -> dict:
    """The block manager's and the scheduler's state, read directly: what a replay must equal."""
    scheduler, bm = engine.scheduler, engine.block_manager
    swapped = [s for g in scheduler.swap.swapped for s in g] if scheduler.swap else []
    live = list(scheduler.running) + list(scheduler.waiting) + swapped
    return {
        "tables": {str(s.seq_id): list(s.block_table) for s in live
                   if s.block_table and s.status != SequenceStatus.SWAPPED},
        "cpu_tables": {str(s.seq_id): list(s.block_table) for s in swapped},
        "ref_counts": [b.ref_count for b in bm.blocks],
        "cached": set(bm.cached_blocks.values()),
        "free": set(bm.free_blocks),
        "cached_free": set(bm.cached_blocks.values()) & set(bm.free_blocks),
        "num_cached_tokens": {str(s.seq_id): s.num_cached_tokens for s in live},
        "num_preemptions": scheduler.num_preemptions,
    }


class CheckedTrace(Trace):
    """A Trace that also keeps, at every step, the engine's own state and the step's batch."""

    def __enter__(self):
        self.truth, self.batches = [], []
        return super().__enter__()

    def launched(self, batch):
        super().launched(batch)
        self.truth.append(engine_truth(self.engine))
        self.batches.append({"copies": list(batch.copies), "swap_in": list(batch.swap_in),
                             "swap_out": list(batch.swap_out)})

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.truth.append(engine_truth(self.engine))  # after `end`


def synthetic_trace(num_blocks: int, num_steps: int, seed: int = 0) -> dict:
    """A large trace in the file format without running a model: sequences arrive, grow a block
    at a time, fork (sharing all their blocks) and finish, keeping most of the blocks in use."""
    rng = random.Random(seed)
    free, refs, tables, seqs, steps = list(range(num_blocks)), [0] * num_blocks, {}, {}, []
    rng.shuffle(free)

    def take(seq_id, events):
        b = free.pop()
        refs[b] += 1
        events.append(["alloc", b, seq_id, None])
        return b
    for step in range(num_steps):
        events, changed = [], {}
        for seq_id in [s for s in tables if rng.random() < 0.004]:  # finish
            events.append(["finish", None, seq_id, "length"])
            for b in tables.pop(seq_id):
                refs[b] -= 1
                events.append(["free", b, seq_id, refs[b]])
                if refs[b] == 0:
                    free.append(b)
            changed[str(seq_id)] = None
        for seq_id in list(tables):  # grow
            if rng.random() < 0.05 and free:
                tables[seq_id] = tables[seq_id] + [take(seq_id, events)]
                changed[str(seq_id)] = tables[seq_id]
        while len(free) > num_blocks // 8:  # arrive, or fork
            seq_id = len(seqs)
            parent = rng.choice(list(tables)) if tables and rng.random() < 0.2 else None
            request = seqs[str(parent)]["request"] if parent is not None else f"req-{seq_id}"
            seqs[str(seq_id)] = {"request": request, "sample": 0, "parent": parent, "beam": False,
                                 "prompt": f"prompt {seq_id}", "num_prompt_tokens": 64}
            if parent is not None:
                tables[seq_id] = list(tables[parent])
                for b in tables[seq_id]:
                    refs[b] += 1
                events.append(["fork", None, seq_id, parent])
            else:
                tables[seq_id] = [take(seq_id, events) for _ in range(rng.randint(1, 8))]
            changed[str(seq_id)] = tables[seq_id]
        batch = [[s, "decode", 1, 100, 1] for s in list(tables)[:64]]
        steps.append({"step": step, "t": step * 0.01, "dt": 0.01, "batch": batch, "tables": changed,
                      "cpu_tables": {}, "events": events, "num_free": len(free),
                      "running": len(tables), "waiting": 0, "swapped": 0})
    return {"format": "nanovllm-trace", "version": 1, "num_blocks": num_blocks, "block_size": 16,
            "num_cpu_blocks": 0, "preemption_mode": "recompute", "model": "synthetic",
            "start": {"tables": {}, "cpu_tables": {}, "cached": []}, "seqs": seqs, "steps": steps,
            "end": None}


def long_trace(num_steps: int, num_blocks: int = 64, seed: int = 0) -> dict:
    """A long trace in the file format, kept small per step: requests arrive in waves (a prefill
    step, then decode steps in batches of at most 4, a block every 16 tokens), finish, or are
    preempted (their blocks freed) when a growing request finds no free block."""
    rng, block_size = random.Random(seed), 16
    free, seqs, steps = list(range(num_blocks)), {}, []
    running = []  # [seq id, table, tokens so far, tokens to reach]
    for step in range(num_steps):
        events, changed, batch = [], {}, []
        wave = 0.5 + 0.45 * math.sin(2 * math.pi * step / max(1, num_steps // 5))
        if len(running) < 4 and rng.random() < 0.05 * wave:  # a request arrives: its prefill
            seq_id, prompt = len(seqs), rng.randint(8, 120)
            need = -(-prompt // block_size)
            if len(free) >= need:
                seqs[str(seq_id)] = {"request": f"req-{seq_id}", "sample": 0, "parent": None,
                                     "beam": False, "prompt": f"prompt {seq_id}",
                                     "num_prompt_tokens": prompt}
                table = [free.pop() for _ in range(need)]
                events += [["alloc", b, seq_id, None] for b in table]
                running.append([seq_id, table, prompt, prompt + rng.randint(4, 400)])
                changed[str(seq_id)] = table
                batch.append([seq_id, "prefill", prompt, 0, 1])
        for seq in list(running):
            seq_id, table, tokens, target = seq
            if any(b[0] == seq_id for b in batch):
                continue
            if tokens == target or tokens % block_size == 0 and not free:
                reason = "length" if tokens == target else None
                events.append(["finish", None, seq_id, reason] if reason else
                              ["preempt", None, seq_id, "recompute"])
                events += [["free", b, seq_id, 0] for b in table]
                free += table
                running.remove(seq)
                changed[str(seq_id)] = None
                continue
            if tokens % block_size == 0:
                table.append(free.pop())
                events.append(["alloc", table[-1], seq_id, None])
                changed[str(seq_id)] = list(table)
            batch.append([seq_id, "decode", 1, tokens, 1])
            seq[2] += 1
        events.sort(key=lambda e: EVENT_ORDER.index(e[0]))
        steps.append({"step": step, "t": round(step * 0.004, 3), "dt": 0.004, "batch": batch,
                      "tables": changed, "cpu_tables": {}, "events": events,
                      "num_free": len(free), "running": len(running), "waiting": 0,
                      "swapped": 0})
    return {"format": "nanovllm-trace", "version": 1, "num_blocks": num_blocks,
            "block_size": block_size, "num_cpu_blocks": 0, "preemption_mode": "recompute",
            "model": "synthetic", "start": {"tables": {}, "cpu_tables": {}, "cached": []},
            "seqs": seqs, "steps": steps, "end": None}


def crowded_workload(llm):
    """Samples (n = 1 to 3) and a beam search at once in a cache too small for them: forks, copies
    on write, preemptions (and swaps) of groups in the same steps."""
    from nanovllm import SamplingParams
    rng = random.Random(1)
    for i in range(5):
        prompt = [rng.randrange(512) for _ in range(rng.randint(10, 30))]
        llm.add_request(prompt, SamplingParams(n=rng.choice([1, 2, 3]), temperature=1.0, seed=i,
                                               max_tokens=24, ignore_eos=True))
    llm.beam_search([[rng.randrange(512) for _ in range(13)]], beam_width=3, max_tokens=12)
    while not llm.is_finished():
        llm.step()
