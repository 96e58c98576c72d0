"""The host's work per engine step, timed on any machine: `python benchmarks/host_step.py --workload
shared-prefix` (or `n8`, or `random`).

With CUDA graphs and run-ahead a decode step costs the GPU a few milliseconds, and the host must
prepare the next one in less (issue 19's rule; with cascade attention on, batch-256 decode steps of
the sharing workloads broke it on an H100: benchmarks/results/h100_session7_cascade_host_time.log).
The host's Python does not need the GPU: this runs a tiny random Qwen3 on the CPU (sdpa) with the
workload's real batch (bench.py's prompts, 256 decode rows) and times, per step, the engine's own
phases (schedule, step_inputs, update, outputs) and, on that step's inputs, the parts that only run
on CUDA: the graph upload's list building (cuda_graphs.upload; here without pinning), its
unpacking, the cascade plan (attention/cascade.py) and the sampling settings (layers/sampler.py).
What it cannot time is what the CUDA calls themselves cost the host (launches, copies, a call that
blocks): profile_step.py's host-ops table on a GPU shows those.
"""
import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from random import randint, seed

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import sharing_requests  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.attention.cascade import BlockCopies, members_per_tile, plan_tiles  # noqa: E402
from nanovllm.engine import cuda_graphs  # noqa: E402
from nanovllm.layers.sampler import SamplingTensors  # noqa: E402


def timed(obj, name: str, sink: dict):
    """Wrap obj.name so that its host time adds up in sink[name]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sink[name] += time.perf_counter() - start
        return out
    setattr(obj, name, wrapper)


def mean_us(fn, repeats: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def followed(copies: BlockCopies, step):
    copies.update(step)
    return step


def requests(workload: str, context: int, batch: int, max_tokens: int):
    if workload != "random":
        prompts, params = sharing_requests(workload, max_tokens=max_tokens)
        return prompts, [params] * len(prompts)
    seed(0)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    return [[randint(0, 10000) for _ in range(context)] for _ in range(batch)], [params] * batch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="shared-prefix", choices=["shared-prefix", "n8", "random"])
    parser.add_argument("--context", type=int, default=1024, help="random: prompt tokens")
    parser.add_argument("--batch", type=int, default=256, help="random: requests")
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed")
    args = parser.parse_args()
    config = Qwen3Config(vocab_size=10001, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=8,
                         max_position_embeddings=4096)  # Qwen3-0.6B's heads per KV head
    with tempfile.TemporaryDirectory() as path:
        Qwen3ForCausalLM(config).save_pretrained(path)
        # run ahead as on CUDA (worker/run_ahead.py)
        llm = LLM(path, skip_tokenizer_init=True, num_kvcache_blocks=3000, async_scheduling=True,
                  device="cpu")
        prompts, params = requests(args.workload, args.context, args.batch, args.steps * 2 + 20)
        for prompt, p in zip(prompts, params):
            llm.add_request(prompt, replace(p, output_kind="final"))
        phases = defaultdict(float)
        for name in ("schedule", "update"):
            timed(llm.scheduler, name, phases)
        timed(llm.model_runner, "step_inputs", phases)
        timed(llm.output_processor, "outputs", phases)
        # the copies the cascade follows (attention/cascade.py) build up over the run, as the
        # engine's do: every step's, outside the timing
        copies, timed_inputs = BlockCopies(llm.config.kvcache_block_size), llm.model_runner.step_inputs
        llm.model_runner.step_inputs = lambda batch: followed(copies, timed_inputs(batch))
        running = llm.scheduler.running
        while len(running) < len(prompts) * params[0].n or any(
                len(s.token_ids) - s.num_computed_tokens > 1 for s in running):
            llm.step()  # prefill, until every sequence decodes
            running = llm.scheduler.running
        phases.clear()  # the decode steps' times only
        for _ in range(args.steps):
            llm.step()
        batch = llm.scheduler.schedule()  # one more decode step, not run: its inputs are timed
        step = llm.model_runner.step_inputs(batch)
        width = -(-llm.config.max_model_len // llm.config.kvcache_block_size)  # as a graph's tables
        sizes = (step.num_decodes, step.num_decodes, 0, width)
        into = torch.zeros(sum(cuda_graphs.field_sizes(*sizes)) + len(step.sample_rows), dtype=torch.int32)
        upload = mean_us(lambda: cuda_graphs.upload(step, sizes, into))  # on CPU: not pinned
        flat = cuda_graphs.upload(step, sizes, into)
        lengths = cuda_graphs.step_sizes(step)
        unpack = mean_us(lambda: cuda_graphs.unpack(flat, sizes, lengths, step.num_decodes, step))
        members = members_per_tile(2)
        plan = mean_us(lambda: (copies.update(step), plan_tiles(
            step.block_tables, step.context_lens, step.num_decodes, llm.config.kvcache_block_size,
            members, copies)))
        rows = [(s, s.sample_index + j) for s, k in zip(batch.seqs, batch.num_samples) for j in range(k)]
        sampling = mean_us(lambda: SamplingTensors.of(rows, config.vocab_size, torch.device("cpu")))
    print(f"{args.workload}: {step.num_decodes} decode rows, contexts {min(step.context_lens)} to "
          f"{max(step.context_lens)} keys, this machine's CPU\n")
    print("| host work per step | us |\n|---|---:|")
    for name, seconds in phases.items():
        print(f"| engine: {name} | {seconds / args.steps * 1e6:,.0f} |")
    for name, us in [("CUDA only: graph upload, list building (cuda_graphs.upload)", upload),
                     ("CUDA only: its unpacking (cuda_graphs.unpack)", unpack),
                     ("triton only: cascade plan (BlockCopies.update, plan_tiles)", plan),
                     ("sampling settings (SamplingTensors.of)", sampling)]:
        print(f"| {name} | {us:,.0f} |")
    total = sum(phases.values()) / args.steps * 1e6 + upload + unpack + plan + sampling
    print(f"| **sum** | **{total:,.0f}** |")


if __name__ == "__main__":
    main()
