"""The operation table: every call on a sandbox that a client names (an exec, a file call, a snapshot,
a grade, a network change, a kill), how it runs on the node, and how its request and result are stored.

The node API, the E2B layer and a trajectory's rebuild all make calls through ``Actions.call`` or the
table; the trajectory log wraps the calls from outside (a ``Recorder``) and never runs one itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from ..errors import InvalidRequest, InvalidState
from ..kinds.base import OutputCallback
from ..kinds.execio import ExecIO
from ..protocol import network as policy
from ..protocol.checkpoints import CheckpointInfo, CheckpointRequest, RollbackRequest
from ..protocol.grade import GradeRequest, GradeResult
from ..protocol.network import NetworkSpec
from ..protocol.sandbox import (
    ExecRequest,
    ExecResult,
    FileEntry,
    FileList,
    ImageInfo,
    NetworkStatus,
    SandboxInfo,
    SnapshotRequest,
)
from ..protocol.trajectory import SEQ_HEADER
from ..tenancy import Caller


class Target(Protocol):
    """What the actions run on: the node's calls on a sandbox, each on behalf of a caller."""

    async def exec(
        self,
        sandbox_id: str,
        req: ExecRequest,
        on_output: OutputCallback | None = None,
        *,
        caller: Caller,
        io: ExecIO | None = None,
    ) -> ExecResult: ...

    async def read_file(self, sandbox_id: str, path: str, *, caller: Caller) -> bytes: ...

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, *, caller: Caller
    ) -> None: ...

    async def list_dir(self, sandbox_id: str, path: str, *, caller: Caller) -> list[FileEntry]: ...

    async def mkdir(self, sandbox_id: str, path: str, *, caller: Caller) -> None: ...

    async def stat(self, sandbox_id: str, path: str, *, caller: Caller) -> FileEntry: ...

    async def rename(self, sandbox_id: str, source: str, destination: str, *, caller: Caller) -> None: ...

    async def set_metadata(self, sandbox_id: str, path: str, metadata: dict[str, str], *, caller: Caller) -> None: ...

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False, *, caller: Caller) -> None: ...

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes, *, caller: Caller) -> None: ...

    async def download_tar(self, sandbox_id: str, path: str, *, caller: Caller) -> bytes: ...

    async def snapshot(self, sandbox_id: str, req: SnapshotRequest, *, caller: Caller) -> ImageInfo: ...

    async def grade(self, sandbox_id: str, req: GradeRequest, *, caller: Caller) -> GradeResult: ...

    async def set_network(self, sandbox_id: str, policy: NetworkSpec, *, caller: Caller) -> NetworkStatus: ...

    async def kill(self, sandbox_id: str, *, caller: Caller) -> SandboxInfo: ...

    async def checkpoint(self, sandbox_id: str, req: CheckpointRequest, *, caller: Caller) -> CheckpointInfo: ...

    async def remove_checkpoint(self, sandbox_id: str, checkpoint: str, *, caller: Caller) -> None: ...

    async def rollback(self, sandbox_id: str, req: RollbackRequest, *, caller: Caller) -> SandboxInfo: ...


# target, sandbox id, request, payload (the bytes a write or an upload carries), caller, output
Run = Callable[[Target, str, Any, bytes | None, Caller, OutputCallback | None], Awaitable[Any]]


@dataclass(frozen=True)
class Action:
    name: str
    run: Run
    request: type[BaseModel] | None = None  # the request model; None: a plain dict of parameters
    result: type[BaseModel] | str | None = None  # a model, "bytes", "files", or None (no result)

    def params(self, req: Any) -> dict[str, Any]:
        if isinstance(req, BaseModel):
            return req.model_dump(mode="json")
        return dict(req)

    def parse(self, params: dict[str, Any]) -> Any:
        return self.request.model_validate(params) if self.request is not None else params

    def encode(self, value: Any) -> tuple[str | None, bytes | None]:
        """A result as stored: (JSON text, bytes)."""
        if self.result == "bytes":
            return None, bytes(value)
        if self.result == "files":
            return FileList(entries=value).model_dump_json(), None
        if isinstance(value, BaseModel):
            return value.model_dump_json(), None
        return None, None

    def decode(self, result: str | None, blob: bytes | None) -> Any:
        if self.result == "bytes":
            return blob or b""
        if self.result == "files":
            return FileList.model_validate_json(result or '{"entries": []}').entries
        if isinstance(self.result, type) and result is not None:
            value = self.result.model_validate_json(result)
            if isinstance(value, ExecResult):
                value.replayed = True
            return value
        return None


async def _exec(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, out: OutputCallback | None) -> Any:
    return await t.exec(sid, req, out, caller=c)


def live_exec(io: ExecIO) -> Run:
    """The exec runner for a command driven live (stdin, pid, signals through ``io``)."""

    async def run(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, out: OutputCallback | None) -> Any:
        return await t.exec(sid, req, out, caller=c, io=io)

    return run


async def _read(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await t.read_file(sid, req["path"], caller=c)


async def _write(t: Target, sid: str, req: Any, data: bytes | None, c: Caller, _: OutputCallback | None) -> Any:
    await t.write_file(sid, req["path"], data or b"", req["mode"], caller=c)


async def _list(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await t.list_dir(sid, req["path"], caller=c)


async def _mkdir(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    await t.mkdir(sid, req["path"], caller=c)


async def _stat(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await t.stat(sid, req["path"], caller=c)


async def _move(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    await t.rename(sid, req["source"], req["destination"], caller=c)


async def _metadata(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    await t.set_metadata(sid, req["path"], req["metadata"], caller=c)


async def _remove(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    await t.remove(sid, req["path"], req["recursive"], caller=c)


async def _upload(t: Target, sid: str, req: Any, data: bytes | None, c: Caller, _: OutputCallback | None) -> Any:
    await t.upload_tar(sid, req["path"], data or b"", caller=c)


async def _download(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await t.download_tar(sid, req["path"], caller=c)


async def _snapshot(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await t.snapshot(sid, req, caller=c)


async def _grade(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await t.grade(sid, req, caller=c)


async def _network(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await t.set_network(sid, policy.from_json(req["policy"]), caller=c)


async def _kill(t: Target, sid: str, _: Any, __: bytes | None, c: Caller, ___: OutputCallback | None) -> Any:
    return await t.kill(sid, caller=c)


async def _checkpoint(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await t.checkpoint(sid, req, caller=c)


async def _uncheckpoint(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    await t.remove_checkpoint(sid, req["checkpoint"], caller=c)


async def _rollback(t: Target, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await t.rollback(sid, req, caller=c)


ACTIONS: dict[str, Action] = {
    action.name: action
    for action in (
        Action("exec", _exec, ExecRequest, ExecResult),
        Action("read", _read, None, "bytes"),
        Action("write", _write),
        Action("list", _list, None, "files"),
        Action("mkdir", _mkdir),
        Action("stat", _stat, None, FileEntry),
        Action("move", _move),
        Action("remove", _remove),
        Action("set_metadata", _metadata),
        Action("upload", _upload),
        Action("download", _download, None, "bytes"),
        Action("snapshot", _snapshot, SnapshotRequest, ImageInfo),
        Action("grade", _grade, GradeRequest, GradeResult),
        Action("set_network", _network, None, NetworkStatus),
        Action("kill", _kill, None, SandboxInfo),
        Action("checkpoint", _checkpoint, CheckpointRequest, CheckpointInfo),
        Action("remove_checkpoint", _uncheckpoint),
        Action("rollback", _rollback, RollbackRequest, SandboxInfo),
    )
}


@dataclass(frozen=True)
class Call:
    """One call as a recorder sees it; ``go`` runs it on the node."""

    sandbox_id: str
    action: Action
    req: Any
    payload: bytes | None
    seq: int | None
    caller: Caller
    go: Callable[[], Awaitable[Any]]


class Recorder(Protocol):
    async def record(self, call: Call) -> tuple[Any, bool]:
        """Run the call (or answer it from a log); returns (result, replayed)."""
        ...


class Actions:
    """The one way a named call on a sandbox is made."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.recorder: Recorder | None = None  # set by the trajectory log once it is open

    async def call(
        self,
        sandbox_id: str,
        name: str,
        req: Any,
        payload: bytes | None = None,
        *,
        seq: int | None,
        caller: Caller,
        on_output: OutputCallback | None = None,
        io: ExecIO | None = None,
    ) -> tuple[Any, bool]:
        """Run a call; with a recorder, through it. Returns (result, replayed).

        ``seq``: the call's position in the sandbox's trajectory. ``io``: an exec driven live (its pid
        and signals; see ExecIO); a replayed exec never starts, so ``io`` is then left untouched."""
        action = ACTIONS[name]
        if io is not None and action.name != "exec":
            raise InvalidRequest(f"only an exec can be driven live, not {action.name}")
        run = action.run if io is None else live_exec(io)

        def go() -> Awaitable[Any]:
            return run(self.target, sandbox_id, req, payload, caller, on_output)

        if self.recorder is not None:
            return await self.recorder.record(Call(sandbox_id, action, req, payload, seq, caller, go))
        if seq is not None:
            raise InvalidState(f"sandbox {sandbox_id} is not bound to a trajectory: {SEQ_HEADER} does not apply")
        return await go(), False
