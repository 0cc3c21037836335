"""The console's trajectory pages in a real browser: a rollout recorded through the SDK is read back in
the viewer call by call (op, exit code, outputs with the truncation marked, the error, the grade), its
JSONL export is the same as `dsec trajectory export`'s, and two rollouts of one task, graded 1 and 0,
are compared position by position. What the sandbox printed is shown as text, never run."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect

import dsec
from dsec.cli.trajectory import training_record
from dsec.protocol.trajectory import REPLAYED_HEADER, SEQ_HEADER, RecordedCall

from ..conftest import Daemon
from .conftest import Console

# The task: leave the answer in /workspace/answer.txt; the grader (a pristine sibling) checks it.
GRADER = [
    "sh",
    "-c",
    'a=$(cat /workspace/answer.txt); if [ "$a" = 42 ]; then echo PASS; else echo "FAIL: got $a"; exit 1; fi',
]
PAYLOAD = "<script>alert('xss-stdout')</script><img src=x onerror=\"alert('xss-img')\">"


def rollout(make_sandbox: Callable[..., dsec.Sandbox], trajectory: str, answer: str) -> dsec.Sandbox:
    """One attempt at the task, recorded: output on both streams, a file, an error, a cut output, a grade.
    Positions: 0 create, 1-2 execs, 3 write, 4 read (error), 5 exec (truncated), 6 exec (payload), 7 grade."""
    sb = make_sandbox(trajectory=trajectory)
    sb.exec("mkdir -p /workspace && echo started")
    sb.exec(["sh", "-c", f"echo thinking >&2; echo 'the answer is {answer}'; exit 3"])
    sb.files.write("/workspace/answer.txt", answer + "\n")
    with pytest.raises(dsec.FileNotFoundInSandbox):
        sb.files.read("/workspace/missing.txt")
    sb.exec("seq 1 3000", output_limit=1024)
    sb.exec(["printf", "%s\n", PAYLOAD])
    graded = sb.grade(GRADER, paths=["/workspace"], timeout=60)
    assert graded.result.exit_code == (0 if answer == "42" else 1), graded.result
    return sb


def recorded(daemon: Daemon, trajectory: str) -> list[RecordedCall]:
    return list(daemon.client().trajectory_calls(trajectory))


@pytest.mark.timeout(240)
def test_the_viewer_shows_every_call_its_output_and_the_grade(
    console: Console, daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    prefix = f"ui-{uuid.uuid4().hex[:8]}/"
    tid = f"{prefix}rollout-0"
    rollout(make_sandbox, tid, "42")
    calls = recorded(daemon, tid)
    assert [c.op for c in calls] == ["create", "exec", "exec", "write", "read", "exec", "exec", "grade"]

    # the browser by prefix: one row, which opens the viewer
    console.goto(f"#/trajectories?prefix={prefix}")
    rows = console.testid("trajectory-row")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-id", tid)
    rows.first.get_by_test_id("trajectory-link").click()
    expect(console.testid("trajectory-id")).to_have_text(tid)

    # every call, in order, with its op, exit code and duration
    call_rows = console.testid("call-row")
    expect(call_rows).to_have_count(len(calls))
    for i, c in enumerate(calls):
        row = call_rows.nth(i)
        expect(row).to_have_attribute("data-seq", str(c.seq))
        expect(row.get_by_test_id("call-op")).to_have_text(c.op)
        expect(row.get_by_test_id("call-mode")).to_have_text("live")
        if c.op == "exec":
            expect(row.get_by_test_id("call-exit")).to_have_text(f"exit {(c.result or {})['exit_code']}")
    expect(console.testid("trajectory-timeline").get_by_test_id("timeline-bar")).to_have_count(len(calls))

    # an exec's two streams, opened from its row
    row = call_rows.nth(2)
    row.get_by_test_id("call-toggle").click()
    expect(row.get_by_test_id("call-stdout")).to_have_text("the answer is 42\n")
    expect(row.get_by_test_id("call-stderr")).to_have_text("thinking\n")
    expect(row.get_by_test_id("call-args")).to_contain_text("thinking")
    expect(row.get_by_test_id("call-truncated")).to_have_count(0)

    # the cut output is marked as such
    row = call_rows.nth(5)
    row.get_by_test_id("call-toggle").click()
    expect(row.get_by_test_id("call-truncated")).to_be_visible()
    assert (calls[5].result or {})["truncated"] is True

    # the failed read keeps its error
    row = call_rows.nth(4)
    row.get_by_test_id("call-toggle").click()
    expect(row.get_by_test_id("call-error")).to_contain_text("file_not_found")

    # the payload the sandbox printed is text on the page, not markup
    row = call_rows.nth(6)
    row.get_by_test_id("call-toggle").click()
    expect(row.get_by_test_id("call-stdout")).to_have_text(PAYLOAD + "\n")
    expect(console.page.locator("main img")).to_have_count(0)
    expect(console.page.locator("main script")).to_have_count(0)

    grade = console.testid("trajectory-grade")
    expect(grade).to_have_attribute("data-grade", "1")
    expect(grade).to_contain_text("grade 1")
    row = call_rows.nth(7)
    row.get_by_test_id("call-toggle").click()
    expect(row.get_by_test_id("call-stdout")).to_have_text("PASS\n")

    console.page.wait_for_timeout(300)  # any handler the payload could have installed would have fired
    assert console.watch.dialogs == []
    assert console.watch.page_errors == []
    assert console.watch.csp_violations() == []


@pytest.mark.timeout(240)
def test_a_call_answered_again_from_the_log_shows_as_replayed(
    console: Console, daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    tid = f"ui-{uuid.uuid4().hex[:8]}/replayed"
    sb = make_sandbox(trajectory=tid)
    sb.exec("echo once")
    sb.exec("echo twice")
    # a trainer resuming: its create is answered from call 0 ...
    again = dsec.Sandbox.create(client=daemon.client(), image="dsec/busybox", trajectory=tid)
    assert again.id == sb.id
    # ... and a call it sends at a recorded position (as after a broken connection) from call 2, twice
    for _ in range(2):
        reply = httpx.post(
            f"{daemon.url}/v1/sandboxes/{sb.id}/exec",
            headers={"authorization": f"Bearer {daemon.token}", SEQ_HEADER: "2"},
            json={"cmd": "echo twice"},
            timeout=30,
        )
        assert reply.status_code == 200 and reply.headers.get(REPLAYED_HEADER) == "1", reply.text
    deadline = time.monotonic() + 10  # the counts are committed without the replies waiting for them
    while [c.replays for c in recorded(daemon, tid)] != [1, 0, 2]:
        assert time.monotonic() < deadline, [c.replays for c in recorded(daemon, tid)]
        time.sleep(0.05)

    console.goto(f"#/trajectories/view?id={tid}")
    modes = console.testid("call-row").get_by_test_id("call-mode")
    expect(modes).to_have_count(3)
    expect(modes.nth(0)).to_have_text("replayed ×1")
    expect(modes.nth(1)).to_have_text("live")
    expect(modes.nth(2)).to_have_text("replayed ×2")
    expect(modes.nth(2)).to_have_attribute("data-replays", "2")
    expect(modes.nth(2)).to_have_attribute("title", re.compile("last answered from the log"))
    expect(modes.nth(1)).to_have_attribute("title", "")
    assert console.watch.dialogs == [] and console.watch.page_errors == []


@pytest.mark.timeout(240)
def test_the_jsonl_export_is_the_cli_export(
    console: Console, daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox], tmp_path: Path
) -> None:
    tid = f"ui-{uuid.uuid4().hex[:8]}/export"
    rollout(make_sandbox, tid, "41")
    console.goto(f"#/trajectories/view?id={tid}")
    expect(console.testid("call-row")).to_have_count(8)
    with console.page.expect_download() as info:
        console.testid("trajectory-export").click()
    download = info.value
    assert download.suggested_filename.endswith(".jsonl")
    path = tmp_path / "export.jsonl"
    download.save_as(path)
    got = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    want = [json.loads(json.dumps(training_record(tid, c))) for c in recorded(daemon, tid)]
    assert len(got) == len(want) == 8
    for g, w in zip(got, want, strict=True):
        assert _stamp(g) == _stamp(w)
        assert g == w
    assert got[6]["stdout"] == PAYLOAD + "\n" and got[5]["truncated"] is True and "error" in got[4]
    # the download is a blob: URL the page made; the policy let it through
    assert console.watch.csp_violations() == []


def _stamp(record: dict[str, Any]) -> datetime:
    """started_at, parsed (the API writes UTC as Z, Python's isoformat as +00:00); replaced by its parse."""
    stamp = datetime.fromisoformat(record["started_at"].replace("Z", "+00:00"))
    record["started_at"] = "(compared)"
    return stamp


@pytest.mark.timeout(300)
def test_two_rollouts_graded_1_and_0_side_by_side(
    console: Console, daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    prefix = f"ui-{uuid.uuid4().hex[:8]}/task/"
    good, bad = f"{prefix}rollout-good", f"{prefix}rollout-bad"
    rollout(make_sandbox, good, "42")
    rollout(make_sandbox, bad, "41")

    # picked from the list: tick two, compare
    console.goto(f"#/trajectories?prefix={prefix}")
    expect(console.testid("trajectory-row")).to_have_count(2)
    expect(console.testid("trajectory-compare")).to_be_disabled()
    for tid in (good, bad):
        console.page.locator(f'[data-testid="trajectory-row"][data-id="{tid}"]').get_by_test_id(
            "trajectory-pick"
        ).check()
    console.testid("trajectory-compare").click()
    expect(console.testid("compare-row")).to_have_count(8)

    # whichever side the list put each on, go to a known order
    console.goto(f"#/trajectories/compare?a={good}&b={bad}")
    expect(console.testid("compare-left")).to_have_attribute("data-id", good)
    expect(console.testid("compare-right")).to_have_attribute("data-id", bad)
    expect(console.testid("compare-left").get_by_test_id("trajectory-grade")).to_have_attribute("data-grade", "1")
    expect(console.testid("compare-right").get_by_test_id("trajectory-grade")).to_have_attribute("data-grade", "0")

    rows = console.testid("compare-row")
    expect(rows).to_have_count(8)
    # aligned by position; marked where the calls or their answers differ
    kinds = {
        0: "same",  # create: same image and limits (the trajectory ids differ, as they must)
        2: "request",  # the command embeds the answer
        3: "request",  # the written file's bytes differ
        4: "same",  # the same failed read
        5: "same",  # seq 1 3000, cut the same way
        7: "result",  # the same grade, another outcome
    }
    for seq, kind in kinds.items():
        expect(rows.nth(seq)).to_have_attribute("data-seq", str(seq))
        expect(rows.nth(seq)).to_have_attribute("data-diff", kind)
    expect(rows.nth(7).locator('[data-side="left"]').get_by_test_id("compare-exit")).to_have_text("exit 0")
    expect(rows.nth(7).locator('[data-side="right"]').get_by_test_id("compare-exit")).to_have_text("exit 1")
    # opened, a row shows both calls in full
    rows.nth(7).locator("button.cmp-seq").click()
    expect(rows.nth(7).locator('[data-side="left"]').get_by_test_id("call-stdout")).to_have_text("PASS\n")
    expect(rows.nth(7).locator('[data-side="right"]').get_by_test_id("call-stdout")).to_have_text("FAIL: got 41\n")

    console.testid("compare-only-diff").check()
    expect(rows).to_have_count(sum(1 for _ in _differing(daemon, good, bad)))
    assert console.watch.dialogs == [] and console.watch.page_errors == []


def _differing(daemon: Daemon, a: str, b: str) -> list[int]:
    """Positions whose calls differ in what they asked (digest) or got (status, exit, outputs); create
    and kill compared by what they did, as the page does."""
    out = []
    for x, y in zip(recorded(daemon, a), recorded(daemon, b), strict=True):
        if x.op == "create":
            same = all(x.request.get(k) == y.request.get(k) for k in ("image", "kind", "limits"))
        elif x.digest != y.digest or x.status != y.status:
            same = False
        else:
            rx, ry = _exec_part(x), _exec_part(y)
            same = rx == ry if rx or ry else (x.result_bytes == y.result_bytes and x.result == y.result)
        if not same:
            out.append(x.seq)
    return out


def _exec_part(c: RecordedCall) -> tuple[Any, ...] | None:
    r = c.result or {}
    if c.op == "grade":
        r = r.get("result") or {}
    elif c.op != "exec" or "error" in r:
        return None
    return tuple(r.get(k) for k in ("exit_code", "signal", "stdout", "stderr"))


@pytest.mark.timeout(180)
def test_a_tenant_sees_only_its_own_trajectories(
    open_console: Callable[[str | None], Console], daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    tid = f"ui-{uuid.uuid4().hex[:8]}/operator-only"
    sb = make_sandbox(trajectory=tid)
    sb.exec("echo secret-of-the-operator")
    tenant = daemon.client().create_tenant(f"ui-traj-{uuid.uuid4().hex[:6]}")
    c = open_console(tenant.token)
    c.goto(f"#/trajectories?prefix={tid}")
    expect(c.testid("trajectory-table")).to_contain_text("No trajectory here")
    expect(c.testid("trajectory-row")).to_have_count(0)
    c.goto(f"#/trajectories/view?id={tid}")
    expect(c.testid("error")).to_contain_text("404")  # as the API answers: no such trajectory of its own
    expect(c.testid("call-row")).to_have_count(0)
    expect(c.page.locator("body")).not_to_contain_text("secret-of-the-operator")


@pytest.mark.timeout(180)
def test_a_rebuilds_note_shows_under_the_call_it_is_about(
    console: Console, daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    tid = f"ui-{uuid.uuid4().hex[:8]}/rebuilt"
    sb = make_sandbox(trajectory=tid)
    sb.exec("cat /proc/sys/kernel/random/uuid")  # a re-run answers differently
    sb.exec("echo stable")
    dsec.Sandbox.connect(sb.id, client=daemon.client()).kill()  # from outside: lost to the trajectory
    make_sandbox(trajectory=tid)  # the resumed create rebuilds it from the log
    notes = {c.seq: c.note for c in recorded(daemon, tid) if c.note}
    assert list(notes) == [1], notes
    console.goto(f"#/trajectories/view?id={tid}")
    expect(console.testid("trajectory-info")).to_contain_text("1 call with a note")
    rows = console.testid("call-row")
    expect(rows).to_have_count(3)
    expect(rows.nth(1).get_by_test_id("call-note")).to_have_text(f"note: {notes[1]}")
    expect(rows.nth(2).get_by_test_id("call-note")).to_have_count(0)
