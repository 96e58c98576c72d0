"""Draw what steps did over time: `python benchmarks/plot_timeline.py a.json b.json -o steps.png`.

Each JSON file holds runs of benchmarks/serving.py (--json), each drawn in a panel of its own. For
a window of the run, the upper line is the number of sequences that decoded a token in each step
and the shaded area the prompt tokens the step prefilled: with prefill_first, decodes drop to zero
while prompts are prefilled (the stall one kind of step removes); mixed steps keep decoding through
them.
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("-o", "--output", default="steps.png")
    parser.add_argument("--start", type=float, default=2.0, help="window start (s)")
    parser.add_argument("--seconds", type=float, default=0.5, help="window length (s)")
    args = parser.parse_args()
    runs = []
    for path in args.runs:
        with open(path) as f:
            data = json.load(f)
        runs += data.get("runs", [data])  # serving.py's runs, or one run (files before sweeps)
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), sharex=True,
                             squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        steps = [s for s in run["timeline"] if args.start <= s[0] <= args.start + args.seconds]
        times = [s[0] - args.start for s in steps]
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
        lines = ax.get_legend_handles_labels()
        fills = twin.get_legend_handles_labels()
        ax.legend(lines[0] + fills[0], lines[1] + fills[1], loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel(f"seconds from {args.start} s into the run")
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
