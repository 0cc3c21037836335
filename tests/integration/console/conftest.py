"""Browser fixtures for the console tests: a daemon listening on loopback HTTP (the console is served at
/ui), Debian's Chromium driven by Playwright, and a page logged in as the operator that records every
dialog, console error and page error, so a test can prove that nothing a sandbox produced ran as code.

Chromium comes from the ``chromium`` package (never ``playwright install``); without it the tests skip,
except under CI=true, where a missing browser is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, ConsoleMessage, Dialog, Locator, Page, expect, sync_playwright

from ..conftest import Daemon, free_port, scratch_dir, shut_down, start_daemon

CHROMIUM = Path(os.environ.get("DSEC_CHROMIUM", "/usr/bin/chromium"))
IMAGE = "dsec/busybox"
KIND = "container"
# Playwright's own waits (clicks, expect) give up after this many milliseconds.
WAIT_MS = 15_000


@pytest.fixture(scope="package")
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """Overrides the suite's daemon: the console needs an HTTP origin, not the unix socket."""
    with scratch_dir("dsec-console-") as work:
        d = start_daemon(work / "state", listen=f"http://127.0.0.1:{free_port()}")
        try:
            yield d
        finally:
            shut_down(d)
            if request.session.testsfailed:
                kept = Path(f"/tmp/dsec-console-daemon-{d.proc.pid}.log")
                shutil.copyfile(d.log, kept)
                print(f"\n[dsec] console daemon log kept: {kept}")


# Package-scoped, not session-scoped: Playwright's sync API keeps an event loop running on the main thread
# while it is open, and the suite's tests after this package call asyncio.run().
@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing (apt-get install chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@dataclass
class Watch:
    """What a page did that it should not: dialogs (alert/confirm/prompt), console errors, page errors."""

    dialogs: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)

    def attach(self, page: Page) -> None:
        def on_dialog(dialog: Dialog) -> None:
            self.dialogs.append(f"{dialog.type}: {dialog.message}")
            dialog.dismiss()

        def on_console(msg: ConsoleMessage) -> None:
            if msg.type == "error":
                self.console_errors.append(msg.text)

        page.on("dialog", on_dialog)
        page.on("console", on_console)
        page.on("pageerror", lambda err: self.page_errors.append(str(err)))

    def csp_violations(self) -> list[str]:
        return [e for e in self.console_errors if "Content Security Policy" in e or "Refused to" in e]

    def unexpected_errors(self, allowed: tuple[str, ...] = ()) -> list[str]:
        """Console errors other than failed loads the test caused on purpose (e.g. a 404 it asked for)."""
        pattern = re.compile("|".join(re.escape(a) for a in allowed)) if allowed else None
        return [e for e in self.console_errors if not (pattern and pattern.search(e))]


@dataclass
class Console:
    """A browser page on the console, with its watch and the daemon it talks to."""

    page: Page
    context: BrowserContext
    watch: Watch
    base: str  # e.g. http://127.0.0.1:PORT (no trailing slash)

    def goto(self, route: str) -> None:
        """Goes to a console route such as "#/sandboxes" (no reload when the document is loaded)."""
        if not self.page.url.startswith(f"{self.base}/ui/"):
            self.page.goto(f"{self.base}/ui/{route}")
        else:
            self.page.evaluate("h => { window.location.hash = h; }", route)

    def testid(self, name: str) -> Locator:
        return self.page.get_by_test_id(name)


def log_in(console: Console, token: str) -> None:
    page = console.page
    page.goto(f"{console.base}/ui/#/login")
    page.get_by_test_id("login-token").fill(token)
    page.get_by_test_id("login-submit").click()
    expect(page.get_by_test_id("whoami")).to_be_visible()


@pytest.fixture
def open_console(browser: Browser, daemon: Daemon) -> Iterator[Callable[[str | None], Console]]:
    """open_console(token) → a fresh browser context (own cookies) logged in with token (None: not logged in)."""
    contexts: list[BrowserContext] = []

    def open_one(token: str | None) -> Console:
        context = browser.new_context(accept_downloads=True, viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(WAIT_MS)
        contexts.append(context)
        page = context.new_page()
        watch = Watch()
        watch.attach(page)
        console = Console(page, context, watch, daemon.url.rstrip("/"))
        if token is not None:
            log_in(console, token)
        return console

    yield open_one
    for context in contexts:
        context.close()


@pytest.fixture
def console(open_console: Callable[[str | None], Console], daemon: Daemon) -> Console:
    """A page logged in as the operator."""
    return open_console(daemon.token)
