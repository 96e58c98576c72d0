"""The step trace (nanovllm/trace.py): replaying it gives back the engine's own state at every
step, and its events are the engine's (copies, forks, prefix hits, evictions, preemptions,
swaps)."""
import json
import os
import subprocess
import sys

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.trace import EVENT_ORDER, Trace, replay
from nanovllm.viz import render_page
from nanovllm.viz.__main__ import main as viz_main
from nanovllm.viz.check import MAX_TRACE_BYTES
from tests.trace_helpers import (DEMO_OPTIONS, SWAP_OPTIONS, CheckedTrace, crowded_workload,
                                 engine_truth, long_trace, run_workload)

MARKER_START = '<script type="application/json" id="trace">'
MODES = {"recompute": ({}, run_workload), "swap": (SWAP_OPTIONS, run_workload),  # the demo's
         "crowded": ({"num_kvcache_blocks": 28}, crowded_workload),
         "crowded swap": ({**SWAP_OPTIONS, "num_kvcache_blocks": 28}, crowded_workload)}
DEMO = ["recompute", "swap"]


@pytest.fixture(scope="module")
def traced(tiny_path, tmp_path_factory):
    """mode -> (trace data, CheckedTrace) of a workload run under those options."""
    runs = {}
    for mode, (options, workload) in MODES.items():
        llm = LLM(tiny_path, **{**DEMO_OPTIONS, **options})
        path = tmp_path_factory.mktemp(mode.replace(" ", "_")) / "run.json"
        with CheckedTrace(llm, path) as trace:
            workload(llm)
        with open(path) as f:
            runs[mode] = json.load(f), trace
    return runs


def events(entry, kind):
    return [e for e in entry["events"] if e[0] == kind]


def all_entries(data):
    return data["steps"] + [data["end"]]


@pytest.mark.parametrize("mode", MODES)
def test_replay_gives_back_the_engine_state_at_every_step(traced, mode):
    data, trace = traced[mode]
    assert len(trace.truth) == len(data["steps"]) + 1 > 20
    for i, truth in enumerate(trace.truth):
        state = replay(data, i)
        for key in ("tables", "cpu_tables", "ref_counts", "cached", "free"):
            assert state[key] == truth[key], (i, key)
        assert state["cached"] & state["free"] == truth["cached_free"]
        assert all_entries(data)[i]["num_free"] == len(truth["free"])
    assert not trace.truth[-1]["tables"] and len(trace.truth[-1]["free"]) == data["num_blocks"]


@pytest.mark.parametrize("mode", MODES)
def test_copy_on_write_events_are_the_batch_copies(traced, mode):
    data, trace = traced[mode]
    for entry, batch in zip(data["steps"], trace.batches):
        cows = [(src, dst) for _, dst, _, src in events(entry, "cow")]
        assert sorted(cows) == sorted(batch["copies"])
    assert sum(len(b["copies"]) for b in trace.batches) >= 3  # n=3 sampling and the beams copy


@pytest.mark.parametrize("mode", MODES)
def test_swaps_and_preemptions_are_the_engines(traced, mode):
    data, trace = traced[mode]
    for entry, batch in zip(data["steps"], trace.batches):
        assert [(b, cpu) for _, b, _, cpu in events(entry, "swap_out")] == batch["swap_out"]
        assert [(cpu, b) for _, b, _, cpu in events(entry, "swap_in")] == batch["swap_in"]
    preempts = [e for entry in all_entries(data) for e in events(entry, "preempt")]
    groups = {(i, data["seqs"][str(e[2])]["request"]) for i, entry in enumerate(all_entries(data))
              for e in events(entry, "preempt")}  # the scheduler counts a group once
    assert len(groups) == trace.truth[-1]["num_preemptions"] >= 1
    assert {e[3] for e in preempts} == {data["preemption_mode"]}
    if data["preemption_mode"] == "swap":
        assert any(batch["swap_in"] for batch in trace.batches)


@pytest.mark.parametrize("mode", MODES)
def test_block_events_agree_with_the_engine_state(traced, mode):
    data, trace = traced[mode]
    before = {"cached": set(data["start"]["cached"]), "tables": {}}
    for entry, truth in zip(all_entries(data), trace.truth):
        for kind, block, seq, _ in entry["events"]:
            if kind in ("alloc", "cow", "swap_in"):  # taken fresh: cached only if the step fills it
                assert truth["ref_counts"][block] >= 1
                assert (block not in truth["cached"]
                        or ["cached", block, None, None] in entry["events"])
            if kind in ("alloc", "cow", "hit", "share"):
                assert block in truth["tables"][str(seq)]
            if kind == "hit":  # cached before, or by the step that computes it (scheduled first)
                assert block in truth["cached"]
                assert block in before["cached"] or ["cached", block, None, None] in entry["events"]
            if kind == "free":
                assert block in before["tables"][str(seq)]
        evicted, cached = ({e[1] for e in events(entry, kind)} for kind in ("evict", "cached"))
        assert before["cached"] - truth["cached"] <= evicted <= before["cached"]
        assert truth["cached"] - before["cached"] <= cached <= truth["cached"]
        assert evicted & truth["cached"] <= cached  # taken for new data and registered again
        before = truth


@pytest.mark.parametrize("mode", DEMO)
def test_prefix_hits_are_the_cached_tokens(traced, mode):
    """A sequence's hit blocks at its first admission make its num_cached_tokens (a full hit still
    computes its last prompt token)."""
    data, trace = traced[mode]
    first_seen, hits = {}, {}
    for i, entry in enumerate(all_entries(data)):
        for kind, _, seq, _ in entry["events"]:
            if kind in ("hit", "alloc") and seq is not None:
                first_seen.setdefault(seq, i)
                if kind == "hit" and first_seen[seq] == i:
                    hits[seq] = hits.get(seq, 0) + 1
    block_size, full_hits = data["block_size"], 0
    for seq, i in first_seen.items():
        info = data["seqs"][str(seq)]
        cached = trace.truth[i]["num_cached_tokens"][str(seq)]
        assert cached == min(hits.get(seq, 0) * block_size, info["num_prompt_tokens"] - 1), seq
        full_hits += hits.get(seq, 0) * block_size == info["num_prompt_tokens"]
    assert full_hits >= 1 and len(hits) >= 2


@pytest.mark.parametrize("mode", MODES)
def test_a_fork_shares_its_parents_blocks(traced, mode):
    data, trace = traced[mode]
    num_forks = 0
    for i, entry in enumerate(data["steps"]):
        copies = {dst: src for src, dst in trace.batches[i]["copies"]}
        for _, _, child, parent in events(entry, "fork"):
            num_forks += 1
            assert data["seqs"][str(child)]["parent"] == parent
            parent_table = (trace.truth[i - 1]["tables"].get(str(parent))
                            or trace.truth[i]["tables"][str(parent)])
            child_table = [copies.get(b, b) for b in trace.truth[i]["tables"][str(child)]]
            shared = [b for _, b, s, _ in events(entry, "share") if s == child]
            assert child_table[:len(parent_table)] == parent_table
            assert shared and set(shared) <= set(parent_table)
            request = data["seqs"][str(child)]["request"]
            assert request == data["seqs"][str(parent)]["request"]
    assert num_forks >= 2 + 3  # the n=3 request's two forks, and the beams'


def test_beams_let_go_and_requests_finish(traced):
    data, _ = traced["recompute"]
    reasons = [e[3] for entry in all_entries(data) for e in events(entry, "finish")]
    assert "pruned" in reasons and "length" in reasons
    beams = [s for s, info in data["seqs"].items() if info["beam"]]
    assert len(beams) >= 4


def test_batches_and_format(traced):
    data, _ = traced["recompute"]
    assert data["format"] == "nanovllm-trace" and data["version"] == 1
    assert data["num_blocks"] == DEMO_OPTIONS["num_kvcache_blocks"]
    assert data["block_size"] == DEMO_OPTIONS["kvcache_block_size"]
    kinds = {e[0] for entry in all_entries(data) for e in entry["events"]}
    assert kinds == set(EVENT_ORDER) - {"swap_out", "swap_in"}
    for entry in data["steps"]:
        assert entry["batch"] and entry["dt"] >= 0
        assert [EVENT_ORDER.index(e[0]) for e in entry["events"]] == sorted(
            EVENT_ORDER.index(e[0]) for e in entry["events"])
        for seq, kind, n, start, _ in entry["batch"]:
            prompt = data["seqs"][str(seq)]["num_prompt_tokens"]
            assert (kind == "prefill") == (start < prompt) and n >= 1
    assert "batch" not in data["end"]
    assert [e["step"] for e in data["steps"]] == list(range(len(data["steps"])))


def test_a_trace_opened_mid_run_starts_from_the_engine_state(tiny_path, tmp_path):
    llm = LLM(tiny_path, **DEMO_OPTIONS)
    llm.add_request(list(range(30)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    llm.add_request(list(range(30)) + [7] * 9, SamplingParams(n=2, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        llm.step()
    start = engine_truth(llm)
    with CheckedTrace(llm, tmp_path / "t.json") as trace:
        while not llm.is_finished():
            llm.step()
    data = json.loads((tmp_path / "t.json").read_text())
    assert replay(data, -1)["tables"] == start["tables"] and start["tables"]
    for i, truth in enumerate(trace.truth):
        assert replay(data, i)["ref_counts"] == truth["ref_counts"]


def test_no_open_trace_records_nothing_and_an_error_still_writes_it(tiny_path, tmp_path):
    llm = LLM(tiny_path, **DEMO_OPTIONS)
    assert not llm.observers
    with pytest.raises(KeyboardInterrupt), llm.trace(tmp_path / "t.json"):
        with pytest.raises(RuntimeError, match="already open"):
            Trace(llm, tmp_path / "u.json").__enter__()
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        request_id = llm.add_request(list(range(20)), params)
        llm.step()
        raise KeyboardInterrupt
    assert not llm.observers and not (tmp_path / "u.json").exists()
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["steps"] and replay(data, len(data["steps"]))["tables"]  # the request still runs
    assert llm.abort_request(request_id)
    llm.generate([list(range(20))], SamplingParams(max_tokens=4), use_tqdm=False)  # untraced
    assert json.loads((tmp_path / "t.json").read_text()) == data


def test_the_page_embeds_the_trace_as_inert_data(traced):
    """Request ids and prompts can hold anything: in the page the trace is JSON that no `<` can
    end, and it reads back equal."""
    data = json.loads(json.dumps(traced["recompute"][0]))
    hostile = "</script><script>alert(1)</script><!-- & \u2028"
    first = next(iter(data["seqs"]))  # sequence ids count on across the test session
    data["seqs"][first]["request"] = data["seqs"][first]["prompt"] = hostile
    page = render_page(data)
    start = page.index(MARKER_START) + len(MARKER_START)
    inside = page[start:page.index("</script>", start)]
    assert "<" not in inside and ">" not in inside and "&" not in inside
    assert json.loads(inside) == data
    with pytest.raises(ValueError, match="not a nanovllm trace"):
        render_page({"format": "something else"})


def viz_cli(path, monkeypatch, capsys) -> tuple[int, str]:
    """`python -m nanovllm.viz path` run here: its exit status and what it wrote to stderr."""
    monkeypatch.setattr("sys.argv", ["viz", str(path), "-o", str(path) + ".html"])
    try:
        viz_main()
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize("mode", MODES)
def test_the_page_command_draws_every_traced_run(traced, mode, tmp_path, monkeypatch, capsys):
    """What the engine writes passes the page's check: samples, beams, preemption, swapping."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps(traced[mode][0]))
    assert viz_cli(path, monkeypatch, capsys) == (0, "")
    assert (tmp_path / "run.json.html").stat().st_size > path.stat().st_size


def first(trace, field) -> int:
    """The first step with something in `field`."""
    return next(e["step"] for e in trace["steps"] if e[field])


def put(trace, where, value):
    """trace with the value at a path of keys (a callable key: computed from the trace)."""
    *path, last = [k(trace) if callable(k) else k for k in where]
    obj = trace
    for key in path:
        obj = obj[key]
    if value is DELETE:
        del obj[last]
    else:
        obj[last] = value
    return trace


DELETE = object()


def seq_of_table(trace) -> str:
    return next(iter(trace["steps"][first(trace, "tables")]["tables"]))


REFUSED = {  # name: (where, value, the message), on a valid trace of 300 steps and 16 blocks
    "no steps": (["steps"], DELETE, "steps is None: expected a non-empty list of steps"),
    "empty steps": (["steps"], [], "steps is []: expected a non-empty list of steps"),
    "steps oops": (["steps"], "oops", "steps is 'oops': expected a non-empty list of steps"),
    "num_blocks NaN": (["num_blocks"], float("nan"),
                       "num_blocks is nan: expected an integer from 1 to 131072"),
    "num_blocks negative": (["num_blocks"], -3,
                            "num_blocks is -3: expected an integer from 1 to 131072"),
    "num_blocks 10**9": (["num_blocks"], 10**9,
                         "num_blocks is 1000000000: expected an integer from 1 to 131072"),
    "num_blocks a string": (["num_blocks"], "16",
                            "num_blocks is '16': expected an integer from 1 to 131072"),
    "num_blocks true": (["num_blocks"], True,
                        "num_blocks is True: expected an integer from 1 to 131072"),
    "version 2": (["version"], 2, "version is 2: expected 1 (the version this page draws)"),
    "another format": (["format"], "chrome-trace", "not a nanovllm trace: its 'format' is "
                       "'chrome-trace', expected 'nanovllm-trace'"),
    "a step not an object": (["steps", 5], "x", "steps[5] is 'x': expected an object"),
    "a step out of order": (["steps", 7, "step"], 8, "steps[7].step is 8: expected 7 (its index)"),
    "a block past the cache": (
        ["steps", lambda t: first(t, "tables"), "tables", seq_of_table, 0], 16,
        "steps[40].tables['0'] block is 16: expected an integer from 0 to 15"),
    "a table of an unknown sequence": (
        ["steps", 3, "tables", "999"], [1], "steps[3].tables key is '999': expected a sequence "
        "id of 'seqs'"),
    "a batch of 'many' tokens": (
        ["steps", lambda t: first(t, "batch"), "batch", 0, 2], "many",
        "steps[40].batch[0] tokens is 'many': expected an integer from 0 up"),
    "an event of no known kind": (
        ["steps", lambda t: first(t, "events"), "events", 0, 0], "explode",
        "steps[40].events[0] is ['explode', 15, 0, None]: expected [kind, block, seq id, extra], "
        "kind one of ('finish', 'preempt', 'free', 'swap_out', 'swap_in', 'fork', "
        "'share', 'evict', 'hit', 'alloc', 'cow', 'cached')"),
    "an infinite time": (["steps", 0, "t"], float("inf"),
                         "steps[0].t is inf: expected a number of seconds, finite, from 0"),
    "free blocks past the cache": (["end"], {"tables": {}, "cpu_tables": {}, "events": [],
                                             "num_free": 17, "running": 0, "waiting": 0,
                                             "swapped": 0},
                                   "end.num_free is 17: expected an integer from 0 to 16"),
    "a prompt not text": (["seqs", "0", "prompt"], ["x"] * 200,
                          "seqs['0'].prompt is ['x', 'x', 'x', 'x', ...]: expected a string"),
    "NaN where the page does not read": (["note"], float("nan"), "the trace holds NaN or "
                                         "Infinity, which JSON (and the page) does not allow"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_the_page_command_refuses_a_trace_it_cannot_draw(name, tmp_path, monkeypatch, capsys):
    """Exit status 2, one line on stderr naming the field, and no page written."""
    where, value, message = REFUSED[name]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(put(long_trace(300, num_blocks=16), where, value)))
    status, err = viz_cli(path, monkeypatch, capsys)
    assert (status, err) == (2, f"python -m nanovllm.viz: error: {message}\n")
    assert not (tmp_path / "bad.json.html").exists()


NOT_TRACES = {  # name: (the file's bytes, None: a sparse file past the limit; the message)
    "not JSON": (b"{", "is not JSON: Expecting property name enclosed in double quotes"),
    "a list": (b"[1, 2]", "not a nanovllm trace: its 'format' is 'list'"),
    "not UTF-8": (b'{"model": "\xff"}', "is not JSON: 'utf-8' codec can't decode byte 0xff"),
    "too large": (None, f"is {MAX_TRACE_BYTES + 1:,} bytes: the page holds a trace of at most "
                        f"{MAX_TRACE_BYTES:,} ({MAX_TRACE_BYTES >> 20} MiB)"),
}


@pytest.mark.parametrize("name", NOT_TRACES)
def test_the_page_command_refuses_a_file_that_is_no_trace(name, tmp_path, monkeypatch, capsys):
    content, message = NOT_TRACES[name]
    path = tmp_path / "bad.json"
    if content is None:  # its size is checked before it is read
        with open(path, "wb") as f:
            f.truncate(MAX_TRACE_BYTES + 1)
    else:
        path.write_bytes(content)
    status, err = viz_cli(path, monkeypatch, capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith("python -m nanovllm.viz: error: ") and message in err
    assert not (tmp_path / "bad.json.html").exists()


def test_a_trace_nested_200000_levels_is_refused_in_one_line(tmp_path):
    """Python's JSON reader recurses per level: the command says so in one line, exit status 2."""
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "nanovllm.viz", str(path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"python -m nanovllm.viz: error: {path} nests its JSON deeper than a "
                           "trace does (and than Python's reader can follow)\n")
    assert not (tmp_path / "deep.html").exists()


def test_the_demo_writes_a_trace_and_its_page(tmp_path, monkeypatch, capsys):
    from benchmarks import trace_demo
    monkeypatch.setattr("sys.argv", ["trace_demo.py", "--out", str(tmp_path / "demo")])
    trace_demo.main()
    data = json.loads((tmp_path / "demo" / "trace_demo.json").read_text())
    kinds = {e[0] for entry in all_entries(data) for e in entry["events"]}
    assert {"hit", "fork", "cow", "preempt"} <= kinds  # what the demo is there to show
    assert any(info["beam"] for info in data["seqs"].values())
    page = (tmp_path / "demo" / "trace_demo.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and json.loads(
        page.split(MARKER_START)[1].split("</script>")[0]) == data
    for fetch in ("http", "src=", "<link", "import(", "fetch("):  # no network: nothing to fetch
        assert fetch not in page
    assert f"{len(data['steps'])} steps traced" in capsys.readouterr().out


def test_the_demo_writes_nothing_into_the_repository(tmp_path, monkeypatch):
    """Without --out the demo writes into a new temporary directory; the repository's root is
    refused as --out (it once wrote trace_demo.json and .html there, from the working directory)."""
    from benchmarks import trace_demo
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    made = trace_demo.output_dir("")
    assert os.path.dirname(made) == str(tmp_path) and os.listdir(made) == []
    with pytest.raises(ValueError, match="--out .* is the repository's root"):
        trace_demo.output_dir(trace_demo.REPO)


def test_a_step_that_fails_to_launch_is_not_recorded(tiny_path, tmp_path):
    """The step is undone (requeue.py) and scheduled again: the trace holds the launched steps."""
    llm = LLM(tiny_path, **DEMO_OPTIONS)
    run, launches = llm.model_runner.run, []

    def fails_once(batch):
        launches.append(batch)
        if len(launches) == 2:
            raise RuntimeError("launch failed")
        return run(batch)
    llm.model_runner.run = fails_once
    path = tmp_path / "run.json"
    with Trace(llm, path):
        llm.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4))
        with pytest.raises(RuntimeError, match="launch failed"):
            while not llm.is_finished():
                llm.step()
        while not llm.is_finished():
            llm.step()
    with open(path) as f:
        data = json.load(f)
    assert len(data["steps"]) == len(launches) - 1 >= 4
    assert not replay(data, len(data["steps"]))["tables"]
