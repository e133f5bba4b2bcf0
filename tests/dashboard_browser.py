"""What the tests in a real browser share (the dashboard's, and the exchange's /docs page): Debian's
chromium driven by Playwright, a `rollmarket dashboard` process on a free loopback port, a page that
records its requests and script errors, and screenshots under test-artifacts/dashboard/. The
`browser` and `page` fixtures are in conftest.py."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from rollmarket.localhost import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


@contextmanager
def chromium():
    """Debian's chromium (never a downloaded one: `playwright install` is not used)."""
    if not CHROMIUM.exists():
        pytest.fail("/usr/bin/chromium is missing: `make browser` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def dashboard_process(runs_dir: Path, log: Path, *args: str, env: dict | None = None):
    """`rollmarket dashboard --runs RUNS_DIR ARGS…` as a real process; yields its URL once healthy."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rollmarket", "dashboard", "--runs", str(runs_dir),
                                 "--port", str(port), *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log=log)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def open_page(browser, **context_args):
    """A new context and page; `page.requests` and `page.errors` collect every URL it asks for and
    every script error it throws."""
    context = browser.new_context(viewport={"width": 1400, "height": 900}, **context_args)
    page = context.new_page()
    page.requests, page.errors = [], []
    page.on("request", lambda r: page.requests.append(r.url))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    return context, page


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def chart_pixels(page, canvas_id: str) -> int:
    """Painted (non-transparent) pixels of a canvas: zero if the chart was never drawn."""
    return page.evaluate("""id => {
        const c = document.getElementById(id);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""", canvas_id)
