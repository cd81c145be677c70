"""What every browser test shares: a Playwright page whose requests outside ``allowed`` URL prefixes are blocked
and recorded, with console and page errors collected, and one ceiling on every wait.

Browser tests wait for the page's own signal that it has drawn, never for a guessed time: the report and every
view page set ``body[data-ready='1']`` once all their views are drawn (``LS.start`` in
``viz/report/assets/core.js``); the app of ``lenscope serve`` sets ``body[data-app='1']`` when its script has
started, ``data-state=done`` on a view's card or on the side panel when it is drawn, and ``body[data-ready='1']``
with a new ``data-run`` when every view of a run has answered (``viz/app/assets/app.js``); a notebook frame posts
its height, which its parent writes into the frame's style.
"""

from __future__ import annotations

import os
import shutil

import pytest

# Debian's chromium (or LENSCOPE_CHROMIUM) driven by Playwright for Python; a test module that needs them sets
# ``pytestmark = NEEDS_BROWSER`` (skipped with the command that installs what is missing; ``./dev test`` installs
# both, and CI's policy refuses a skip) and imports the module-scoped ``browser`` fixture below (``chromium_browser``).
CHROMIUM = os.environ.get("LENSCOPE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None

needs_playwright = pytest.mark.skipif(sync_playwright is None, reason="Playwright for Python is missing: pip install "
                                      "playwright (./dev test installs it)")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install chromium (Debian's package; "
                                    "./dev test installs it when run as root), or set LENSCOPE_CHROMIUM to a Chromium "
                                    "executable")
NEEDS_BROWSER = [needs_playwright, needs_chromium]


@pytest.fixture(scope="module", name="browser")
def chromium_browser():
    """``browser``: one headless chromium for a test module (import ``chromium_browser`` into it)."""
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()

# The longest any browser test waits for such a signal (and for any other Playwright action: navigation, a click,
# a download), in milliseconds. A page that works signals within seconds; this is a ceiling, not a budget: a
# loaded 2-core machine running chromium beside the test's own Python (a tiny model's views are computed in the
# test process or by its server thread) does not reach it in normal operation, and only a page that never
# signals (a script error, a view that does not draw) waits this long, then fails. Never a fixed 10 s.
READY_TIMEOUT_MS = 120_000


def isolated_page(browser, allowed: tuple[str, ...], **context_options):
    """``(context, page, errors, blocked)``: a new context and page; a request whose URL starts with none of
    ``allowed`` is aborted and its URL appended to ``blocked``; console errors and page errors go to ``errors``.
    Every wait and action of the page (and its frames) times out after :data:`READY_TIMEOUT_MS` unless told
    otherwise."""
    ctx = browser.new_context(**context_options)
    ctx.set_default_timeout(READY_TIMEOUT_MS)
    ctx.set_default_navigation_timeout(READY_TIMEOUT_MS)
    blocked: list[str] = []

    def route(r):
        if r.request.url.startswith(allowed):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    ctx.route("**/*", route)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return ctx, page, errors, blocked


def wait_drawn(page_or_frame) -> None:
    """Wait until a report page, a view page (also inside a notebook's frame) or the app has drawn every view:
    ``body[data-ready='1']``."""
    page_or_frame.wait_for_selector("body[data-ready='1']", timeout=READY_TIMEOUT_MS)
