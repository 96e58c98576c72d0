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
"""
import json
from importlib.resources import files

MARKER = "/*TRACE_JSON*/"


def embed(trace: dict) -> str:
    """The trace as JSON that is inert inside an HTML <script> element."""
    text = json.dumps(trace, separators=(",", ":"), ensure_ascii=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(trace: dict) -> str:
    """The page's HTML for a trace (a dict read from a trace file)."""
    found = trace.get("format") if isinstance(trace, dict) else type(trace).__name__
    if found != "nanovllm-trace":
        raise ValueError(f"not a nanovllm trace: its 'format' is {found!r}, "
                         "expected 'nanovllm-trace'")
    template = files("nanovllm.viz").joinpath("page.html").read_text(encoding="utf-8")
    assert template.count(MARKER) == 1
    head, tail = template.split(MARKER)
    return head + embed(trace) + tail


def write_page(trace_path, html_path):
    """Read a trace file and write its page."""
    with open(trace_path, encoding="utf-8") as f:
        trace = json.load(f)
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_page(trace))
