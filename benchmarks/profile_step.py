"""Where a step's time goes: `python benchmarks/profile_step.py --attn-backend triton --batch 256`.

Profiles `--steps` engine steps with torch.profiler and prints, per step: the wall time, the host
time (the wall time less the wait for the GPU's tokens), the time the GPU was busy (the union of its
kernels) and idle, the GPU time of each kind of kernel, and the host time of the engine's phases.
The steps are decode steps of `--batch` random prompts of `--context` tokens (or of bench.py's
`--sharing shared-prefix` or `n8` workload, with `--cascade on` or `off`), with random weights of
`--arch` (benchmarks/archs.json), or with `--serving` steps in the middle of a serving run
(benchmarks/serving.py: `--trace`, `--rate`, `--num-requests`, `--num-kvcache-blocks`), after which
it also prints the run's figures and the GPU-busy fraction of the whole run and of the window
(CUDA events around every step's GPU work, in a run that the profiler does not slow down: it
records a second run up to the window's end). Other modes:

- `--workload`: times every step of bench.py's default workload (or of `--sharing`) and sums them by
  step kind and decode batch size.
- `--host`: the host's work per decode step, on any machine (no GPU needed): a tiny random Qwen3 on
  the CPU with the same decode batch (`--sharing`, or `--batch` x `--context`), timing the engine's
  own phases and, on that step's inputs, the parts that only run on CUDA (the graph upload's list
  building and its unpacking, the cascade plan) and the sampling settings. What it cannot time is
  what the CUDA calls themselves cost the host: the host-ops table of a profiled GPU run shows that.
- `--plot-timeline A.json [B.json ...] -o steps.png`: draws what the steps of serving runs did over
  time (serving.py's or `--serving`'s `--json`): decodes per step and prompt tokens prefilled, one
  panel per run, over a window (`--plot-start`, `--plot-seconds`).

Run from the repository root.
"""
import contextlib
import gc
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from random import randint, seed

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import arch_path, nano_vllm_requests, sharing_requests  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402

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


def idle_by_gap(intervals: list[tuple[float, float]], steps: int, span: float):
    """Print the GPU's idle time between consecutive activities, by the gap's length: gaps of a
    microsecond or two separate the kernels of one graph, longer ones wait for the host."""
    buckets, end = {}, None
    for a, b in sorted(intervals):
        if end is not None and a > end:
            bound = next(k for k in (2, 10, 100, 1000, float("inf")) if a - end <= k)
            n, total = buckets.get(bound, (0, 0.0))
            buckets[bound] = n + 1, total + a - end
        end = b if end is None else max(end, b)
    print(f"\n{len(intervals) / steps:.0f} GPU activities a step; idle between them, per step:")
    for bound, (n, total) in sorted(buckets.items()):
        print(f"  gaps of at most {bound:g} us: {n / steps:6.1f}, {total / steps:6.1f} us "
              f"({total / span:.1%} of the span)")


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
    """Record CUDA events around each step's GPU work; returns a function giving busy / wall of
    the steps recorded so far (or of steps[start:stop])."""
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

    def fraction(start: int = 0, stop: int | None = None) -> float:
        torch.cuda.synchronize()
        steps = events[start:stop]
        busy = sum(a.elapsed_time(b) for a, b in steps)
        return busy / steps[0][0].elapsed_time(steps[-1][1]) if steps else float("nan")
    return fraction


def report(prof, steps: int, wall: float, host: float, phases: dict, title: str):
    kernels, intervals, spans, host_ops = defaultdict(float), [], [], defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            host_ops[e.name[:90]] += e.self_cpu_time_total
        if e.name == "step":
            spans.append((e.time_range.start, e.time_range.end))
        elif (e.device_type == torch.autograd.DeviceType.CUDA and e.name not in phases
              and e.name != "step"):
            kernels[e.name[:90]] += e.time_range.elapsed_us()
            intervals.append((e.time_range.start, e.time_range.end))
    if not spans:  # only the GPU was recorded: the window runs from its first kernel to its last
        spans = [(min(a for a, _ in intervals), max(b for _, b in intervals))]
    span = spans[-1][1] - spans[0][0]
    intervals = [(a, b) for a, b in intervals if spans[0][0] <= a <= spans[-1][1]]  # the window's
    busy = busy_time(intervals)
    print(f"\n{title}")
    print(f"per step: wall {wall:.0f} us (unprofiled), host {host:.0f} us; profiled: "
          f"{span / steps:.0f} us, GPU busy {busy / steps:.0f} us ({busy / span:.1%}), "
          f"idle {(span - busy) / steps:.0f} us")
    idle_by_gap(intervals, steps, span)
    if phases:
        print("host time per step (us):",
              ", ".join(f"{k} {v * 1e6 / steps:.0f}" for k, v in phases.items() if v))
    print("\n| GPU time per step (us) | kernel |\n|---|---|")
    for name, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]:
        print(f"| {t / steps:8.1f} | {name} |")
    if host_ops:
        print("\n| host self time per step (us, profiled) | op or range |\n|---|---|")
    for name, t in sorted(host_ops.items(), key=lambda kv: -kv[1])[:15]:
        print(f"| {t / steps:8.1f} | {name} |")
    return busy / steps


def instrument(llm) -> dict:
    phases = defaultdict(float)
    for attr, names in PHASES.items():
        for name in names:
            if hasattr(getattr(llm, attr), name):
                labelled(getattr(llm, attr), name, phases)
    return phases


def decode_requests(args, max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    """The decode batch's requests: bench.py's `--sharing` workload (its sequences share KV blocks:
    cascade attention), or `--batch` random prompts of `--context` tokens; temperature 0.6."""
    if args.sharing:
        prompts, shared = sharing_requests(args.sharing, max_tokens=max_tokens)
    else:
        seed(0)
        prompts = [[randint(0, 10000) for _ in range(args.context)] for _ in range(args.batch)]
        shared = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    return [(prompt, replace(shared, output_kind="final")) for prompt in prompts]


def engine(args) -> LLM:
    """An engine over random weights of --arch, for decode steps or bench.py's workloads."""
    cascade = {"disable_cascade_attn": args.cascade == "off"} if args.sharing else {}
    return LLM(arch_path(args.arch), load_format="dummy", skip_tokenizer_init=True,
               attn_backend=args.attn_backend, enforce_eager=args.enforce_eager,
               kv_cache_dtype=args.kv_cache_dtype, **cascade)


def decode_steps(args):
    llm = engine(args)
    for prompt, params in decode_requests(args, max_tokens=args.steps * 3 + 10):
        llm.add_request(prompt, params)
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


class WindowDone(Exception):
    """Raised by a step callback once the profiled window is over."""


def serving_steps(args):
    """The serving run twice on one engine: first whole and unobserved but for CUDA events around
    each step (the run's figures, its GPU-busy fraction, the window's by the same events), then
    again up to the end of the window, which the profiler records (the kernel table, and the
    window's busy fraction from the kernels' own times; with --host-ops the host's ops too, whose
    recording slows the host). The profiler is kept out of the run whose figures are reported."""
    import serving
    args.rate = args.rate[0]  # serving.py's --rate takes a sweep: one rate here
    options = {"prefill_first": True} if args.prefill_first else {}
    llm = serving.make_llm(args, **options)
    requests = serving.synthesize(args.trace, args.num_requests, args.seed,
                                  llm.config.max_model_len)
    arrivals = serving.poisson_arrivals(args.rate, args.num_requests, args.seed)
    vocab = llm.config.hf_config["vocab_size"]
    warm = requests[:16]
    serving.drive(llm, warm, [0.0] * len(warm), vocab, args.seed + 7)
    gc.freeze()  # the engine's objects out of the collector's reach, as the server has them
    wait, fraction = waits(llm), gpu_busy_fraction(llm)
    first, state = args.window_start, {}

    def clock(i):  # wall and host time per step over the window, unprofiled
        if i in (first, first + args.steps):
            state[i] = time.perf_counter(), wait["wait"]
    result = serving.drive(llm, requests, arrivals, vocab, args.seed, clock,
                           sample_every=serving.SAMPLE_EVERY)
    if first + args.steps not in state:
        sys.exit(f"the run took {result['steps']} steps: fewer than --window-start + --steps")
    window = fraction(first, first + args.steps)
    whole = fraction()
    (t0, w0), (t1, w1) = state[first], state[first + args.steps]
    wall = (t1 - t0) / args.steps * 1e6
    host = wall - (w1 - w0) / args.steps * 1e6

    def profiled(i):  # profile steps first+1 .. first+args.steps, then stop the second run
        if i == first:  # the host's ops and phases only if asked: recording them slows the host
            state["phases"] = instrument(llm) if args.host_ops else {}
            cpu = [ProfilerActivity.CPU] if args.host_ops else []
            state["prof"] = profile(activities=cpu + [ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["range"] = record_function("step")
            state["range"].__enter__()
        elif first < i <= first + args.steps:
            state["range"].__exit__(None, None, None)
            if i == first + args.steps:
                state["prof"].__exit__(None, None, None)
                raise WindowDone
            state["range"] = record_function("step")
            state["range"].__enter__()
    try:  # other prompts of the same lengths: the first run's are in the prefix cache
        serving.drive(llm, requests, arrivals, vocab, args.seed + 1, profiled,
                      sample_every=serving.SAMPLE_EVERY)
    except WindowDone:
        for request_id in list(llm.requests):
            llm.abort_request(request_id)
        while not llm.is_finished():
            llm.step()
    title = (f"{args.attn_backend}, serving {args.trace} rate {args.rate}, {args.num_requests} "
             f"requests, prefill_first={args.prefill_first}, steps {first + 1}.."
             f"{first + args.steps}, {torch.cuda.get_device_name()}")
    busy = report(state["prof"], args.steps, wall, host, state["phases"], title)
    if args.chrome_trace:
        state["prof"].export_chrome_trace(args.chrome_trace)
    print(f"GPU busy over the same steps, unprofiled (CUDA events): {window:.1%}; the profiled "
          f"kernels' time over the unprofiled steps' GPU time: {busy / (wall * window):.1%}")
    print(f"\nthe whole run: {serving.summary(result)}; GPU busy {whole:.1%} of the time "
          "from the first step's GPU work to the last's (CUDA events)")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), rate=str(args.rate), **result), f)


def workload_steps(args):
    """Time each step of nano-vllm's workload (or of bench.py's `--sharing` workload, with cascade
    attention `--cascade`); print seconds by step kind and decode batch size."""
    llm = engine(args)
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
        prefill = f"with prefill ({sum(batch.num_new_tokens)} tokens)"
        last["t"], last["kind"] = now, kind if decodes else prefill
        return batch
    llm.scheduler.schedule = timed
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    times["the last step, and reading it"] = [1, total - sum(t for _, t in times.values())]
    what = f"{args.sharing}, cascade {args.cascade}" if args.sharing else "nano-vllm's workload"
    print(f"\n{args.attn_backend}: {what} in {total:.2f} s, "
          f"{sum(p.max_tokens * p.n for p in params) / total:,.0f} tokens/s\n\n"
          "| steps | kind | seconds | ms per step |\n"
          "|---|---|---|---|")
    for kind, (n, seconds) in sorted(times.items()):
        print(f"| {n} | {kind} | {seconds:.2f} | {seconds / n * 1e3:.2f} |")


def timed(obj, name: str, sink: dict):
    """Wrap obj.name so that its host time adds up in sink[name] (no profiler range)."""
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


def host_steps(args):
    """The host's work per decode step, timed on the CPU with a tiny random Qwen3 (its heads per KV
    head are Qwen3-0.6B's) and the decode batch's real shape (--sharing, or --batch x --context)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nanovllm.attention.cascade import BlockCopies, members_per_tile, plan_tiles
    from nanovllm.layers.sampler import SamplingTensors
    from nanovllm.worker import cuda_graphs
    config = Qwen3Config(vocab_size=10001, hidden_size=64, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=8, max_position_embeddings=4096)
    with tempfile.TemporaryDirectory() as path:
        Qwen3ForCausalLM(config).save_pretrained(path)
        # run ahead as on CUDA (worker/run_ahead.py)
        llm = LLM(path, skip_tokenizer_init=True, num_kvcache_blocks=3000, async_scheduling=True,
                  device="cpu")
        requests = decode_requests(args, max_tokens=args.steps * 2 + 20)
        for prompt, params in requests:
            llm.add_request(prompt, params)
        phases = defaultdict(float)
        for name in ("schedule", "update"):
            timed(llm.scheduler, name, phases)
        timed(llm.model_runner, "step_inputs", phases)
        timed(llm.output_processor, "outputs", phases)
        # the copies the cascade follows (attention/cascade.py) build up over the run, as the
        # engine's do: every step's, outside the timing
        copies, inputs = BlockCopies(llm.config.kvcache_block_size), llm.model_runner.step_inputs

        def followed(batch):
            step = inputs(batch)
            copies.update(step)
            return step
        llm.model_runner.step_inputs = followed
        num_seqs = sum(params.n for _, params in requests)
        running = llm.scheduler.running
        while len(running) < num_seqs or any(
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
        into = torch.zeros(sum(cuda_graphs.field_sizes(*sizes)) + len(step.sample_rows),
                           dtype=torch.int32)
        upload = mean_us(lambda: cuda_graphs.upload(step, sizes, into))  # on CPU: not pinned
        flat = cuda_graphs.upload(step, sizes, into)
        lengths = cuda_graphs.step_sizes(step)
        unpack = mean_us(lambda: cuda_graphs.unpack(flat, sizes, lengths, step.num_decodes, step))
        members = members_per_tile(2)
        plan = mean_us(lambda: (copies.update(step), plan_tiles(
            step.block_tables, step.context_lens, step.num_decodes, llm.config.kvcache_block_size,
            members, copies)))
        rows = [(s, s.sample_index + j) for s, k in zip(batch.seqs, batch.num_samples)
                for j in range(k)]
        sampling = mean_us(lambda: SamplingTensors.of(rows, config.vocab_size, torch.device("cpu")))
    what = args.sharing or f"batch {args.batch}, context {args.context}"
    print(f"{what}: {step.num_decodes} decode rows, contexts {min(step.context_lens)} to "
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


def plot_timeline(args):
    """One panel per serving run: for a window of it, the sequences that decoded a token in each
    step (line) and the prompt tokens the step prefilled (shaded). With prefill_first, decodes drop
    to zero while prompts are prefilled (the stall one kind of step removes)."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = []
    for path in args.plot_timeline:
        with open(path) as f:
            data = json.load(f)
        runs += data.get("runs", [data])  # serving.py's runs, or profile_step.py --serving's one
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), sharex=True,
                             squeeze=False)
    start, end = args.plot_start, args.plot_start + args.plot_seconds
    for ax, run in zip(axes[:, 0], runs):
        steps = [s for s in run["timeline"] if start <= s[0] <= end]
        times = [s[0] - start for s in steps]
        ax.step(times, [s[1] for s in steps], where="post", color="tab:blue",
                label="sequences decoding")
        ax.set_ylabel("decodes per step")
        ax.set_ylim(bottom=0)
        twin = ax.twinx()
        twin.fill_between(times, [s[2] for s in steps], step="post", color="tab:orange", alpha=0.35,
                          label="prompt tokens prefilled")
        twin.set_ylabel("prompt tokens per step")
        twin.set_ylim(bottom=0)
        mode = "prefill-first (vLLM v0)" if run["prefill_first"] else "one kind of step (mixed)"
        ax.set_title(f"{mode}: {run['output_tokens_per_s']:,.0f} output tokens/s, "
                     f"{len(run['timeline'])} steps in {run['wall']:.1f} s", fontsize=10)
        lines, fills = ax.get_legend_handles_labels(), twin.get_legend_handles_labels()
        ax.legend(lines[0] + fills[0], lines[1] + fills[1], loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel(f"seconds from {start} s into the run")
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


def main():
    import serving
    parser = serving.parser()
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--serving", action="store_true", help="profile steps of a serving run")
    parser.add_argument("--host-ops", action="store_true",
                        help="--serving: profile the host's ops and phases too (slowing its steps)")
    parser.add_argument("--window-start", type=int, default=600,
                        help="--serving: profile after this step")
    parser.add_argument("--workload", action="store_true",
                        help="time the steps of bench.py's workload")
    parser.add_argument("--host", action="store_true",
                        help="the host's work per decode step, on the CPU (no GPU needed)")
    parser.add_argument("--plot-timeline", nargs="+", metavar="JSON", default=[],
                        help="draw the step timelines of serving runs (serving.py --json)")
    parser.add_argument("-o", "--output", default="steps.png", help="--plot-timeline: the PNG")
    parser.add_argument("--plot-start", type=float, default=2.0, help="window start (s)")
    parser.add_argument("--plot-seconds", type=float, default=0.5, help="window length (s)")
    parser.add_argument("--sharing", choices=["shared-prefix", "n8"], default="",
                        help="decode steps of bench.py's workload of that name, not random")
    parser.add_argument("--cascade", choices=["on", "off"], default="on", help="with --sharing")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--chrome-trace", default="", help="also write a Chrome trace to this file")
    args = parser.parse_args()
    if args.plot_timeline:
        plot_timeline(args)
    elif args.host:
        host_steps(args)
    elif args.workload:
        workload_steps(args)
    elif args.serving:
        serving_steps(args)
    else:
        decode_steps(args)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
