"""What the page can draw, checked before a page is written: a trace file is read within a size
limit and without Python's recursion running out, and its fields (the format nanovllm/trace.py
writes) have the types and ranges the page's script relies on. A trace that fails is refused with a
ValueError of one line naming the field, rather than written as a page that stays blank.

The limits, and why (times in headless Chromium on 2 CPU cores):
- MAX_TRACE_BYTES (256 MiB), for the file and for the JSON the page holds: the page reads the trace
  as one JavaScript string (Chromium's longest is 2**29 - 24 characters, about 512 Mi) and parses it
  into objects several times its size: a trace of 250 MiB (1.2 million short steps) loads in about
  5 s into 0.75 GiB of the 3.5 GiB a page may use.
- MAX_BLOCKS (2**17), GPU and CPU blocks: the grid draws every block at every step, a cell of at
  least 4 pixels each; at 2**17 blocks a step takes about 0.35 s to draw, and the time grows with
  the count (4.6 s at 2**20).
"""
import json
import os
import reprlib

from nanovllm.trace import EVENT_ORDER

FORMAT, VERSION = "nanovllm-trace", 1
MAX_TRACE_BYTES = 256 * 2**20
MAX_BLOCKS = 2**17
MAX_BLOCK_SIZE = 2**20  # tokens in a block
BATCH_KINDS = ("prefill", "decode")
PREEMPTION_MODES = ("recompute", "swap")
_repr = reprlib.Repr()  # a value in a message: short, one line, however large or deep
_repr.maxstring = _repr.maxother = 40
_repr.maxlist = _repr.maxdict = 4
_repr.maxlevel = 2
_short = _repr.repr


def load_trace(path) -> dict:
    """Read a trace file: a ValueError for one too large, not JSON, or nested too deep to read."""
    size = os.path.getsize(path)
    if size > MAX_TRACE_BYTES:
        raise ValueError(f"{path} is {size:,} bytes: the page holds a trace of at most "
                         f"{MAX_TRACE_BYTES:,} ({MAX_TRACE_BYTES >> 20} MiB)")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except RecursionError:  # Python's reader recurses once per level of nesting
            raise ValueError(f"{path} nests its JSON deeper than a trace does (and than Python's "
                             "reader can follow)") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path} is not JSON: {e}") from None


def fail(where: str, value, expected: str):
    raise ValueError(f"{where} is {_short(value)}: expected {expected}")


def is_int(value) -> bool:
    return type(value) is int  # not bool, not float (NaN, 1e9 and 2.5 included)


def count(value, where: str, lo: int, hi: int | None = None) -> int:
    """An integer from lo (to hi): a block count, a block id, a number of tokens."""
    if not is_int(value) or value < lo or hi is not None and value > hi:
        fail(where, value, f"an integer from {lo}" + (f" to {hi}" if hi is not None else " up"))
    return value


def field(obj: dict, name: str, where: str, kind: type, expected: str):
    value = obj.get(name)
    if not isinstance(value, kind) or kind is not bool and isinstance(value, bool):
        fail(f"{where}{name}", value, expected)
    return value


def check_tables(tables, where: str, seqs: dict, num_blocks: int, dropped: bool):
    """{seq id: a block table of ids below num_blocks} (None where the table was dropped)."""
    if not isinstance(tables, dict):
        fail(where, tables, "an object of block tables by sequence id")
    for seq_id, table in tables.items():
        if seq_id not in seqs:
            fail(f"{where} key", seq_id, "a sequence id of 'seqs'")
        if table is None and dropped:
            continue
        if not isinstance(table, list):
            fail(f"{where}[{seq_id!r}]", table, "a list of block ids" + (" or null" * dropped))
        for b in table:
            if not is_int(b) or not 0 <= b < num_blocks:
                count(b, f"{where}[{seq_id!r}] block", 0, num_blocks - 1)


def check_events(events, where: str, num_blocks: int, num_cpu_blocks: int):
    """[[kind, block or null, seq id or null, extra]]; a swap's extra is its CPU block."""
    if not isinstance(events, list):
        fail(where, events, "a list of events")
    for j, event in enumerate(events):
        if not isinstance(event, list) or len(event) != 4 or event[0] not in EVENT_ORDER:
            fail(f"{where}[{j}]", event, f"[kind, block, seq id, extra], kind one of {EVENT_ORDER}")
        kind, block, seq_id, extra = event
        if block is not None:
            count(block, f"{where}[{j}] block", 0, num_blocks - 1)
        if seq_id is not None and not is_int(seq_id):
            fail(f"{where}[{j}] seq id", seq_id, "an integer or null")
        if kind in ("swap_out", "swap_in"):
            count(extra, f"{where}[{j}] CPU block", 0, num_cpu_blocks - 1)
        elif extra is not None and not isinstance(extra, (int, str)):
            fail(f"{where}[{j}] extra", extra, "an integer, a string or null")


def check_batch(batch, where: str, seqs: dict):
    """[[seq id, "prefill" or "decode", new tokens, start position, tokens sampled]]."""
    if not isinstance(batch, list):
        fail(where, batch, "a list of [seq id, kind, tokens, start, samples]")
    for j, item in enumerate(batch):
        if (not isinstance(item, list) or len(item) != 5 or str(item[0]) not in seqs
                or item[1] not in BATCH_KINDS):
            fail(f"{where}[{j}]", item, "[seq id of 'seqs', 'prefill' or 'decode', tokens, "
                                        "start, samples]")
        for name, value in zip(("tokens", "start", "samples"), item[2:]):
            if not is_int(value) or value < 0:
                count(value, f"{where}[{j}] {name}", 0)


def check_entry(entry, where: str, trace: dict, is_step: bool):
    """A step (or `end`, which has no batch and no time): what changed, and the queue lengths."""
    if not isinstance(entry, dict):
        fail(where, entry, "an object")
    seqs, num_blocks = trace["seqs"], trace["num_blocks"]
    check_tables(entry.get("tables"), f"{where}.tables", seqs, num_blocks, True)
    check_tables(entry.get("cpu_tables"), f"{where}.cpu_tables", seqs, trace["num_cpu_blocks"],
                 True)
    check_events(entry.get("events"), f"{where}.events", num_blocks, trace["num_cpu_blocks"])
    count(entry.get("num_free"), f"{where}.num_free", 0, num_blocks)
    for name in ("running", "waiting", "swapped"):
        count(entry.get(name), f"{where}.{name}", 0)
    if is_step:
        check_batch(entry.get("batch"), f"{where}.batch", seqs)
        for name in ("t", "dt"):
            value = entry.get(name)
            if type(value) not in (int, float) or not 0 <= value < float("inf"):
                fail(f"{where}.{name}", value, "a number of seconds, finite, from 0")


def check_seqs(seqs):
    """{seq id: {"request", "sample", "parent", "beam", "prompt", "num_prompt_tokens"}}."""
    if not isinstance(seqs, dict):
        fail("seqs", seqs, "an object of sequences by id")
    for seq_id, info in seqs.items():
        where = f"seqs[{seq_id!r}]"
        if not isinstance(info, dict):
            fail(where, info, "an object")
        request = info.get("request")
        if not isinstance(request, (int, str)) or isinstance(request, bool):
            fail(f"{where}.request", request, "a request id (an integer or a string)")
        count(info.get("sample"), f"{where}.sample", 0)
        parent = info.get("parent")
        if parent is not None and not is_int(parent):
            fail(f"{where}.parent", parent, "a seq id or null")
        field(info, "beam", f"{where}.", bool, "true or false")
        field(info, "prompt", f"{where}.", str, "a string")
        count(info.get("num_prompt_tokens"), f"{where}.num_prompt_tokens", 0)


def check_trace(trace) -> None:
    """Raise ValueError naming the first field of `trace` that the page cannot draw."""
    found = trace.get("format") if isinstance(trace, dict) else type(trace).__name__
    if found != FORMAT:
        raise ValueError(f"not a nanovllm trace: its 'format' is {_short(found)}, "
                         f"expected {FORMAT!r}")
    if trace.get("version") != VERSION or not is_int(trace.get("version")):
        fail("version", trace.get("version"), f"{VERSION} (the version this page draws)")
    num_blocks = count(trace.get("num_blocks"), "num_blocks", 1, MAX_BLOCKS)
    count(trace.get("num_cpu_blocks"), "num_cpu_blocks", 0, MAX_BLOCKS)
    count(trace.get("block_size"), "block_size", 1, MAX_BLOCK_SIZE)
    if trace.get("preemption_mode") not in PREEMPTION_MODES:
        fail("preemption_mode", trace.get("preemption_mode"), f"one of {PREEMPTION_MODES}")
    field(trace, "model", "", str, "a string")
    check_seqs(trace.get("seqs"))
    start = field(trace, "start", "", dict, "an object {tables, cpu_tables, cached}")
    check_tables(start.get("tables"), "start.tables", trace["seqs"], num_blocks, False)
    check_tables(start.get("cpu_tables"), "start.cpu_tables", trace["seqs"],
                 trace["num_cpu_blocks"], False)
    cached = field(start, "cached", "start.", list, "a list of block ids")
    for b in cached:
        count(b, "start.cached block", 0, num_blocks - 1)
    steps = trace.get("steps")
    if not isinstance(steps, list) or not steps:
        fail("steps", steps, "a non-empty list of steps")
    for i, entry in enumerate(steps):
        check_entry(entry, f"steps[{i}]", trace, True)
        if entry.get("step") != i or not is_int(entry["step"]):
            fail(f"steps[{i}].step", entry.get("step"), f"{i} (its index)")
    if trace.get("end") is not None:
        check_entry(trace["end"], "end", trace, False)
