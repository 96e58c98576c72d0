"""The vLLM paper's Figures 12, 13 and 2 in this engine: serving under load with paged KV memory
against the reservations of its Orca baselines (`kv_reservation`: oracle, pow2, max).

    python benchmarks/figure12.py run --trace sharegpt -o benchmarks/results/figure12_sharegpt.json
    python benchmarks/figure12.py run --trace alpaca -o benchmarks/results/figure12_alpaca.json
    python benchmarks/figure12.py plot benchmarks/results/figure12_*.json

`run` serves one trace in each mode, with the same requests, on Qwen3-0.6B's shape with random
weights and a KV cache as small against the demand as the paper's (docs/figure12.md says why):
  1. a saturated run: requests always wait (`--backlog` of them), for `--saturate` seconds. After
     its first fifth, it gives the most the mode sustains (output tokens per second, and that over
     the trace's mean output length in requests per second), how many requests it batches (Figure
     13) and what its KV cache holds (Figure 2, from serving.kv_breakdown);
  2. Poisson runs of `--duration` seconds at `--fractions` of that rate, lowest first, for the
     normalized latency against the request rate (Figure 12), until one falls behind: its median
     request waits more than `--queue-steps` decode steps (median TPOT) before it is first
     scheduled, or requests are left at the deadline. Queueing is what makes the paper's normalized
     latency blow up over its hour-long traces; in runs of seconds it shows first in the queueing
     delay, while the normalized latency of a mode that keeps up still grows with its batch (a step
     takes longer), which is no blow-up.
The modes share `--budget` seconds: a mode starts no Poisson run once its share is spent (a run
lasts at most twice --duration plus 10 s). The JSON file is rewritten after every run. `--tiny`
runs a small random model on the CPU with a cache that holds 3 requests of max_model_len.

`plot` draws figure12_latency.png, figure13_batch.png, figure2_memory.png and
figure2_memory_time.png into --out-dir and prints the tables (figure12.md there too). A mode
sustains a rate when neither that run nor any at a lower rate fell behind.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving  # noqa: E402

# 984 blocks of 16: 15,744 KV slots, as many as the paper's OPT-13B had on one A100-40GB (15.7K)
GPU_SETUP = dict(arch="Qwen3-0.6B", attn_backend="triton", block_size=16, max_model_len=2048,
                 num_kvcache_blocks=984)
TINY_SETUP = dict(block_size=16, max_model_len=256, num_kvcache_blocks=48)  # "max" holds 3 requests
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
                queue_p50=serving.percentile(queue, 50),
                kv_shares=serving.shares(means), sampled_running=means["running"],
                ttft_p50=serving.percentile(ttft, 50), ttft_p99=serving.percentile(ttft, 99),
                tpot_p50=serving.percentile(tpot, 50), tpot_p99=serving.percentile(tpot, 99),
                e2e_mean=sum(r["e2e"] for r in recs) / max(1, len(recs)))


def setup(args) -> dict:
    """The engine's options and the run's constants, --tiny or the GPU's."""
    chosen = TINY_SETUP if args.tiny else GPU_SETUP
    for key, value in chosen.items():
        if getattr(args, key, None) in (None, 0, ""):
            setattr(args, key, value)
    args.prefill_first, args.enforce_eager = False, False
    return dict(block_size=args.block_size, max_model_len=args.max_model_len,
                num_kvcache_blocks=args.num_kvcache_blocks, arch="tiny" if args.tiny else args.arch,
                attn_backend="sdpa" if args.tiny else args.attn_backend)


def run(args):
    started = time.monotonic()
    out = dict(trace=args.trace, setup=setup(args), fractions=args.fractions,
               duration=args.duration, saturate=args.saturate, queue_steps=args.queue_steps,
               modes={})
    for k, mode in enumerate(args.modes):
        mode_started = time.monotonic()  # the time left is shared by the modes left
        share = (args.budget - (mode_started - started)) / (len(args.modes) - k)
        llm = serving.make_llm(args, **serving.engine_options(args, mode))
        out["device"] = device_name(llm)
        out["setup"]["kv_bytes_per_token"] = kv_bytes_per_token(llm)
        serving.warm_up(llm, args.trace, args.seed)
        vocab, max_len = llm.config.hf_config["vocab_size"], llm.config.max_model_len
        many = serving.synthesize(args.trace, 100_000, args.seed, max_len)
        mean_output = sum(o for _, o in many) / len(many)
        result = serving.drive(llm, many, [0.0] * len(many), vocab, args.seed, backlog=args.backlog,
                               sample_every=args.sample_every, deadline=args.saturate)
        loaded = serving.window(result["samples"], 0.2)
        saturated = dict(run_summary(result, loaded), samples=result["samples"],
                         tokens_per_s=serving.tokens_per_s(loaded))
        saturated["capacity"] = saturated["tokens_per_s"] / mean_output  # requests per second
        out["modes"][mode] = dict(saturated=saturated, mean_output=mean_output, runs=[])
        print(f"{args.trace}, {mode}, saturated: {saturated['tokens_per_s']:,.0f} output "
              f"tokens/s = {saturated['capacity']:.2f} req/s, mean running "
              f"{saturated['sampled_running']:.1f}, KV token states "
              f"{saturated['kv_shares']['tokens']:.0%}", flush=True)
        save(out, args.output)
        for i, fraction in enumerate(args.fractions):
            if time.monotonic() - mode_started > share:
                print(f"{args.trace}, {mode}: its share of --budget is spent", flush=True)
                break
            rate = fraction * saturated["capacity"]
            n = max(args.min_requests, round(rate * args.duration))
            requests = serving.synthesize(args.trace, n, args.seed + 1 + i, max_len)
            arrivals = serving.poisson_arrivals(rate, n, args.seed + 1 + i)
            result = serving.drive(llm, requests, arrivals, vocab, args.seed,
                                   sample_every=args.sample_every, deadline=2 * arrivals[-1] + 10)
            summary = dict(run_summary(result, result["samples"]), rate=rate, fraction=fraction)
            out["modes"][mode]["runs"].append(summary)
            save(out, args.output)
            print(f"{args.trace}, {mode}, rate {rate:.2f} ({fraction:.2f} of saturated): "
                  f"{serving.summary(result)}", flush=True)
            if behind(summary, args.queue_steps):
                break
        llm.shutdown()


def device_name(llm) -> str:
    import torch
    return torch.cuda.get_device_name() if llm.config.device == "cuda" else "CPU"


def kv_bytes_per_token(llm) -> int:
    """K and V of every layer for one token."""
    cfg = llm.config.hf_config
    return (2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]
            * llm.config.torch_dtype.itemsize)


def save(out: dict, path: str):
    if path:
        with open(path, "w") as f:
            json.dump(out, f)


def behind(run: dict, queue_steps: float) -> bool:
    """Whether a Poisson run fell behind its arrivals: requests left at the deadline, or the median
    request queued for more than `queue_steps` decode steps before it was first scheduled."""
    return bool(run["unfinished"]) or run["queue_p50"] > queue_steps * run["tpot_p50"]


def sustained(runs: list[dict], queue_steps: float) -> float:
    """The highest rate at which neither that run nor any at a lower rate fell behind (0: none)."""
    best = 0.0
    for r in sorted(runs, key=lambda r: r["rate"]):
        if behind(r, queue_steps):
            break
        best = r["rate"]
    return best


def tables(data: dict) -> str:
    """Markdown: per mode its saturated figures, KV breakdown and sustained rate; then every run."""
    modes, steps = data["modes"], data["queue_steps"]
    rates = {mode: sustained(m["runs"], steps) for mode, m in modes.items()}
    ref = modes.get("paged")
    s = data["setup"]
    slots = s["num_kvcache_blocks"] * s["block_size"]
    lines = [f"### {data['trace']}: {data.get('device', '?')}, {s['arch']}, {s['attn_backend']}, "
             f"{s['num_kvcache_blocks']} blocks of {s['block_size']} tokens ({slots:,} slots), "
             f"max_model_len {s['max_model_len']}", "",
             "Saturated: requests always waiting. Sustained: the highest rate at which the median "
             f"request waited at most {steps:g} decode steps (median TPOT) to be scheduled.", "",
             ("| mode | saturated req/s | output tokens/s | mean batch | preemptions | token "
              "states | tail | reserved, later | reserved, never | free | sustained req/s | "
              "paged / mode (sustained) | paged / mode (saturated) |"), "|" + "---|" * 13]
    for mode, m in modes.items():
        sat, kv = m["saturated"], m["saturated"]["kv_shares"]
        ratio_s = (f"{rates['paged'] / rates[mode]:.2f}" if ref and rates[mode] else "")
        ratio_c = f"{ref['saturated']['capacity'] / sat['capacity']:.2f}" if ref else ""
        shares = " | ".join(f"{kv[k]:.1%}" for k in serving.BREAKDOWN)
        lines.append(f"| {mode} | {sat['capacity']:.2f} | {sat['tokens_per_s']:,.0f} | "
                     f"{sat['sampled_running']:.1f} | {sat['preemptions']} | {shares} | "
                     f"{rates[mode]:.2f} | {ratio_s} | {ratio_c} |")
    lines += ["", ("| mode | rate req/s | requests | normalized latency ms/token | queueing p50 ms "
                   "| TTFT p50 ms | TPOT p50 ms | mean running | preemptions | aborted |"),
              "|" + "---|" * 10]
    for mode, m in modes.items():
        for r in m["runs"]:
            lines.append(f"| {mode} | {r['rate']:.2f} | {r['requests']} | "
                         f"{r['normalized_latency'] * 1e3:.2f} | {r['queue_p50'] * 1e3:.0f} | "
                         f"{r['ttft_p50'] * 1e3:.0f} | {r['tpot_p50'] * 1e3:.2f} | "
                         f"{r['mean_running']:.1f} | {r['preemptions']} | {r['unfinished']} |")
    return "\n".join(lines)


def plot(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = []
    for path in args.results:
        with open(path) as f:
            data.append(json.load(f))
    os.makedirs(args.out_dir, exist_ok=True)
    width = len(data)

    fig, axes = plt.subplots(1, width, figsize=(5.5 * width, 4), squeeze=False)
    for ax, d in zip(axes[0], data):
        top = 0.0
        for mode, m in d["modes"].items():
            color, marker, label = STYLE[mode]
            runs = m["runs"]
            ax.plot([r["rate"] for r in runs], [r["normalized_latency"] * 1e3 for r in runs],
                    color=color, marker=marker, label=label)
            if runs:  # the paper's lines leave the chart where they blow up; so do these
                top = max(top, 6 * runs[0]["normalized_latency"] * 1e3)
        ax.set_ylim(0, top or None)
        ax.set_xlim(left=0)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (ms/token)")
        ax.set_title(f"{d['trace']}, {d['setup']['arch']}, {d.get('device', '')}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_fig(fig, args.out_dir, "figure12_latency.png")

    fig, axes = plt.subplots(1, width, figsize=(4.5 * width, 3.6), squeeze=False)
    for ax, d in zip(axes[0], data):
        modes = list(d["modes"])
        values = [d["modes"][m]["saturated"]["sampled_running"] for m in modes]
        bars = ax.bar([STYLE[m][2] for m in modes], values, color=[STYLE[m][0] for m in modes])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_ylabel("requests batched (mean, saturated)")
        ax.set_title(d["trace"], fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    save_fig(fig, args.out_dir, "figure13_batch.png")

    fig, axes = plt.subplots(1, width, figsize=(5.5 * width, 3.2), squeeze=False)
    for ax, d in zip(axes[0], data):
        modes = list(d["modes"])
        left = [0.0] * len(modes)
        for k in serving.BREAKDOWN:
            share = [d["modes"][m]["saturated"]["kv_shares"][k] * 100 for m in modes]
            bars = ax.barh([STYLE[m][2] for m in modes], share, left=left, color=KV_COLORS[k],
                           label=KV_LABELS[k])
            if k == "tokens":
                ax.bar_label(bars, fmt="%.1f%%", label_type="center", fontsize=8, color="white")
            left = [a + b for a, b in zip(left, share)]
        ax.set_xlim(0, 100)
        ax.set_xlabel("share of the KV cache (%), saturated")
        ax.set_title(d["trace"], fontsize=10)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_fig(fig, args.out_dir, "figure2_memory.png")

    rows = max(len(d["modes"]) for d in data)
    fig, axes = plt.subplots(rows, width, figsize=(5.5 * width, 1.9 * rows), squeeze=False,
                             sharey=True)
    for col, d in enumerate(data):
        for row, (mode, m) in enumerate(d["modes"].items()):
            samples = m["saturated"]["samples"]
            fields = serving.SAMPLE_FIELDS
            t = [s[0] for s in samples]
            total = [sum(s[fields.index(k)] for k in serving.BREAKDOWN) or 1 for s in samples]
            stack = [[100 * s[fields.index(k)] / n for s, n in zip(samples, total)]
                     for k in serving.BREAKDOWN]
            ax = axes[row][col]
            ax.stackplot(t, stack, colors=[KV_COLORS[k] for k in serving.BREAKDOWN],
                         labels=[KV_LABELS[k] for k in serving.BREAKDOWN])
            ax.set_title(f"{d['trace']}, {STYLE[mode][2]}", fontsize=9)
            ax.set_ylim(0, 100)
            ax.set_ylabel("% of KV")
        axes[-1][col].set_xlabel("seconds into the saturated run")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_fig(fig, args.out_dir, "figure2_memory_time.png")

    text = "\n\n".join(tables(d) for d in data)
    with open(os.path.join(args.out_dir, "figure12.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def save_fig(fig, out_dir: str, name: str):
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="serve one trace in every mode; write a JSON file")
    r.add_argument("--trace", default="sharegpt", choices=sorted(serving.TRACES))
    r.add_argument("-o", "--output", default="", help="the JSON file (rewritten after every run)")
    r.add_argument("--modes", nargs="+", default=list(serving.MODES), choices=list(serving.MODES))
    r.add_argument("--fractions", nargs="+", type=float,
                   default=[0.4, 0.7, 0.9, 1.0, 1.15],
                   help="Poisson rates, as fractions of the mode's saturated rate")
    r.add_argument("--duration", type=float, default=5.0, help="seconds of Poisson arrivals")
    r.add_argument("--saturate", type=float, default=5.0, help="seconds of the saturated run")
    r.add_argument("--backlog", type=int, default=64, help="requests kept waiting, saturated")
    r.add_argument("--min-requests", type=int, default=20)
    r.add_argument("--queue-steps", type=float, default=10.0,
                   help="a run falls behind when its median request queues longer (steps)")
    r.add_argument("--sample-every", type=float, default=0.02, help="seconds between KV samples")
    r.add_argument("--budget", type=float, default=520.0,
                   help="seconds for the whole command: a mode starts no run past its share")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--tiny", action="store_true", help="a small random model on the CPU")
    r.add_argument("--arch", default="")
    r.add_argument("--attn-backend", default="")
    r.add_argument("--block-size", type=int, default=0)
    r.add_argument("--max-model-len", type=int, default=0)
    r.add_argument("--num-kvcache-blocks", type=int, default=0)
    d = sub.add_parser("plot", help="draw the figures and print the tables from run's JSON files")
    d.add_argument("results", nargs="+")
    d.add_argument("--out-dir", default="benchmarks/results")
    args = p.parse_args()
    if args.command == "run":
        run(args)
    else:
        plot(args)


if __name__ == "__main__":
    main()
