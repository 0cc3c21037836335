"""The trajectory log end to end in one process.

The SDK (``AsyncClient`` / ``AsyncSandbox``) talks to the real app through httpx's ASGI transport; the
log's store (SQLite in the state directory), its group-commit writer, the recorder and the HTTP routes are
all the real ones. Only the sandbox kind is a fake: an in-memory FakeBackend that also records every call
that reaches it. So these tests check the log's logic (recording, replay, fast-forward, divergence, header
rules, interruption, rebuild, closing, concurrency, tenancy, export, retention), not real sandboxes; those
are covered by tests/integration/test_trajectory.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import io
import json
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from pydantic import BaseModel

import dsec
from dsec.cli.trajectory import training_record
from dsec.core.manager import SandboxManager
from dsec.core.trajectory.recorder import TrajectoryOptions
from dsec.errors import (
    BackendError,
    CallInterrupted,
    DsecError,
    FileNotFoundInSandbox,
    InvalidState,
    NotFound,
    SandboxGone,
    TrajectoryDiverged,
)
from dsec.images.store import ImageRef, ImageStore
from dsec.kinds.base import BackendContext, OutputCallback
from dsec.protocol.network import NetworkSpec
from dsec.protocol.sandbox import TERMINAL_STATES, ExecRequest, ExecResult, FileEntry, State
from dsec.protocol.trajectory import RECORDED_AT, REPLAYED_HEADER, SEQ_HEADER, RecordedCall, call_digest
from dsec.sdk.aio import AsyncClient, AsyncSandbox
from dsec.sdk.trajectory import PAGE as SDK_PAGE
from dsec.sdk.trajectory import canonical_params
from dsec.sdk.transport import RETRIES
from dsec.store.records import SandboxRecord
from dsec.store.trajectories import TRAJECTORIES, CallRow, TrajectoryRow, TrajectoryStore

from ...fakes.backend import FakeBackend, make_image
from ..conftest import AUTH, IMAGE, ROOMY, TOKEN, ManagerSwitch, new_manager

OP = "admin"  # the operator's tenant: what the operator's token creates is owned by it
BASE = "http://dsec.test"
BLOB = bytes(range(256)) + b"\x00\xff\xfe\x00"  # every byte value, NULs and 0xFF included: not UTF-8


# ---- a fake kind that records what reaches it ------------------------------------------------------------


class RecordingBackend(FakeBackend):
    """FakeBackend plus ``calls``: every sandbox operation that reached the kind, in order. ``gate``, when
    set, holds every exec until it is set (``entered`` tells that one is waiting)."""

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.calls: list[tuple[Any, ...]] = []
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self._unpacking = False

    async def create(self, rec: SandboxRecord, image: ImageRef) -> None:
        await super().create(rec, image)
        self.calls.append(("create", rec.id))

    async def destroy(self, rec: SandboxRecord) -> None:
        self.calls.append(("destroy", rec.id))
        await super().destroy(rec)

    async def exec(
        self, rec: SandboxRecord, req: ExecRequest, on_output: OutputCallback | None = None, io: Any = None
    ) -> ExecResult:
        self.calls.append(("exec", rec.id, tuple(req.argv())))
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()
        return await super().exec(rec, req, on_output, io)

    async def read_file(self, rec: SandboxRecord, path: str) -> bytes:
        self.calls.append(("read", rec.id, path))
        return await super().read_file(rec, path)

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, mode: int = 0o644) -> None:
        if not self._unpacking:
            self.calls.append(("write", rec.id, path, bytes(data)))
        await super().write_file(rec, path, data, mode)

    async def list_dir(self, rec: SandboxRecord, path: str) -> list[FileEntry]:
        self.calls.append(("list", rec.id, path))
        return await super().list_dir(rec, path)

    async def remove(self, rec: SandboxRecord, path: str, recursive: bool = False) -> None:
        self.calls.append(("remove", rec.id, path))
        await super().remove(rec, path, recursive)

    async def mkdir(self, rec: SandboxRecord, path: str) -> None:
        self.calls.append(("mkdir", rec.id, path))
        await super().mkdir(rec, path)

    async def upload_tar(self, rec: SandboxRecord, path: str, data: bytes) -> None:
        self.calls.append(("upload", rec.id, path))
        self._unpacking = True
        try:
            await super().upload_tar(rec, path, data)
        finally:
            self._unpacking = False

    async def download_tar(self, rec: SandboxRecord, path: str) -> bytes:
        self.calls.append(("download", rec.id, path))
        return await super().download_tar(rec, path)

    async def set_network(self, rec: SandboxRecord, policy: NetworkSpec) -> None:
        self.calls.append(("set_network", rec.id, policy))
        await super().set_network(rec, policy)

    def mutations(self, since: int = 0) -> list[tuple[Any, ...]]:
        return [c for c in self.calls[since:] if c[0] not in ("read", "list", "download")]


# ---- one daemon (manager + app) and the SDK clients pointed at it -------------------------------------------


def asgi_http(app: FastAPI, token: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url=BASE, headers={"authorization": f"Bearer {token}"}
    )


@dataclass
class Daemon:
    app: FastAPI
    switch: ManagerSwitch
    root: Path
    mgr: SandboxManager
    backend: RecordingBackend
    clients: list[AsyncClient] = field(default_factory=list)
    _http: dict[str, httpx.AsyncClient] = field(default_factory=dict)

    async def client(self, token: str = TOKEN) -> AsyncClient:
        """A new SDK client (a new trainer process, as far as the daemon can tell)."""
        client = AsyncClient(url=BASE, token=token)
        await client._transport.http.aclose()
        client._transport.http = asgi_http(self.app, token)
        self.clients.append(client)
        return client

    async def raw(
        self, method: str, path: str, *, seq: int | str | None = None, token: str = TOKEN, **kwargs: Any
    ) -> httpx.Response:
        """An HTTP request as is (no SDK, no error mapping); ``seq`` goes in the Dsec-Seq header."""
        http = self._http.get(token)
        if http is None:
            http = self._http[token] = asgi_http(self.app, token)
        headers = dict(kwargs.pop("headers", {}))
        if seq is not None:
            headers[SEQ_HEADER] = str(seq)
        return await http.request(method, path, headers=headers, **kwargs)

    @property
    def store(self) -> TrajectoryStore:
        return self.mgr.trajectories.store

    def calls(self, tid: str, owner: str = OP) -> list[CallRow]:
        return self.store.calls(owner, tid, 0, 1_000_000)

    def call(self, tid: str, seq: int, owner: str = OP) -> CallRow:
        row = self.store.call(owner, tid, seq)
        assert row is not None, (tid, seq)
        return row

    def row(self, tid: str, owner: str = OP) -> TrajectoryRow:
        row = self.store.get(owner, tid)
        assert row is not None, tid
        return row

    async def restart(self, *, options: TrajectoryOptions | None = None, sandboxes_survive: bool = True) -> None:
        """Stop this manager and start a new one on the same state directory, with a new backend. With
        ``sandboxes_survive`` the new backend still holds the old one's files (containers outlive the
        daemon); otherwise set ``backend.dead`` yourself before, or mark them in the new one's."""
        old = self.backend
        await self.mgr.close()
        mgr = SandboxManager(
            state_dir=self.root / "state",
            images=ImageStore(self.root / "images", lazy=False, mount=False),
            kinds=["container"],
            trajectory=options,
            admission=ROOMY,
        )
        backend = RecordingBackend(mgr.ctx)
        if sandboxes_survive:
            backend.files, backend.dirs = old.files, old.dirs
        backend.dead = set(old.dead)
        mgr.backends["container"] = backend
        self.switch.target = mgr
        self.mgr, self.backend = mgr, backend
        await mgr.start()

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
        for http in self._http.values():
            await http.aclose()
        await self.mgr.close()


@pytest.fixture
async def daemon(workdir: Path, shared_app: tuple[FastAPI, ManagerSwitch]) -> AsyncIterator[Daemon]:
    app, switch = shared_app
    mgr, _ = new_manager(workdir)
    backend = RecordingBackend(mgr.ctx)
    mgr.backends["container"] = backend
    switch.target = mgr
    await mgr.start()  # httpx's ASGI transport does not run the app's lifespan
    d = Daemon(app, switch, workdir, mgr, backend)
    try:
        yield d
    finally:
        await d.aclose()
        switch.target = None


# ---- what a call gave, comparable across a live run and a replay --------------------------------------------


def normal(value: Any) -> Any:
    if isinstance(value, ExecResult):
        return value.model_dump(exclude={"duration", "replayed"})
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, list):
        return [normal(v) for v in value]
    return value


async def outcome(call: Awaitable[Any]) -> tuple[Any, ...]:
    try:
        value = await call
    except DsecError as e:
        return ("error", type(e), e.code, e.message, dict(e.detail))
    return ("ok", normal(value))


def tar_of(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def exec_digest(cmd: str | list[str], **body: Any) -> str:
    full = {"cmd": cmd, "timeout": 60.0, "cwd": None, "env": {}, "stdin": None, **body}
    return call_digest("exec", canonical_params(ExecRequest, full))


def error_of(reply: httpx.Response) -> dict[str, Any]:
    err: dict[str, Any] = reply.json()["error"]
    return err


async def wait_until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# ---- 1. resuming through the SDK ------------------------------------------------------------------------------


async def mixed_session(sb: AsyncSandbox, backend: RecordingBackend) -> tuple[list[tuple[Any, ...]], list[Any]]:
    """The same trainer code, run once live and once resumed: every kind of call, two errors among them."""
    out: list[tuple[Any, ...]] = []
    execs: list[Any] = []

    async def exec_kept(call: Awaitable[ExecResult]) -> ExecResult:
        result = await call
        execs.append(result)
        return result

    out.append(await outcome(exec_kept(sb.exec(["cat"], stdin="fed\n", env={"K": "V"}))))  # 1
    out.append(await outcome(sb.files.write("/data/blob.bin", BLOB)))  # 2
    out.append(await outcome(sb.files.read("/data/blob.bin")))  # 3
    out.append(await outcome(sb.files.mkdir("/data/sub")))  # 4
    out.append(await outcome(sb.files.write("/data/sub/t.txt", "héllo\n")))  # 5
    out.append(await outcome(sb.files.list("/data")))  # 6
    backend.exit_code = 3
    out.append(await outcome(exec_kept(sb.exec("exit 3", cwd="/data"))))  # 7: a non-zero exit
    backend.exit_code = 0
    out.append(await outcome(sb.files.remove("/data/sub/t.txt")))  # 8
    out.append(await outcome(sb.files.read("/missing")))  # 9: FileNotFoundInSandbox
    out.append(await outcome(sb.files.upload_tar("/up", tar_of({"a.txt": b"A", "b.bin": b"\xff\x00"}))))  # 10
    out.append(await outcome(sb.files.download_tar("/up")))  # 11
    events = [e async for e in sb.exec_stream(["echo", "streamed"])]  # 12
    execs.append(events[-1].result)
    out.append(("stream", [(e.type, e.data, normal(e.result) if e.result else None) for e in events]))
    out.append(await outcome(sb.set_network(None)))  # 13
    out.append(await outcome(sb.files.remove("/nothing/here")))  # 14: a mutating call that failed
    out.append(await outcome(sb.files.list("/")))  # 15
    return out, execs


SESSION_OPS = [
    "create", "exec", "write", "read", "mkdir", "write", "list", "exec", "remove", "read", "upload", "download",
    "exec", "set_network", "remove", "list",
]  # fmt: skip


async def test_sdk_resume_replays_every_call_from_the_log_then_goes_live(daemon: Daemon) -> None:
    d, tid = daemon, "job-1/rollout-0"
    first = await d.client()
    sb = await first.create(image=IMAGE, trajectory=tid, env={"A": "1"})
    assert sb.trajectory is not None
    assert (sb.trajectory.position, sb.trajectory.recorded) == (1, 1)
    live, live_execs = await mixed_session(sb, d.backend)
    assert [r.replayed for r in live_execs] == [False, False, False]
    assert live_execs[1].exit_code == 3
    assert live[8][:3] == ("error", FileNotFoundInSandbox, "file_not_found")
    assert live[8][4] == {RECORDED_AT: 9}
    assert live[13][:3] == ("error", FileNotFoundInSandbox, "file_not_found")
    assert (sb.trajectory.position, sb.trajectory.live, sb.trajectory.replayed) == (16, 15, 0)

    calls = d.calls(tid)
    assert [c.op for c in calls] == SESSION_OPS
    assert [c.seq for c in calls] == list(range(16))
    assert [c.status for c in calls] == ["error" if c.seq in (9, 14) else "done" for c in calls]
    assert calls[2].payload == BLOB and calls[3].result_blob == BLOB

    backend_before = list(d.backend.calls)
    execs_before = len(d.backend.execs)
    files_before = copy.deepcopy(d.backend.files)

    # a new trainer process resumes: same id, same arguments, same calls
    second = await d.client()
    again = await second.create(image=IMAGE, trajectory=tid, env={"A": "1"})
    assert again.id == sb.id
    assert again._info.trajectory == tid and again._info.trajectory_length == 16
    assert again.trajectory is not None and again.trajectory.recorded == 16 and again.trajectory.replaying
    replayed, replayed_execs = await mixed_session(again, d.backend)

    assert replayed == live  # results, error classes, messages and details (recorded_at) alike
    assert [r.replayed for r in replayed_execs] == [True, True, True]
    assert d.backend.calls == backend_before  # nothing reached the sandbox
    assert len(d.backend.execs) == execs_before
    assert d.backend.files == files_before
    t = again.trajectory
    assert (t.position, t.replayed, t.live, t.last_replayed, t.replaying) == (16, 15, 0, True, False)
    assert len(d.calls(tid)) == 16  # replays add nothing to the log

    # the first call past the end of the log runs, and is logged
    result = await again.exec(["echo", "after"])
    assert not result.replayed and result.stdout == "echo after\n"
    assert d.backend.calls[len(backend_before) :] == [("exec", sb.id, ("echo", "after"))]
    assert (t.position, t.live, t.last_replayed) == (17, 1, False)
    last = d.call(tid, 16)
    assert (last.op, last.status, json.loads(last.request)["cmd"]) == ("exec", "done", ["echo", "after"])
    assert json.loads(last.result or "{}")["stdout"] == "echo after\n"
    assert (await second.trajectory(tid)).length == 17


async def test_resume_with_create_arguments_in_another_order_is_the_same_trajectory(daemon: Daemon) -> None:
    client = await daemon.client()
    sb = await client.create(image=IMAGE, trajectory="t/order", env={"A": "1", "B": "2"}, labels={"x": "1", "y": "2"})
    await sb.exec(["echo", "1"])
    again = await (await daemon.client()).create(
        image=IMAGE, trajectory="t/order", labels={"y": "2", "x": "1"}, env={"B": "2", "A": "1"}
    )
    assert again.id == sb.id and again._info.trajectory_length == 2


# ---- 2. fast-forward by pages ---------------------------------------------------------------------------------


async def test_fast_forward_fetches_pages_not_one_request_per_call(daemon: Daemon) -> None:
    d, tid, n = daemon, "t/long", 1500
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    for i in range(n):
        await sb.exec(["echo", str(i)])
    assert d.row(tid).length == n + 1
    execs_before = len(d.backend.execs)

    client = await d.client()
    sent: list[tuple[str, str]] = []

    async def count(request: httpx.Request) -> None:
        sent.append((request.method, request.url.path))

    client._transport.http.event_hooks["request"].append(count)
    again = await client.create(image=IMAGE, trajectory=tid)
    for i in range(n):
        result = await again.exec(["echo", str(i)])
        assert result.replayed and result.stdout == f"echo {i}\n"
    pages = -(-n // SDK_PAGE)
    # the pages, and at the end of the log one report of the calls answered from them (for their counts)
    report = ("POST", "/v1/trajectories/replayed")
    assert sent == [("POST", "/v1/sandboxes")] + [("GET", "/v1/trajectories/calls")] * pages + [report]
    assert len(d.backend.execs) == execs_before
    await again.exec(["echo", "live"])
    assert sent[-1] == ("POST", f"/v1/sandboxes/{sb.id}/exec") and len(sent) == pages + 3
    assert len(d.backend.execs) == execs_before + 1


# ---- 3. divergence --------------------------------------------------------------------------------------------


async def recorded_four(d: Daemon, tid: str) -> AsyncSandbox:
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await sb.exec(["echo", "1"])
    await sb.files.write("/f", b"one")
    await sb.exec(["echo", "3"])
    await sb.exec(["echo", "4"])
    return sb


async def test_sdk_raises_diverged_at_the_first_differing_call_and_runs_nothing(daemon: Daemon) -> None:
    d, tid = daemon, "t/div-sdk"
    await recorded_four(d, tid)
    before = list(d.backend.calls)
    again = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await again.exec(["echo", "1"])
    await again.files.write("/f", b"one")
    with pytest.raises(TrajectoryDiverged) as info:
        await again.exec(["echo", "three"])
    assert info.value.detail["position"] == 3
    assert info.value.detail["recorded"] == d.call(tid, 3).digest == exec_digest(["echo", "3"])
    assert info.value.detail["given"] == exec_digest(["echo", "three"])
    assert info.value.detail["recorded_op"] == "exec"
    assert d.backend.calls == before
    assert again.trajectory is not None and again.trajectory.position == 3  # the diverging call took no position
    # the same bytes matter for a write (the payload is in the digest)
    resumed = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await resumed.exec(["echo", "1"])
    with pytest.raises(TrajectoryDiverged) as info:
        await resumed.files.write("/f", b"ONE")
    assert info.value.detail["position"] == 2
    # the right call at the position still replays
    assert (await again.exec(["echo", "3"])).replayed
    assert d.backend.calls == before and len(d.calls(tid)) == 5


async def test_a_position_is_written_one_way_only(daemon: Daemon) -> None:
    """Dsec-Seq is a decimal position: "+3", "03" and "3_0" (which pydantic read as 3, 3 and 30) are
    refused like any malformed header, before anything is logged or run."""
    d, tid = daemon, "t/seq-text"
    sb = await recorded_four(d, tid)
    before = list(d.backend.calls)
    for text in ("+3", "03", "3_0", "3.0", "0x3", "1" * 19):
        reply = await d.raw("POST", f"/v1/sandboxes/{sb.id}/exec", seq=text, json={"cmd": ["echo", "3"]})
        assert reply.status_code == 400 and SEQ_HEADER in error_of(reply)["message"], (text, reply.text)
    assert d.backend.calls == before and d.row(tid).length == 5
    reply = await d.raw("POST", f"/v1/sandboxes/{sb.id}/exec", seq="3", json={"cmd": ["echo", "3"]})
    assert reply.status_code == 200 and reply.headers[REPLAYED_HEADER] == "1"


async def test_http_divergence_skip_ahead_and_create_with_other_arguments_are_409(daemon: Daemon) -> None:
    d, tid = daemon, "t/div-http"
    sb = await recorded_four(d, tid)
    before = list(d.backend.calls)
    url = f"/v1/sandboxes/{sb.id}"

    reply = await d.raw("POST", f"{url}/exec", seq=3, json={"cmd": ["echo", "other"]})
    assert reply.status_code == 409, reply.text
    err = error_of(reply)
    assert err["code"] == "trajectory_diverged"
    assert err["detail"]["position"] == 3
    assert err["detail"]["recorded"] == d.call(tid, 3).digest
    assert err["detail"]["given"] == exec_digest(["echo", "other"])

    reply = await d.raw("PUT", f"{url}/files", seq=2, params={"path": "/f"}, content=b"two")
    assert reply.status_code == 409 and error_of(reply)["detail"]["position"] == 2
    reply = await d.raw("GET", f"{url}/files", seq=1, params={"path": "/f"})  # another op at an exec's place
    assert reply.status_code == 409 and error_of(reply)["detail"]["recorded_op"] == "exec"

    # the same call at a recorded position is answered from the log, marked as such
    reply = await d.raw("POST", f"{url}/exec", seq=3, json={"cmd": ["echo", "3"]})
    assert reply.status_code == 200 and reply.headers[REPLAYED_HEADER] == "1"
    assert reply.json()["stdout"] == "echo 3\n" and reply.json()["replayed"] is True
    reply = await d.raw("PUT", f"{url}/files", seq=2, params={"path": "/f"}, content=b"one")
    assert reply.status_code == 204 and reply.headers[REPLAYED_HEADER] == "1"
    reply = await d.raw("POST", f"{url}/exec/stream", seq=4, json={"cmd": ["echo", "4"]})
    events = [json.loads(line) for line in reply.text.splitlines()]
    assert [e["type"] for e in events] == ["stdout", "result"]
    assert events[0]["data"] == "echo 4\n" and events[1]["result"]["replayed"] is True

    # skipping ahead of the log (length 5: the next is 5)
    reply = await d.raw("POST", f"{url}/exec", seq=6, json={"cmd": ["echo", "6"]})
    assert reply.status_code == 409, reply.text
    assert error_of(reply)["code"] == "trajectory_diverged"
    assert error_of(reply)["detail"] == {"position": 6, "length": 5}
    assert d.backend.calls == before and d.row(tid).length == 5

    # a create with other arguments diverges at position 0, over HTTP and in the SDK; nothing is made
    reply = await d.raw("POST", "/v1/sandboxes", json={"image": IMAGE, "trajectory": tid, "env": {"X": "1"}})
    assert reply.status_code == 409, reply.text
    err = error_of(reply)
    assert err["code"] == "trajectory_diverged"
    assert err["detail"]["position"] == 0 and err["detail"]["recorded"] == d.call(tid, 0).digest
    assert err["detail"]["recorded_op"] == "create"
    with pytest.raises(TrajectoryDiverged) as info:
        await (await d.client()).create(image=IMAGE, trajectory=tid, timeout=601)
    assert info.value.detail["position"] == 0
    assert d.backend.calls == before and d.row(tid).length == 5


# ---- 4. header rules -------------------------------------------------------------------------------------------


async def test_header_rules(daemon: Daemon) -> None:
    d, tid = daemon, "t/headers"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await sb.files.write("/f", b"x")
    url = f"/v1/sandboxes/{sb.id}"
    before = list(d.backend.calls)

    # calls that change a bound sandbox must carry their position
    unnumbered: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", f"{url}/exec", {"json": {"cmd": ["touch", "/g"]}}),
        ("PUT", f"{url}/files", {"params": {"path": "/g"}, "content": b"g"}),
        ("POST", f"{url}/files/mkdir", {"params": {"path": "/d"}}),
        ("DELETE", f"{url}/files", {"params": {"path": "/f"}}),
        ("PUT", f"{url}/archive", {"params": {"path": "/u"}, "content": tar_of({"u": b"u"})}),
        ("PUT", f"{url}/network", {"json": None}),
    ]
    for method, path, kwargs in unnumbered:
        reply = await d.raw(method, path, **kwargs)
        assert reply.status_code == 409, (method, path, reply.text)
        assert error_of(reply)["code"] == "invalid_state", (method, path)
        assert SEQ_HEADER in error_of(reply)["message"]
    assert d.backend.calls == before and d.row(tid).length == 2

    # reads without a position are allowed and not logged
    reply = await d.raw("GET", f"{url}/files", params={"path": "/f"})
    assert reply.status_code == 200 and reply.content == b"x" and REPLAYED_HEADER not in reply.headers
    assert (await d.raw("GET", f"{url}/files/list", params={"path": "/"})).status_code == 200
    assert (await d.raw("GET", f"{url}/archive", params={"path": "/"})).status_code == 200
    assert (await d.raw("GET", url)).status_code == 200
    assert d.row(tid).length == 2
    before = list(d.backend.calls)

    # positions must be 1 or more (0 is the create) and numbers
    for bad in (0, -1, "x"):
        reply = await d.raw("POST", f"{url}/exec", seq=bad, json={"cmd": ["true"]})
        assert reply.status_code == 400, (bad, reply.text)
        assert error_of(reply)["code"] == "invalid_request"
    assert d.backend.calls == before and d.row(tid).length == 2

    # a position on a sandbox that belongs to no trajectory is refused, and nothing runs
    plain = await (await d.client()).create(image=IMAGE)
    assert plain.trajectory is None
    plain_before = list(d.backend.calls)
    numbered: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/exec", {"json": {"cmd": ["true"]}}),
        ("GET", "/files", {"params": {"path": "/"}}),
        ("DELETE", "", {}),
    ]
    for method, suffix, kwargs in numbered:
        reply = await d.raw(method, f"/v1/sandboxes/{plain.id}{suffix}", seq=1, **kwargs)
        assert reply.status_code == 409, (method, suffix, reply.text)  # sound, but this sandbox takes none
        assert error_of(reply)["code"] == "invalid_state"
    assert d.backend.calls == plain_before
    assert (await plain.exec(["echo", "plain"])).stdout == "echo plain\n"  # unbound calls carry no position

    # a sandbox attached by id is outside the trajectory: it may read, not change
    mark = len(d.backend.calls)
    attached = await AsyncSandbox.connect(sb.id, client=await d.client())
    assert attached.trajectory is None and attached._info.trajectory == tid
    assert await attached.files.read("/f") == b"x"
    with pytest.raises(InvalidState):
        await attached.exec(["echo", "outside"])
    assert d.backend.mutations(mark) == [] and d.row(tid).length == 2

    # a kill from outside the trajectory needs no position; it is not logged and does not close it
    reply = await d.raw("DELETE", url)
    assert reply.status_code == 200 and reply.json()["state"] == "stopped"
    assert d.backend.calls[-1] == ("destroy", sb.id)
    row = d.row(tid)
    assert row.length == 2 and not row.closed


async def test_remove_listing_and_paging_over_http(daemon: Daemon) -> None:
    d = daemon
    client = await d.client()
    sb = await client.create(image=IMAGE, trajectory="job-9/a")
    for i in range(5):
        await sb.exec(["echo", str(i)])
    await client.create(image=IMAGE, trajectory="job-9/b")
    await client.create(image=IMAGE, trajectory="other")

    assert sorted(t.id for t in await client.trajectories(prefix="job-9/")) == ["job-9/a", "job-9/b"]
    reply = await d.raw("GET", "/v1/trajectories/calls", params={"id": "job-9/a", "start": 1, "limit": 2})
    page = reply.json()
    assert [c["seq"] for c in page["calls"]] == [1, 2] and page["next"] == 3
    reply = await d.raw("GET", "/v1/trajectories/calls", params={"id": "job-9/a", "start": 4, "limit": 10})
    assert [c["seq"] for c in reply.json()["calls"]] == [4, 5] and reply.json()["next"] is None
    assert [c.seq async for c in client.trajectory_calls("job-9/a", start=3)] == [3, 4, 5]

    reply = await d.raw("DELETE", "/v1/trajectories", params={"id": "job-9/a"})
    assert reply.status_code == 409 and error_of(reply)["code"] == "invalid_state"  # its sandbox runs
    await sb.kill()
    await client.remove_trajectory("job-9/a")
    with pytest.raises(NotFound):
        await client.trajectory("job-9/a")
    assert d.store.calls(OP, "job-9/a") == []
    fresh = await client.create(image=IMAGE, trajectory="job-9/a")  # the id starts over
    assert fresh.id != sb.id and fresh._info.trajectory_length == 1


# ---- 5. recorded errors ----------------------------------------------------------------------------------------


async def test_recorded_error_replays_as_the_same_error_and_takes_its_position(daemon: Daemon) -> None:
    d, tid = daemon, "t/errors"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await sb.exec(["echo", "1"])
    with pytest.raises(FileNotFoundInSandbox) as live:
        await sb.files.read("/missing")
    assert live.value.detail[RECORDED_AT] == 2
    assert sb.trajectory is not None and sb.trajectory.position == 3  # the error counts as a call
    await sb.exec(["echo", "3"])
    assert [(c.seq, c.op, c.status) for c in d.calls(tid)] == [
        (0, "create", "done"), (1, "exec", "done"), (2, "read", "error"), (3, "exec", "done"),
    ]  # fmt: skip
    assert json.loads(d.call(tid, 2).result or "{}")["error"]["code"] == "file_not_found"

    # over HTTP: the recorded error again, with its position, though the file exists now
    d.backend.files[sb.id]["/missing"] = b"here now"
    reply = await d.raw("GET", f"/v1/sandboxes/{sb.id}/files", seq=2, params={"path": "/missing"})
    assert reply.status_code == 404, reply.text
    err = error_of(reply)
    assert err["code"] == "file_not_found" and err["message"] == live.value.message
    assert err["detail"] == {RECORDED_AT: 2}

    # in the SDK: the same class, message and detail; the next call gets the next position
    again = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await again.exec(["echo", "1"])
    with pytest.raises(FileNotFoundInSandbox) as replayed:
        await again.files.read("/missing")
    assert replayed.value.message == live.value.message and replayed.value.detail == {RECORDED_AT: 2}
    assert again.trajectory is not None and again.trajectory.position == 3
    assert (await again.exec(["echo", "3"])).replayed
    assert await again.files.read("/missing") == b"here now"  # position 4: live
    assert d.call(tid, 4).op == "read" and d.call(tid, 4).status == "done"


# ---- 6. interrupted calls ---------------------------------------------------------------------------------------


class DeadWriter:
    """What a dead daemon writes to its log: nothing."""

    async def write(self, _: object) -> object:
        raise ConnectionError("the daemon died")


async def test_call_running_when_the_daemon_died_is_interrupted_after_restart(daemon: Daemon) -> None:
    d, tid = daemon, "t/interrupted"
    client = await d.client()
    sb = await client.create(image=IMAGE, trajectory=tid)
    await sb.exec(["echo", "1"])
    d.backend.gate = asyncio.Event()
    pending = asyncio.create_task(sb.exec(["sleep", "100"]))
    await asyncio.wait_for(d.backend.entered.wait(), 10)
    assert d.call(tid, 2).status == "running"
    assert d.row(tid).length == 3

    # the daemon dies mid-call: its log gets nothing more, the call's client loses the connection
    writer = d.mgr.trajectories._writer
    d.mgr.trajectories._writer = DeadWriter()  # type: ignore[assignment]
    pending.cancel()
    with contextlib.suppress(asyncio.CancelledError, DsecError):
        await pending
    d.mgr.trajectories._writer = writer
    d.backend.gate = None
    assert d.call(tid, 2).status == "running"
    await d.restart()

    row = d.call(tid, 2)
    assert (row.status, row.result) == ("interrupted", None)
    assert [c.status for c in d.calls(tid)] == ["done", "done", "interrupted"]

    # server side: replaying it says it was interrupted (a different call at its place still diverges)
    url = f"/v1/sandboxes/{sb.id}/exec"
    reply = await d.raw("POST", url, seq=2, json={"cmd": ["sleep", "100"]})
    assert reply.status_code == 409, reply.text
    assert error_of(reply)["code"] == "call_interrupted"
    assert error_of(reply)["detail"] == {"position": 2, RECORDED_AT: 2}
    reply = await d.raw("POST", url, seq=2, json={"cmd": ["sleep", "1"]})
    assert error_of(reply)["code"] == "trajectory_diverged"
    assert d.backend.execs == []

    # the SDK: the replay raises CallInterrupted, the trajectory moves on, the next call is live
    again = await (await d.client()).create(image=IMAGE, trajectory=tid)
    assert again.id == sb.id and again._info.trajectory_length == 3
    assert (await again.exec(["echo", "1"])).replayed
    with pytest.raises(CallInterrupted) as info:
        await again.exec(["sleep", "100"])
    assert info.value.detail[RECORDED_AT] == 2
    assert isinstance(info.value, dsec.CallInterrupted)
    assert again.trajectory is not None and again.trajectory.position == 3
    result = await again.exec(["echo", "3"])
    assert not result.replayed
    assert [r.argv() for r in d.backend.execs] == [["echo", "3"]]
    assert d.call(tid, 3).status == "done"


async def test_a_call_whose_client_went_away_is_interrupted_and_a_retry_says_so(daemon: Daemon) -> None:
    d, tid = daemon, "t/gone-client"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await sb.exec(["echo", "1"])
    d.backend.gate = asyncio.Event()
    pending = asyncio.create_task(sb.exec(["sleep", "100"]))
    await asyncio.wait_for(d.backend.entered.wait(), 10)
    pending.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pending
    d.backend.gate = None
    await wait_until(lambda: d.call(tid, 2).status == "interrupted", "the call recorded as interrupted")
    assert sb.trajectory is not None and sb.trajectory.position == 2  # it never answered
    with pytest.raises(CallInterrupted):
        await sb.exec(["sleep", "100"])  # sent again: the daemon answers from the log
    assert sb.trajectory.position == 3
    assert not (await sb.exec(["echo", "3"])).replayed
    assert [r.argv() for r in d.backend.execs] == [["echo", "1"], ["echo", "3"]]


async def test_restart_interrupts_only_this_nodes_running_calls(daemon: Daemon) -> None:
    d = daemon
    now = time.time()
    elsewhere = TrajectoryRow(OP, "t/elsewhere", "sb-0123456789ab", "container", IMAGE, now, now, 1)
    create = CallRow(OP, "t/elsewhere", 0, "create", "d0", "{}", "done", now, result="{}")
    running = CallRow(OP, "t/elsewhere", 1, "exec", "d1", "{}", "running", now)
    d.store.write([TrajectoryStore.begin(elsewhere, create), TrajectoryStore.start(running)])
    sb = await (await d.client()).create(image=IMAGE, trajectory="t/here")
    d.store.write([TrajectoryStore.start(CallRow(OP, "t/here", 1, "exec", "d1", "{}", "running", now))])
    await d.restart()
    assert d.call("t/here", 1).status == "interrupted"
    assert d.call("t/elsewhere", 1).status == "running"  # another node's sandbox: not ours to judge
    assert d.row("t/here").sandbox_id == sb.id


async def test_a_call_the_log_cannot_record_does_not_run(daemon: Daemon) -> None:
    d, tid = daemon, "t/log-down"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    writer = d.mgr.trajectories._writer
    d.mgr.trajectories._writer = DeadWriter()  # type: ignore[assignment]
    try:
        with pytest.raises(BackendError, match="could not record call 1"):
            await sb.exec(["echo", "1"])
    finally:
        d.mgr.trajectories._writer = writer
    assert d.backend.execs == [] and d.row(tid).length == 1
    assert sb.trajectory is not None and sb.trajectory.position == 1
    assert not (await sb.exec(["echo", "1"])).replayed  # the log is back: the same call runs, once
    assert [r.argv() for r in d.backend.execs] == [["echo", "1"]]


# ---- 7. rebuild --------------------------------------------------------------------------------------------------


async def rebuild_session(sb: AsyncSandbox) -> list[tuple[Any, ...]]:
    return [
        await outcome(sb.exec(["echo", "a"])),  # 1
        await outcome(sb.files.write("/w/f.bin", b"\x00\x01")),  # 2
        await outcome(sb.files.read("/w/f.bin")),  # 3
        await outcome(sb.files.mkdir("/w/d")),  # 4
        await outcome(sb.exec("echo b")),  # 5
        await outcome(sb.files.remove("/nope")),  # 6: failed, and fails the same on the re-run
        await outcome(sb.files.list("/w")),  # 7
        await outcome(sb.files.remove("/w/f.bin")),  # 8
        await outcome(sb.files.upload_tar("/w/u", tar_of({"x": b"X"}))),  # 9
        await outcome(sb.files.write("/w/g.txt", "g")),  # 10
    ]


@pytest.mark.parametrize("loss", ["killed outside the trajectory", "expired", "lost in a restart"])
async def test_a_lost_sandbox_is_rebuilt_by_re_applying_the_log(daemon: Daemon, loss: str) -> None:
    d, tid = daemon, "t/rebuild"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    live = await rebuild_session(sb)
    assert live[5][:3] == ("error", FileNotFoundInSandbox, "file_not_found")
    if loss == "killed outside the trajectory":
        assert (await d.raw("DELETE", f"/v1/sandboxes/{sb.id}")).status_code == 200
    elif loss == "expired":
        d.mgr.record(sb.id).expires_at = time.time() - 1
    else:
        d.backend.dead.add(sb.id)
        await d.restart(sandboxes_survive=False)
        assert d.mgr.info(sb.id).state == State.lost
    assert not d.row(tid).closed
    mark = len(d.backend.calls)
    d.backend.exit_code = 7  # the re-runs of the two execs now answer differently

    again = await (await d.client()).create(image=IMAGE, trajectory=tid)
    new = again.id
    assert new != sb.id
    assert again._info.state == State.running and again._info.trajectory_length == 11
    assert d.backend.calls[mark:] == [
        ("create", new),
        ("exec", new, ("echo", "a")),
        ("write", new, "/w/f.bin", b"\x00\x01"),
        ("mkdir", new, "/w/d"),
        ("exec", new, ("/bin/sh", "-c", "echo b")),
        ("remove", new, "/nope"),
        ("remove", new, "/w/f.bin"),
        ("upload", new, "/w/u"),
        ("write", new, "/w/g.txt", b"g"),
    ]  # the state-changing calls, in their order; no reads
    assert d.backend.files[new] == {"/w/u/x": b"X", "/w/g.txt": b"g"}
    assert "/w/d" in d.backend.dirs[new]
    info = await (await d.client()).trajectory(tid)
    assert (info.sandbox_id, info.rebuilds, info.length, info.closed) == (new, 1, 11, False)
    notes = {c.seq: c.note for c in d.calls(tid) if c.note}
    assert set(notes) == {1, 5}, notes  # the two execs exited 7 instead of 0; the failed remove failed alike
    assert all(n.startswith("rebuild 1:") and "differs" in n for n in notes.values())

    # resuming replays the log (with its recorded results), then runs live on the new sandbox
    mark = len(d.backend.calls)
    assert await rebuild_session(again) == live
    assert d.backend.calls[mark:] == []
    result = await again.exec(["echo", "next"])
    assert result.exit_code == 7 and not result.replayed
    assert d.backend.calls[-1] == ("exec", new, ("echo", "next"))

    # a second resume while the rebuilt sandbox runs: no second rebuild
    third = await (await d.client()).create(image=IMAGE, trajectory=tid)
    assert third.id == new and (await (await d.client()).trajectory(tid)).rebuilds == 1


async def test_rebuild_after_a_restart_skips_a_call_that_was_interrupted(daemon: Daemon) -> None:
    d, tid = daemon, "t/rebuild-interrupted"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await sb.files.write("/a", b"a")
    now = time.time()
    d.store.write([TrajectoryStore.start(CallRow(OP, tid, 2, "exec", "dx", '{"cmd":["x"]}', "running", now))])
    d.backend.dead.add(sb.id)
    await d.restart(sandboxes_survive=False)
    mark = len(d.backend.calls)
    again = await (await d.client()).create(image=IMAGE, trajectory=tid)
    assert d.backend.calls[mark:] == [("create", again.id), ("write", again.id, "/a", b"a")]
    note = d.call(tid, 2).note
    assert note is not None and "not re-applied" in note and "interrupted" in note


async def test_rebuild_runs_on_the_image_version_the_lost_sandbox_ran_on(daemon: Daemon) -> None:
    d, tid = daemon, "t/rebuild-version"
    client = await d.client()
    sb = await client.create(image=IMAGE, trajectory=tid)
    await sb.files.write("/a", b"a")
    first_version = d.backend.images[sb.id].digest
    d.backend.dead.add(sb.id)
    await d.restart(sandboxes_survive=False)
    await client.remove_image(IMAGE)  # the name is free (its versions stay until a gc), then taken again
    make_image(d.root / "images", IMAGE, env={"PATH": "/usr/bin:/bin"}, files={"etc/hostname": b"v2\n"})
    await d.restart()
    plain = await client.create(image=IMAGE)
    assert d.backend.images[plain.id].digest != first_version  # the name points at a new version now
    again = await client.create(image=IMAGE, trajectory=tid)
    assert again.id != sb.id and d.backend.images[again.id].digest == first_version
    assert d.backend.files[again.id] == {"/a": b"a"}


async def test_a_replaced_sandbox_adds_nothing_to_its_old_trajectory(daemon: Daemon) -> None:
    """After a rebuild the trajectory is bound to the new sandbox; a late call through the old one (its
    trainer did not know) must not take a position in the log, or the resumed trainer diverges."""
    d, tid = daemon, "t/stale"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await sb.exec(["echo", "1"])
    assert (await d.raw("DELETE", f"/v1/sandboxes/{sb.id}")).status_code == 200
    again = await (await d.client()).create(image=IMAGE, trajectory=tid)
    assert again.id != sb.id and d.row(tid).sandbox_id == again.id
    reply = await d.raw("POST", f"/v1/sandboxes/{sb.id}/exec", seq=2, json={"cmd": ["echo", "stale"]})
    assert reply.status_code >= 400
    assert d.row(tid).length == 2, [(c.seq, c.op, c.status) for c in d.calls(tid)]
    assert (await again.exec(["echo", "1"])).replayed
    assert not (await again.exec(["echo", "2"])).replayed


# ---- 8. a logged kill closes the trajectory -----------------------------------------------------------------------


async def test_a_logged_kill_closes_the_trajectory(daemon: Daemon) -> None:
    d, tid = daemon, "t/closed"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await sb.exec(["echo", "1"])
    await sb.kill()
    assert sb._info.state == State.stopped
    assert d.row(tid).closed and d.call(tid, 2).op == "kill"
    created = list(d.backend.created)

    again = await (await d.client()).create(image=IMAGE, trajectory=tid)
    assert again.id == sb.id and again._info.state == State.stopped and again._info.trajectory_length == 3
    assert (await again.exec(["echo", "1"])).replayed
    await again.kill()  # replayed from the log
    assert again._info.state == State.stopped
    with pytest.raises(SandboxGone) as info:
        await again.exec(["echo", "after"])  # past the end: the sandbox is gone, nothing is rebuilt
    assert info.value.detail[RECORDED_AT] == 3
    assert d.backend.created == created and d.backend.execs[-1].argv() == ["echo", "1"]
    row = d.row(tid)
    assert (row.rebuilds, row.closed, row.sandbox_id, row.length) == (0, True, sb.id, 4)
    third = await (await d.client()).create(image=IMAGE, trajectory=tid)
    assert third.id == sb.id and d.backend.created == created


async def test_a_closed_trajectory_resumes_as_stopped_after_its_record_is_reaped(daemon: Daemon) -> None:
    d, tid = daemon, "t/closed-reaped"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await sb.kill()
    d.mgr.store.delete_older_than(time.time() + 86400, set(TERMINAL_STATES))  # the reaper, a day later
    assert d.mgr.store.get(sb.id) is None
    again = await (await d.client()).create(image=IMAGE, trajectory=tid)
    assert again.id == sb.id and d.backend.created == [sb.id]
    assert again._info.state in TERMINAL_STATES


# ---- retries, races ----------------------------------------------------------------------------------------------


class LosesAnswers(httpx.AsyncBaseTransport):
    """Between the SDK and the app: ``lose`` drops the answers of the next requests to a path after the app
    handled them (the connection broke on the way back): by default as many as the SDK's transport sends
    one call (its first try and its retries with the same Idempotency-Key), so the call fails to the
    trajectory layer above it; ``refuse`` fails the next one before it is sent."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.lose: dict[str, int] = {}
        self.refuse: set[str] = set()

    def lose_next(self, path: str, times: int = RETRIES + 1) -> None:
        self.lose[path] = times

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in self.refuse:
            self.refuse.discard(request.url.path)
            raise httpx.ConnectError("connection refused", request=request)
        response = await self.inner.handle_async_request(request)
        if self.lose.get(request.url.path):
            self.lose[request.url.path] -= 1
            await response.aclose()
            raise httpx.ReadError("connection reset by peer", request=request)
        return response


async def test_a_call_whose_answer_was_lost_is_sent_again_and_answered_from_the_log(daemon: Daemon) -> None:
    d, tid = daemon, "t/retry"
    client = await d.client()
    flaky = LosesAnswers(httpx.ASGITransport(app=d.app))
    await client._transport.http.aclose()
    client._transport.http = httpx.AsyncClient(transport=flaky, base_url=BASE, headers=AUTH)
    sb = await client.create(image=IMAGE, trajectory=tid)
    exec_url, files_url = f"/v1/sandboxes/{sb.id}/exec", f"/v1/sandboxes/{sb.id}/files"

    flaky.lose_next(exec_url)
    result = await sb.exec(["echo", "once"])  # ran, answer lost, sent again: the log answers
    assert result.stdout == "echo once\n" and result.replayed
    assert [r.argv() for r in d.backend.execs] == [["echo", "once"]]

    flaky.refuse.add(exec_url)
    result = await sb.exec(["echo", "twice"])  # never reached the daemon: sent again, runs once
    assert not result.replayed
    assert [r.argv() for r in d.backend.execs] == [["echo", "once"], ["echo", "twice"]]

    flaky.lose_next(files_url)
    with pytest.raises(FileNotFoundInSandbox) as info:
        await sb.files.read("/missing")  # its answer, an error, lost: the retry gets the recorded error
    assert info.value.detail[RECORDED_AT] == 3

    assert sb.trajectory is not None and sb.trajectory.position == 4
    assert [(c.seq, c.op, c.status) for c in d.calls(tid)] == [
        (0, "create", "done"), (1, "exec", "done"), (2, "exec", "done"), (3, "read", "error"),
    ]  # fmt: skip


async def test_a_lost_answer_is_first_asked_again_with_the_same_idempotency_key(daemon: Daemon) -> None:
    """One lost answer: the transport sends the call again with its key, and the daemon's memory answers
    it (the answer of the run that happened, not one from the log): it ran once."""
    d, tid = daemon, "t/retry-key"
    client = await d.client()
    flaky = LosesAnswers(httpx.ASGITransport(app=d.app))
    await client._transport.http.aclose()
    client._transport.http = httpx.AsyncClient(transport=flaky, base_url=BASE, headers=AUTH)
    sb = await client.create(image=IMAGE, trajectory=tid)
    flaky.lose_next(f"/v1/sandboxes/{sb.id}/exec", times=1)
    result = await sb.exec(["echo", "once"])
    assert result.stdout == "echo once\n" and not result.replayed
    assert [r.argv() for r in d.backend.execs] == [["echo", "once"]]
    assert [(c.seq, c.op, c.status) for c in d.calls(tid)] == [(0, "create", "done"), (1, "exec", "done")]


async def test_two_clients_at_one_position_run_the_call_once(daemon: Daemon) -> None:
    d, tid = daemon, "t/race"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await sb.exec(["echo", "1"])
    d.backend.gate = asyncio.Event()
    first = asyncio.create_task(sb.exec(["echo", "2"]))
    await asyncio.wait_for(d.backend.entered.wait(), 10)

    # a second trainer resumes while call 2 runs: the log holds it as running, so the SDK sends it and the
    # daemon waits for the running call, then answers from the log
    other = await (await d.client()).create(image=IMAGE, trajectory=tid)
    assert other._info.trajectory_length == 3
    assert (await other.exec(["echo", "1"])).replayed
    second = asyncio.create_task(other.exec(["echo", "2"]))
    await asyncio.sleep(0.05)
    assert not second.done()
    d.backend.gate.set()
    a, b = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert (a.replayed, b.replayed) == (False, True)
    assert a.stdout == b.stdout == "echo 2\n"
    assert [r.argv() for r in d.backend.execs] == [["echo", "1"], ["echo", "2"]]
    assert d.row(tid).length == 3


async def test_concurrent_creates_of_one_new_trajectory_make_one_sandbox(daemon: Daemon) -> None:
    d, tid = daemon, "t/one-create"
    clients = [await d.client() for _ in range(8)]
    sandboxes = await asyncio.gather(*(c.create(image=IMAGE, trajectory=tid) for c in clients))
    assert len({sb.id for sb in sandboxes}) == 1
    assert len(d.backend.created) == 1
    assert d.row(tid).length == 1 and [c.op for c in d.calls(tid)] == ["create"]


async def test_trajectory_ids_are_checked(daemon: Daemon) -> None:
    d = daemon
    for bad in ["", "/abs", "-x", "a b", "a\nb", "é", "x" * 201, "a?b"]:
        reply = await d.raw("POST", "/v1/sandboxes", json={"image": IMAGE, "trajectory": bad})
        assert reply.status_code == 400, (bad, reply.text)
        reply = await d.raw("GET", "/v1/trajectories/info", params={"id": bad})
        assert reply.status_code == 400, (bad, reply.text)
    assert d.backend.created == []
    for good in ["job-17/rollout-3", "a", "A.b_c:d/e@f+g-h", "x" * 200]:
        reply = await d.raw("POST", "/v1/sandboxes", json={"image": IMAGE, "trajectory": good})
        assert reply.status_code == 201, (good, reply.text)
        assert reply.json()["trajectory"] == good and reply.json()["trajectory_length"] == 1


# ---- 9. many trajectories at once ---------------------------------------------------------------------------------


CONCURRENT = 2000


async def test_thousands_of_trajectories_at_once_keep_their_own_calls(daemon: Daemon) -> None:
    d = daemon
    client = await d.client()

    async def trainer(i: int) -> str:
        tid = f"load/{i:05d}"
        sb = await client.create(image=IMAGE, trajectory=tid)
        for k in range(3):
            result = await sb.exec(["echo", tid, f"step-{k}"])
            assert result.stdout == f"echo {tid} step-{k}\n"
        await sb.files.write(f"/out/{i}.txt", f"{tid}\n")
        return sb.id

    started = time.perf_counter()
    ids = await asyncio.gather(*(trainer(i) for i in range(CONCURRENT)))
    driven = time.perf_counter() - started
    assert len(set(ids)) == CONCURRENT

    async def check(i: int, sid: str) -> None:
        tid = f"load/{i:05d}"
        calls: list[RecordedCall] = [c async for c in client.trajectory_calls(tid)]
        assert [(c.seq, c.op, c.status) for c in calls] == [
            (0, "create", "done"), (1, "exec", "done"), (2, "exec", "done"), (3, "exec", "done"),
            (4, "write", "done"),
        ], tid  # fmt: skip
        assert (calls[0].result or {})["id"] == sid
        for k in range(3):
            assert calls[1 + k].request["cmd"] == ["echo", tid, f"step-{k}"]
            assert (calls[1 + k].result or {})["stdout"] == f"echo {tid} step-{k}\n"
        assert calls[4].request == {"path": f"/out/{i}.txt", "mode": 0o644}
        assert calls[4].payload_bytes == len(f"{tid}\n")
        assert d.backend.files[sid] == {f"/out/{i}.txt": f"{tid}\n".encode()}

    gate = asyncio.Semaphore(64)

    async def checked(i: int, sid: str) -> None:
        async with gate:
            await check(i, sid)

    await asyncio.gather(*(checked(i, sid) for i, sid in enumerate(ids)))
    listed = await client.trajectories(prefix="load/", limit=10000)
    assert len(listed) == CONCURRENT and {t.length for t in listed} == {5}
    assert {t.sandbox_id for t in listed} == set(ids)
    assert len(d.backend.execs) == 3 * CONCURRENT
    writer = d.mgr.trajectories.writer
    print(
        f"\n{CONCURRENT} trajectories x 5 calls driven in {driven:.1f} s, checked in "
        f"{time.perf_counter() - started - driven:.1f} s; log: {writer.writes} writes in {writer.commits} commits"
    )
    assert writer.commits < writer.writes  # group commit did group


# ---- 10. tenants ----------------------------------------------------------------------------------------------------


async def test_another_tenant_neither_sees_nor_resumes_a_trajectory(daemon: Daemon) -> None:
    d, tid = daemon, "shared/name"
    _, alice_token = d.mgr.tenants.add("alice")
    _, bob_token = d.mgr.tenants.add("bob")
    alice, bob = await d.client(alice_token), await d.client(bob_token)
    sb = await alice.create(image=IMAGE, trajectory=tid)
    await sb.exec(["echo", "alice"])
    assert [t.id for t in await alice.trajectories()] == [tid]

    assert await bob.trajectories() == []
    with pytest.raises(NotFound):
        await bob.trajectory(tid)
    with pytest.raises(NotFound):
        _ = [c async for c in bob.trajectory_calls(tid)]
    with pytest.raises(NotFound):
        await bob.remove_trajectory(tid)
    foreign: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/v1/trajectories/info", {"params": {"id": tid}}),
        ("GET", "/v1/trajectories/calls", {"params": {"id": tid}}),
        ("POST", f"/v1/sandboxes/{sb.id}/exec", {"json": {"cmd": ["echo", "alice"]}, "seq": 1}),
        ("POST", f"/v1/sandboxes/{sb.id}/exec", {"json": {"cmd": ["echo", "bob"]}, "seq": 2}),
    ]
    for method, path, kwargs in foreign:
        reply = await d.raw(method, path, token=bob_token, **kwargs)
        assert reply.status_code == 404, (path, reply.text)

    # the same id under bob is another trajectory: its own sandbox, its own log, created with other arguments
    before = len(d.backend.execs)
    theirs = await bob.create(image=IMAGE, trajectory=tid, env={"WHO": "bob"})
    assert theirs.id != sb.id and theirs._info.trajectory_length == 1
    result = await theirs.exec(["echo", "alice"])
    assert not result.replayed and len(d.backend.execs) == before + 1
    assert [c.request.get("cmd") async for c in bob.trajectory_calls(tid)] == [None, ["echo", "alice"]]
    assert (await alice.trajectory(tid)).length == 2 and (await bob.trajectory(tid)).sandbox_id == theirs.id
    assert d.row(tid, "alice").sandbox_id == sb.id and d.row(tid, "bob").sandbox_id == theirs.id
    # and alice resumes hers as before
    mine = await alice.create(image=IMAGE, trajectory=tid)
    assert mine.id == sb.id and (await mine.exec(["echo", "alice"])).replayed


# ---- 11. export ------------------------------------------------------------------------------------------------------


async def test_training_records(daemon: Daemon) -> None:
    d, tid = daemon, "t/export"
    client = await d.client()
    sb = await client.create(image=IMAGE, trajectory=tid)
    d.backend.exit_code = 2
    await sb.exec(["grep", "x"], stdin="y\n")
    d.backend.exit_code = 0
    await sb.files.write("/t.txt", "héllo")
    await sb.files.write("/b.bin", BLOB)
    await sb.files.read("/t.txt")
    await sb.files.read("/b.bin")
    with pytest.raises(FileNotFoundInSandbox):
        await sb.files.read("/none")
    await sb.files.list("/")
    records = [training_record(tid, rec) async for rec in client.trajectory_calls(tid)]
    assert [(r["seq"], r["op"], r["status"]) for r in records] == [
        (0, "create", "done"), (1, "exec", "done"), (2, "write", "done"), (3, "write", "done"),
        (4, "read", "done"), (5, "read", "done"), (6, "read", "error"), (7, "list", "done"),
    ]  # fmt: skip
    assert all(r["trajectory"] == tid for r in records)
    json.dumps(records)  # plain JSON

    create, ex = records[0], records[1]
    assert create["result"]["id"] == sb.id and "command" not in create
    assert ex["command"] == ["grep", "x"] and ex["request"]["stdin"] == "y\n"
    assert (ex["exit_code"], ex["stdout"], ex["stderr"]) == (2, "grep x\n", "")
    assert ex["timed_out"] is False and ex["duration_ms"] >= 0 and "result" not in ex
    assert records[2]["request"] == {"path": "/t.txt", "mode": 0o644} and "output" not in records[2]
    assert records[4]["output"] == "héllo" and "output_encoding" not in records[4]
    assert records[5]["output_encoding"] == "base64"
    assert base64.b64decode(records[5]["output"]) == BLOB
    assert records[6]["error"]["code"] == "file_not_found" and "output" not in records[6]
    assert [e["name"] for e in records[7]["result"]["entries"]] == ["b.bin", "t.txt"]


# ---- 12. retention ---------------------------------------------------------------------------------------------------


def test_retention_must_be_positive(workdir: Path) -> None:
    for days in (0, -1):
        with pytest.raises(ValueError, match="retention"):
            SandboxManager(
                state_dir=workdir / "state",
                images=ImageStore(workdir / "images", lazy=False, mount=False),
                kinds=["container"],
                trajectory=TrajectoryOptions(keep_days=days),
            )


async def test_retention_prunes_old_trajectories_but_never_a_live_ones(daemon: Daemon) -> None:
    d = daemon
    _, bob_token = d.mgr.tenants.add("bob")
    admin, bob = await d.client(), await d.client(bob_token)
    live = await admin.create(image=IMAGE, trajectory="old/live")
    await live.exec(["echo", "1"])
    closed = await admin.create(image=IMAGE, trajectory="old/closed")
    await closed.kill()
    dropped = await admin.create(image=IMAGE, trajectory="old/dropped")
    assert (await d.raw("DELETE", f"/v1/sandboxes/{dropped.id}")).status_code == 200
    recent = await admin.create(image=IMAGE, trajectory="new/stopped")
    await recent.kill()
    theirs = await bob.create(image=IMAGE, trajectory="old/live")  # same id, another tenant, stopped
    await theirs.kill()

    two_days_ago = time.time() - 2 * 86400
    with d.store.engine.begin() as conn:
        conn.execute(
            sa.update(TRAJECTORIES).where(TRAJECTORIES.c.id.startswith("old/")).values(updated_at=two_days_ago)
        )

    await d.restart(options=TrajectoryOptions(keep_days=1))  # a retention pass runs at start
    await wait_until(lambda: d.store.get(OP, "old/closed") is None, "the retention pass")
    await wait_until(lambda: d.store.get("bob", "old/live") is None, "the retention pass")
    assert d.store.get(OP, "old/dropped") is None and d.store.calls(OP, "old/dropped") == []
    assert d.row("old/live").length == 2  # its sandbox runs: kept, however old
    assert d.row("new/stopped").closed  # recent: kept
    assert (await live.exec(["echo", "2"])).stdout == "echo 2\n"
    assert TrajectoryOptions().keep_days == 30
