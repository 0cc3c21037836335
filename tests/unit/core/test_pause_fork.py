"""Pause, resume and fork in the core: states, refusals, all-or-nothing forks (over in-memory kinds)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dsec.core import lifecycle
from dsec.core.manager import SandboxManager
from dsec.errors import BackendError, InvalidRequest, InvalidState, SandboxGone
from dsec.protocol.checkpoints import CheckpointRequest, RollbackRequest
from dsec.protocol.sandbox import MAX_TTL_S, CreateSandbox, ExecRequest, ForkRequest, State
from dsec.store.records import SandboxRecord

from ...fakes.backend import FakeBackend
from ..conftest import AUTH, IMAGE, Api

Core = tuple[SandboxManager, FakeBackend]


class MachineFake(FakeBackend):
    """A kind that can pause and fork: a checkpoint is a copy of the sandbox's files."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.paused: set[str] = set()
        self.restore_error: dict[int, BaseException] = {}  # index of the copy -> what it raises
        self.restored = 0
        self.checkpoints_open = 0
        self.exec_gate: asyncio.Event | None = None

    async def pause(self, rec: SandboxRecord) -> None:
        self.paused.add(rec.id)

    async def resume(self, rec: SandboxRecord) -> None:
        if rec.id in self.dead:
            raise SandboxGone(f"the VM of {rec.id} is gone")
        self.paused.discard(rec.id)

    @contextlib.asynccontextmanager
    async def checkpoint(self, rec: SandboxRecord) -> AsyncIterator[dict[str, bytes]]:
        self.checkpoints_open += 1
        try:
            yield dict(self.files[rec.id])
        finally:
            self.checkpoints_open -= 1

    async def restore(self, rec: SandboxRecord, parent: SandboxRecord, checkpoint: Any) -> None:
        index = self.restored
        self.restored += 1
        await asyncio.sleep(0)
        if index in self.restore_error:
            raise self.restore_error[index]
        self.created.append(rec.id)
        self.files[rec.id] = dict(checkpoint)
        self.dirs[rec.id] = set(self.dirs[parent.id])

    async def exec(self, rec: SandboxRecord, req: ExecRequest, on_output: Any = None, io: Any = None) -> Any:
        if self.exec_gate is not None:
            await self.exec_gate.wait()
        return await super().exec(rec, req, on_output, io)


@pytest.fixture
async def machine(fresh: Core) -> AsyncIterator[tuple[SandboxManager, MachineFake]]:
    mgr, _ = fresh
    backend = MachineFake(mgr.ctx)
    mgr.backends["container"] = backend
    await mgr.start()
    try:
        yield mgr, backend
    finally:
        await mgr.close()


async def _create(mgr: SandboxManager, **kw: Any) -> str:
    return (await mgr.create(CreateSandbox.model_validate({"image": IMAGE, **kw}))).id


async def test_pause_and_resume(machine: tuple[SandboxManager, MachineFake]) -> None:
    mgr, backend = machine
    sid = await _create(mgr)
    assert (await mgr.pause(sid)).state == State.paused
    assert sid in backend.paused
    assert (await mgr.pause(sid)).state == State.paused  # twice is fine
    with pytest.raises(InvalidState, match="paused"):
        await mgr.exec(sid, ExecRequest(cmd="true"))
    with pytest.raises(InvalidState, match="paused"):
        await mgr.write_file(sid, "/f", b"x")
    assert (await mgr.resume(sid)).state == State.running
    assert sid not in backend.paused
    assert (await mgr.resume(sid)).state == State.running  # resuming a running one is fine
    assert (await mgr.exec(sid, ExecRequest(cmd="true"))).exit_code == 0


async def test_pause_is_refused_while_a_command_runs(machine: tuple[SandboxManager, MachineFake]) -> None:
    mgr, backend = machine
    sid = await _create(mgr)
    backend.exec_gate = asyncio.Event()
    running = asyncio.create_task(mgr.exec(sid, ExecRequest(cmd="sleep 1")))
    await asyncio.sleep(0.01)
    with pytest.raises(InvalidState, match="1 command"):
        await mgr.pause(sid)
    backend.exec_gate.set()
    await running
    assert (await mgr.pause(sid)).state == State.paused


async def test_a_kind_that_cannot_pause_or_fork_says_so(fresh: Core) -> None:
    mgr, _ = fresh  # the plain fake keeps the ABC's defaults
    await mgr.start()
    try:
        sid = await _create(mgr)
        with pytest.raises(InvalidRequest, match="cannot be paused"):
            await mgr.pause(sid)
        assert mgr.info(sid).state == State.running  # a refused pause leaves it running
        with pytest.raises(InvalidRequest, match="memory snapshot"):
            await mgr.fork(sid, ForkRequest(n=2))
        assert [s.id for s in mgr.list()] == [sid]  # and no half-made copies
        with pytest.raises(InvalidRequest, match="cannot take checkpoints yet"):
            await mgr.checkpoint(sid, CheckpointRequest())
        with pytest.raises(InvalidRequest, match="cannot roll back yet"):
            await mgr.rollback(sid, RollbackRequest(checkpoint="c1"))
        with pytest.raises(InvalidRequest, match="cannot be forked from a checkpoint"):
            await mgr.fork(sid, ForkRequest(n=1, checkpoint="c1"))
        assert mgr.list_checkpoints(sid) == []
        with pytest.raises(InvalidRequest, match=r"on_timeout 'pause'.*cannot be paused"):
            await _create(mgr, on_timeout="pause")
    finally:
        await mgr.close()


async def test_resume_of_a_vanished_sandbox_marks_it_failed(machine: tuple[SandboxManager, MachineFake]) -> None:
    mgr, backend = machine
    sid = await _create(mgr)
    await mgr.pause(sid)
    backend.dead.add(sid)
    with pytest.raises(SandboxGone):
        await mgr.resume(sid)
    assert mgr.info(sid).state == State.failed


async def test_fork_makes_n_running_copies(machine: tuple[SandboxManager, MachineFake]) -> None:
    mgr, backend = machine
    sid = await _create(mgr, labels={"job": "a"}, timeout=900)
    await mgr.write_file(sid, "/work/state", b"checkpoint")
    result = await mgr.fork(sid, ForkRequest(n=3))
    copies = result.sandboxes
    assert len({c.id for c in copies}) == 3 and sid not in {c.id for c in copies}
    for c in copies:
        assert c.state == State.running and c.forked_from == sid and c.started_from == "fork"
        assert c.labels == {"job": "a"}
        assert abs((c.expires_at - c.created_at).total_seconds() - 900) < 1
        assert await mgr.read_file(c.id, "/work/state") == b"checkpoint"
    # copies are independent of each other and of the parent
    await mgr.write_file(copies[0].id, "/work/state", b"changed")
    assert await mgr.read_file(copies[1].id, "/work/state") == b"checkpoint"
    assert await mgr.read_file(sid, "/work/state") == b"checkpoint"
    assert mgr.info(sid).state == State.running and backend.checkpoints_open == 0


async def test_fork_of_a_paused_sandbox_leaves_it_paused(machine: tuple[SandboxManager, MachineFake]) -> None:
    mgr, _ = machine
    sid = await _create(mgr)
    await mgr.pause(sid)
    result = await mgr.fork(sid, ForkRequest(n=1, timeout=60, labels={"copy": "1"}))
    assert mgr.info(sid).state == State.paused
    (copy,) = result.sandboxes
    assert copy.labels == {"copy": "1"} and abs((copy.expires_at - copy.created_at).total_seconds() - 60) < 1


async def test_each_copy_of_a_fork_is_made_or_fails_on_its_own(machine: tuple[SandboxManager, MachineFake]) -> None:
    mgr, backend = machine
    sid = await _create(mgr)
    backend.restore_error = {1: BackendError("the VM did not come up")}
    result = await mgr.fork(sid, ForkRequest(n=3))
    assert len(result.sandboxes) == 2 and [f.index for f in result.failed] == [1]
    assert result.failed[0].error.code == "backend_error" and result.failed[0].error.message == "the VM did not come up"
    assert {s.id for s in mgr.list()} == {sid, *(c.id for c in result.sandboxes)}
    assert all(mgr.info(c.id).state == State.running for c in result.sandboxes)
    (gone,) = [s for s in mgr.list(include_finished=True) if s.forked_from == sid and s.state == State.failed]
    assert gone.reason == "fork failed: the VM did not come up" and gone.id in backend.destroyed
    assert mgr.info(sid).state == State.running and backend.checkpoints_open == 0


async def test_a_fork_none_of_whose_copies_starts_is_an_error(machine: tuple[SandboxManager, MachineFake]) -> None:
    mgr, backend = machine
    sid = await _create(mgr)
    backend.restore_error = {i: BackendError("the VM did not come up") for i in range(2)}
    with pytest.raises(BackendError, match="the VM did not come up"):
        await mgr.fork(sid, ForkRequest(n=2))
    assert [s.id for s in mgr.list()] == [sid]
    finished = [s for s in mgr.list(include_finished=True) if s.forked_from == sid]
    assert len(finished) == 2 and all(s.state == State.failed for s in finished)
    assert {s.id for s in finished} <= set(backend.destroyed) and backend.checkpoints_open == 0


async def test_fork_of_a_stopped_sandbox(machine: tuple[SandboxManager, MachineFake]) -> None:
    mgr, _ = machine
    sid = await _create(mgr)
    await mgr.kill(sid)
    with pytest.raises(SandboxGone):
        await mgr.fork(sid, ForkRequest(n=1))


def test_fork_request_bounds() -> None:
    for bad in ({"n": 0}, {"n": 65}, {"n": 1, "timeout": -1}, {"n": 1, "labels": {"": "x"}}, {"n": 1, "x": 1}):
        with pytest.raises(ValueError):
            ForkRequest.model_validate(bad)


def test_the_wire(api: Api) -> None:
    """The routes only translate: errors come back as the error model with the core's message."""
    sid = str(api.create()["id"])
    reply = api.client.post(f"/v1/sandboxes/{sid}/fork", json={"n": 2}, headers=AUTH)
    assert reply.status_code == 400 and "memory snapshot" in reply.json()["error"]["message"]
    reply = api.client.post(f"/v1/sandboxes/{sid}/fork", json={"n": 0}, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"
    reply = api.client.post(f"/v1/sandboxes/{sid}/pause", headers=AUTH)
    assert reply.status_code == 400 and "cannot be paused" in reply.json()["error"]["message"]
    for action in ("pause", "resume", "fork"):
        reply = api.client.post(f"/v1/sandboxes/sb-nope/{action}", json={"n": 1}, headers=AUTH)
        assert reply.status_code == 404, (action, reply.text)
    api.manager.backends["container"] = MachineFake(api.manager.ctx)  # a kind that can
    sid = str(api.create()["id"])
    reply = api.client.post(f"/v1/sandboxes/{sid}/pause", headers=AUTH)
    assert reply.status_code == 200 and reply.json()["state"] == "paused"
    reply = api.client.post(f"/v1/sandboxes/{sid}/fork", json={"n": 2, "labels": {"k": "v"}}, headers=AUTH)
    assert reply.status_code == 201, reply.text
    body = reply.json()
    assert len(body["sandboxes"]) == 2 and all(s["forked_from"] == sid for s in body["sandboxes"])
    assert api.client.post(f"/v1/sandboxes/{sid}/resume", headers=AUTH).json()["state"] == "running"


async def test_a_sandbox_that_pauses_at_its_timeout(machine: tuple[SandboxManager, MachineFake]) -> None:
    mgr, backend = machine
    sid = await _create(mgr, on_timeout="pause")
    assert mgr.info(sid).on_timeout == "pause"
    mgr.sandboxes.get(sid).expires_at = time.time() - 1
    await mgr.reap_once()
    info = mgr.info(sid)
    assert info.state == State.paused and sid in backend.paused
    assert info.expires_at.timestamp() > time.time() + MAX_TTL_S - 60  # kept paused, not reaped next pass
    await mgr.reap_once()
    assert mgr.info(sid).state == State.paused
    assert (await mgr.resume(sid)).state == State.running
    # expire(): the timeout reached now, as the reaper would
    assert (await mgr.expire(sid)).state == State.paused
    plain = await _create(mgr)
    assert (await mgr.expire(plain)).state == State.stopped
    # a paused one past its time to live is stopped
    mgr.sandboxes.get(sid).expires_at = time.time() - 1
    await mgr.reap_once()
    assert mgr.info(sid).state == State.stopped


async def test_a_command_running_at_the_timeout_delays_the_pause_within_a_grace(
    machine: tuple[SandboxManager, MachineFake],
) -> None:
    mgr, backend = machine
    sid = await _create(mgr, on_timeout="pause")
    backend.exec_gate = asyncio.Event()
    running = asyncio.create_task(mgr.exec(sid, ExecRequest(cmd="sleep 1")))
    await asyncio.sleep(0.01)
    mgr.sandboxes.get(sid).expires_at = time.time() - 1
    await mgr.reap_once()
    assert mgr.info(sid).state == State.running  # paused at a later pass, once the command is done
    backend.exec_gate.set()
    await running
    await mgr.reap_once()
    assert mgr.info(sid).state == State.paused
    # past the grace, a sandbox still running a command is stopped: the time to live bounds it
    other = await _create(mgr, on_timeout="pause")
    backend.exec_gate = asyncio.Event()
    held = asyncio.create_task(mgr.exec(other, ExecRequest(cmd="sleep 1")))
    await asyncio.sleep(0.01)
    mgr.sandboxes.get(other).expires_at = time.time() - lifecycle.PAUSE_GRACE_S - 1
    await mgr.reap_once()
    info = mgr.info(other)
    assert info.state == State.stopped and "not paused: 1 command(s)" in (info.reason or "")
    backend.exec_gate.set()
    with contextlib.suppress(Exception):
        await held


async def test_a_sandbox_that_fails_to_pause_at_its_timeout_is_stopped(
    machine: tuple[SandboxManager, MachineFake],
) -> None:
    mgr, backend = machine
    sid = await _create(mgr, on_timeout="pause")

    async def broken(rec: SandboxRecord) -> None:
        raise BackendError("the freezer is stuck")

    backend.pause = broken  # type: ignore[method-assign]
    mgr.sandboxes.get(sid).expires_at = time.time() - 1
    await mgr.reap_once()
    info = mgr.info(sid)
    assert info.state == State.stopped and "could not be paused: the freezer is stuck" in (info.reason or "")
