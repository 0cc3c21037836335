"""The lifecycle core over the in-memory FakeBackend."""

from __future__ import annotations

import asyncio
import io
import tarfile
import time

import pytest

from dsec.core import lifecycle as lifecycle_module
from dsec.core import manager as manager_module
from dsec.core.lifecycle import KEEP_FINISHED_S
from dsec.core.manager import SandboxManager
from dsec.core.node import node_status
from dsec.errors import (
    BackendError,
    FileNotFoundInSandbox,
    ImageNotFound,
    InvalidRequest,
    InvalidState,
    KindUnavailable,
    SandboxGone,
    SandboxNotFound,
)
from dsec.protocol.sandbox import CreateSandbox, ExecRequest, Limits, State
from dsec.store.records import SandboxRecord
from dsec.tenancy import OPERATOR

from ...fakes.backend import FakeBackend
from ..conftest import IMAGE

Core = tuple[SandboxManager, FakeBackend]


def req(**kw: object) -> CreateSandbox:
    return CreateSandbox.model_validate({"image": IMAGE, **kw})


def expire(mgr: SandboxManager, sandbox_id: str, when: float | None = None) -> None:
    # the manager's own record (live records are held in memory and written through)
    rec = mgr.record(sandbox_id)
    rec.expires_at = time.time() - 1 if when is None else when
    mgr.store.put(rec)


def state_of(mgr: SandboxManager, sandbox_id: str) -> tuple[State, str | None]:
    rec = mgr.store.get(sandbox_id)
    assert rec is not None
    live = mgr.record(sandbox_id)
    assert (live.state, live.reason) == (rec.state, rec.reason), "memory and store disagree"
    return rec.state, rec.reason


# ---- start and create -----------------------------------------------------------------------------------


async def test_start_keeps_the_injected_backend(core: Core) -> None:
    mgr, backend = core
    assert mgr.backends["container"] is backend
    assert not backend.started  # start() skips injected kinds entirely


async def test_create_runs_and_persists(core: Core) -> None:
    mgr, backend = core
    before = time.time()
    info = await mgr.create(req(timeout=120, env={"A": "1"}, labels={"run": "r1"}))
    assert info.state == State.running
    assert info.id.startswith("sb-")
    assert info.image == IMAGE
    assert info.kind == "container"
    assert info.reason is None
    assert info.labels == {"run": "r1"}
    assert before + 119 <= info.expires_at.timestamp() <= time.time() + 121
    assert backend.created == [info.id]
    assert backend.images[info.id].env["FROM_IMAGE"] == "1"
    rec = mgr.store.get(info.id)
    assert rec is not None
    assert rec.state == State.running
    assert rec.runtime["fake"] is True  # what the backend put in runtime is persisted
    assert set(rec.timings) == {"queue", "runtime", "total"}  # and the core's figures with it
    assert rec.node == mgr.node_name


async def test_create_ids_are_unique(core: Core) -> None:
    mgr, _ = core
    ids = {(await mgr.create(req())).id for _ in range(20)}
    assert len(ids) == 20


async def test_create_unknown_image(core: Core) -> None:
    mgr, backend = core
    with pytest.raises(ImageNotFound):
        await mgr.create(req(image="nobody/nothing:1"))
    assert mgr.store.all() == []
    assert backend.created == []


async def test_a_creation_waiting_for_its_image_is_listed_and_one_whose_image_fails_leaves_nothing(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr, _ = core
    real = mgr.images.resolve
    gate = asyncio.Event()

    async def slow(name: str, **kw: object) -> object:
        await gate.wait()
        return await real(name, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(mgr.images, "resolve", slow)
    creating = asyncio.create_task(mgr.create(req()))
    await asyncio.sleep(lifecycle_module.RESOLVE_SHOWN_AFTER + 0.2)
    (shown,) = mgr.list()
    assert shown.state == State.creating and shown.waiting is not None and IMAGE in shown.waiting
    assert mgr.store.all() == []  # shown, not recorded: a pull that fails leaves nothing
    gate.set()
    info = await creating
    assert (info.id, info.state, info.waiting) == (shown.id, State.running, None)
    assert [r.id for r in mgr.store.all()] == [info.id]

    async def failing(name: str, **kw: object) -> object:
        await asyncio.sleep(lifecycle_module.RESOLVE_SHOWN_AFTER + 0.2)
        raise ImageNotFound(f"no image {name}")

    monkeypatch.setattr(mgr.images, "resolve", failing)
    with pytest.raises(ImageNotFound):
        await mgr.create(req())
    assert [i.id for i in mgr.list()] == [info.id] and [r.id for r in mgr.store.all()] == [info.id]


@pytest.mark.parametrize(
    ("kind", "why"), [("function", "not enabled on this node"), ("vm", "not enabled on this node")]
)
async def test_create_of_a_kind_this_node_does_not_run(core: Core, kind: str, why: str) -> None:
    mgr, _ = core  # real kinds this manager did not start
    with pytest.raises(InvalidRequest, match=why):
        await mgr.create(req(kind=kind))
    assert mgr.store.all() == []


async def test_create_more_memory_than_the_host(core: Core, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr, _ = core
    monkeypatch.setattr(lifecycle_module, "host_memory", lambda: 256 << 20)
    with pytest.raises(InvalidRequest, match="exceeds this node"):
        await mgr.create(req(limits=Limits(memory="512Mi")))


async def test_create_failure_leaves_a_failed_record(core: Core) -> None:
    mgr, backend = core
    backend.create_error = RuntimeError("crun exploded")
    with pytest.raises(BackendError, match="crun exploded") as info:
        await mgr.create(req(labels={"k": "v"}))
    assert isinstance(info.value.__cause__, RuntimeError)
    (rec,) = mgr.store.all()
    assert rec.state == State.failed
    assert rec.reason == "creation failed: RuntimeError: crun exploded"
    assert backend.destroyed == [rec.id]  # half-created sandboxes are cleaned up
    assert mgr.list() == []
    assert [i.id for i in mgr.list(include_finished=True)] == [rec.id]


async def test_create_failure_with_a_dsec_error_is_reraised_as_is(core: Core) -> None:
    mgr, backend = core
    backend.create_error = InvalidRequest("image has no /bin/sh")
    with pytest.raises(InvalidRequest, match="no /bin/sh"):
        await mgr.create(req())
    (rec,) = mgr.store.all()
    assert rec.state == State.failed
    assert rec.reason == "creation failed: image has no /bin/sh"


# ---- queries ------------------------------------------------------------------------------------------


async def test_info_and_unknown_ids(core: Core) -> None:
    mgr, _ = core
    info = await mgr.create(req())
    assert mgr.info(info.id) == info
    for bad in ("sb-nope", "", "x" * 65):
        with pytest.raises(SandboxNotFound):
            mgr.info(bad)


async def test_list_filters_by_labels(core: Core) -> None:
    mgr, _ = core
    a = await mgr.create(req(labels={"team": "a", "run": "1"}))
    b = await mgr.create(req(labels={"team": "b", "run": "1"}))
    c = await mgr.create(req())
    assert {i.id for i in mgr.list()} == {a.id, b.id, c.id}
    assert [i.id for i in mgr.list({"team": "a"})] == [a.id]
    assert {i.id for i in mgr.list({"run": "1"})} == {a.id, b.id}
    assert [i.id for i in mgr.list({"team": "a", "run": "1"})] == [a.id]
    assert mgr.list({"team": "a", "run": "2"}) == []
    await mgr.kill(a.id)
    assert [i.id for i in mgr.list({"team": "a"})] == []
    assert [i.id for i in mgr.list({"team": "a"}, include_finished=True)] == [a.id]


# ---- exec and files ------------------------------------------------------------------------------------


async def test_exec_echoes_and_merges_env(core: Core) -> None:
    mgr, backend = core
    info = await mgr.create(req(env={"A": "sandbox", "B": "sandbox"}))
    result = await mgr.exec(info.id, ExecRequest(cmd=["echo", "hi"], env={"B": "exec", "C": "exec"}))
    assert result.exit_code == 0
    assert result.stdout == "echo hi\n"
    assert backend.execs[-1].env == {"A": "sandbox", "B": "exec", "C": "exec"}


async def test_exec_exit_code(core: Core) -> None:
    mgr, backend = core
    info = await mgr.create(req())
    backend.exit_code = 3
    result = await mgr.exec(info.id, ExecRequest(cmd="exit 3"))
    assert result.exit_code == 3
    assert not result.ok


async def test_exec_output_callback(core: Core) -> None:
    mgr, _ = core
    info = await mgr.create(req())
    seen: list[tuple[str, bytes]] = []
    await mgr.exec(info.id, ExecRequest(cmd="ls"), lambda s, d: seen.append((s, d)))
    assert seen == [("stdout", b"/bin/sh -c ls\n")]


async def test_exec_that_finds_the_sandbox_gone_marks_it_failed(core: Core) -> None:
    mgr, backend = core
    info = await mgr.create(req())
    backend.exec_error = SandboxGone("the sandbox's init process died")
    with pytest.raises(SandboxGone):
        await mgr.exec(info.id, ExecRequest(cmd="true"))
    assert state_of(mgr, info.id) == (State.failed, "the sandbox's init process died")


async def test_exec_on_a_sandbox_that_is_not_running(core: Core) -> None:
    mgr, _ = core
    info = await mgr.create(req())
    rec = mgr.record(info.id)
    rec.state = State.paused
    mgr.store.put(rec)
    with pytest.raises(InvalidState) as err:
        await mgr.exec(info.id, ExecRequest(cmd="true"))
    assert not isinstance(err.value, SandboxGone)
    assert err.value.detail == {"state": "paused"}


async def test_files_round_trip(core: Core) -> None:
    mgr, _ = core
    sid = (await mgr.create(req())).id
    await mgr.write_file(sid, "/work/a.bin", b"\0\1\2")
    await mgr.mkdir(sid, "/work/sub")
    assert await mgr.read_file(sid, "/work/a.bin") == b"\0\1\2"
    assert [e.name for e in await mgr.list_dir(sid, "/work")] == ["a.bin", "sub"]
    await mgr.remove(sid, "/work", recursive=True)
    with pytest.raises(FileNotFoundInSandbox):
        await mgr.read_file(sid, "/work/a.bin")


async def test_tar_round_trip(core: Core) -> None:
    mgr, _ = core
    sid = (await mgr.create(req())).id
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("dir/x.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    await mgr.upload_tar(sid, "/dst", buf.getvalue())
    assert await mgr.read_file(sid, "/dst/dir/x.txt") == b"hello"
    with tarfile.open(fileobj=io.BytesIO(await mgr.download_tar(sid, "/dst"))) as tar:
        assert tar.getnames() == ["dir/x.txt"]


# ---- kill and time to live ---------------------------------------------------------------------------


async def test_kill_twice_is_fine(core: Core) -> None:
    mgr, backend = core
    info = await mgr.create(req())
    first = await mgr.kill(info.id)
    second = await mgr.kill(info.id)
    assert first.state == second.state == State.stopped
    assert first.reason == "killed by request"
    assert backend.destroyed == [info.id]


async def test_everything_on_a_killed_sandbox_is_gone(core: Core) -> None:
    mgr, _ = core
    sid = (await mgr.create(req())).id
    await mgr.kill(sid)
    with pytest.raises(SandboxGone, match="killed by request") as err:
        await mgr.exec(sid, ExecRequest(cmd="true"))
    assert err.value.detail == {"state": "stopped"}
    for op in (
        mgr.read_file(sid, "/x"),
        mgr.write_file(sid, "/x", b""),
        mgr.list_dir(sid, "/"),
        mgr.mkdir(sid, "/d"),
        mgr.remove(sid, "/x"),
        mgr.download_tar(sid, "/"),
    ):
        with pytest.raises(SandboxGone):
            await op


async def test_kill_unknown(core: Core) -> None:
    mgr, _ = core
    with pytest.raises(SandboxNotFound):
        await mgr.kill("sb-nope")


async def test_kill_whose_cleanup_fails_is_failed(core: Core) -> None:
    mgr, backend = core
    sid = (await mgr.create(req())).id
    backend.destroy_error = BackendError("cgroup busy")
    with pytest.raises(BackendError):
        await mgr.kill(sid)
    state, reason = state_of(mgr, sid)
    assert state == State.failed
    assert reason == "killed by request; cleanup failed: cgroup busy"


async def test_reap_once_stops_expired_sandboxes(core: Core) -> None:
    mgr, backend = core
    old = (await mgr.create(req())).id
    young = (await mgr.create(req())).id
    expire(mgr, old)
    with pytest.raises(SandboxGone, match="time to live"):
        await mgr.exec(old, ExecRequest(cmd="true"))
    await mgr.reap_once()
    state, reason = state_of(mgr, old)
    assert state == State.stopped
    assert reason is not None and "time to live" in reason
    assert state_of(mgr, young) == (State.running, None)
    assert backend.destroyed == [old]


async def test_tiny_timeout_is_reaped(core: Core) -> None:
    mgr, _ = core
    sid = (await mgr.create(req(timeout=0.05))).id
    await asyncio.sleep(0.1)
    await mgr.reap_once()
    state, reason = state_of(mgr, sid)
    assert state == State.stopped
    assert reason is not None and "time to live" in reason


async def test_reap_once_forgets_long_finished_records(core: Core) -> None:
    mgr, _ = core
    gone = (await mgr.create(req())).id
    recent = (await mgr.create(req())).id
    await mgr.kill(gone)
    await mgr.kill(recent)
    expire(mgr, gone, time.time() - KEEP_FINISHED_S - 10)
    await mgr.reap_once()
    assert mgr.store.get(gone) is None
    assert mgr.store.get(recent) is not None


async def test_reaper_failure_of_one_sandbox_does_not_stop_the_others(core: Core) -> None:
    mgr, backend = core
    a = (await mgr.create(req())).id
    b = (await mgr.create(req())).id
    expire(mgr, a)
    expire(mgr, b)
    backend.destroy_error = BackendError("stuck")
    await mgr.reap_once()
    assert state_of(mgr, a)[0] == State.failed
    assert state_of(mgr, b)[0] == State.failed


# ---- readopt after a restart -------------------------------------------------------------------------


def stored(mgr: SandboxManager, sid: str, state: State, kind: str = "container") -> None:
    now = time.time()
    mgr.store.put(
        SandboxRecord(
            id=sid,
            kind=kind,
            image=IMAGE,
            state=state,
            created_at=now,
            expires_at=now + 600,
            limits=Limits(),
        )
    )


async def test_readopt(fresh: Core) -> None:
    mgr, backend = fresh
    stored(mgr, "sb-alive", State.running)
    stored(mgr, "sb-dead", State.running)
    stored(mgr, "sb-creating", State.creating)
    stored(mgr, "sb-stopping", State.stopping)
    stored(mgr, "sb-paused", State.paused)
    stored(mgr, "sb-paused-dead", State.paused)
    stored(mgr, "sb-vm", State.running, kind="vm")
    stored(mgr, "sb-done", State.stopped)
    backend.dead.add("sb-dead")
    backend.dead.add("sb-paused-dead")
    await mgr.start()
    try:
        assert state_of(mgr, "sb-alive") == (State.running, None)
        state, reason = state_of(mgr, "sb-dead")
        assert state == State.lost
        assert reason == "the sandbox was not running when the daemon restarted"
        assert state_of(mgr, "sb-creating") == (
            State.lost,
            "the daemon stopped while the sandbox was being created",
        )
        assert state_of(mgr, "sb-stopping") == (
            State.lost,
            "the daemon stopped while the sandbox was being stopped",
        )
        # a paused sandbox still there stays paused (a VM stopped in place survives the daemon)
        assert state_of(mgr, "sb-paused") == (State.paused, None)
        assert state_of(mgr, "sb-paused-dead")[0] == State.lost
        assert state_of(mgr, "sb-vm") == (State.lost, "kind 'vm' is not available in this daemon")
        assert state_of(mgr, "sb-done") == (State.stopped, None)
        assert not {"sb-alive", "sb-paused"} & set(backend.destroyed)
        assert {"sb-dead", "sb-creating", "sb-stopping", "sb-paused-dead"} <= set(backend.destroyed)
        result = await mgr.exec("sb-alive", ExecRequest(cmd="true"))
        assert result.exit_code == 0
        with pytest.raises(SandboxGone, match="not running when the daemon restarted"):
            await mgr.exec("sb-dead", ExecRequest(cmd="true"))
    finally:
        await mgr.close()


async def test_readopt_when_alive_raises(fresh: Core) -> None:
    mgr, backend = fresh
    stored(mgr, "sb-x", State.running)

    async def broken(rec: SandboxRecord) -> bool:
        raise BackendError("crun state failed")

    backend.alive = broken  # type: ignore[method-assign]
    await mgr.start()
    try:
        assert state_of(mgr, "sb-x")[0] == State.lost
    finally:
        await mgr.close()


async def test_create_a_kind_this_manager_did_not_start(core: Core) -> None:
    mgr, _ = core
    with pytest.raises(InvalidRequest, match="not enabled on this node"):
        await mgr.create(req(kind="microvm"))
    assert mgr.store.all() == []


def _kinds_fail_to_start(monkeypatch: pytest.MonkeyPatch, failure: Exception) -> None:
    """Every kind the manager loads raises ``failure`` from its start()."""

    class Broken:
        def __init__(self, ctx: object) -> None:
            pass

        async def start(self) -> list[str]:
            raise failure

    monkeypatch.setattr(manager_module.registry, "load", lambda kind, ctx: Broken(ctx))


async def test_an_optional_kind_that_cannot_start_is_reported_not_fatal(
    fresh: tuple[SandboxManager, FakeBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr, _ = fresh
    mgr.kinds = ["container", "microvm"]

    _kinds_fail_to_start(monkeypatch, KindUnavailable("qemu-system-x86_64 is not installed"))
    await mgr.start()
    try:
        assert "microvm" in mgr.unavailable and "microvm" not in mgr.backends
        with pytest.raises(InvalidRequest, match="not available on this node: qemu"):
            await mgr.create(req(kind="microvm"))
        assert node_status(mgr, OPERATOR).unavailable == {"microvm": "qemu-system-x86_64 is not installed"}
    finally:
        await mgr.close()


@pytest.mark.parametrize("failure", [TypeError("start() got an unexpected keyword"), BackendError("probe failed")])
async def test_a_kind_that_fails_to_start_for_no_named_reason_stops_the_daemon(
    fresh: tuple[SandboxManager, FakeBackend], monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """Only a probed, named prerequisite makes a kind unavailable; any other failure is a bug that a
    node quietly running without the kind (and a suite skipping it) would hide."""
    mgr, _ = fresh
    mgr.kinds = ["container", "microvm"]

    _kinds_fail_to_start(monkeypatch, failure)
    with pytest.raises(type(failure)):
        await mgr.start()
    await mgr.close()
    assert mgr.unavailable == {}
