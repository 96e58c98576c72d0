"""Helpers of the trace tests: the demo's workload traced, with the engine's own state read at every
step beside the trace (what replaying the trace must give back)."""
from benchmarks.trace_demo import DEMO_OPTIONS, SWAP_OPTIONS, run_workload  # noqa: F401
from nanovllm.engine.sequence import SequenceStatus
from nanovllm.trace import Trace


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

    def on_step(self, batch):
        super().on_step(batch)
        self.truth.append(engine_truth(self.engine))
        self.batches.append({"copies": list(batch.copies), "swap_in": list(batch.swap_in),
                             "swap_out": list(batch.swap_out)})

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.truth.append(engine_truth(self.engine))  # after `end`
