"""The trace page (nanovllm/viz) in headless Chromium: stepped with its keys, slider and timeline,
it shows what the trace says (blocks per request, reference counts and holders, colours, free and
cached free blocks), text from requests stays text, and a trace of 400,000 steps draws and steps.
Skipped where Chromium is missing."""
import json
import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.trace import replay
from nanovllm.viz import write_page
from tests.browser import chromium_paths, console_errors, go_to, hover_block, open_page, seek
from tests.trace_helpers import (
    DEMO_OPTIONS,
    SWAP_OPTIONS,
    long_trace,
    run_workload,
    synthetic_trace,
)

pytestmark = [pytest.mark.skipif(chromium_paths() is None,
                                 reason="needs chromium, chromium-driver and selenium"),
              pytest.mark.slow]  # the quick subset, -m "not slow", leaves it out

CELL_PIXELS = """
    const [id, n, at] = arguments, g = document.getElementById(id);
    const cols = +g.dataset.cols, c = +g.dataset.cell, scale = g.width / (cols * c);
    const d = g.getContext('2d').getImageData(0, 0, g.width, g.height).data, out = [];
    for (let b = 0; b < n; b++) {
      const x = Math.floor(((b % cols) + at) * c * scale);
      const y = Math.floor((Math.floor(b / cols) + at) * c * scale);
      const i = (y * g.width + x) * 4;
      out.push([d[i], d[i + 1], d[i + 2]]);
    }
    return out;"""  # the colour of each block's cell, at a point `at` of the way into it
HOSTILE = "</script><script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'>"


@pytest.fixture(scope="module")
def pages(tiny_path, tmp_path_factory):
    """mode -> (trace, page path) of the demo's workload; one request has a hostile id."""
    out = {}
    for mode, options in (("recompute", {}), ("swap", SWAP_OPTIONS)):
        llm = LLM(tiny_path, **{**DEMO_OPTIONS, **options})
        folder = tmp_path_factory.mktemp(mode)
        with llm.trace(folder / "run.json"):
            run_workload(llm)
            llm.add_request(list(range(12)), SamplingParams(max_tokens=3), request_id=HOSTILE)
            while not llm.is_finished():
                llm.step()
        data = json.loads((folder / "run.json").read_text())
        write_page(folder / "run.json", folder / "run.html")
        out[mode] = data, str(folder / "run.html")
    return out


@pytest.fixture(scope="module")
def browser(pages):
    page = open_page(pages["recompute"][1])
    yield page
    page.quit()


def shown_position(page) -> str:
    return page.execute_script("return document.querySelector('#stepline b').textContent")


def label(data, p) -> str:
    return f"step {p}" if p < len(data["steps"]) else "end"


def shown_blocks_per_request(page) -> dict:
    return page.execute_script(
        "const out = {}; for (const row of document.querySelectorAll('#legend [data-request]'))"
        " out[row.dataset.request] = +row.dataset.blocks; return out;")


def blocks_per_request(data, p) -> dict:
    """Distinct blocks each request's sequences hold after position p, from the trace."""
    out = {}
    for seq, table in replay(data, p)["tables"].items():
        out.setdefault(str(data["seqs"][seq]["request"]), set()).update(table)
    return {request: len(blocks) for request, blocks in out.items()}


def first_step(data, kind) -> int:
    return next(e["step"] for e in data["steps"] if any(ev[0] == kind for ev in e["events"]))


def test_keys_step_through_and_show_the_blocks_of_each_request(pages, browser):
    from selenium.webdriver.common.keys import Keys
    data, _ = pages["recompute"]
    n = len(data["steps"]) + 1
    body = browser.find_element("tag name", "body")
    positions = {3: lambda: go_to(browser, 3), 16: lambda: go_to(browser, 16),
                 n - 1: lambda: body.send_keys(Keys.END), 0: lambda: body.send_keys(Keys.HOME)}
    for p, move in positions.items():
        move()
        assert shown_position(browser) == label(data, p)
        assert shown_blocks_per_request(browser) == blocks_per_request(data, p)
    body.send_keys(Keys.SHIFT, Keys.ARROW_RIGHT, Keys.NULL, Keys.ARROW_RIGHT, Keys.ARROW_LEFT)
    assert shown_position(browser) == label(data, 10)
    marked = [e["step"] for e in data["steps"] if {ev[0] for ev in e["events"]}
              & {"preempt", "swap_out", "swap_in", "cow", "hit", "fork"}]
    body.send_keys("]")
    assert shown_position(browser) == label(data, min(m for m in marked if m > 10))
    body.send_keys("[", "[")
    assert shown_position(browser) == label(data, sorted(m for m in marked if m < 10)[-2])


def test_a_shared_block_shows_its_count_holders_and_block_tables(pages, browser):
    data, _ = pages["recompute"]
    p = first_step(data, "fork")  # a request's samples share its prompt's blocks
    go_to(browser, p)
    state = replay(data, p)
    block = max(range(data["num_blocks"]), key=lambda b: state["ref_counts"][b])
    assert state["ref_counts"][block] >= 3
    hover_block(browser, block)
    tip = browser.find_element("id", "tooltip")
    holders = sorted(s for s, t in state["tables"].items() for b in t if b == block)
    assert tip.get_attribute("data-block") == str(block)
    assert tip.get_attribute("data-refs") == str(state["ref_counts"][block])
    assert sorted(map(str, json.loads(tip.get_attribute("data-holders")))) == holders
    assert f"reference count {state['ref_counts'][block]}" in tip.text
    shown = browser.execute_script(
        "const out = {}; for (const t of document.querySelectorAll('#tables table'))"
        " out[t.dataset.seq] = [...t.rows[1].cells].map(c => +c.textContent); return out;")
    request = data["seqs"][holders[0]]["request"]
    assert shown == {s: t for s, t in state["tables"].items()
                     if data["seqs"][s]["request"] == request}


def test_block_colours_are_their_requests_and_free_differs_from_cached_free(pages, browser):
    data, _ = pages["recompute"]

    def telling(p):  # free and cached-free blocks, and blocks shared by two requests
        state = replay(data, p)
        owners = {}
        for seq, table in state["tables"].items():
            for b in table:
                owners.setdefault(b, set()).add(data["seqs"][seq]["request"])
        return (state["free"] - state["cached"] and state["free"] & state["cached"]
                and any(len(o) > 1 for o in owners.values()))
    p = next(p for p in range(len(data["steps"])) if telling(p))
    go_to(browser, p)
    pixels = browser.execute_script(CELL_PIXELS, "grid", data["num_blocks"], 0.3)
    swatches = browser.execute_script(
        "const out = {}; for (const row of document.querySelectorAll('#legend [data-request]'))"
        " out[row.dataset.request] = getComputedStyle(row.querySelector('.sw')).backgroundColor;"
        " const key = [...document.querySelectorAll('#key .sw')]"
        "   .map(s => getComputedStyle(s).backgroundColor); out['free'] = key[0];"
        " out['cached free'] = key[1]; return out;")
    rgb = {k: [int(x) for x in v[v.index("(") + 1:-1].split(",")[:3]]
           for k, v in swatches.items()}
    state = replay(data, p)
    holders = {}
    for seq, table in state["tables"].items():
        for b in table:
            holders.setdefault(b, set()).add(str(data["seqs"][seq]["request"]))
    kinds = set()
    for b, pixel in enumerate(pixels):
        if b in holders:
            expected = [rgb[r] for r in holders[b]]
        else:
            kind = "cached free" if b in state["cached"] else "free"
            kinds.add(kind)
            expected = [rgb[kind]]
        assert any(max(abs(x - y) for x, y in zip(pixel, e)) <= 2 for e in expected), (b, pixel)
    assert kinds == {"free", "cached free"} and rgb["free"] != rgb["cached free"]
    requests = blocks_per_request(data, p)
    assert len({tuple(rgb[r]) for r in requests}) == len(requests)  # each its own colour


def test_the_slider_and_a_click_on_the_timeline_go_to_a_step(pages, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    data, _ = pages["recompute"]
    browser.execute_script("const s = document.getElementById('slider'); s.value = 40;"
                           "s.dispatchEvent(new Event('input'));")
    assert shown_position(browser) == label(data, 40)
    timeline = browser.find_element("id", "timeline")
    n, width = len(data["steps"]) + 1, timeline.size["width"]
    target = 25
    x = 2 + target / (n - 1) * (width - 4)
    ActionChains(browser).move_to_element_with_offset(
        timeline, round(x - width / 2), 0).click().perform()
    assert abs(int(shown_position(browser).split()[1]) - target) <= 1
    p = int(shown_position(browser).split()[1])
    assert shown_blocks_per_request(browser) == blocks_per_request(data, p)
    assert int(browser.find_element("id", "slider").get_attribute("value")) == p


def test_request_text_is_shown_as_text(pages, browser):
    data, _ = pages["recompute"]
    from selenium.webdriver.common.keys import Keys
    browser.find_element("tag name", "body").send_keys(Keys.END)
    seq = next(s for s, info in data["seqs"].items() if info["request"] == HOSTILE)
    p = next(e["step"] for e in data["steps"] if seq in e["tables"])
    go_to(browser, p)
    assert HOSTILE in shown_blocks_per_request(browser)
    hover_block(browser, replay(data, p)["tables"][seq][0])
    assert HOSTILE in browser.find_element("id", "tooltip").text
    assert HOSTILE in browser.find_element("id", "tables").text
    assert browser.execute_script("return window.pwned === undefined")
    assert not browser.find_elements("css selector", "img")
    assert len(browser.find_elements("tag name", "script")) == 2


def test_the_swap_page_shows_blocks_in_the_cpu_pool(pages):
    data, path = pages["swap"]
    page = open_page(path)
    try:
        p = first_step(data, "swap_out")
        go_to(page, p)
        state = replay(data, p)
        assert state["cpu_tables"]
        events = page.execute_script("return [...document.querySelectorAll('#events [data-kind]')]"
                                     ".map(e => e.dataset.kind)")
        assert "swap_out" in events and "preempt" in events
        pixels = page.execute_script(CELL_PIXELS, "cpu", data["num_cpu_blocks"], 0.5)
        free = page.execute_script("return getComputedStyle(document.querySelector('#key .sw'))"
                                   ".backgroundColor")
        held = {b for b, pixel in enumerate(pixels) if f"rgb({', '.join(map(str, pixel))})" != free}
        assert held == {b for t in state["cpu_tables"].values() for b in t}
    finally:
        page.quit()


def test_a_trace_of_thousands_of_steps_and_blocks_stays_responsive(tmp_path):
    """4096 blocks and 3000 steps load and step; the times are printed, not asserted."""
    data = synthetic_trace(4096, 3000)
    (tmp_path / "big.json").write_text(json.dumps(data))
    write_page(tmp_path / "big.json", tmp_path / "big.html")
    start = time.perf_counter()
    page = open_page(str(tmp_path / "big.html"))
    try:
        loaded = time.perf_counter() - start
        timing = page.execute_script("""
            const s = document.getElementById('slider'), t0 = performance.now();
            for (const v of [2999, 17, 1500, 2222, 640]) {
              s.value = v; s.dispatchEvent(new Event('input'));
            }
            const t1 = performance.now();
            for (let i = 0; i < 20; i++)
              document.dispatchEvent(new KeyboardEvent('keydown', {key: 'ArrowRight'}));
            return [(t1 - t0) / 5, (performance.now() - t1) / 20];""")
        print(f"\n4096 blocks, 3000 steps ({len(json.dumps(data)) >> 20} MiB): loaded in "
              f"{loaded:.2f} s, seek {timing[0]:.1f} ms, step {timing[1]:.1f} ms")
        assert shown_position(page) == "step 660"
        shown, expected = shown_blocks_per_request(page), blocks_per_request(data, 660)
        assert len(shown) == 100 and all(expected[r] == n for r, n in shown.items())
        more = page.find_element("css selector", "#legend [data-more]").get_attribute("data-more")
        assert len(shown) + int(more) == len(expected)
    finally:
        page.quit()


LONG_STEPS = 400_000


@pytest.fixture(scope="module")
def long_page(tmp_path_factory):
    """(trace, page, seconds the page took to load, MiB of the trace file) of a synthetic trace
    of 400,000 steps."""
    folder = tmp_path_factory.mktemp("long")
    data = long_trace(LONG_STEPS)
    (folder / "long.json").write_text(json.dumps(data, separators=(",", ":")))
    write_page(folder / "long.json", folder / "long.html")
    start = time.perf_counter()
    page = open_page(str(folder / "long.html"))
    loaded = time.perf_counter() - start
    yield data, page, loaded, (folder / "long.json").stat().st_size / 2**20
    page.quit()


def test_a_trace_of_400000_steps_draws_and_steps(long_page):
    """No console error; the header and the step line count all the steps; the timeline draws a
    bar in nearly every column of pixels (steps of no tokens are rare); a step far in shows what
    the trace holds there. Times are printed, not asserted."""
    data, page, loaded, size = long_page
    assert console_errors(page) == []
    assert f"{LONG_STEPS} steps" in page.find_element("id", "info").text
    assert page.find_element("id", "stepline").text.startswith(f"step 0 of {LONG_STEPS}")
    drawn = page.execute_script("""
        const tl = document.getElementById('timeline'), w = tl.width, h = tl.height;
        const d = tl.getContext('2d').getImageData(0, h - 1, w, 1).data;  // the bars' foot
        let n = 0;
        for (let x = 2; x < w - 2; x++) n += d[4 * x + 3] > 0;
        return n / (w - 4);""")
    assert drawn > 0.95
    seeks = page.execute_script("""
        const s = document.getElementById('slider'), t0 = performance.now();
        for (const v of [399999, 17, 150000, 250000, 321987]) {
          s.value = v; s.dispatchEvent(new Event('input'));
        }
        return (performance.now() - t0) / 5;""")
    print(f"\n{LONG_STEPS} steps ({size:.0f} MiB): loaded in {loaded:.2f} s, seek {seeks:.1f} ms")
    assert shown_position(page) == "step 321987"
    assert shown_blocks_per_request(page) == blocks_per_request(data, 321987)
    assert console_errors(page) == []


def test_the_strip_under_the_timeline_shows_the_steps_around_the_current_one(long_page):
    """A click on the strip goes to the step under the mouse, and the strip follows; while the
    mouse drags on it, the strip keeps its steps."""
    from selenium.webdriver.common.action_chains import ActionChains
    data, page, *_ = long_page
    seek(page, 200_123)
    strip = page.find_element("id", "detail")
    assert strip.is_displayed()
    first, count = int(strip.get_attribute("data-from")), int(strip.get_attribute("data-count"))
    assert first <= 200_123 < first + count and count >= 100
    span = page.execute_script("return arguments[0].clientWidth - 4", strip)

    def offset(i):  # of the i-th step of the strip, from its centre
        return round(2 + (i + 0.5) * span / count - strip.size["width"] / 2)
    ActionChains(page).move_to_element_with_offset(strip, offset(count - 6), 0).click().perform()
    assert shown_position(page) == f"step {first + count - 6}"
    assert shown_blocks_per_request(page) == blocks_per_request(data, first + count - 6)
    moved = int(strip.get_attribute("data-from"))
    assert moved > first  # it follows
    actions = ActionChains(page).move_to_element_with_offset(strip, offset(10), 0).click_and_hold()
    for i in range(20, 100, 10):
        actions.move_to_element_with_offset(strip, offset(i), 0)
    actions.perform()
    assert shown_position(page) == f"step {moved + 90}"
    ActionChains(page).release().perform()
    assert shown_position(page) == f"step {moved + 90}"
    assert int(strip.get_attribute("data-from")) == moved + 90 - count // 2
