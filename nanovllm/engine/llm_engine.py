"""The engine loop: `add_request` queues a request, `step` runs one iteration of continuous
batching.

A step schedules a batch (nanovllm/core/scheduler.py), launches it on the model runner, reads its
sampled tokens and hands them to the scheduler, which ends the sequences the output processor says
are done. With async_scheduling (vLLM's name, the default on CUDA) it reads the tokens of the step
launched run_ahead_steps before instead, while the later ones run (run-ahead:
nanovllm/worker/run_ahead.py). Requests come in through the input processor and leave through the
output processor as RequestOutputs. With tensor_parallel_size > 1 the engine also starts one
worker process per extra rank; `shutdown()` (or leaving a `with LLM(...)` block, or the engine
being collected, or the program's exit) stops them. Started by torchrun, the engine is rank 0 and
torchrun's other ranks are its workers: on them, `start_workers` runs rank 0's steps and then exits
the process (nanovllm/worker/torchrun.py).
"""
import gc
from collections import deque
from contextlib import AbstractContextManager

from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import ScheduledBatch, Scheduler
from nanovllm.core.sequence import Sequence
from nanovllm.engine.input_processor import InputProcessor, load_tokenizer
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.worker.model_runner import ModelRunner
from nanovllm.worker.run_ahead import SampledTokens


class LLMEngine(AbstractContextManager):
    def __init__(self, model: str, **options):
        self.config = config = Config.from_options(model, **options)
        tokenizer = config.tokenizer or model
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(tokenizer)
        self.stop_workers = None  # tensor parallelism's worker processes, while they run
        if config.tensor_parallel_size > 1:
            from nanovllm.worker.distributed import start_workers
            self.model_runner = start_workers(self)
        else:
            self.model_runner = ModelRunner(config)
        num_blocks = self.model_runner.kv_cache.shape[2]
        block_size, caching = config.kvcache_block_size, config.enable_prefix_caching
        self.block_manager = BlockManager(num_blocks, block_size, caching)
        if config.kv_reservation is not None:  # the paper's Orca baselines: core/reservation.py
            from nanovllm.core.reservation import ReservingBlockManager
            self.block_manager = ReservingBlockManager(num_blocks, config)
        self.scheduler = Scheduler(config, self.block_manager)
        if config.preemption_mode == "swap":
            from nanovllm.core.swap import Swapper
            swap_space = self.model_runner.swap_space
            self.scheduler.swap = Swapper(self.block_manager, swap_space.num_blocks)
        self.input_processor = InputProcessor(config, self.tokenizer, num_blocks)
        self.output_processor = OutputProcessor(config, self.tokenizer)
        self.model_runner.eos_token_ids = self.output_processor.eos_token_ids
        self.requests: dict[int | str, Sequence] = {}  # request id -> root sequence, until it ends
        self.in_flight = deque()  # (batch, tokens) launched and not read yet, oldest first
        self.held: list[RequestOutput] = []  # outputs a caller's generate() did not ask for
        # what sees each request queued, step launched and step read: with log_stats, the request
        # timings and token counts (engine/metrics.py); an open Trace (nanovllm/trace.py)
        self.observers: list = []
        if config.log_stats:
            from nanovllm.engine.metrics import Stats
            self.observers.append(Stats())

    def shutdown(self):
        """Stop the tensor-parallel workers and free the model, its KV cache and the rendezvous
        port."""
        if self.stop_workers is not None:
            self.stop_workers()  # runs Workers.shutdown once
        if self.model_runner is not None:  # free the pools now, even if the model outlives us
            self.model_runner.graphs = None
            self.model_runner.kv_cache.allocate(0)
        self.model_runner, self.in_flight = None, deque()
        gc.collect()  # the model's modules hold reference cycles: free their memory now

    def __exit__(self, *exc):  # (contextlib's __enter__ returns the engine)
        self.shutdown()

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: int | str | None = None) -> int | str:
        """Queue a request (a string, token ids, or {"prompt": ...} / {"prompt_token_ids": ...});
        returns its id. A request that can never run is a ValueError, and nothing is queued."""
        self.check_open(request_id)
        return self.queue(self.input_processor.make_sequence(prompt, sampling_params), request_id)

    def check_open(self, request_id: int | str | None = None):
        """A RuntimeError once the engine is shut down; a ValueError for a request id in use."""
        if self.model_runner is None:
            raise RuntimeError("the engine was shut down")
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already queued")

    def queue(self, seq: Sequence, request_id: int | str | None = None) -> int | str:
        """Queue a sequence that the input processor made (`make_sequence`, which a server runs on
        a thread of its own); returns the request's id."""
        self.check_open(request_id)
        seq.request_id = seq.seq_id if request_id is None else request_id
        self.requests[seq.request_id] = seq
        self.scheduler.waiting.append(seq)
        for observer in self.observers:
            observer.arrived(seq)
        return seq.request_id

    def abort_request(self, request_id: int | str) -> bool:
        """End a request at once, wherever it is (waiting, running, swapped out), with finish_reason
        "abort", and free its blocks. False if no such request is queued."""
        from nanovllm.core.requeue import abort
        return abort(self, request_id)

    def step(self) -> list[RequestOutput]:
        """One iteration: a RequestOutput for each request that got new tokens (its text and tokens
        so far, or only the new ones with output_kind="delta", or only at its end with "final")."""
        self.check_open()
        launched = self.launch()
        ahead = len(self.in_flight) - 1  # nothing launched: read the oldest step
        if launched:
            ahead = 0 if needs_tokens(launched) else self.config.steps_ahead
        outputs, self.held = self.held, []
        try:
            while self.in_flight and (len(self.in_flight) > ahead or ended(self.in_flight[0][0])):
                outputs += self.read_step(*self.in_flight[0])
                self.in_flight.popleft()
        except BaseException:  # interrupted while waiting: those tokens are lost (requeue.py)
            from nanovllm.core.requeue import lose
            lose(self, [batch for batch, _ in self.in_flight], outputs)
            raise
        return outputs

    def launch(self) -> ScheduledBatch | None:
        """Schedule a step and launch it on the model runner, without waiting for the GPU (into
        in_flight, with its sampled tokens); the batch, or None if there is nothing to run. A step
        that fails to launch is undone: its sequences start over (requeue.py)."""
        batch = self.scheduler.schedule() if self.scheduler.has_unfinished() else None
        if batch is None or not (batch.seqs or batch.swap_in or batch.swap_out):
            return None  # (a step may only move blocks)
        try:
            sampled = self.model_runner.run(batch)
        except BaseException:
            from nanovllm.core.requeue import requeue
            requeue(self.scheduler, [batch])
            raise
        self.scheduler.num_launched += 1  # the next step's samples take the next slot
        self.in_flight.append((batch, SampledTokens(*sampled)))
        for observer in self.observers:  # a launched step (one that failed is not recorded)
            observer.launched(batch)
        return batch

    def read_step(self, batch: ScheduledBatch, sampled: SampledTokens) -> list[RequestOutput]:
        """Wait for a launched step's sampled tokens and record them; the requests' outputs."""
        new_tokens = self.scheduler.update(batch, sampled.tolist(), sampled.logprobs,
                                           self.output_processor.check_stop)
        outputs = self.output_processor.outputs(new_tokens)
        for observer in self.observers:
            observer.read(new_tokens, outputs)
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    def is_finished(self) -> bool:
        return not self.scheduler.has_unfinished() and not self.in_flight and not self.held

    def get_stats(self) -> dict:
        """Requests running, waiting and swapped out; KV blocks used and in all; preemptions; with
        log_stats=True also the prefix cache's hit rate (prompt tokens served from it), prompt
        tokens admitted and tokens generated."""
        from nanovllm.engine.stats import engine_stats
        return engine_stats(self)


def needs_tokens(batch: ScheduledBatch) -> bool:
    """Whether the host needs a step's tokens now (beam candidates, log-probabilities): no step
    will take them on the device."""
    return any(seq.beam_width or seq.params.logprobs is not None for seq in batch.seqs)


def ended(batch: ScheduledBatch) -> bool:
    """Whether nobody waits for a step's tokens: all its samples' sequences ended at a step before
    (read at once, the engine then holds nothing for them)."""
    return bool(batch.sampled) and all(seq.is_finished for seq, _, _ in batch.sampled)
