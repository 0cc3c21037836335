"""The console's sandbox pages in a real browser: log in, watch new sandboxes appear without a reload,
filter, follow an exec's output as it runs, download a file, kill from the UI."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable

import pytest
from playwright.sync_api import expect

import dsec

from ..conftest import Daemon
from .conftest import Console


@pytest.mark.timeout(60)
def test_a_bad_token_is_refused_and_a_good_one_logs_in(
    open_console: Callable[[str | None], Console], daemon: Daemon
) -> None:
    c = open_console(None)
    c.page.goto(f"{c.base}/ui/")
    expect(c.testid("login-token")).to_be_visible()  # no session: the login form
    c.testid("login-token").fill("not-a-token")
    c.testid("login-submit").click()
    expect(c.testid("login-error")).to_be_visible()
    c.testid("login-token").fill(daemon.token)
    c.testid("login-submit").click()
    expect(c.testid("whoami")).to_contain_text("operator")
    expect(c.testid("fleet-capacity")).to_be_visible()
    c.testid("logout").click()
    expect(c.testid("login-token")).to_be_visible()
    # The session is gone on the server too: a reload lands on the login form again.
    c.page.reload()
    expect(c.testid("login-token")).to_be_visible()
    assert not c.watch.dialogs and not c.watch.page_errors


@pytest.mark.timeout(120)
def test_new_sandboxes_appear_without_a_reload(console: Console, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    run = uuid.uuid4().hex[:10]
    console.goto("#/sandboxes")
    expect(console.testid("sandbox-total")).to_contain_text("sandbox")
    # A mark on the window survives only if the document is never reloaded.
    console.page.evaluate("() => { window.__noReload = 'kept'; }")

    other = make_sandbox(labels={"run": f"other-{run}"})
    made = [make_sandbox(labels={"run": run, "n": str(i)}) for i in range(3)]
    for sb in [other, *made]:
        expect(console.page.locator(f'[data-testid="sandbox-row"][data-id="{sb.id}"]')).to_be_visible(timeout=10_000)
    assert console.page.evaluate("() => window.__noReload") == "kept"

    # The label filter narrows the list to this run's sandboxes, and the hash carries it.
    console.testid("sandbox-filter-label").fill(f"run={run}")
    expect(console.page).to_have_url(re.compile(rf"#/sandboxes\?label=run(%3D|=){run}$"))
    expect(console.testid("sandbox-total")).to_have_text("3 sandboxes")
    expect(console.testid("sandbox-row")).to_have_count(3)
    expect(console.page.locator(f'[data-testid="sandbox-row"][data-id="{other.id}"]')).to_have_count(0)
    console.testid("sandbox-filter-state").select_option("paused")
    expect(console.testid("sandbox-row")).to_have_count(0)
    console.testid("sandbox-filter-state").select_option("running")
    expect(console.testid("sandbox-row")).to_have_count(3)

    # A row opens the sandbox's page.
    console.page.locator(f'[data-testid="sandbox-row"][data-id="{made[0].id}"] a').click()
    expect(console.testid("sandbox-id")).to_have_text(made[0].id)
    expect(console.testid("sandbox-state")).to_have_text("running")
    expect(console.testid("sandbox-info")).to_contain_text("dsec/busybox")
    expect(console.testid("sandbox-limits")).to_be_visible()
    expect(console.testid("sandbox-timings")).to_be_visible()
    assert not console.watch.dialogs and not console.watch.page_errors


@pytest.mark.timeout(120)
def test_an_execs_output_streams_into_the_page(console: Console, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    console.goto(f"#/sandboxes/{sb.id}")
    expect(console.testid("exec-stream-status")).to_have_text("live")

    result: list[dsec.ExecResult] = []
    worker = threading.Thread(
        target=lambda: result.append(sb.exec("echo first-line; sleep 4; echo second-line >&2; exit 3", timeout=60))
    )
    worker.start()
    try:
        block = console.testid("exec-block").filter(has_text="first-line")
        expect(block).to_be_visible(timeout=10_000)
        # Seen while the command still runs: the output streamed in, it was not fetched at the end.
        assert worker.is_alive(), "the exec had finished before its first line showed"
        stream = block.get_by_test_id("exec-stream")
        expect(stream).to_have_text("first-line\n")
        expect(block.get_by_test_id("exec-cmd")).to_contain_text("echo first-line")
        expect(stream).to_have_text("first-line\nsecond-line\n", timeout=15_000)
        expect(block.get_by_test_id("exec-exit")).to_have_text("exit 3")
        expect(block.locator(".stderr")).to_contain_text("second-line")
    finally:
        worker.join(60)
    assert result and result[0].exit_code == 3


@pytest.mark.timeout(120)
def test_a_file_downloads_from_the_browser(console: Console, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    body = f"console download {uuid.uuid4().hex}\n" * 50
    sb.exec("mkdir -p /tmp/dl")
    sb.files.write("/tmp/dl/report.txt", body)
    console.goto(f"#/sandboxes/{sb.id}")
    path = console.testid("files-path")
    path.fill("/tmp/dl")
    path.press("Enter")
    row = console.page.locator('[data-testid="file-row"][data-path="/tmp/dl/report.txt"]')
    expect(row).to_be_visible()
    with console.page.expect_download() as info:
        row.get_by_test_id("file-download").click()
    download = info.value
    assert download.suggested_filename == "report.txt"
    saved = download.path()
    assert saved is not None and saved.read_text() == body
    # Directories open in place: back up to /tmp and into dl again by clicking.
    console.page.get_by_role("button", name="↑ up").click()
    expect(console.page.locator('[data-testid="file-row"][data-path="/tmp/dl"]')).to_be_visible()


@pytest.mark.timeout(120)
def test_pause_resume_and_kill_from_the_ui(
    console: Console, make_sandbox: Callable[..., dsec.Sandbox], daemon: Daemon
) -> None:
    sb = make_sandbox()
    console.goto(f"#/sandboxes/{sb.id}")
    expect(console.testid("sandbox-state")).to_have_text("running")

    # Cancelling the confirmation leaves it running.
    console.testid("action-kill").click()
    console.testid("confirm-no").click()
    expect(console.testid("confirm-yes")).to_have_count(0)
    time.sleep(1)
    assert sb.info().state == "running"

    # Pause and resume, each confirmed.
    console.testid("action-pause").click()
    console.testid("confirm-yes").click()
    expect(console.testid("sandbox-state")).to_have_text("paused")
    assert sb.info().state == "paused"
    console.testid("action-resume").click()
    console.testid("confirm-yes").click()
    expect(console.testid("sandbox-state")).to_have_text("running")

    console.testid("action-kill").click()
    console.testid("confirm-yes").click()
    expect(console.testid("sandbox-state")).to_have_text("stopped", timeout=20_000)
    expect(console.testid("action-kill")).to_be_disabled()
    state: str
    try:
        state = dsec.Sandbox.connect(sb.id, client=daemon.client()).info().state
    except dsec.NotFound:
        state = "gone"
    assert state in ("stopped", "gone")
    # an ended sandbox is listed when the list is asked for that state
    console.goto("#/sandboxes?state=stopped")
    expect(console.page.locator(f'[data-testid="sandbox-row"][data-id="{sb.id}"]')).to_be_visible()
    assert not console.watch.dialogs and not console.watch.page_errors
