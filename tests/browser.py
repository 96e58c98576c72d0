"""Headless Chromium for the trace page's tests and screenshots (Debian's `chromium` and
`chromium-driver` packages, driven by selenium). `chromium_paths()` is None where either is missing."""
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
    page = webdriver.Chrome(service=Service(driver), options=options)
    try:
        page.get("file://" + os.path.abspath(path))
        WebDriverWait(page, 20).until(
            lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
    except BaseException:
        page.quit()
        raise
    return page
