"""Where a step's time goes: `python benchmarks/profile_step.py --attn-backend triton --batch 256`.

Profiles `--steps` engine steps with torch.profiler and prints, per step: the wall time, the host time
(the wall time less the wait for the GPU's tokens), the time the GPU was busy (the union of its
kernels) and idle, the GPU time of each kind of kernel, and the host time of the engine's phases.
The steps are decode steps of `--batch` random prompts of `--context` tokens (or of bench.py's
`--sharing shared-prefix` or `n8` workload, with `--cascade on` or `off`), with random Qwen3-0.6B
weights, or with `--serving` steps in the middle of a serving run (benchmarks/serving.py: `--trace`,
`--rate`, `--num-requests`, `--num-kvcache-blocks`), after which it also prints the run's figures and
the GPU-busy fraction of the whole run (CUDA events around every step's GPU work).
With `--workload` it instead times every step of bench.py's default workload and sums them by step
kind and decode batch size. Run from the repository root, with PYTHONPATH=.
"""
import argparse
import contextlib
import os
import time
from collections import defaultdict
from dataclasses import replace
from random import randint, seed

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from nanovllm import LLM, SamplingParams

ARCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "Qwen3-0.6B")
PHASES = {"scheduler": ("schedule", "update", "postprocess", "advance"),
          "model_runner": ("upload", "prepare", "execute", "sampling_tensors", "run")}


def labelled(obj, name: str, sink: dict | None = None):
    """Wrap obj.name in a profiler range of that name (and add its host time to sink[name])."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        with record_function(name):
            out = fn(*args, **kwargs)
        if sink is not None:
            sink[name] += time.perf_counter() - start
        return out
    setattr(obj, name, wrapper)


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def waits(llm) -> dict:
    """Make the host's waits for a step's tokens measurable: returns {"wait": seconds so far}."""
    import nanovllm.worker.model_runner as runner_module
    try:
        from nanovllm.worker.run_ahead import SampledTokens
    except ImportError:  # before run_ahead.py
        SampledTokens = runner_module.SampledTokens
    sink, tolist = {"wait": 0.0}, SampledTokens.tolist

    def timed(self):
        start = time.perf_counter()
        out = tolist(self)
        sink["wait"] += time.perf_counter() - start
        return out
    SampledTokens.tolist = timed
    return sink


def gpu_busy_fraction(llm):
    """Record CUDA events around each step's GPU work; returns a function giving busy / wall so far."""
    events, run = [], llm.model_runner.run

    def timed_run(batch):
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        out = run(batch)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        events.append((begin, end))
        return out
    llm.model_runner.run = timed_run

    def fraction() -> float:
        torch.cuda.synchronize()
        busy = sum(a.elapsed_time(b) for a, b in events)
        return busy / events[0][0].elapsed_time(events[-1][1]) if events else float("nan")
    return fraction


def report(prof, steps: int, wall: float, host: float, phases: dict, title: str):
    kernels, intervals, spans, host_ops = defaultdict(float), [], [], defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            host_ops[e.name[:90]] += e.self_cpu_time_total
        if e.name == "step":
            spans.append((e.time_range.start, e.time_range.end))
        elif e.device_type == torch.autograd.DeviceType.CUDA and e.name not in phases and e.name != "step":
            kernels[e.name[:90]] += e.time_range.elapsed_us()
            intervals.append((e.time_range.start, e.time_range.end))
    span = spans[-1][1] - spans[0][0]
    busy = busy_time([(a, b) for a, b in intervals if spans[0][0] <= a <= spans[-1][1]])
    print(f"\n{title}")
    print(f"per step: wall {wall:.0f} us (unprofiled), host {host:.0f} us; profiled: {span / steps:.0f} us, "
          f"GPU busy {busy / steps:.0f} us ({busy / span:.0%}), idle {(span - busy) / steps:.0f} us")
    print("host time per step (us):", ", ".join(f"{k} {v * 1e6 / steps:.0f}" for k, v in phases.items() if v))
    print("\n| GPU time per step (us) | kernel |\n|---|---|")
    for name, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]:
        print(f"| {t / steps:8.1f} | {name} |")
    print("\n| host self time per step (us, profiled) | op or range |\n|---|---|")
    for name, t in sorted(host_ops.items(), key=lambda kv: -kv[1])[:15]:
        print(f"| {t / steps:8.1f} | {name} |")


def instrument(llm) -> dict:
    phases = defaultdict(float)
    for attr, names in PHASES.items():
        for name in names:
            if hasattr(getattr(llm, attr), name):
                labelled(getattr(llm, attr), name, phases)
    return phases


def decode_steps(args):
    cascade = {"disable_cascade_attn": args.cascade == "off"} if args.sharing else {}
    llm = LLM(ARCH, load_format="dummy", skip_tokenizer_init=True, attn_backend=args.attn_backend,
              enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype, **cascade)
    seed(0)
    final = {"output_kind": "final"} if "output_kind" in SamplingParams.__dataclass_fields__ else {}
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.steps * 3 + 10, **final)
    if args.sharing:  # bench.py's workloads whose sequences share KV blocks (cascade attention)
        from bench import sharing_requests
        prompts, shared = sharing_requests(args.sharing, max_tokens=params.max_tokens)
        for prompt in prompts:
            llm.add_request(prompt, replace(shared, **final))
    else:
        for _ in range(args.batch):
            llm.add_request([randint(0, 10000) for _ in range(args.context)], params)
    for _ in range(args.steps + 4):  # prefill, then warm up decode
        llm.step()
    wait = waits(llm)
    start, waited = time.perf_counter(), wait["wait"]
    for _ in range(args.steps):
        llm.step()
    wall = (time.perf_counter() - start) / args.steps * 1e6
    host = wall - (wait["wait"] - waited) / args.steps * 1e6
    phases = instrument(llm)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            with record_function("step"):
                llm.step()
    if args.chrome_trace:
        prof.export_chrome_trace(args.chrome_trace)
    what = (f"{args.sharing}, cascade {args.cascade}" if args.sharing
            else f"batch {args.batch}, context {args.context}")
    what += f", KV cache {args.kv_cache_dtype}"
    report(prof, args.steps, wall, host, phases, f"{args.attn_backend}, decode, {what}, "
           f"{torch.cuda.get_device_name()}")


def serving_steps(args):
    import serving
    args.rate = args.rate[0]  # serving.py's --rate takes a sweep: one rate here
    options = {"prefill_first": True} if args.prefill_first else {}
    llm = serving.make_llm(args, **options)
    requests = serving.synthesize(args.trace, args.num_requests, args.seed, llm.config.max_model_len)
    arrivals = serving.poisson_arrivals(args.rate, args.num_requests, args.seed)
    vocab = llm.config.hf_config["vocab_size"]
    warm = requests[:16]
    serving.drive(llm, warm, [0.0] * len(warm), vocab, args.seed + 7)
    wait, fraction = waits(llm), gpu_busy_fraction(llm)
    first = args.window_start
    state = {}

    def on_step(i):  # profile steps first+1 .. first+args.steps
        if i == first - args.steps:
            state["t"], state["w"] = time.perf_counter(), wait["wait"]
        if i == first:
            state["wall"] = (time.perf_counter() - state["t"]) / args.steps * 1e6
            state["host"] = state["wall"] - (wait["wait"] - state["w"]) / args.steps * 1e6
            state["phases"] = instrument(llm)
            state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["range"] = record_function("step")
            state["range"].__enter__()
        elif first < i <= first + args.steps:
            state["range"].__exit__(None, None, None)
            if i == first + args.steps:
                state["prof"].__exit__(None, None, None)
            else:
                state["range"] = record_function("step")
                state["range"].__enter__()
    result = serving.drive(llm, requests, arrivals, vocab, args.seed, on_step)
    title = (f"{args.attn_backend}, serving {args.trace} rate {args.rate}, {args.num_requests} requests, "
             f"prefill_first={args.prefill_first}, steps {first + 1}..{first + args.steps}, "
             f"{torch.cuda.get_device_name()}")
    if "prof" in state:
        report(state["prof"], args.steps, state["wall"], state["host"], state["phases"], title)
    print(f"\nthe whole run: {serving.summary(result)}; GPU busy {fraction():.1%} of the time from the first "
          "step's GPU work to the last's (CUDA events)")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), rate=str(args.rate), **result), f)


def workload_steps(args):
    """Time each step of nano-vllm's workload (or of bench.py's `--sharing` workload, with cascade
    attention `--cascade`); print seconds by step kind and decode batch size."""
    from bench import nano_vllm_requests, sharing_requests
    cascade = {"disable_cascade_attn": args.cascade == "off"} if args.sharing else {}
    llm = LLM(ARCH, load_format="dummy", skip_tokenizer_init=True, attn_backend=args.attn_backend,
              enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype, **cascade)
    if args.sharing:  # a warm-up of the same shapes (bench.py's sharing_workload)
        llm.generate(*sharing_requests(args.sharing, seed_value=1, max_tokens=4), use_tqdm=False)
        prompts, params = sharing_requests(args.sharing)
        params = [params] * len(prompts)
    else:
        prompts, params = nano_vllm_requests()
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    times, schedule = defaultdict(lambda: [0, 0.0]), llm.scheduler.schedule
    last = {"t": None, "kind": None, "steps": 0}

    def timed():
        batch = schedule()
        now = time.perf_counter()
        times[last["kind"] or "before the first step"][0] += 1
        times[last["kind"] or "before the first step"][1] += now - (last["t"] or start)
        n = len(batch.seqs)
        decodes = all(k == 1 for k in batch.num_new_tokens)
        kind = f"decode, batch <= {min(b for b in (16, 64, 128, 256, 512) if b >= n)}"
        if args.sharing:  # one batch size: by the decode steps' order (own tokens grow)
            kind = f"decode, batch {n}, steps {last['steps'] // 64 * 64}+"
            last["steps"] += decodes
        last["t"], last["kind"] = now, kind if decodes else f"with prefill ({sum(batch.num_new_tokens)} tokens)"
        return batch
    llm.scheduler.schedule = timed
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    times["the last step, and reading it"] = [1, total - sum(t for _, t in times.values())]
    what = f"{args.sharing}, cascade {args.cascade}" if args.sharing else "nano-vllm's workload"
    print(f"\n{args.attn_backend}: {what} in {total:.2f} s, "
          f"{sum(p.max_tokens * p.n for p in params) / total:,.0f} tokens/s\n\n| steps | kind | seconds | ms per step |\n"
          "|---|---|---|---|")
    for kind, (n, seconds) in sorted(times.items()):
        print(f"| {n} | {kind} | {seconds:.2f} | {seconds / n * 1e3:.2f} |")


def main():
    import serving
    parser = serving.parser()
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--serving", action="store_true", help="profile steps of a serving run")
    parser.add_argument("--window-start", type=int, default=600, help="--serving: profile after this step")
    parser.add_argument("--workload", action="store_true", help="time the steps of bench.py's workload")
    parser.add_argument("--sharing", choices=["shared-prefix", "n8"], default="",
                        help="decode steps of bench.py's workload of that name (not random prompts)")
    parser.add_argument("--cascade", choices=["on", "off"], default="on", help="with --sharing")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--chrome-trace", default="", help="also write a Chrome trace to this file")
    args = parser.parse_args()
    if args.workload:
        workload_steps(args)
    elif args.serving:
        serving_steps(args)
    else:
        decode_steps(args)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
