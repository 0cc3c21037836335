"""The calls a trajectory records: how each runs on the manager, how its parameters and its result
are stored, and how a stored one is read back (for a replay, or for a rebuild to re-apply)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ...errors import DsecError, error_from_wire
from ...kinds.base import OutputCallback
from ...kinds.execio import ExecIO
from ...protocol import network as policy
from ...protocol.grade import GradeRequest, GradeResult
from ...protocol.sandbox import (
    ExecRequest,
    ExecResult,
    FileEntry,
    FileList,
    ImageInfo,
    NetworkStatus,
    SandboxInfo,
    SnapshotRequest,
)
from ...protocol.trajectory import call_digest
from ...tenancy import Caller

if TYPE_CHECKING:
    from ..manager import SandboxManager

Runner = Callable[["SandboxManager", str, Any, bytes | None, Caller, OutputCallback | None], Awaitable[Any]]


@dataclass(frozen=True)
class Op:
    name: str
    run: Runner
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


def encode_error(e: DsecError) -> str:
    return json.dumps({"error": {"code": e.code, "message": e.message, "detail": e.detail}}, default=str)


def decode_error(result: str | None) -> DsecError:
    try:
        err = json.loads(result or "")["error"]
        return error_from_wire(str(err["code"]), str(err["message"]), err.get("detail") or {})
    except (ValueError, KeyError, TypeError):
        return DsecError("the recorded call failed (its error could not be read back)")


def outcome(op: Op, value: Any) -> str:
    """What a rebuild compares between a recorded result and a re-run's: the result without timings."""
    if isinstance(value, ExecResult):
        value = value.model_copy(update={"duration": 0.0, "replayed": False})
    text, blob = op.encode(value)
    return call_digest(op.name, {"result": text}, blob)


async def _exec(m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, out: OutputCallback | None) -> Any:
    return await m.exec(sid, req, out, caller=c)


def live_exec(io: ExecIO) -> Runner:
    """The exec runner for a command driven live (stdin, pid, signals through ``io``)."""

    async def run(m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, out: OutputCallback | None) -> Any:
        return await m.exec(sid, req, out, caller=c, io=io)

    return run


async def _read(m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await m.read_file(sid, req["path"], caller=c)


async def _write(m: SandboxManager, sid: str, req: Any, data: bytes | None, c: Caller, _: OutputCallback | None) -> Any:
    await m.write_file(sid, req["path"], data or b"", req["mode"], caller=c)


async def _list(m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await m.list_dir(sid, req["path"], caller=c)


async def _mkdir(m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    await m.mkdir(sid, req["path"], caller=c)


async def _stat(m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await m.stat(sid, req["path"], caller=c)


async def _move(m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    await m.rename(sid, req["source"], req["destination"], caller=c)


async def _remove(m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    await m.remove(sid, req["path"], req["recursive"], caller=c)


async def _upload(
    m: SandboxManager, sid: str, req: Any, data: bytes | None, c: Caller, _: OutputCallback | None
) -> Any:
    await m.upload_tar(sid, req["path"], data or b"", caller=c)


async def _download(
    m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None
) -> Any:
    return await m.download_tar(sid, req["path"], caller=c)


async def _snapshot(
    m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None
) -> Any:
    return await m.snapshot(sid, req, caller=c)


async def _grade(m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await m.grade(sid, req, caller=c)


async def _network(m: SandboxManager, sid: str, req: Any, _: bytes | None, c: Caller, __: OutputCallback | None) -> Any:
    return await m.set_network(sid, policy.from_json(req["policy"]), caller=c)


async def _kill(m: SandboxManager, sid: str, _: Any, __: bytes | None, c: Caller, ___: OutputCallback | None) -> Any:
    return await m.kill(sid, caller=c)


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op("exec", _exec, ExecRequest, ExecResult),
        Op("read", _read, None, "bytes"),
        Op("write", _write),
        Op("list", _list, None, "files"),
        Op("mkdir", _mkdir),
        Op("stat", _stat, None, FileEntry),
        Op("move", _move),
        Op("remove", _remove),
        Op("upload", _upload),
        Op("download", _download, None, "bytes"),
        Op("snapshot", _snapshot, SnapshotRequest, ImageInfo),
        Op("grade", _grade, GradeRequest, GradeResult),
        Op("set_network", _network, None, NetworkStatus),
        Op("kill", _kill, None, SandboxInfo),
    )
}
