"""Headless Chromium for the trace page's tests and screenshots (Debian's `chromium` and
`chromium-driver` packages, driven by selenium). `chromium_paths()` is None where one is missing."""
import os
import shutil

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def chromium_paths() -> tuple[str, str] | None:
    """(browser, driver) paths, or None."""
    browser = next((p for p in map(shutil.which, CHROMIUM) if p), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        return None
    try:
        import selenium  # noqa: F401
    except ImportError:
        return None
    return browser, driver


def open_page(path: str, width: int = 1400, height: int = 900):
    """A headless Chromium showing the HTML file at path, once its script has run."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait
    browser, driver = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # for console_errors
    page = webdriver.Chrome(service=Service(driver), options=options)
    try:
        page.get("file://" + os.path.abspath(path))
        WebDriverWait(page, 20).until(
            lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
    except BaseException:
        page.quit()
        raise
    return page


def console_errors(page) -> list[str]:
    """The errors the page logged to the console (uncaught exceptions among them) so far."""
    return [e["message"] for e in page.get_log("browser") if e["level"] == "SEVERE"]


def seek(page, position: int):
    """Move the page's slider to a position (as dragging it does)."""
    page.execute_script("const s = document.getElementById('slider'); s.value = arguments[0];"
                        "s.dispatchEvent(new Event('input'));", position)


def go_to(page, position: int):
    """Step the page to a position with its keys (Home, then shift+right and right)."""
    from selenium.webdriver.common.keys import Keys
    body = page.find_element("tag name", "body")
    body.send_keys(Keys.HOME)
    body.send_keys(*[Keys.SHIFT, Keys.ARROW_RIGHT, Keys.NULL] * (position // 10))  # NULL: shift up
    body.send_keys(*[Keys.ARROW_RIGHT] * (position % 10))


def hover_block(page, block: int):
    """Move the mouse over a block of the grid."""
    from selenium.webdriver.common.action_chains import ActionChains
    grid = page.find_element("id", "grid")
    cols, cell = int(grid.get_attribute("data-cols")), int(grid.get_attribute("data-cell"))
    x, y = (block % cols + 0.5) * cell, (block // cols + 0.5) * cell
    ActionChains(page).move_to_element_with_offset(
        grid, round(x - grid.size["width"] / 2), round(y - grid.size["height"] / 2)).perform()


SHOTS = {  # name: (the first step with this event, the event kinds whose block to hover)
    "prefix_hit": ("hit", ("hit",)),
    "beam_search": ("fork", ("share", "cow")),
    "preemption": ("preempt", ("alloc", "hit")),
    "swap_out": ("swap_out", ()),
    "swap_in": ("swap_in", ("swap_in",)),
}


def take_screenshots(html_path: str, trace: dict, out_dir: str) -> list[str]:
    """PNGs of the page at the first step of each kind in SHOTS that the trace has (for the beam
    search: the first fork of a beam; swaps and preemption by the trace's preemption mode), the
    block of a telling event under the mouse."""
    from selenium.webdriver.common.action_chains import ActionChains
    os.makedirs(out_dir, exist_ok=True)
    page, written = open_page(html_path, 1400, 1000), []
    swap = trace["preemption_mode"] == "swap"
    try:
        for name, (kind, hover) in SHOTS.items():
            if swap != name.startswith("swap"):
                continue
            step = next((e for e in trace["steps"] if any(
                ev[0] == kind and (kind != "fork" or trace["seqs"][str(ev[2])]["beam"])
                for ev in e["events"])), None)
            if step is None:
                continue
            ActionChains(page).move_to_element(page.find_element("tag name", "header")).perform()
            go_to(page, step["step"])
            block = next((ev[1] for ev in step["events"] if ev[0] in hover), None)
            if block is not None:
                hover_block(page, block)
            path = os.path.join(out_dir, f"trace_{name}.png")
            page.save_screenshot(path)
            written.append(path)
    finally:
        page.quit()
    return written


def screenshot_long_trace(path: str, num_steps: int = 400_000, position: int = 200_123):
    """A PNG of the page of a long synthetic trace (tests/trace_helpers.py) at a step mid-way."""
    import json
    import tempfile

    from nanovllm.viz import write_page
    from tests.trace_helpers import long_trace
    with tempfile.TemporaryDirectory() as folder:
        trace = os.path.join(folder, "long.json")
        with open(trace, "w") as f:
            json.dump(long_trace(num_steps), f, separators=(",", ":"))
        write_page(trace, os.path.join(folder, "long.html"))
        page = open_page(os.path.join(folder, "long.html"), 1400, 1000)
        try:
            seek(page, position)
            page.save_screenshot(path)
        finally:
            page.quit()


if __name__ == "__main__":  # python -m tests.browser docs/images/trace_long.png
    import sys
    screenshot_long_trace(sys.argv[1])
