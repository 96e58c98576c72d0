"""Tensor parallelism's processes: one per rank, rank 0 being the engine's own process.

Rank 0 holds the scheduler and the block manager. Every step it broadcasts a `StepInputs` (plain
lists: token ids, positions, cache slots, block tables) to ranks 1..N-1 over a gloo group; every
rank then runs the same forward pass on its shard of the weights, the layers meeting in
all-reduces (NCCL on GPUs, gloo on CPU), and the LM head gathers the logits to rank 0, which
alone samples. A `None` step tells the workers to stop.

The ranks meet through a TCPStore that rank 0 opens on a port the OS picks, and the process groups
are this engine's own objects, not torch.distributed's one global default group, so two engines
can run side by side in one process. Workers are fresh interpreters running
`python -m nanovllm.worker.tp_worker` (not forked, which CUDA forbids, nor spawned, which would
re-import the user's script): the engine's Config reaches them through the store. They ignore
Ctrl-C (rank 0 stops them) and exit when the engine's process is gone. On CPU every rank, rank 0
included, runs cpu_count // N threads.
"""
import os
import pickle
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.layers.tensor_parallel import heads_per_rank, shard_model
from nanovllm.worker.model_runner import ModelRunner

# Workers wait for the next step for as long as the engine stays idle: no timeout that an idle
# engine could reach. A rank that dies is noticed anyway: gloo reports the closed connection.
IDLE_TIMEOUT = timedelta(days=365)
STARTUP_TIMEOUT = timedelta(seconds=120)  # for a worker to reach the store


@dataclass
class TPGroup:
    """One rank's place in the tensor-parallel group, and the groups it talks through."""
    rank: int
    size: int
    device_group: dist.ProcessGroup  # NCCL on cuda, gloo on cpu: the model's all-reduces and gather
    cpu_group: dist.ProcessGroup     # gloo: rank 0's message of each step
    local_rank: int = 0  # this rank's GPU on its host: cuda:local_rank
    # (rank 0) the workers are waiting for a step, so a message can reach them
    idle: bool = False
    # the dicts that hold this rank's CUDA graphs (the steps' and cascade's twins), which captured
    # device_group collectives
    graphs: list[dict] = field(default_factory=list)

    def send_step(self, step):
        """Rank 0: hand the workers the next forward pass (None: stop)."""
        self.idle = False
        dist.broadcast_object_list([step], group=self.cpu_group, group_src=0)

    def receive_step(self):
        """Ranks 1..N-1: wait for rank 0's next step."""
        box = [None]
        dist.broadcast_object_list(box, group=self.cpu_group, group_src=0)
        return box[0]

    def broadcast(self, tensor: torch.Tensor):
        """Rank 0's tensor to every rank, over the model's group."""
        dist.broadcast(tensor, group=self.device_group, group_src=0)

    def min(self, value: int) -> int:
        """The smallest of every rank's value (the number of KV blocks that fits on all of them)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    def close(self):
        """Shut the groups down; every rank does it at once. NCCL frees a communicator only when the
        CUDA graphs that captured its collectives are gone (every one of them: else shutdown waits
        forever), so they go first."""
        for graphs in self.graphs:
            graphs.clear()
        self.device_group.shutdown()
        self.cpu_group.shutdown()

    def abort(self):
        """Close without waiting for the other ranks."""
        for graphs in self.graphs:
            graphs.clear()
        self.device_group.abort()
        self.cpu_group.abort()


class TPModelRunner(ModelRunner):
    """One rank's model runner: its shard of the model (nanovllm/layers/tensor_parallel.py), the KV
    blocks that fit on every rank (rank 0's one block manager hands them out for all), and, on rank
    0, each step sent to the other ranks, which run the same forward pass on their shards."""

    def __init__(self, config: Config, tp: TPGroup):
        self.tp = tp
        device = torch.device("cuda", tp.local_rank) if config.device == "cuda" else None
        super().__init__(config, device)
        tp.idle = True  # every rank is built: the workers now wait for steps

    def heads(self) -> tuple[int, int]:
        return tuple(heads_per_rank(n, self.tp.size) for n in super().heads())

    def build_model(self) -> torch.nn.Module:
        model = super().build_model()
        shard_model(model, self.tp.device_group, self.config.hf_config["num_key_value_heads"])
        return model

    def num_kv_blocks(self) -> int:
        return self.tp.min(super().num_kv_blocks())

    def step_inputs(self, batch):
        step = super().step_inputs(batch)
        self.tp.send_step(step)
        return step

    def run(self, batch):
        sampled = super().run(batch)
        self.tp.idle = True  # the workers are back waiting for a step
        return sampled

    def fill_placeholders(self, input_ids: torch.Tensor):
        """Rank 0 holds the last step's tokens: it fills the ids and sends them to the other
        ranks."""
        if self.tp.rank == 0:
            super().fill_placeholders(input_ids)
        self.tp.broadcast(input_ids)


def _new_group(store: dist.Store, rank: int, size: int, device_type: str) -> dist.ProcessGroup:
    """A process group of our own (not torch.distributed's global default): NCCL on cuda, else
    gloo."""
    backend_type = dist.ProcessGroup.BackendType
    kind = backend_type.NCCL if device_type == "cuda" else backend_type.GLOO
    if device_type == "cuda":
        backend = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
        backend._set_sequence_number_for_group()
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, IDLE_TIMEOUT)
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(kind)
    group._register_backend(torch.device(device_type), kind, backend)
    return group


def join_group(store: dist.Store, rank: int, size: int, device_type: str,
               local_rank: int | None = None) -> TPGroup:
    """Meet the other ranks: one group for the model's tensors, one gloo group for step messages.
    local_rank: the rank's GPU on its host (by default its rank: every rank on one host)."""
    cpu_group = _new_group(dist.PrefixStore("cpu", store), rank, size, "cpu")
    device_group = _new_group(dist.PrefixStore("device", store), rank, size, device_type)
    return TPGroup(rank, size, device_group, cpu_group, rank if local_rank is None else local_rank)


def run_steps(config: Config, group: TPGroup):
    """Ranks 1..N-1: build this rank's shard, then run every step rank 0 sends until it sends
    None."""
    try:
        runner = TPModelRunner(config, group)
        while (step := group.receive_step()) is not None:
            runner.execute(step)
    finally:
        group.close()


def start_workers(engine) -> TPModelRunner:
    """Rank 0's model runner, once ranks 1..N-1 run: processes of its own (`Workers`), or the
    ranks that torchrun started (nanovllm/worker/torchrun.py). The engine's `shutdown()`, the
    engine being collected or the program's exit stop them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun started every rank
        from nanovllm.worker.torchrun import TorchrunWorkers, run_worker, shut_down_at_exit
        if int(os.environ["RANK"]) > 0:
            run_worker(engine.config)  # rank 0's steps until it shuts down, then sys.exit(0)
        engine.workers = TorchrunWorkers(engine.config)
        shut_down_at_exit(engine)
    else:
        engine.workers = Workers(engine.config)
    engine.stop_workers = weakref.finalize(engine, engine.workers.shutdown)
    try:
        return TPModelRunner(engine.config, engine.workers.group)
    except BaseException:
        engine.stop_workers()
        raise


class Workers:
    """Rank 0's side: starts ranks 1..N-1, joins their group, and stops them."""

    def __init__(self, config):
        size = config.tensor_parallel_size
        # port 0: the OS picks a free port, so no two engines ever collide
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=STARTUP_TIMEOUT)
        self.port = self.store.port
        self.store.set("config", pickle.dumps(config))
        if config.device == "cpu":
            share_cpu_cores(size)
        self.procs = []
        self.group: TPGroup | None = None
        try:
            for rank in range(1, size):
                cmd = [sys.executable, "-m", "nanovllm.worker.tp_worker", str(rank),
                       str(self.port), str(os.getpid())]
                self.procs.append(subprocess.Popen(cmd))
            self._wait_for_workers()
            self.group = join_group(self.store, 0, size, config.device)
        except BaseException:
            self.shutdown()
            raise

    def _wait_for_workers(self):
        """Wait until every worker has reached the store, failing at once if one died on the way."""
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        while self.store.add("started", 0) < len(self.procs):
            dead = [rank for rank, p in enumerate(self.procs, 1) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"tensor-parallel worker(s) of rank {dead} exited while "
                                   "starting; see their error above")
            if time.monotonic() > deadline:
                raise RuntimeError("tensor-parallel workers did not start within "
                                   f"{STARTUP_TIMEOUT}")
            time.sleep(0.01)

    def shutdown(self):
        """Stop the workers: with a message if they wait for one, every rank then closing its groups
        at once (NCCL's shutdown waits for all ranks); else by signal, the groups aborted (a worker
        in the middle of a step, or gone, would never join a shutdown)."""
        group, self.group = self.group, None
        if group is not None:
            stop_group(group)
        for proc in self.procs:
            for stop in (lambda: None, proc.terminate, proc.kill):  # stuck: it has nothing to save
                stop()
                try:
                    proc.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.procs = []
        # the port is free once the model's layers, which hold the groups, are gone too
        self.store = None


def stop_group(group: TPGroup):
    """Rank 0: stop ranks 1..N-1 with a message if they wait for one, every rank then closing its
    groups at once; else abort the groups."""
    stopped = False
    if group.idle:
        try:
            group.send_step(None)
            stopped = True
        except Exception:  # a worker already gone: the groups are aborted
            pass
    if stopped:
        group.close()
    else:
        group.abort()


def share_cpu_cores(size: int):
    """Give this rank its share of the cores: a spare thread spinning after its matmul would starve
    another rank (two ranks on two cores run 10x slower with two threads each than with one)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def check_tensor_parallel(config):
    """Every rank needs a GPU of its own and an equal share of the heads and of the MLP; under
    torchrun, one rank per shard."""
    tp, cfg = config.tensor_parallel_size, config.hf_config
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun's rank: cuda:LOCAL_RANK
        from nanovllm.worker.torchrun import torchrun_ranks
        local_rank = torchrun_ranks(config).local_rank  # WORLD_SIZE must be tensor_parallel_size
        if config.device == "cuda" and local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} needs cuda:{local_rank} but only "
                             f"{torch.cuda.device_count()} GPU(s) are visible")
    elif config.device == "cuda" and tp > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp} but only {torch.cuda.device_count()} GPU(s) "
                         "are visible")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={heads}")
    # fewer KV heads than ranks: each is replicated on tp // kv_heads ranks
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_key_value_heads={kv_heads} "
                         "or be a multiple of it")
    if cfg["intermediate_size"] % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide "
                         f"intermediate_size={cfg['intermediate_size']}")
