"""Tensor parallelism's processes: one per rank, rank 0 being the engine's own process.

Rank 0 holds the scheduler and the block manager. Every step it broadcasts a `StepInputs` (plain
lists: token ids, positions, cache slots, block tables) to ranks 1..N-1 over a gloo group; every
rank then runs the same forward pass on its shard of the weights, the layers meeting in
all-reduces (NCCL on GPUs, gloo on CPU), and the LM head gathers the logits to rank 0, which
alone samples. A `None` step tells the workers to stop.

The ranks meet through a TCPStore that rank 0 opens on a port the OS picks, and the process groups
are this engine's own objects, not torch.distributed's one global default group, so two engines
can run side by side in one process. Workers are daemonic, ignore Ctrl-C (rank 0 stops them) and
exit when the engine's process is gone. They are spawned (not forked, which CUDA forbids), so a
script that starts an engine needs the usual `if __name__ == "__main__":`. On CPU every rank, rank
0 included, runs cpu_count // N threads.
"""
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner

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
    idle: bool = False               # (rank 0) the workers are waiting for a step, so a message can reach them
    graphs: dict = field(default_factory=dict)  # this rank's CUDA graphs, which captured device_group collectives

    def send_step(self, step):
        """Rank 0: hand the workers the next forward pass (None: stop)."""
        self.idle = False
        dist.broadcast_object_list([step], group=self.cpu_group, group_src=0)

    def receive_step(self):
        """Ranks 1..N-1: wait for rank 0's next step."""
        box = [None]
        dist.broadcast_object_list(box, group=self.cpu_group, group_src=0)
        return box[0]

    def min(self, value: int) -> int:
        """The smallest of every rank's value (the number of KV blocks that fits on all of them)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    def close(self):
        """Shut the groups down; every rank does it at once. NCCL frees a communicator only when the CUDA graphs
        that captured its collectives are gone, so they go first."""
        self.graphs.clear()
        self.device_group.shutdown()
        self.cpu_group.shutdown()

    def abort(self):
        """Close without waiting for the other ranks."""
        self.graphs.clear()
        self.device_group.abort()
        self.cpu_group.abort()


def _new_group(store: dist.Store, rank: int, size: int, device_type: str) -> dist.ProcessGroup:
    """A process group of our own (not torch.distributed's global default): NCCL on cuda, else gloo."""
    kind = dist.ProcessGroup.BackendType.NCCL if device_type == "cuda" else dist.ProcessGroup.BackendType.GLOO
    if device_type == "cuda":
        backend = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
        backend._set_sequence_number_for_group()
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, IDLE_TIMEOUT)
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(kind)
    group._register_backend(torch.device(device_type), kind, backend)
    return group


def join_group(store: dist.Store, rank: int, size: int, device_type: str) -> TPGroup:
    """Meet the other ranks: one group for the model's tensors, one gloo group for step messages."""
    cpu_group = _new_group(dist.PrefixStore("cpu", store), rank, size, "cpu")
    device_group = _new_group(dist.PrefixStore("device", store), rank, size, device_type)
    return TPGroup(rank, size, device_group, cpu_group)


class Workers:
    """Rank 0's side: starts ranks 1..N-1, joins their group, and stops them."""

    def __init__(self, config: Config):
        size = config.tensor_parallel_size
        # port 0: the OS picks a free port, so no two engines ever collide
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=STARTUP_TIMEOUT)
        self.port = self.store.port
        if config.device == "cpu":
            share_cpu_cores(size)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(config, rank, self.port, os.getpid()),
                                  name=f"nanovllm-tp-rank{rank}", daemon=True) for rank in range(1, size)]
        self.group: TPGroup | None = None
        try:
            for proc in self.procs:
                proc.start()
            self._wait_for_workers()
            self.group = join_group(self.store, 0, size, config.device)
        except BaseException:
            self.shutdown()
            raise

    def _wait_for_workers(self):
        """Wait until every worker has reached the store, failing at once if one died on the way."""
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        while self.store.add("started", 0) < len(self.procs):
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"tensor-parallel worker(s) {dead} exited while starting; see their error above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT}")
            time.sleep(0.01)

    def shutdown(self):
        """Stop the workers: with a message if they wait for one, every rank then closing its groups at once (NCCL's
        shutdown waits for all ranks); else by signal, the groups aborted (a worker in the middle of a step, or gone,
        would never join a shutdown)."""
        group, self.group = self.group, None
        stopped = False
        if group is not None and group.idle:
            try:
                group.send_step(None)
                stopped = True
            except Exception:  # a worker already gone: the others are stopped below
                pass
        if group is not None and stopped:
            group.close()
        elif group is not None:
            group.abort()
        for proc in (p for p in self.procs if p.pid is not None):  # skip any that never started
            proc.join(timeout=5)
            if proc.is_alive():  # stuck: it has nothing to save
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs = []
        self.store = None  # the port is free once the model's layers, which hold the groups, are gone too


def share_cpu_cores(size: int):
    """Give this rank its share of the cores: a spare thread spinning after its matmul would starve
    another rank (two ranks on two cores run 10x slower with two threads each than with one)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def worker_main(config: Config, rank: int, port: int, parent_pid: int):
    """Ranks 1..N-1: build this rank's shard of the model, then run every step rank 0 sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the workers
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if config.device == "cuda":
        torch.cuda.set_device(rank)  # before NCCL binds to the current device
    else:
        share_cpu_cores(config.tensor_parallel_size)
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=STARTUP_TIMEOUT)
    store.add("started", 1)
    group = join_group(store, rank, config.tensor_parallel_size, config.device)
    try:
        runner = ModelRunner(config, group)
        while (step := group.receive_step()) is not None:
            runner.execute(step)
    finally:
        group.close()


def _exit_with_parent(parent_pid: int):
    """Die with the engine's process, even when it is killed while this rank waits inside a collective."""
    while os.getppid() == parent_pid:
        time.sleep(1)
    os._exit(1)
