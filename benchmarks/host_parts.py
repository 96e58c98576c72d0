"""The host's time per decode step on a GPU, unprofiled, by part: `PYTHONPATH=. python3
benchmarks/host_parts.py [--kv-cache-dtype fp8] [--batch 256] [--context 640]`.

Decode steps of `--batch` random prompts of `--context` tokens (random Qwen3-0.6B weights, triton,
temperature 0.6: bench.py's sampling), or with `--sharing n8` or `shared-prefix` of bench.py's
workload of that name (cascade attention on), with run-ahead. The engine's and the model runner's
methods are wrapped in timers: each part's time includes the parts it calls. `host` is the wall time
less the wait for a step's tokens (SampledTokens.tolist). Then the audit events the steps raise (an
audit hook, which filelock installs on Python >= 3.12, makes each a Python call). No torch.profiler:
its per-op overhead would swell the parts that launch many CUDA ops. benchmarks/host_step.py times
the CPU-side parts on any machine; this one is for CUDA (on a CPU it runs, eagerly).
"""
import argparse
import os
import sys
import time
from collections import defaultdict
from dataclasses import replace
from random import randint, seed

import torch

import nanovllm.worker.cuda_graphs as cuda_graphs
import nanovllm.layers.sampler as sampler
from nanovllm import LLM, SamplingParams
from nanovllm.worker.run_ahead import SampledTokens

ARCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "Qwen3-0.6B")


def timed(fn, label: str, sink: dict):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink[label] += time.perf_counter() - start
    return wrapper


def instrument(llm, sink: dict):
    runner = llm.model_runner
    for obj, names in [(llm.scheduler, ["schedule", "update"]), (llm, ["launch", "read_step"]),
                       (runner, ["run", "execute", "step_inputs", "fill_placeholders"]),
                       (runner.graphs, ["run", "sample"]), (cuda_graphs, ["upload"]),
                       (runner.backend.cascade, ["prepare"]),
                       (runner.model, ["compute_logits"]), (sampler, ["sample_batch", "sample"]),
                       (llm.output_processor, ["outputs"])]:
        for name in names if obj is not None else []:  # no graphs: a CPU run, for a smoke test
            setattr(obj, name, timed(getattr(obj, name), f"{type(obj).__name__}.{name}", sink))
    of = sampler.SamplingTensors.of.__func__
    sampler.SamplingTensors.of = classmethod(timed(of, "SamplingTensors.of", sink))
    for cls, name in [(cuda_graphs.FullGraph, "replay"), (SampledTokens, "__init__"),
                      (SampledTokens, "tolist")]:
        setattr(cls, name, timed(getattr(cls, name), f"{cls.__name__}.{name}", sink))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sharing", choices=["n8", "shared-prefix"], default="",
                        help="bench.py's workload of that name instead of random prompts")
    args = parser.parse_args()
    llm = LLM(ARCH, load_format="dummy", skip_tokenizer_init=True, attn_backend="triton",
              kv_cache_dtype=args.kv_cache_dtype)
    seed(0)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.steps + 60,
                            output_kind="final")
    if args.sharing:
        from bench import sharing_requests
        prompts, shared = sharing_requests(args.sharing, max_tokens=params.max_tokens)
        params = replace(shared, output_kind="final")
    else:
        prompts = [[randint(0, 10000) for _ in range(args.context)] for _ in range(args.batch)]
    for prompt in prompts:
        llm.add_request(prompt, params)
    for _ in range(30):  # prefill, then warm up decode (the sampler graph is captured on first use)
        llm.step()
    sink = defaultdict(float)
    instrument(llm, sink)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    wall = (time.perf_counter() - start) / args.steps * 1e6
    host = wall - sink["SampledTokens.tolist"] / args.steps * 1e6
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    what = args.sharing or f"batch {args.batch}, context {args.context}"
    print(f"{device}, KV cache {args.kv_cache_dtype}, {what}: wall {wall:,.0f} us per step, "
          f"host {host:,.0f} us\n")
    print("| part (inclusive) | us per step |\n|---|---:|")
    for label, seconds in sorted(sink.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {seconds / args.steps * 1e6:,.0f} |")
    events, on = defaultdict(int), [False]
    sys.addaudithook(lambda event, _: on[0] and events.__setitem__(event, events[event] + 1))
    on[0] = True
    for _ in range(10):
        llm.step()
    on[0] = False
    print("\naudit events per step:", {k: v / 10 for k, v in events.items()} or "none")


if __name__ == "__main__":
    main()
