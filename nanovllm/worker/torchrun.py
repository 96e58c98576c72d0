"""Tensor parallelism across hosts: the ranks are the processes that torchrun starts.

    torchrun --nnodes K --nproc-per-node M --rdzv-backend c10d --rdzv-endpoint HOST:PORT script.py

runs the same script once per GPU on each of K hosts, and `LLM(model, tensor_parallel_size=K*M)`
in it, seeing torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, and MASTER_ADDR and
MASTER_PORT for env://), meets the other ranks through torchrun's store instead of starting
worker processes of its own (nanovllm/worker/distributed.py). Everything else is the same: rank 0
is the engine (scheduler, block manager, sampling) and puts its Config on the store, which every
rank then runs; each step goes from rank 0 to the others, and each rank runs the forward pass on
its shard, on cuda:LOCAL_RANK (NCCL) or on the CPU (gloo).

On ranks > 0, `LLM(...)` runs rank 0's steps until rank 0 shuts down, then ends the process with
`sys.exit(0)`: the rest of the script (its generate calls, prints, files written, a server) is
rank 0's alone, as in vLLM's and torchrun's own worker processes, so the script needs no
`if rank == 0` around each of its lines, and a worker never returns an engine that cannot run.
(SystemExit still runs `finally` blocks and atexit handlers.) Ranks > 0 ignore Ctrl-C: rank 0
stops them. One engine per torchrun job: the other ranks have exited once it shuts down.
"""
import atexit
import os
import pickle
import signal
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.worker.distributed import (STARTUP_TIMEOUT, join_group, run_steps, share_cpu_cores,
                                         stop_group)


@dataclass(frozen=True)
class Ranks:
    """This process's place among torchrun's."""
    rank: int
    size: int
    local_rank: int  # its GPU on this host
    local_size: int  # torchrun's processes on this host


def torchrun_ranks(config: Config) -> Ranks:
    """torchrun's environment, which must hold one rank per tensor-parallel shard."""
    size, tp = int(os.environ["WORLD_SIZE"]), config.tensor_parallel_size
    if size != tp:
        raise ValueError(f"torchrun started WORLD_SIZE={size} ranks but tensor_parallel_size={tp}"
                         "; they must be equal: one rank per shard of the model")
    return Ranks(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", 0)),
                 int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def meet(ranks: Ranks, device: str) -> dist.Store:
    """torchrun's store (env://), with keys of our own; on CPU, this rank's share of its host's
    cores (unless OMP_NUM_THREADS says how many threads a rank runs, as torchrun sets it)."""
    store, _, _ = next(dist.rendezvous("env://", ranks.rank, ranks.size, timeout=STARTUP_TIMEOUT))
    if device == "cuda":
        torch.cuda.set_device(ranks.local_rank)  # before NCCL binds to the current device
    elif "OMP_NUM_THREADS" not in os.environ:
        share_cpu_cores(ranks.local_size)
    return dist.PrefixStore("nanovllm", store)


def run_worker(config: Config):
    """Ranks > 0: run rank 0's steps, in rank 0's Config, until it shuts down; then exit."""
    ranks = torchrun_ranks(config)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    store = meet(ranks, config.device)
    config = pickle.loads(store.get("config"))
    run_steps(config, join_group(store, ranks.rank, ranks.size, config.device, ranks.local_rank))
    sys.exit(0)


class TorchrunWorkers:
    """Rank 0's side: meets the ranks torchrun started, and stops them."""
    procs = ()  # torchrun's, not ours

    def __init__(self, config: Config):
        ranks = torchrun_ranks(config)
        assert ranks.rank == 0, "ranks > 0 are workers: run_worker"
        store = meet(ranks, config.device)
        store.set("config", pickle.dumps(config))
        self.group = join_group(store, 0, ranks.size, config.device, ranks.local_rank)

    def shutdown(self):
        """Stop the other ranks: they leave their loop, and their processes exit."""
        group, self.group = self.group, None
        if group is not None:
            stop_group(group)


def shut_down_at_exit(engine):
    """Rank 0: at the program's exit, the engine's whole shutdown (the workers stopped, then the
    model and its groups freed) while torchrun's store still answers; groups left to the
    interpreter's teardown can abort the process once the other hosts are gone."""
    ref = weakref.ref(engine)

    def shut_down():
        if (alive := ref()) is not None:
            alive.shutdown()
    atexit.register(shut_down)
