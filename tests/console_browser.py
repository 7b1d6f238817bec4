"""Headless Chromium for the console's browser tests: Debian's `chromium` driven by Playwright
(never `playwright install`, which downloads a browser of its own), one browser per module, a
fresh context (cookies, storage) per viewer, every page's console errors collected."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What the browser needs on these machines: no sandbox as root, no GPU, and nothing that reaches
# out to the network on its own (QUIC, component updates, sync, background fetches).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def chromium() -> str:
    """Debian's Chromium (`make test` installs it), or INFERBUS_CHROMIUM; skipped without one, except in CI."""
    found = os.environ.get("INFERBUS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        message = "no chromium: `apt-get install chromium` (make test does), or set INFERBUS_CHROMIUM"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def artifacts_dir(name: str) -> Path:
    """Where screenshots go (INFERBUS_ARTIFACTS_DIR, default .artifacts/ in the repository, git-ignored)."""
    base = Path(os.environ.get("INFERBUS_ARTIFACTS_DIR") or ROOT / ".artifacts")
    target = base / name
    target.mkdir(parents=True, exist_ok=True)
    return target


class Browser:
    def __init__(self, playwright: Any, executable: str, shots: Path) -> None:
        self.browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        self.shots = shots
        self.errors: list[str] = []

    @contextmanager
    def viewer(self) -> Iterator[Any]:
        """A page in a context of its own: a new visitor with no cookies."""
        context = self.browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
        page = context.new_page()
        page.on("console", lambda m: self.errors.append(f"{page.url}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"{page.url}: {e}"))
        page.on("dialog", lambda dialog: dialog.accept())  # the revoke confirmation
        try:
            yield page
        finally:
            context.close()

    def shot(self, page: Any, name: str) -> Path:
        path = self.shots / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    def close(self) -> None:
        self.browser.close()


def sign_in(page: Any, base_url: str, key: str) -> None:
    page.goto(base_url + "/console/")
    assert page.url.startswith(base_url + "/console/login"), page.url
    page.fill("#key", key)
    page.click("#sign-in")
    page.wait_for_load_state()


def cells(page: Any, selector: str) -> list[dict[str, Any]]:
    """Rows of the tables matching `selector`: their table id, row key and cells' exact values."""
    return page.eval_on_selector_all(selector + " tr[data-key]", """rows => rows.map(row => ({
        table: row.closest('table').id, key: row.dataset.key, state: row.dataset.state || null,
        values: Object.fromEntries([...row.querySelectorAll('[data-col]')]
            .map(c => [c.dataset.col, c.dataset.value ?? c.textContent.trim()])),
    }))""")


def charts_drawn(page: Any) -> list[str]:
    """data-drawn of every canvas: set by console.js once Chart.js drew it."""
    return page.eval_on_selector_all("canvas[data-chart]", "cs => cs.map(c => c.dataset.drawn || '')")


_SECRET = re.compile(r"ib-[A-Za-z0-9_\-]{20,}")


def secrets_in(text: str) -> list[str]:
    """Whole API keys (`ib-` and 20+ key characters) in `text`."""
    return _SECRET.findall(text)


def wait_until(predicate: Any, timeout: float, message: Any = "", interval: float = 0.3) -> Any:
    """Call `predicate` until it returns something truthy and return that; fail with `message`
    (a string, or a callable that makes one) after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(message() if callable(message) else message or f"not within {timeout:g} s")
        time.sleep(interval)


def off_loop(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Call `function` in a thread of its own: Playwright's sync API keeps an event loop running in
    the test's thread, where `asyncio.run` (the CLI, the ledger reader) refuses to start another."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(function, *args, **kwargs).result()
