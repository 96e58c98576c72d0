"""Where a decode step's time goes: `python benchmarks/profile_step.py --attn-backend flash --batch 256`.

Runs `--batch` random prompts of `--context` tokens with random Qwen3-0.6B weights (as bench.py does), then
profiles `--steps` decode steps with torch.profiler and prints, per step: the wall time, the time the GPU
was busy and idle, the GPU time of each kind of kernel, and the host time of each phase of `LLM.step`.
With `--workload` it instead times every step of bench.py's default workload and sums them by step kind
and decode batch size (run from the repository root, with PYTHONPATH=.).
"""
import argparse
import contextlib
import os
import time
from collections import defaultdict
from random import randint, seed

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import nanovllm.engine.model_runner as model_runner_module
from nanovllm import LLM, SamplingParams

ARCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "Qwen3-0.6B")


def labelled(obj, name: str):
    """Wrap obj.name in a profiler range of that name."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    setattr(obj, name, wrapper)


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def workload_steps(llm):
    """Time each step of nano-vllm's workload; print seconds by prefill and by decode batch size. (A step's wall
    time is mostly the GPU time of the step before it, which the host waits for: the engine runs one ahead.)"""
    from bench import nano_vllm_requests
    prompts, params = nano_vllm_requests()
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    times, step = defaultdict(lambda: [0, 0.0]), llm.step

    def timed():
        start = time.perf_counter()
        out, num_tokens = step()
        n = len(llm.in_flight[0].seqs) if llm.in_flight else 0
        kind = "prefill" if num_tokens > 0 else f"decode, batch <= {min(b for b in (16, 64, 128, 256) if b >= n)}"
        times[kind][0] += 1
        times[kind][1] += time.perf_counter() - start
        return out, num_tokens
    llm.step = timed
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    print(f"\n{llm.config.attn_backend}: nano-vllm's workload in {total:.2f} s, "
          f"{sum(p.max_tokens for p in params) / total:,.0f} tokens/s\n\n| steps | kind | seconds | ms per step |\n|---|---|---|---|")
    for kind, (n, seconds) in sorted(times.items()):
        print(f"| {n} | {kind} | {seconds:.2f} | {seconds / n * 1e3:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attn-backend", default="flash", choices=["flash", "triton", "sdpa"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--trace", default="", help="also write a Chrome trace to this file")
    parser.add_argument("--workload", action="store_true", help="time the steps of bench.py's default workload")
    args = parser.parse_args()
    llm = LLM(ARCH, load_format="dummy", skip_tokenizer_init=True, attn_backend=args.attn_backend,
              enforce_eager=args.enforce_eager)
    if args.workload:
        return workload_steps(llm)
    phases_of = {llm.scheduler: ("schedule", "postprocess", "finish"),
                 llm.model_runner: ("prepare", "execute", "sampling_tensors"), model_runner_module: ("sample",)}
    for obj, names in phases_of.items():
        for name in names:
            labelled(obj, name)
    phase_names = {name for names in phases_of.values() for name in names}
    seed(0)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.steps * 3 + 10)
    for _ in range(args.batch):
        llm.add_request([randint(0, 10000) for _ in range(args.context)], params)
    while llm.step()[1] >= 0:  # prefill until the first decode step
        pass
    for _ in range(args.steps):  # warm up decode
        llm.step()
    start = time.perf_counter()  # every step ends in a sync (the sampled tokens come to the host)
    for _ in range(args.steps):
        llm.step()
    wall = (time.perf_counter() - start) * 1e6 / args.steps  # us per step, unprofiled
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            with record_function("step"):
                llm.step()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    kernels, phases = defaultdict(float), defaultdict(float)
    intervals, steps = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in phase_names:  # not the GPU mirror of a range
            kernels[e.name[:90]] += e.time_range.elapsed_us()
            intervals.append((e.time_range.start, e.time_range.end))
        elif e.name == "step":
            steps.append((e.time_range.start, e.time_range.end))
        elif e.name in phase_names:
            phases[e.name] += e.time_range.elapsed_us()
    span = steps[-1][1] - steps[0][0]
    busy = busy_time([(a, b) for a, b in intervals if steps[0][0] <= a <= steps[-1][1]])
    n = args.steps
    print(f"\n{args.attn_backend}, batch {args.batch}, context {args.context}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    print(f"step (unprofiled): {wall:.0f} us; profiled: {span / n:.0f} us, GPU busy {busy / n:.0f} us, "
          f"idle {(span - busy) / n:.0f} us")
    print("\nhost time per step (us):", ", ".join(f"{k} {v / n:.0f}" for k, v in phases.items()))
    print("\n| GPU time per step (us) | kernel |\n|---|---|")
    for name, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:30]:
        print(f"| {t / n:8.1f} | {name} |")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
