"""The console's security in a real browser: what a sandbox produced is shown as text and never runs,
a tenant sees only its own slice, actions need the CSRF token, and the session cookie and headers are
the strict ones."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest
from playwright.sync_api import expect

import dsec

from ..conftest import Daemon
from .conftest import Console

SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(2)>"
SVG = "<svg onload=alert(3)>"
# File names cannot hold "/", so the closing </script> payload goes into output and labels only.
FILE_NAMES = [IMG, SVG, "\"'><b onmouseover=alert(4)>bold"]


def no_execution(console: Console) -> None:
    """Nothing injected ran: no dialog, no page error, no CSP refusal, no element the payloads would make."""
    assert console.watch.dialogs == []
    assert console.watch.page_errors == []
    assert console.watch.csp_violations() == []
    assert console.page.locator("img").count() == 0
    assert console.page.locator("svg").count() == 0
    assert console.page.locator("b").count() == 0
    # Only the bundle's own <script> element exists.
    assert console.page.evaluate("() => [...document.scripts].map(s => s.src)") == [f"{console.base}/ui/assets/app.js"]


@pytest.mark.timeout(150)
def test_sandbox_payloads_are_shown_as_text_and_never_run(
    console: Console, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    run = uuid.uuid4().hex[:10]
    sb = make_sandbox(labels={"run": run, "payload": SCRIPT, IMG: SVG})
    sb.exec("mkdir -p /tmp/evil")
    for name in FILE_NAMES:
        sb.files.write(f"/tmp/evil/{name}", "x")

    console.goto(f"#/sandboxes?label=run={run}")
    # Controls: the watch sees a real dialog, and the CSP refuses an inline script (and the watch sees that).
    console.page.evaluate("() => alert('control')")
    console.page.evaluate(
        """() => { const s = document.createElement('script'); s.textContent = 'window.__ran = 1';
                   document.body.appendChild(s); s.remove(); }"""
    )
    assert console.watch.dialogs == ["alert: control"]
    assert console.page.evaluate("() => window.__ran") is None
    console.page.wait_for_timeout(200)
    assert console.watch.csp_violations(), console.watch.console_errors
    console.watch.dialogs.clear()
    console.watch.console_errors.clear()
    row = console.page.locator(f'[data-testid="sandbox-row"][data-id="{sb.id}"]')
    expect(row).to_contain_text(f"payload={SCRIPT}")
    expect(row).to_contain_text(f"{IMG}={SVG}")

    console.goto(f"#/sandboxes/{sb.id}")
    expect(console.testid("exec-stream-status")).to_have_text("live")
    sb.exec(f"printf '%s\\n' '{SCRIPT}' '{IMG}'; printf '%s\\n' '{SVG}' >&2")
    block = console.testid("exec-block").last
    expect(block.get_by_test_id("exec-exit")).to_have_text("exit 0")
    stream = block.get_by_test_id("exec-stream")
    shown = stream.inner_text()
    for payload in (SCRIPT, IMG, SVG):
        assert f"{payload}\n" in shown
    expect(console.testid("sandbox-info")).to_contain_text(f"payload={SCRIPT}")

    path = console.testid("files-path")
    path.fill("/tmp/evil")
    path.press("Enter")
    for name in FILE_NAMES:
        file_row = console.page.locator(f"[data-testid=file-row][data-path={json.dumps('/tmp/evil/' + name)}]")
        expect(file_row).to_be_visible()
        expect(file_row.locator("td").first).to_have_text(name)
    no_execution(console)

    # The list and the fleet draw the same untrusted strings: still nothing runs after a round of polls.
    console.goto("#/sandboxes")
    expect(console.page.locator(f'[data-testid="sandbox-row"][data-id="{sb.id}"]')).to_contain_text(SCRIPT)
    console.goto("#/fleet")
    expect(console.testid("fleet-capacity")).to_be_visible()
    console.page.wait_for_timeout(2500)
    no_execution(console)


@pytest.mark.timeout(120)
def test_a_tenant_sees_and_opens_only_its_own_sandboxes(
    open_console: Callable[[str | None], Console], daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    operator = daemon.client()
    name = f"ui-{uuid.uuid4().hex[:8]}"
    created = operator.create_tenant(name)
    try:
        tenant_client = dsec.Client(url=daemon.url, token=created.token)
        theirs = make_sandbox()  # the operator's
        mine = make_sandbox(client=tenant_client)

        c = open_console(created.token)
        expect(c.testid("whoami")).to_contain_text(name)
        expect(c.testid("whoami")).to_contain_text("tenant")
        c.goto("#/sandboxes")
        expect(c.page.locator(f'[data-testid="sandbox-row"][data-id="{mine.id}"]')).to_be_visible()
        expect(c.testid("sandbox-row")).to_have_count(1)
        expect(c.page.locator(f'[data-testid="sandbox-row"][data-id="{theirs.id}"]')).to_have_count(0)

        # By URL: the other tenant's sandbox is not found, and nothing of it is shown.
        c.goto(f"#/sandboxes/{theirs.id}")
        expect(c.testid("error")).to_contain_text("404")
        expect(c.testid("sandbox-info")).to_have_count(0)
        expect(c.testid("action-kill")).to_be_disabled()
        # Nor can the page's own session act on it.
        status = c.page.evaluate(
            """async ([id]) => {
                const s = await (await fetch('/ui/session')).json();
                const r = await fetch(`/v1/sandboxes/${id}`, {method: 'DELETE', headers: {'X-CSRF-Token': s.csrf}});
                return r.status;
            }""",
            [theirs.id],
        )
        assert status == 404
        assert theirs.info().state == "running"
        assert c.watch.dialogs == [] and c.watch.page_errors == []
    finally:
        operator.remove_tenant(name)


@pytest.mark.timeout(90)
def test_actions_need_the_csrf_token(console: Console, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    request = console.context.request  # carries the session cookie, like a forged form or fetch would
    refused = request.post(f"{console.base}/v1/sandboxes/{sb.id}/pause")
    assert refused.status == 403
    assert refused.json()["error"]["code"] == "forbidden"
    wrong = request.post(f"{console.base}/v1/sandboxes/{sb.id}/pause", headers={"X-CSRF-Token": "nope"})
    assert wrong.status == 403
    assert sb.info().state == "running"
    assert request.post(f"{console.base}/ui/logout").status == 403  # logout is an action too

    # The same request with the session's token goes through (the check is the token, not the route).
    csrf = request.get(f"{console.base}/ui/session").json()["csrf"]
    ok = request.post(f"{console.base}/v1/sandboxes/{sb.id}/pause", headers={"X-CSRF-Token": csrf})
    assert ok.status == 200, ok.text()
    assert sb.info().state == "paused"
    assert request.post(f"{console.base}/v1/sandboxes/{sb.id}/resume", headers={"X-CSRF-Token": csrf}).status == 200


@pytest.mark.timeout(60)
def test_session_cookie_and_headers_are_strict(console: Console) -> None:
    cookies = [c for c in console.context.cookies() if c["name"] == "dsec_session"]
    assert len(cookies) == 1
    cookie = cookies[0]
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert cookie["path"] == "/"
    assert "dsec_session" not in console.page.evaluate("() => document.cookie")

    response = console.page.goto(f"{console.base}/ui/")
    assert response is not None and response.ok
    headers = response.headers
    csp = headers["content-security-policy"]
    for directive in (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "object-src 'none'",
        "frame-ancestors 'none'",
    ):
        assert directive in csp, csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    assert "no-store" in headers["cache-control"]
    script = console.context.request.get(f"{console.base}/ui/assets/app.js")
    assert script.ok and "content-security-policy" in script.headers
    # Without the cookie the API refuses the console's calls.
    anonymous = console.page.evaluate("async () => (await fetch('/v1/sandboxes', {credentials: 'omit'})).status")
    assert anonymous == 401
