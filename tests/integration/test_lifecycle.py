from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import dsec


def test_create_exec_kill(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(labels={"suite": "lifecycle", "n": "1"}, env={"GREETING": "hi"})
    info = sb.info()
    assert info.state == dsec.State.running
    assert info.kind == "container"
    assert info.image == "dsec/busybox:latest"
    res = sb.exec("echo $GREETING from $(hostname)")
    assert res.exit_code == 0
    assert res.stdout == "hi from sandbox\n"
    sb.kill()
    assert sb.info().state == dsec.State.stopped
    assert sb.info().reason == "killed by request"
    sb.kill()  # idempotent
    with pytest.raises(dsec.SandboxGone):
        sb.exec("true")


def test_context_manager_kills(daemon: object) -> None:
    with dsec.Sandbox.create(image="dsec/busybox") as sb:
        assert sb.exec(["true"]).exit_code == 0
        sid = sb.id
    assert dsec.Sandbox.connect(sid).info().state == dsec.State.stopped


def test_list_filters_by_labels(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    a = make_sandbox(labels={"team": "red", "run": "x1"})
    b = make_sandbox(labels={"team": "blue", "run": "x1"})
    red = {i.id for i in dsec.Sandbox.list(labels={"team": "red"})}
    both = {i.id for i in dsec.Sandbox.list(labels={"run": "x1"})}
    assert a.id in red and b.id not in red
    assert {a.id, b.id} <= both
    assert dsec.Sandbox.list(labels={"team": "red", "run": "nope"}) == []


def test_connect_returns_same_sandbox(sb: dsec.Sandbox) -> None:
    again = dsec.Sandbox.connect(sb.id)
    sb.files.write("/tmp/marker", b"1")
    assert again.files.read("/tmp/marker") == b"1"


def test_ttl_is_reaped_on_the_host(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(timeout=1.5)
    deadline = time.monotonic() + 15
    # stopping is transient: the reaper is still tearing the sandbox down
    while sb.info().state in (dsec.State.running, dsec.State.stopping) and time.monotonic() < deadline:
        time.sleep(0.3)
    info = sb.info()
    assert info.state == dsec.State.stopped
    assert "time to live" in (info.reason or "")
    with pytest.raises(dsec.SandboxGone):
        sb.exec("true")


async def test_async_sdk_contract(daemon: object) -> None:
    async with await dsec.AsyncSandbox.create(image="dsec/busybox", labels={"api": "async"}) as sb:
        res = await sb.exec(["sh", "-c", "echo out; echo err >&2; exit 4"])
        assert (res.exit_code, res.stdout, res.stderr) == (4, "out\n", "err\n")
        await sb.files.write("/data/x.bin", bytes(range(256)))
        assert await sb.files.read("/data/x.bin") == bytes(range(256))
        chunks = [e async for e in sb.exec_stream("echo a; sleep 0.2; echo b")]
        assert [c.data for c in chunks if c.type == "stdout"] == ["a\n", "b\n"]
        assert chunks[-1].type == "result" and chunks[-1].result is not None
        assert chunks[-1].result.exit_code == 0
        assert any(i.id == sb.id for i in await dsec.AsyncSandbox.list(labels={"api": "async"}))
    assert (await sb.info()).state == dsec.State.stopped


def test_kill_during_exec_ends_the_exec_cleanly(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    import threading

    sb = make_sandbox()
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(sb.exec("sleep 60", timeout=120))
        except dsec.DsecError as e:
            outcome.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    started = time.monotonic()
    sb.kill()
    t.join(30)
    assert not t.is_alive(), "the exec hung after its sandbox was killed"
    assert time.monotonic() - started < 15
    (result,) = outcome
    if isinstance(result, dsec.DsecError):
        assert isinstance(result, dsec.SandboxGone), result
    else:
        assert isinstance(result, dsec.ExecResult) and result.exit_code != 0
