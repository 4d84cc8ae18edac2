"""Debian's chromium driven by Playwright for the chat page's browser tests, and small page helpers.

Playwright's own browser download needs a network these machines lack, so the tests launch the system's
chromium (`apt-get install chromium`; `nox -s tests` installs it when missing). Without it, or without the
playwright package, the tests skip and say why. A test module imports the `browser` fixture from here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("CORE_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
TIMEOUT_MS = 60_000  # a real model on a loaded 2-core machine
SETTINGS = "core-chat.settings"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless chromium per test module (skips when it or playwright is missing)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright "
                                                                 "(pip install -e '.[test]')")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; `nox -s tests` installs it)")
    with sync_api.sync_playwright() as playwright:
        try:
            launched = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        except Exception as exc:  # a broken install: say so instead of failing every test
            pytest.skip(f"chromium at {CHROMIUM} does not start: {exc}")
        yield launched
        launched.close()


def open_chat(browser: Any, base_url: str, settings: dict[str, Any] | None = None,
              width: int = 1100, height: int = 760) -> Any:
    """A fresh page (its own localStorage) on the chat page, with `settings` stored before it loads."""
    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(TIMEOUT_MS)
    if settings:
        context.add_init_script(
            f"if (!localStorage.getItem({json.dumps(SETTINGS)})) "
            f"localStorage.setItem({json.dumps(SETTINGS)}, {json.dumps(json.dumps(settings))});")
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.goto(base_url + "/")
    # function predicates, not expressions: the page's CSP forbids eval
    page.wait_for_function("() => document.querySelector('#model').options.length > 0 || "
                           "!document.querySelector('#notice').hidden")
    return page


def send(page: Any, text: str) -> None:
    """Type `text` into the composer and press Enter (as a person would)."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_reply_done(page: Any) -> Any:
    """The last reply, once it stopped streaming."""
    page.wait_for_selector("#stop", state="hidden")
    return page.locator(".message.assistant").last


def stored_conversations(page: Any) -> list[dict[str, Any]]:
    return page.evaluate("JSON.parse(localStorage.getItem('core-chat.conversations'))")
