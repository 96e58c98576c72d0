"""A tensor-parallel worker: `python -m nanovllm.worker.tp_worker RANK PORT PARENT_PID`.

Ranks 1..N-1 of an engine (nanovllm/worker/distributed.py). It reads the engine's Config from the
store that rank 0 opened on PORT, builds this rank's shard of the model, then runs every step that
rank 0 sends until it sends None. It dies with the engine's process.
"""
import os
import pickle
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from nanovllm.worker.distributed import STARTUP_TIMEOUT, join_group, run_steps, share_cpu_cores


def exit_with_parent(parent_pid: int):
    """Die with the engine's process, even when it is killed while this rank waits in a
    collective."""
    while os.getppid() == parent_pid:
        time.sleep(1)
    os._exit(1)


def main(rank: int, port: int, parent_pid: int):
    # Ctrl-C is rank 0's to handle: it stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, args=(parent_pid,), daemon=True).start()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STARTUP_TIMEOUT)
    config = pickle.loads(store.get("config"))
    if config.device == "cuda":
        torch.cuda.set_device(rank)  # before NCCL binds to the current device
    else:
        share_cpu_cores(config.tensor_parallel_size)
    store.add("started", 1)
    run_steps(config, join_group(store, rank, config.tensor_parallel_size, config.device))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
