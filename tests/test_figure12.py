"""benchmarks/figure12.py on a tiny CPU model: the setup its JSON records (tensor parallelism
included), Figure 16's shared prefix (shared by paged memory, by no reservation), a --budget that
bounds the whole command, and the panels and tables that `plot` draws from several files."""
import json
import os
import subprocess
import sys
import time
from argparse import Namespace

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "figure12.py")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import figure12  # noqa: E402
import serving  # noqa: E402

QUICK = ["--tiny", "--saturate", "1", "--duration", "1", "--min-requests", "5"]


def figure12_command(*words: str, timeout: float = 120) -> float:
    """Run figure12.py with these arguments; its wall time in seconds."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, SCRIPT, *map(str, words)], capture_output=True,
                            text=True, timeout=timeout, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return time.monotonic() - started


@pytest.fixture(scope="module")
def run_json(tmp_path_factory) -> str:
    """Figure 12's command on two ranks (gloo): paged and Orca (Max) on Alpaca."""
    path = str(tmp_path_factory.mktemp("figure12") / "alpaca.json")
    figure12_command("run", *QUICK, "--trace", "alpaca", "--tensor-parallel-size", 2, "--modes",
                     "paged", "max", "--fractions", 0.5, 1.0, "--budget", 40, "-o", path)
    return path


@pytest.fixture(scope="module")
def prefix_json(tmp_path_factory) -> str:
    """Figure 16's command: both prefixes, paged with prefix caching and Orca (Oracle) without."""
    path = str(tmp_path_factory.mktemp("figure16") / "prefix.json")
    figure12_command("prefix", *QUICK, "--fractions", 0.5, "--budget", 40, "-o", path)
    return path


@pytest.mark.slow  # runs figure12.py on the tiny model
def test_run_records_its_setup(run_json):
    with open(run_json) as f:
        data = json.load(f)
    setup = data["setup"]
    assert setup["tensor_parallel_size"] == 2 and setup["arch"] == "tiny"
    assert setup["num_kvcache_blocks"] == 48 and setup["block_size"] == 16
    assert data["device"] == "CPU" and data["budget"] == 40
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    assert head and data["commit"].startswith(head)
    [panel] = data["panels"]
    assert panel["figure"] == 12 and panel["trace"] == "alpaca"
    for mode in ("paged", "max"):
        assert panel["modes"][mode]["saturated"]["capacity"] > 0
        assert panel["modes"][mode]["runs"], mode
    batch = {m: panel["modes"][m]["saturated"]["sampled_running"] for m in ("paged", "max")}
    assert batch["paged"] > batch["max"]


@pytest.mark.slow  # runs figure12.py on the tiny model
def test_prefix_is_shared_by_paged_memory_only(prefix_json):
    with open(prefix_json) as f:
        data = json.load(f)
    slots = data["setup"]["num_kvcache_blocks"] * data["setup"]["block_size"]
    assert [(p["figure"], p["shots"], p["prefix_len"]) for p in data["panels"]] == [
        (16, 1, 80), (16, 5, 341)]
    for panel in data["panels"]:
        paged, oracle = (panel["modes"][m]["saturated"] for m in ("paged", "oracle"))
        assert paged["prefix_hits"] > 0.5 and oracle["prefix_hits"] == 0, panel["shots"]
        assert paged["sampled_running"] > oracle["sampled_running"], panel["shots"]
        # a block shared by the running requests is counted once: the slots add up to the cache
        held = sum(paged["kv_slots"][k] for k in serving.BREAKDOWN)
        assert held == pytest.approx(slots), panel["shots"]
        assert all(panel["modes"][m]["runs"] for m in ("paged", "oracle"))


@pytest.mark.slow  # runs figure12.py on the tiny model
def test_budget_bounds_the_whole_command(tmp_path):
    """Saturated and Poisson runs that would take minutes stop with the budget, builds counted."""
    path = str(tmp_path / "budget.json")
    budget = 12
    wall = figure12_command("run", "--tiny", "--modes", "paged", "oracle", "--saturate", 60,
                            "--duration", 60, "--fractions", 0.5, "--budget", budget, "-o", path)
    assert wall < budget + 6
    with open(path) as f:
        modes = json.load(f)["panels"][0]["modes"]
    assert list(modes) == ["paged", "oracle"]
    assert all(0 < m["saturated"]["wall"] < budget / 2 + 1 for m in modes.values())


def fake_run(rate: float, fell_behind: bool = False, cut: bool = False) -> dict:
    return dict(rate=rate, queue_p50=1.0 if fell_behind else 0.001, tpot_p50=0.01, unfinished=0,
                cut=cut)


def test_sustained_rate():
    runs = [fake_run(1), fake_run(2), fake_run(3, fell_behind=True), fake_run(4)]
    assert figure12.sustained(runs, 10) == 2
    assert figure12.sustained([fake_run(1), fake_run(2, cut=True), fake_run(3)], 10) == 1
    assert figure12.sustained([fake_run(1, fell_behind=True)], 10) == 0


def sweep(knee_rate: float, fractions: list[float], monkeypatch) -> list[float]:
    """The fractions of the saturated rate (100 req/s) that figure12.serve runs, in order, for a
    mode whose median request queues (falls behind) above `knee_rate` req/s."""
    def drive(llm, requests, arrivals, vocab, seed, backlog=0, deadline=0.0, **_):
        rate = len(requests) / 100 if not backlog else 0.0  # --duration 100
        record = dict(prompt=8, output=8, e2e=1.0, prefix=0, cached=0, ttft=0.1, tpot=0.01,
                      queue=1.0 if rate > knee_rate else 0.001)
        tokens = 100 * sum(o for _, o in requests) / len(requests)  # saturated: 100 requests/s
        samples = [[t, 4, 0, tokens * t] + [1] * len(serving.BREAKDOWN) for t in (0.0, 0.5, 1.0)]
        return dict(wall=1.0, steps=100, requests_per_s=rate, output_tokens_per_s=tokens,
                    mean_running=4, max_running=4, unfinished=0, normalized_latency=0.1,
                    preemptions=0, records=[record], samples=samples)
    monkeypatch.setattr(serving, "drive", drive)
    monkeypatch.setattr(serving, "warm_up", lambda *a: None)
    llm = Namespace(config=Namespace(hf_config=dict(vocab_size=100), max_model_len=256))
    args = Namespace(backlog=4, sample_every=0.0, saturate=1.0, seed=0, fractions=fractions,
                     min_requests=1, duration=100.0, queue_steps=10.0, knee=1.1, output="")
    panel = dict(figure=12, trace="alpaca", prefix_len=0, modes={})
    out = dict(setup=dict(arch="tiny"))
    figure12.serve(args, llm, "paged", panel, time.monotonic() + 10_000, out)
    return [run["fraction"] for run in panel["modes"]["paged"]["runs"]]


def test_runs_place_the_knee_within_ten_percent(monkeypatch):
    """After a run falls behind, runs at geometric midpoints narrow the knee to 10%; if the first
    run falls behind, lower rates look for one that keeps up."""
    ran = sweep(93, [0.5, 0.8, 1.0], monkeypatch)
    assert ran[:3] == [0.5, 0.8, 1.0] and ran[3] == pytest.approx(0.8 ** 0.5)
    kept = max(f for f in ran if f <= 0.93)
    behind = min(f for f in ran if f > 0.93)
    assert behind / kept <= 1.1 + 1e-9 and len(ran) == 5
    ran = sweep(60, [0.9], monkeypatch)
    assert ran[:2] == pytest.approx([0.9, 0.9 / 1.21])
    kept = max(f for f in ran if f <= 0.6)
    assert min(f for f in ran if f > 0.6) / kept <= 1.1 + 1e-9
    assert sweep(200, [0.5, 1.0], monkeypatch) == [0.5, 1.0]  # kept up at every rate: no more
    assert figure12.next_fraction(0.0, 0.9, 1.0) is None  # --knee 1: none


def fake_panel(arch: str, trace: str, rates: dict[str, tuple[float, float]]) -> dict:
    """A Figure 12 panel whose modes sustain rates[mode][0] and saturate at rates[mode][1]."""
    modes = {m: dict(saturated=dict(capacity=saturated),
                     runs=[fake_run(rate / 2), fake_run(rate), fake_run(rate * 1.5, True)])
             for m, (rate, saturated) in rates.items()}
    return dict(figure=12, trace=trace, prefix_len=0, queue_steps=10, device="GPU", modes=modes,
                setup=dict(arch=arch, tensor_parallel_size=2 if arch == "big" else 1,
                           num_kvcache_blocks=984, block_size=16))


def test_summary_table_gives_papers_ratios():
    rates = dict(paged=(10.0, 9.0), oracle=(5.0, 6.0), pow2=(4.0, 4.5), max=(2.0, 3.0))
    table = figure12.summary_table([fake_panel("small", "sharegpt", rates)])
    row = table.splitlines()[-1]
    assert row.startswith("| 12 | small, GPU, 15,744 KV slots | sharegpt | 10.00 (9.00) | "
                          "5.00 (6.00) |")
    assert row.endswith("| 2.00 (1.50) | 2.50 (2.00) | 5.00 (3.00) |")
    paged_only = figure12.summary_table([fake_panel("big", "alpaca", dict(paged=(10.0, 9.0)))])
    assert paged_only.splitlines()[-1] == (
        "| 12 | big, 2 x GPU, 15,744 KV slots | alpaca | 10.00 (9.00) | - | - | - | - | - | - |")


def panel_files(tmp_path, *rates: dict) -> list[str]:
    """A JSON file per rates (fake_panel's), each one panel of the same model, cache and trace."""
    paths = []
    for r in rates:
        panel = fake_panel("small", "sharegpt", r)
        common = {k: panel.pop(k) for k in ("setup", "device", "queue_steps")}
        paths.append(str(tmp_path / f"{len(paths)}.json"))
        with open(paths[-1], "w") as f:
            json.dump(dict(common, panels=[panel]), f)
    return paths


def test_modes_of_one_panel_from_two_files(tmp_path):
    """Modes that two commands measured on the same model, cache and trace make one panel."""
    paths = panel_files(tmp_path, dict(max=(2.0, 3.0), oracle=(5.0, 6.0)), dict(paged=(10.0, 9.0)))
    [panel] = figure12.load(paths)
    assert list(panel["modes"]) == ["paged", "oracle", "max"]
    assert len(figure12.load(paths[:1] + [paths[0]])) == 1


def test_a_mode_from_two_files_keeps_every_run(tmp_path):
    """A mode measured by two commands: the first one's saturated run, both ones' Poisson runs."""
    [panel] = figure12.load(panel_files(tmp_path, dict(oracle=(4.0, 6.0)), dict(oracle=(5.0, 7.0))))
    oracle = panel["modes"]["oracle"]
    assert oracle["saturated"]["capacity"] == 6.0
    assert [r["rate"] for r in oracle["runs"]] == [2.0, 2.5, 4.0, 5.0, 6.0, 7.5]
    assert figure12.sustained(oracle["runs"], 10) == 5.0  # 6.0 fell behind


def test_runs_load_sorted_by_rate(tmp_path):
    """--knee runs rates out of order (one that fell behind, then lower ones): load sorts them, so
    that a mode's line and its table go by rate."""
    [path] = panel_files(tmp_path, dict(paged=(4.0, 6.0)))
    with open(path) as f:
        data = json.load(f)
    data["panels"][0]["modes"]["paged"]["runs"].reverse()  # 6.0 (behind), 4.0, 2.0
    with open(path, "w") as f:
        json.dump(data, f)
    [panel] = figure12.load([path])
    assert [r["rate"] for r in panel["modes"]["paged"]["runs"]] == [2.0, 4.0, 6.0]


def test_grid_is_the_papers_layout():
    """A row per trace, a column per model: 2 models x 2 traces in four panels, (a) to (d)."""
    rates = dict(paged=(10.0, 9.0))
    panels = [fake_panel(arch, trace, rates) for trace in ("sharegpt", "alpaca")
              for arch in ("small", "big")]
    fig, placed = figure12.grid(panels, lambda p: p["trace"], figure12.model_name, (2, 2))
    assert fig.axes[0].get_subplotspec().get_gridspec().get_geometry() == (2, 2)
    small, big = "small, GPU, 15,744 KV slots", "big, 2 x GPU, 15,744 KV slots"
    assert [title.split("\n") for _, _, title in placed] == [
        ["(a) sharegpt", small], ["(b) sharegpt", big], ["(c) alpaca", small], ["(d) alpaca", big]]


@pytest.mark.slow  # runs figure12.py on the tiny model
def test_plot_of_several_files(run_json, prefix_json, tmp_path):
    """Two models x two traces for Figures 12, 13 and 2, and Figure 16's two prefixes."""
    with open(run_json) as f:
        data = json.load(f)
    paths = [run_json, prefix_json]
    for arch, trace in (("Qwen3-8B", "alpaca"), ("tiny", "sharegpt"), ("Qwen3-8B", "sharegpt")):
        data["setup"]["arch"], data["panels"][0]["trace"] = arch, trace
        paths.append(str(tmp_path / f"{arch}_{trace}.json"))
        with open(paths[-1], "w") as f:
            json.dump(data, f)
    out = tmp_path / "plots"
    figure12.plot(Namespace(results=paths, out_dir=str(out)))
    for name in ("figure12_latency.png", "figure13_batch.png", "figure2_memory.png",
                 "figure2_memory_time.png", "figure16_latency.png"):
        assert (out / name).stat().st_size > 10_000, name
    text = (out / "figure12.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| 12 |", "| 16 |"))]
    assert len(rows) == 6
    assert sum(row.startswith("| 16 | tiny, CPU, 768 KV slots | wmt16, 5-shot prefix (341 tokens)")
               for row in rows) == 1
    assert text.count("### Figure 12,") == 4 and text.count("### Figure 16,") == 2
