"""The vLLM paper's Figures 12, 13, 2 and 16 in this engine: serving under load with paged KV memory
against the reservations of its Orca baselines (`kv_reservation`: oracle, pow2, max).

    python benchmarks/figure12.py run --arch Qwen3-8B --trace sharegpt -o out/sharegpt_8b.json
    python benchmarks/figure12.py run --arch Qwen3-32B --tensor-parallel-size 2 -o out/32b.json
    python benchmarks/figure12.py prefix --arch Qwen3-8B -o out/figure16_8b.json
    python benchmarks/figure12.py plot out/*.json --out-dir out

`run` (Figures 12, 13 and 2) serves one trace in each mode, with the same requests, on an
architecture of benchmarks/archs.json (`--arch`, random weights) split over
`--tensor-parallel-size` GPUs, with a KV cache as small against the demand as the paper's: its
15,744 slots at every model size (docs/figure12.md says why). For each mode:
  1. a saturated run: requests always wait (`--backlog` of them), for `--saturate` seconds. After
     its first fifth, it gives the most the mode sustains (output tokens per second, and that over
     the trace's mean output length in requests per second), how many requests it batches (Figure
     13) and what its KV cache holds (Figure 2, from serving.kv_breakdown);
  2. Poisson runs of `--duration` seconds at `--fractions` of that rate, lowest first, for the
     normalized latency against the request rate (Figure 12), until one falls behind: its median
     request waits more than `--queue-steps` decode steps (median TPOT) before it is first
     scheduled, or requests are left at the deadline (twice the time its last request would end
     at the saturated run's time per step, plus 10 s). Then runs at the geometric midpoint of the
     highest rate that kept up and the lowest that fell behind place the knee, until the two lie
     within `--knee` (10%) of each other (if the first run fell behind, runs at rates lower by
     `--knee` squared look for one that keeps up). Queueing is what makes the paper's
     normalized latency blow up over its hour-long traces; in runs of seconds it shows first in the
     queueing delay, while the normalized latency of a mode that keeps up still grows with its
     batch (a step takes longer), which is no blow-up.

`prefix` (Figure 16) does the same on the paper's translation workload (serving.py's `wmt16`
trace: a sentence of 32 tokens on average, a translation of 40) behind a prefix that every request
shares, of the paper's lengths: one-shot (an instruction and one example, 80 tokens) and few-shot
(five examples, 341 tokens), random token ids. Paged memory with prefix caching (the prefix's
blocks are shared) runs against Orca (Oracle) without it (every request holds its own copy); both
prefixes are served by one engine per mode.

`--budget` seconds bound the whole command from its start, engine builds included: each mode gets
an equal share of the time left when it starts (a mode is skipped if less is left than the longest
build so far), and each workload an equal share of its mode's. A saturated run lasts at most what
is left; a Poisson run starts only if its last request would end in time at the saturated run's
time per step, and is aborted at the share's end (marked `cut`: it says neither that the mode keeps
up nor that it falls behind). The JSON file is rewritten after every run, so a killed process
leaves what it measured, with the setup (model, tensor parallelism, trace, KV blocks, device,
commit). `--tiny` runs a small random model on the CPU with a cache that holds 3 requests of
max_model_len (`prefix`: 1, as max_model_len is 512 there to hold the few-shot prefix).

`plot` takes any number of JSON files and draws the paper's layouts, a panel per (model, trace):
figure12_latency.png (normalized latency against request rate, a line per system),
figure13_batch.png, figure2_memory.png, figure2_memory_time.png, and figure16_latency.png (a panel
per (model, prefix)), into --out-dir; it prints the tables and writes them to figure12.md there: one
row per panel with each mode's sustained rate and paged's ratios to each, then each panel's runs. A
mode sustains a rate when neither that run nor any at a lower rate fell behind.
"""
import argparse
import json
import math
import os
import string
import subprocess
import sys
import time

STARTED = time.monotonic()  # --budget counts from here, before torch is imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving  # noqa: E402

# 984 blocks of 16: 15,744 KV slots, as many as the paper's OPT-13B had on one A100-40GB (15.7K)
GPU_SETUP = dict(arch="Qwen3-0.6B", attn_backend="triton", block_size=16, max_model_len=2048,
                 num_kvcache_blocks=984)
TINY_SETUP = dict(block_size=16, max_model_len=256, num_kvcache_blocks=48)  # "max" holds 3 requests
TINY_PREFIX_SETUP = dict(TINY_SETUP, max_model_len=512)  # room for the few-shot prefix
PREFIXES = {1: 80, 5: 341}  # examples in the prefix -> its tokens (the paper's Figure 16)
PREFIX_TRACE = "wmt16"
STYLE = {"max": ("tab:red", "x", "Orca (Max)"), "pow2": ("tab:orange", "^", "Orca (Pow2)"),
         "oracle": ("tab:green", "s", "Orca (Oracle)"), "paged": ("tab:blue", "o", "paged (vLLM)")}
KV_LABELS = {"tokens": "token states", "tail": "unused tail of the last block",
             "reserved_later": "reserved, used later", "reserved_never": "reserved, never used",
             "free": "free"}
KV_COLORS = {"tokens": "tab:blue", "tail": "tab:purple", "reserved_later": "tab:olive",
             "reserved_never": "tab:red", "free": "lightgray"}


def run_summary(result: dict, samples: list) -> dict:
    """What a run's JSON keeps: its figures without per-request records and step timelines."""
    recs = result["records"]
    ttft = [r["ttft"] for r in recs if r["ttft"] is not None]
    tpot = [r["tpot"] for r in recs if r["tpot"] is not None]
    keep = {k: result[k] for k in ("wall", "steps", "requests_per_s", "output_tokens_per_s",
                                   "mean_running", "max_running", "unfinished",
                                   "normalized_latency", "preemptions")}
    means = serving.sample_means(samples)
    queue = [r["queue"] for r in recs if r["queue"] is not None]
    return dict(keep, requests=len(recs) + result["unfinished"], kv_slots=means,
                queue_p50=serving.percentile(queue, 50), prefix_hits=prefix_hits(recs),
                kv_shares=serving.shares(means), sampled_running=means["running"],
                ttft_p50=serving.percentile(ttft, 50), ttft_p99=serving.percentile(ttft, 99),
                tpot_p50=serving.percentile(tpot, 50), tpot_p99=serving.percentile(tpot, 99),
                e2e_mean=sum(r["e2e"] for r in recs) / max(1, len(recs)))


def prefix_hits(records: list[dict]) -> float | None:
    """The share of the finished requests' prompt tokens served from the prefix cache."""
    if not records or any(r.get("cached") is None for r in records):
        return None
    return sum(r["cached"] for r in records) / sum(r["prompt"] + r["prefix"] for r in records)


def setup(args, tiny_setup: dict) -> dict:
    """The engine's options and the run's constants, --tiny or the GPU's."""
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    for name in ("budget", "saturate", "duration"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name} must be > 0 seconds, got {getattr(args, name)}")
    if not min(args.fractions) > 0:
        raise ValueError(f"--fractions must all be > 0, got {args.fractions}")
    chosen = tiny_setup if args.tiny else GPU_SETUP
    for key, value in chosen.items():
        if getattr(args, key, None) in (None, 0, ""):
            setattr(args, key, value)
    args.prefill_first, args.enforce_eager, args.run_ahead_steps = False, False, None
    return dict(block_size=args.block_size, max_model_len=args.max_model_len,
                num_kvcache_blocks=args.num_kvcache_blocks, arch="tiny" if args.tiny else args.arch,
                attn_backend="sdpa" if args.tiny else args.attn_backend,
                tensor_parallel_size=args.tensor_parallel_size)


def run(args):
    """Figures 12, 13 and 2: the trace in every mode."""
    out = header(args, setup(args, TINY_SETUP))
    out["panels"] = [dict(figure=12, trace=args.trace, prefix_len=0, modes={})]
    measure(args, out, {mode: serving.engine_options(args, mode) for mode in args.modes})


def prefix(args):
    """Figure 16: paged memory sharing the prefix's blocks against reservations that share none."""
    out = header(args, setup(args, TINY_PREFIX_SETUP))
    out["panels"] = [dict(figure=16, trace=PREFIX_TRACE, shots=shots, prefix_len=PREFIXES[shots],
                          modes={}) for shots in args.shots]
    options = {mode: dict(serving.engine_options(args, mode),
                          enable_prefix_caching=mode == "paged") for mode in args.modes}
    measure(args, out, options)


def header(args, engine_setup: dict) -> dict:
    """What a JSON file says of its command: the setup its panels share."""
    return dict(setup=engine_setup, device="", commit=commit(), budget=args.budget,
                fractions=args.fractions, duration=args.duration, saturate=args.saturate,
                queue_steps=args.queue_steps)


def measure(args, out: dict, options: dict[str, dict]):
    """Serve every panel's workload in each mode (mode -> its engine options), an engine per mode,
    within --budget; the JSON file is rewritten after every run."""
    end, longest_build = STARTED + args.budget, 0.0
    for k, (mode, engine_options) in enumerate(options.items()):
        built = time.monotonic()
        mode_end = built + (end - built) / (len(options) - k)  # the modes left share the time left
        if mode_end - built < longest_build:
            print(f"{mode}: skipped, less of --budget is left than a build takes", flush=True)
            continue
        llm = serving.make_llm(args, **engine_options)
        longest_build = max(longest_build, time.monotonic() - built)
        out["device"] = device_name(llm)
        out["setup"]["kv_bytes_per_token"] = kv_bytes_per_token(llm)
        print(f"{mode}: engine built in {time.monotonic() - built:.0f} s on {out['device']}",
              flush=True)
        for j, panel in enumerate(out["panels"]):
            now = time.monotonic()
            serve(args, llm, mode, panel, now + (mode_end - now) / (len(out["panels"]) - j), out)
        llm.shutdown()


def serve(args, llm, mode: str, panel: dict, panel_end: float, out: dict):
    """One mode on one panel's workload until `panel_end`: the saturated run, then Poisson runs."""
    name = f"{workload_name(panel)}, {out['setup']['arch']}, {mode}"
    vocab = llm.config.hf_config["vocab_size"]
    shared = serving.shared_prefix(panel["prefix_len"], vocab, args.seed)
    max_len = llm.config.max_model_len - len(shared)  # for the request's own tokens
    many = serving.synthesize(panel["trace"], 100_000, args.seed, max_len)
    mean_output = sum(o for _, o in many) / len(many)
    serving.warm_up(llm, panel["trace"], args.seed, shared)
    left = panel_end - time.monotonic()
    if left <= 0:
        print(f"{name}: no time left of --budget", flush=True)
        return
    result = serving.drive(llm, many, [0.0] * len(many), vocab, args.seed, backlog=args.backlog,
                           sample_every=args.sample_every, deadline=min(args.saturate, left),
                           prefix=shared)
    loaded = serving.window(result["samples"], 0.2)
    saturated = dict(run_summary(result, loaded), samples=result["samples"],
                     tokens_per_s=serving.tokens_per_s(loaded))
    saturated["capacity"] = saturated["tokens_per_s"] / mean_output  # requests per second
    step_time = result["wall"] / max(1, result["steps"])
    panel["modes"][mode] = dict(saturated=saturated, mean_output=mean_output, runs=[])
    hits = saturated["prefix_hits"]
    print(f"{name}, saturated: {saturated['tokens_per_s']:,.0f} output tokens/s = "
          f"{saturated['capacity']:.2f} req/s, mean running {saturated['sampled_running']:.1f}, "
          f"KV token states {saturated['kv_shares']['tokens']:.0%}"
          + (f", prefix cache hits {hits:.0%}" if hits is not None else ""), flush=True)
    save(out, args.output)
    if not saturated["capacity"] > 0:
        print(f"{name}: the saturated run measured no rate: no Poisson runs", flush=True)
        return
    fractions, kept_up, fell_behind, i = list(args.fractions), 0.0, math.inf, 0
    while fractions:
        fraction = fractions.pop(0)
        rate = fraction * saturated["capacity"]
        n = max(args.min_requests, round(rate * args.duration))
        requests = serving.synthesize(panel["trace"], n, args.seed + 1 + i, max_len)
        arrivals = serving.poisson_arrivals(rate, n, args.seed + 1 + i)
        ends = last_end(arrivals, requests, step_time)
        left = panel_end - time.monotonic()
        if ends > left:
            print(f"{name}: its share of --budget is spent", flush=True)
            break
        deadline = 2 * ends + 10
        result = serving.drive(llm, requests, arrivals, vocab, args.seed, prefix=shared,
                               sample_every=args.sample_every, deadline=min(deadline, left))
        summary = dict(run_summary(result, result["samples"]), rate=rate, fraction=fraction,
                       cut=bool(result["unfinished"]) and left < deadline)
        panel["modes"][mode]["runs"].append(summary)
        save(out, args.output)
        print(f"{name}, rate {rate:.2f} ({fraction:.2f} of saturated): "
              f"{serving.summary(result)}" + (" (cut by --budget)" if summary["cut"] else ""),
              flush=True)
        if summary["cut"]:
            break
        if behind(summary, args.queue_steps):
            fell_behind, fractions = min(fell_behind, fraction), []  # higher rates fall behind too
        else:
            kept_up = max(kept_up, fraction)
        i += 1
        if not fractions and (refine := next_fraction(kept_up, fell_behind, args.knee)):
            fractions = [refine]


def next_fraction(kept_up: float, fell_behind: float, knee: float) -> float | None:
    """The next Poisson rate, as a fraction of the saturated one, that narrows down the knee: the
    geometric midpoint of the highest fraction that kept up and the lowest that fell behind (0 and
    inf: none yet), or, if none kept up, the lowest over knee squared. None once they lie within a
    factor `knee` of each other, when none fell behind, or with knee <= 1."""
    if knee <= 1 or fell_behind == math.inf or fell_behind <= kept_up * knee:
        return None
    return math.sqrt(kept_up * fell_behind) if kept_up else fell_behind / knee ** 2


def last_end(arrivals: list[float], requests: list[tuple[int, int]], step_time: float) -> float:
    """When the last request ends (seconds from the run's start) if each is scheduled as it arrives
    and generates a token per step of `step_time`."""
    return max(a + output * step_time for a, (_, output) in zip(arrivals, requests))


def device_name(llm) -> str:
    """The GPU's name (the first of the tensor-parallel ones), or "CPU"."""
    import torch
    return torch.cuda.get_device_name() if llm.config.device == "cuda" else "CPU"


def commit() -> str:
    """The checkout's short commit ("-dirty" with uncommitted changes), or "" outside git."""
    def git(*words: str) -> str:
        try:
            return subprocess.run(["git", *words], cwd=os.path.dirname(os.path.abspath(__file__)),
                                  capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    head = git("rev-parse", "--short", "HEAD")
    changed = head and git("status", "--porcelain", "--untracked-files=no")
    return head + "-dirty" if changed else head


def kv_bytes_per_token(llm) -> int:
    """K and V of every layer for one token."""
    cfg = llm.config.hf_config
    return (2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]
            * llm.config.torch_dtype.itemsize)


def save(out: dict, path: str):
    """Write the JSON file whole (nothing if path is empty)."""
    if path:
        with open(path + ".part", "w") as f:
            json.dump(out, f)
        os.replace(path + ".part", path)  # a process killed while writing leaves the last file


def behind(run: dict, queue_steps: float) -> bool:
    """Whether a Poisson run fell behind its arrivals: requests left at the deadline, or the median
    request queued for more than `queue_steps` decode steps before it was first scheduled."""
    return bool(run["unfinished"]) or run["queue_p50"] > queue_steps * run["tpot_p50"]


def sustained(runs: list[dict], queue_steps: float) -> float:
    """The highest rate at which neither that run nor any at a lower rate fell behind (0: none);
    a run cut short by the budget says neither, and ends the search."""
    best = 0.0
    for r in sorted(runs, key=lambda r: r["rate"]):
        if r.get("cut") or behind(r, queue_steps):
            break
        best = r["rate"]
    return best


def load(paths: list[str]) -> list[dict]:
    """The panels of run's and prefix's JSON files, each with its file's setup. Modes of one panel
    (the same model, device, cache and workload) measured by several commands come together; a mode
    measured by several keeps the first one's saturated run and every one's Poisson runs, and each
    mode's runs come sorted by rate."""
    panels = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        common = {k: v for k, v in data.items() if k != "panels"}
        for panel in data.get("panels", [{}]):  # a file without panels is one Figure 12 panel
            p = {"figure": 12, "prefix_len": 0, **common, **panel}
            key = json.dumps([p["figure"], p["setup"], p["device"], p["trace"], p["prefix_len"]],
                             sort_keys=True)
            modes = panels.setdefault(key, dict(p, modes={}))["modes"]
            for mode, measured in p["modes"].items():
                earlier = modes[mode] if mode in modes else dict(measured, runs=[])
                runs = sorted(earlier["runs"] + measured["runs"], key=lambda r: r["rate"])
                modes[mode] = dict(earlier, runs=runs)  # by rate: --knee runs them out of order
    for p in panels.values():
        p["modes"] = {m: p["modes"][m] for m in serving.MODES if m in p["modes"]}
    return list(panels.values())


def model_name(panel: dict) -> str:
    """The model, its devices and its KV cache: what a column of Figure 12 varies."""
    s = panel["setup"]
    tp = s.get("tensor_parallel_size", 1)
    device = panel.get("device") or "?"
    slots = s["num_kvcache_blocks"] * s["block_size"]
    return f"{s['arch']}, " + (f"{tp} x {device}" if tp > 1 else device) + f", {slots:,} KV slots"


def workload_name(panel: dict) -> str:
    """The trace, and for Figure 16 the prefix: what a row of Figure 12 (a column of 16) varies."""
    if panel["figure"] == 16:
        return f"{panel['trace']}, {panel['shots']}-shot prefix ({panel['prefix_len']} tokens)"
    return panel["trace"]


def panel_name(panel: dict) -> str:
    """The workload and the model, short."""
    return f"{workload_name(panel)}, {panel['setup']['arch']}"


def ratio(a: float | None, b: float | None) -> str:
    """a / b to two decimals, or "-" where either is missing, zero or not a number."""
    return f"{a / b:.2f}" if a and b and math.isfinite(a / b) else "-"


def summary_table(panels: list[dict]) -> str:
    """Markdown: a row per panel, each mode's sustained (saturated) rate, paged's ratios to each."""
    others = [m for m in serving.MODES if m != "paged"]
    lines = ["Requests per second each mode sustains (in brackets: saturated), and paged's ratios "
             "to each mode, sustained (saturated).", "",
             "| figure | model | workload | " + " | ".join(STYLE[m][2] for m in serving.MODES)
             + " | " + " | ".join(f"paged / {m}" for m in others) + " |",
             "|" + "---|" * (3 + len(serving.MODES) + len(others))]
    for p in panels:
        rates = {m: sustained(r["runs"], p["queue_steps"]) for m, r in p["modes"].items()}
        sat = {m: r["saturated"]["capacity"] for m, r in p["modes"].items()}
        cells = [f"{rates[m]:.2f} ({sat[m]:.2f})" if m in rates else "-" for m in serving.MODES]
        ratios = [f"{ratio(rates.get('paged'), rates.get(m))} "
                  f"({ratio(sat.get('paged'), sat.get(m))})" if m in rates else "-"
                  for m in others]
        lines.append(f"| {p['figure']} | {model_name(p)} | {workload_name(p)} | "
                     + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def tables(data: dict) -> str:
    """Markdown: per mode its saturated figures, KV breakdown and sustained rate; then every run."""
    modes, steps = data["modes"], data["queue_steps"]
    rates = {mode: sustained(m["runs"], steps) for mode, m in modes.items()}
    ref = modes.get("paged")
    s = data["setup"]
    slots = s["num_kvcache_blocks"] * s["block_size"]
    tp = s.get("tensor_parallel_size", 1)
    lines = [f"### Figure {data['figure']}, {workload_name(data)}: {data.get('device') or '?'}"
             + (f" x {tp}" if tp > 1 else "") + f", {s['arch']}, {s['attn_backend']}, "
             f"{s['num_kvcache_blocks']} blocks of {s['block_size']} tokens ({slots:,} slots), "
             f"max_model_len {s['max_model_len']}"
             + (f", commit {data['commit']}" if data.get("commit") else ""), "",
             "Saturated: requests always waiting. Sustained: the highest rate at which the median "
             f"request waited at most {steps:g} decode steps (median TPOT) to be scheduled.", "",
             ("| mode | saturated req/s | output tokens/s | mean batch | preemptions | prefix "
              "cache hits | token states | tail | reserved, later | reserved, never | free | "
              "sustained req/s | paged / mode (sustained) | paged / mode (saturated) |"),
             "|" + "---|" * 14]
    for mode, m in modes.items():
        sat, kv = m["saturated"], m["saturated"]["kv_shares"]
        hits = sat.get("prefix_hits")
        shares = " | ".join(f"{kv[k]:.1%}" for k in serving.BREAKDOWN)
        lines.append(f"| {mode} | {sat['capacity']:.2f} | {sat['tokens_per_s']:,.0f} | "
                     f"{sat['sampled_running']:.1f} | {sat['preemptions']} | "
                     f"{'-' if hits is None else f'{hits:.1%}'} | {shares} | {rates[mode]:.2f} | "
                     f"{ratio(rates.get('paged'), rates[mode]) if ref else '-'} | "
                     f"{ratio(ref['saturated']['capacity'], sat['capacity']) if ref else '-'} |")
    lines += ["", ("| mode | rate req/s | requests | normalized latency ms/token | queueing p50 ms "
                   "| TTFT p50 ms | TPOT p50 ms | mean running | preemptions | aborted |"),
              "|" + "---|" * 10]
    for mode, m in modes.items():
        for r in m["runs"]:
            aborted = f"{r['unfinished']}" + (" (cut by the budget)" if r.get("cut") else "")
            lines.append(f"| {mode} | {r['rate']:.2f} | {r['requests']} | "
                         f"{r['normalized_latency'] * 1e3:.2f} | {r['queue_p50'] * 1e3:.0f} | "
                         f"{r['ttft_p50'] * 1e3:.0f} | {r['tpot_p50'] * 1e3:.2f} | "
                         f"{r['mean_running']:.1f} | {r['preemptions']} | {aborted} |")
    return "\n".join(lines)


def grid(panels: list[dict], row_of, col_of, size: tuple[float, float], **options):
    """A figure with a panel per cell, rows and columns keyed in order of first appearance (a
    second panel for a taken cell gets a column of its own), and (axes, panel, title) per panel,
    lettered in reading order as the paper's. Empty cells are blank."""
    import matplotlib.pyplot as plt
    rows, cols, cells = [], [], {}
    for p in panels:
        r, c = row_of(p), col_of(p)
        if r not in rows:
            rows.append(r)
        free = [j for j, key in enumerate(cols) if key == c and (rows.index(r), j) not in cells]
        if not free:
            cols.append(c)
            free = [len(cols) - 1]
        cells[rows.index(r), free[0]] = p
    fig, axes = plt.subplots(len(rows), len(cols), squeeze=False,
                             figsize=(size[0] * len(cols), size[1] * len(rows)), **options)
    placed = []
    for (i, j), p in sorted(cells.items()):
        letter = string.ascii_lowercase[len(placed) % 26]
        placed.append((axes[i][j], p, f"({letter}) {workload_name(p)}\n{model_name(p)}"))
    for i in range(len(rows)):
        for j in range(len(cols)):
            if (i, j) not in cells:
                axes[i][j].axis("off")
    return fig, placed


def latency_panel(ax, p: dict, title: str):
    """Normalized latency against request rate, a line per mode (runs cut by the budget left out);
    the paper's lines leave the chart where they blow up, and so do these."""
    top = 0.0
    for mode, m in p["modes"].items():
        color, marker, label = STYLE[mode]
        if p["figure"] == 16:
            label = "paged, prefix shared (vLLM)" if mode == "paged" else label
        runs = [r for r in m["runs"] if not r.get("cut")]
        ax.plot([r["rate"] for r in runs], [r["normalized_latency"] * 1e3 for r in runs],
                color=color, marker=marker, label=label)
        if runs:
            top = max(top, 6 * runs[0]["normalized_latency"] * 1e3)
    ax.set_ylim(0, top or None)
    ax.set_xlim(left=0)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (ms/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(args):
    import matplotlib
    matplotlib.use("Agg")
    panels = load(args.results)
    os.makedirs(args.out_dir, exist_ok=True)
    fig12 = [p for p in panels if p["figure"] == 12]
    fig16 = [p for p in panels if p["figure"] == 16]
    if fig12:
        fig12.sort(key=lambda p: list(serving.TRACES).index(p["trace"]))  # ShareGPT's row first
        by_trace = (lambda p: p["trace"], model_name)  # the paper's: a row per trace
        fig, placed = grid(fig12, *by_trace, (5.5, 4.2))
        for ax, p, title in placed:
            latency_panel(ax, p, title)
        save_fig(fig, args.out_dir, "figure12_latency.png")

        fig, placed = grid(fig12, *by_trace, (4.5, 3.8))
        for ax, p, title in placed:
            modes = list(p["modes"])
            values = [p["modes"][m]["saturated"]["sampled_running"] for m in modes]
            bars = ax.bar([STYLE[m][2] for m in modes], values, color=[STYLE[m][0] for m in modes])
            ax.bar_label(bars, fmt="%.1f")
            ax.set_ylabel("requests batched (mean, saturated)")
            ax.set_title(title, fontsize=9)
            ax.tick_params(axis="x", labelsize=8)
        save_fig(fig, args.out_dir, "figure13_batch.png")

        fig, placed = grid(fig12, *by_trace, (5.5, 3.4))
        for ax, p, title in placed:
            memory_bars(ax, p, title)
        placed[-1][0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        save_fig(fig, args.out_dir, "figure2_memory.png")
        memory_over_time(fig12, args.out_dir)
    if fig16:
        fig, placed = grid(fig16, model_name, workload_name, (5.5, 4.2))  # the paper's: a row
        for ax, p, title in placed:
            latency_panel(ax, p, title)
        save_fig(fig, args.out_dir, "figure16_latency.png")

    text = "\n\n".join([summary_table(panels)] + [tables(p) for p in panels])
    with open(os.path.join(args.out_dir, "figure12.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def memory_bars(ax, p: dict, title: str):
    """Figure 2: the KV breakdown of each mode's saturated run, a stacked bar per mode."""
    modes = list(p["modes"])
    left = [0.0] * len(modes)
    for k in serving.BREAKDOWN:
        share = [p["modes"][m]["saturated"]["kv_shares"][k] * 100 for m in modes]
        bars = ax.barh([STYLE[m][2] for m in modes], share, left=left, color=KV_COLORS[k],
                       label=KV_LABELS[k])
        if k == "tokens":
            ax.bar_label(bars, fmt="%.1f%%", label_type="center", fontsize=8, color="white")
        left = [a + b for a, b in zip(left, share)]
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the KV cache (%), saturated")
    ax.set_title(title, fontsize=9)


def memory_over_time(panels: list[dict], out_dir: str):
    """The KV breakdown over each saturated run: a row per mode, a column per panel."""
    import matplotlib.pyplot as plt
    rows = max(len(p["modes"]) for p in panels)
    fig, axes = plt.subplots(rows, len(panels), figsize=(5.5 * len(panels), 1.9 * rows),
                             squeeze=False, sharey=True)
    fields = serving.SAMPLE_FIELDS
    for col, p in enumerate(panels):
        for row, (mode, m) in enumerate(p["modes"].items()):
            samples = m["saturated"]["samples"]
            t = [s[0] for s in samples]
            total = [sum(s[fields.index(k)] for k in serving.BREAKDOWN) or 1 for s in samples]
            stack = [[100 * s[fields.index(k)] / n for s, n in zip(samples, total)]
                     for k in serving.BREAKDOWN]
            ax = axes[row][col]
            ax.stackplot(t, stack, colors=[KV_COLORS[k] for k in serving.BREAKDOWN],
                         labels=[KV_LABELS[k] for k in serving.BREAKDOWN])
            ax.set_title(f"{panel_name(p)}, {STYLE[mode][2]}", fontsize=9)
            ax.set_ylim(0, 100)
            ax.set_ylabel("% of KV")
        axes[-1][col].set_xlabel("seconds into the saturated run")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_fig(fig, out_dir, "figure2_memory_time.png")


def save_fig(fig, out_dir: str, name: str):
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def serving_options(p: argparse.ArgumentParser, modes: list[str]):
    """The options `run` and `prefix` share: the engine's and the sweep's."""
    p.add_argument("-o", "--output", default="", help="the JSON file (rewritten after every run)")
    p.add_argument("--modes", nargs="+", default=modes, choices=list(serving.MODES))
    p.add_argument("--fractions", nargs="+", type=float,
                   default=[0.4, 0.7, 0.9, 1.0, 1.15],
                   help="Poisson rates, as fractions of the mode's saturated rate")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of Poisson arrivals")
    p.add_argument("--saturate", type=float, default=5.0, help="seconds of the saturated run")
    p.add_argument("--backlog", type=int, default=64, help="requests kept waiting, saturated")
    p.add_argument("--min-requests", type=int, default=20)
    p.add_argument("--knee", type=float, default=1.1,
                   help="after a run falls behind, more runs until the knee lies within this "
                        "factor of rates (1: none)")
    p.add_argument("--queue-steps", type=float, default=10.0,
                   help="a run falls behind when its median request queues longer (steps)")
    p.add_argument("--sample-every", type=float, default=0.02, help="seconds between KV samples")
    p.add_argument("--budget", type=float, default=520.0,
                   help="seconds for the whole command, engine builds included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a small random model on the CPU")
    p.add_argument("--arch", default="", help="an architecture of benchmarks/archs.json")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split on")
    p.add_argument("--attn-backend", default="")
    p.add_argument("--block-size", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--num-kvcache-blocks", type=int, default=0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="Figures 12, 13, 2: one trace in every mode; a JSON file")
    r.add_argument("--trace", default="sharegpt", choices=sorted(serving.TRACES))
    serving_options(r, list(serving.MODES))
    f = sub.add_parser("prefix", help="Figure 16: a shared prefix, paged against Orca (Oracle)")
    f.add_argument("--shots", nargs="+", type=int, default=list(PREFIXES), choices=list(PREFIXES),
                   help="examples in the prefix: 1 (80 tokens), 5 (341 tokens)")
    serving_options(f, ["paged", "oracle"])
    d = sub.add_parser("plot", help="draw the figures and print the tables from JSON files")
    d.add_argument("results", nargs="+")
    d.add_argument("--out-dir", default="benchmarks/results")
    args = p.parse_args()
    {"run": run, "prefix": prefix, "plot": plot}[args.command](args)


if __name__ == "__main__":
    main()
