"""The core's process table (what the E2B layer's commands run on) and ExecIO, over the fake backend:
its live execs behave like ``cat`` (stdin comes back on stdout) and end on a signal as that signal would."""

from __future__ import annotations

import asyncio

import pytest

from dsec.core.manager import SandboxManager
from dsec.core.processes import MAX_PER_SANDBOX, Ended, Output, Subscription
from dsec.errors import InvalidRequest, InvalidState, LimitExceeded, NotFound, SandboxNotFound
from dsec.kinds.execio import ExecIO
from dsec.protocol.sandbox import CreateSandbox, ExecRequest
from dsec.tenancy import OPERATOR, Caller

from ...fakes.backend import FakeBackend
from ..conftest import IMAGE

Core = tuple[SandboxManager, FakeBackend]


async def _sandbox(mgr: SandboxManager, caller: Caller = OPERATOR) -> str:
    return (await mgr.create(CreateSandbox(image=IMAGE), caller=caller)).id


async def _drain(sub: Subscription) -> tuple[bytes, Ended]:
    out = b""
    async for event in sub.events():
        if isinstance(event, Output):
            out += event.data
        else:
            return out, event
    raise AssertionError("no end event")


# ---- ExecIO ----------------------------------------------------------------------------------------


async def test_execio_queues_until_eof_and_bounds_what_waits() -> None:
    io = ExecIO(max_pending=8)
    io.feed(b"abc")
    io.feed(b"")
    with pytest.raises(LimitExceeded, match="not reading"):
        io.feed(b"123456")
    io.close_stdin()
    with pytest.raises(InvalidState, match="closed"):
        io.feed(b"x")
    assert await io.next_chunk() == b"abc"
    assert await io.next_chunk() is None


async def test_execio_signals_only_while_started() -> None:
    io = ExecIO()
    with pytest.raises(InvalidState, match="not started"):
        io.send_signal(15)
    got: list[int] = []
    io.attach(42, got.append)
    assert io.started.is_set() and io.pid == 42
    io.send_signal(15)
    io.detach()
    assert got == [15]
    with pytest.raises(InvalidState, match="ended"):
        io.send_signal(9)
    assert await io.next_chunk() is None  # a reader waiting on an ended command is let go


async def test_manager_refuses_live_io_with_upfront_stdin(core: Core) -> None:
    mgr, _ = core
    sid = await _sandbox(mgr)
    with pytest.raises(InvalidRequest, match="stdin"):
        await mgr.exec(sid, ExecRequest(cmd="cat", stdin="x"), io=ExecIO())


# ---- the process table -----------------------------------------------------------------------------


async def test_start_feed_close_and_end(core: Core) -> None:
    mgr, _ = core
    sid = await _sandbox(mgr)
    proc, sub = await mgr.processes.start(sid, ExecRequest(cmd="cat"), caller=OPERATOR, stdin=True, tag="t1")
    assert proc.pid == 100
    assert [p.pid for p in mgr.processes.list(sid, caller=OPERATOR)] == [100]
    assert mgr.processes.find(sid, caller=OPERATOR, tag="t1") is proc
    proc.io.feed(b"hello ")
    proc.io.feed(b"world")
    proc.io.close_stdin()
    out, ended = await _drain(sub)
    assert out == b"hello world"
    assert ended.result is not None and ended.result.exit_code == 0 and ended.error is None
    await asyncio.sleep(0)
    assert mgr.processes.list(sid, caller=OPERATOR) == []
    with pytest.raises(NotFound):
        mgr.processes.find(sid, caller=OPERATOR, pid=100)


async def test_without_stdin_the_command_reads_eof_at_once(core: Core) -> None:
    mgr, _ = core
    sid = await _sandbox(mgr)
    proc, sub = await mgr.processes.start(sid, ExecRequest(cmd="cat"), caller=OPERATOR)
    out, ended = await _drain(sub)
    assert out == b"" and ended.result is not None and ended.result.exit_code == 0
    with pytest.raises(InvalidState):
        proc.io.feed(b"late")


async def test_signal_ends_the_process_and_every_subscriber_sees_it(core: Core) -> None:
    mgr, backend = core
    sid = await _sandbox(mgr)
    proc, first = await mgr.processes.start(sid, ExecRequest(cmd="sleep 100"), caller=OPERATOR, stdin=True)
    proc.io.feed(b"before")
    await asyncio.sleep(0.05)
    second = proc.subscribe()  # attaches from now on: it does not see "before"
    proc.io.feed(b"after")
    await asyncio.sleep(0.05)
    proc.io.send_signal(9)
    out1, end1 = await _drain(first)
    out2, end2 = await _drain(second)
    assert out1 == b"beforeafter" and out2 == b"after"
    for end in (end1, end2):
        assert end.result is not None and end.result.signal == 9 and end.result.exit_code == 137
    assert backend.signals == [(proc.pid, 9)]
    late = proc.subscribe()  # a subscriber after the end gets the end at once
    assert isinstance(await late.next(1.0), Ended)


async def test_output_is_forwarded_within_the_stream_budget(core: Core) -> None:
    mgr, _ = core
    mgr.processes.stream_limit = 10
    sid = await _sandbox(mgr)
    proc, sub = await mgr.processes.start(sid, ExecRequest(cmd="cat"), caller=OPERATOR, stdin=True)
    proc.io.feed(b"0123456789abcdef")
    proc.io.feed(b"more")
    proc.io.close_stdin()
    out, ended = await _drain(sub)
    assert out.startswith(b"0123456789") and b"beyond 10 bytes is not streamed" in out
    assert b"abcdef" not in out and b"more" not in out
    assert ended.result is not None and "0123456789abcdefmore" in ended.result.stdout  # the result keeps it all


async def test_start_failure_is_raised_and_nothing_is_listed(core: Core) -> None:
    mgr, backend = core
    sid = await _sandbox(mgr)
    backend.exec_error = InvalidRequest("user 'nobody2' is not in the image's /etc/passwd")
    with pytest.raises(InvalidRequest, match="nobody2"):
        await mgr.processes.start(sid, ExecRequest(cmd="true"), caller=OPERATOR)
    assert mgr.processes.list(sid, caller=OPERATOR) == []


async def test_other_tenants_see_nothing(core: Core) -> None:
    mgr, _ = core
    alice, bob = Caller("alice"), Caller("bob")
    sid = await _sandbox(mgr, alice)
    proc, _ = await mgr.processes.start(sid, ExecRequest(cmd="cat"), caller=alice, stdin=True)
    with pytest.raises(SandboxNotFound):
        mgr.processes.list(sid, caller=bob)
    with pytest.raises(SandboxNotFound):
        await mgr.processes.start(sid, ExecRequest(cmd="cat"), caller=bob)
    proc.io.close_stdin()


async def test_processes_per_sandbox_are_bounded(core: Core) -> None:
    mgr, _ = core
    sid = await _sandbox(mgr)
    procs = [
        (await mgr.processes.start(sid, ExecRequest(cmd="cat"), caller=OPERATOR, stdin=True))[0]
        for _ in range(MAX_PER_SANDBOX)
    ]
    with pytest.raises(LimitExceeded, match="already runs"):
        await mgr.processes.start(sid, ExecRequest(cmd="cat"), caller=OPERATOR)
    for p in procs:
        p.io.close_stdin()


async def test_a_timeout_ends_a_process_and_close_cancels_the_rest(core: Core) -> None:
    mgr, _ = core
    sid = await _sandbox(mgr)
    _, sub = await mgr.processes.start(sid, ExecRequest(cmd="cat", timeout=0.5), caller=OPERATOR, stdin=True)
    _, ended = await _drain(sub)  # the fake's timeout ends it like a kill
    assert ended.result is not None and ended.result.timed_out
    other, sub2 = await mgr.processes.start(sid, ExecRequest(cmd="cat"), caller=OPERATOR, stdin=True)
    await mgr.processes.close()
    _, ended2 = await _drain(sub2)
    assert ended2.error is not None and "stopping" in ended2.error.message
    assert other.task is not None and other.task.cancelled()


async def test_set_timeout(core: Core) -> None:
    mgr, _ = core
    sid = await _sandbox(mgr)
    info = mgr.set_timeout(sid, 5, caller=OPERATOR)
    left = (info.expires_at - info.created_at).total_seconds()
    assert 4 < left < 7
    with pytest.raises(InvalidRequest):
        mgr.set_timeout(sid, 0, caller=OPERATOR)
    with pytest.raises(SandboxNotFound):
        mgr.set_timeout(sid, 60, caller=Caller("mallory"))
    mgr.set_timeout(sid, 0.01, caller=OPERATOR)
    await asyncio.sleep(0.05)
    await mgr.reap_once()
    assert mgr.info(sid).state.value == "stopped"


# ---- directory watches (polling through the file API) ---------------------------------------------


async def test_dir_watch_reports_creates_writes_chmods_and_removes(core: Core) -> None:
    from dsec.core.watch import DirWatch

    mgr, _ = core
    sid = await _sandbox(mgr)
    await mgr.mkdir(sid, "/w/sub")
    await mgr.write_file(sid, "/w/old.txt", b"1")
    watch = DirWatch(mgr, sid, "/w", recursive=True, caller=OPERATOR)
    await watch.start()
    assert await watch.changes() == []
    await mgr.write_file(sid, "/w/new.txt", b"hello")
    await mgr.write_file(sid, "/w/sub/deep.txt", b"d")
    await mgr.remove(sid, "/w/old.txt")
    changes = await watch.changes()
    assert [(c.type, c.name) for c in changes] == [
        ("create", "new.txt"),
        ("create", "sub/deep.txt"),
        ("remove", "old.txt"),
    ]
    assert changes[0].entry is not None and changes[0].entry.size == 5
    flat = DirWatch(mgr, sid, "/w", recursive=False, caller=OPERATOR)
    await flat.start()
    await mgr.write_file(sid, "/w/sub/deeper.txt", b"x")
    assert await flat.changes() == []  # not recursive: below the first level is not watched


async def test_dir_watch_refuses_a_missing_dir_or_a_file(core: Core) -> None:
    from dsec.core.watch import DirWatch
    from dsec.errors import FileNotFoundInSandbox

    mgr, _ = core
    sid = await _sandbox(mgr)
    await mgr.write_file(sid, "/f", b"x")
    with pytest.raises(FileNotFoundInSandbox):
        await DirWatch(mgr, sid, "/nope", recursive=False, caller=OPERATOR).start()
    with pytest.raises(InvalidRequest, match="not a directory"):
        await DirWatch(mgr, sid, "/f", recursive=False, caller=OPERATOR).start()
