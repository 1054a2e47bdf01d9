"""A real Chromium for the tests of the pages (the journal's timeline, the live page):
Debian's, driven by Playwright (Playwright's own download cannot be reached here)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from playwright.sync_api import sync_playwright

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")  # scripts/lib.sh installs it


@contextlib.contextmanager
def chromium_page(width: int, height: int) -> Iterator[tuple[Any, list[str]]]:
    """A page of a headless Chromium, and the list its console errors and uncaught
    exceptions are appended to (a test asserts it stays empty)."""
    assert os.path.exists(CHROMIUM), (
        f"{CHROMIUM} is missing: apt-get install chromium (scripts/test.sh does it)"
    )
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            yield page, problems
        finally:
            browser.close()
