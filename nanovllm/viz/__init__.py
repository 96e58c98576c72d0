"""A page that draws a step trace (nanovllm/trace.py): the paged KV cache of the vLLM paper's
Figures 6 to 9, step by step, from a real run.

`write_page(trace, path)` writes one self-contained HTML file (page.html with the trace inside it):
inline script and style, no network, no server; it opens from disk. The page shows the physical
blocks as a grid coloured by the request that holds them (shared blocks marked with their reference
count, cached free and free blocks told apart), the step's block events drawn on the blocks, a
timeline to step through (slider, keys, clicks), and the block table of the request under the mouse.

The trace is data: it sits in a `<script type="application/json">` element with every `<` escaped,
so no request id or prompt can end the element, and the page reads it with JSON.parse and shows all
of its text as text, never as HTML.

Before a page is written the trace is checked (check.py): a file too large for a browser to hold,
a JSON nested beyond reading, or a field the page cannot draw (no steps, a block count that is not
an integer from 1 to 2**17, ...) is a ValueError of one line naming it, and no page is written.
"""
import json
from importlib.resources import files

from nanovllm.viz.check import MAX_TRACE_BYTES, check_trace, load_trace

MARKER = "/*TRACE_JSON*/"


def embed(trace: dict) -> str:
    """The trace as JSON that is inert inside an HTML <script> element."""
    try:
        text = json.dumps(trace, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except RecursionError:  # only fields the page does not read can nest: check_trace passed
        raise ValueError("the trace nests its JSON deeper than Python's writer can "
                         "follow") from None
    except ValueError:  # allow_nan=False: a float of the same fields
        raise ValueError("the trace holds NaN or Infinity, which JSON (and the page) does not "
                         "allow") from None
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(trace: dict) -> str:
    """The page's HTML for a trace (a dict read from a trace file); a ValueError for a trace the
    page cannot draw."""
    check_trace(trace)
    data = embed(trace)
    if len(data) > MAX_TRACE_BYTES:  # escapes (of <, > and any non-ASCII) make it longer
        raise ValueError(f"the trace is {len(data):,} characters as the page holds it: at most "
                         f"{MAX_TRACE_BYTES:,} ({MAX_TRACE_BYTES >> 20} Mi)")
    template = files("nanovllm.viz").joinpath("page.html").read_text(encoding="utf-8")
    assert template.count(MARKER) == 1
    head, tail = template.split(MARKER)
    return head + data + tail


def write_page(trace_path, html_path):
    """Read a trace file, check it, and write its page (nothing is written for a ValueError)."""
    page = render_page(load_trace(trace_path))
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(page)
