"""``sb.checkpoint`` and ``sb.rollback``: a sandbox's files kept under an id, and the sandbox put back to
them in place. A part of ``AsyncSandbox``; each call is a trajectory call like an exec."""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from ..errors import DsecError, InvalidRequest, validation_message
from ..protocol.checkpoints import CheckpointInfo, CheckpointList, CheckpointRequest, RollbackRequest
from ..protocol.sandbox import SandboxInfo
from ..protocol.trajectory import RecordedCall
from .trajectory import Params, canonical_params, model_result, no_result
from .transport import Transport

T = TypeVar("T")
S = TypeVar("S")
ROLLBACK_TIMEOUT = 120.0  # a rollback starts the sandbox again: a creation's time, on a loaded node


def _checked(model: type[CheckpointRequest] | type[RollbackRequest], body: dict[str, Any]) -> None:
    try:
        model.model_validate(body)
    except ValueError as e:
        raise InvalidRequest(validation_message(e)) from None


class Forked(builtins.list[S]):
    """The copies a fork made, in order (a list). ``failed``: the copies that could not be made, as
    (index among the n asked, the error): a container's copies are made, or fail, each on its own."""

    failed: builtins.list[tuple[int, DsecError]]

    def __init__(self, made: Iterable[S] = (), failed: Iterable[tuple[int, DsecError]] = ()) -> None:
        super().__init__(made)
        self.failed = builtins.list(failed)


class CheckpointMixin:
    _info: SandboxInfo

    @property
    def id(self) -> str:
        raise NotImplementedError

    @property
    def _t(self) -> Transport:
        raise NotImplementedError

    async def _call(
        self,
        op: str,
        params: Params,
        payload: bytes | None,
        live: Callable[[dict[str, str]], Awaitable[T]],
        decode: Callable[[RecordedCall], T],
    ) -> T:
        raise NotImplementedError

    async def checkpoint(self, name: str | None = None, *, processes: bool | None = None) -> CheckpointInfo:
        """Keep this sandbox's files as they are now; ``rollback`` puts them back. The sandbox is held
        still while its writable layer is packed (like ``snapshot``, but kept on its node, unscrubbed, and
        named ``c1``, ``c2``, ... or ``name``). At most 16 per sandbox, their bytes within its disk limit.
        ``processes=True`` asks for processes and memory too, an error where the node cannot
        (``client.node().checkpoints`` says, per kind); containers keep files only, and a rollback starts
        their processes afresh."""
        body = {"name": name, "processes": processes}
        _checked(CheckpointRequest, body)

        async def live(headers: dict[str, str]) -> CheckpointInfo:
            url = f"/v1/sandboxes/{self.id}/checkpoints"
            reply = await self._t.request("POST", url, json=body, timeout=ROLLBACK_TIMEOUT, headers=headers)
            return CheckpointInfo.model_validate_json(reply.content)

        params = lambda: canonical_params(CheckpointRequest, body)  # noqa: E731
        return await self._call("checkpoint", params, None, live, model_result(CheckpointInfo))

    async def checkpoints(self) -> builtins.list[CheckpointInfo]:
        """This sandbox's checkpoints, oldest first."""
        reply = await self._t.request("GET", f"/v1/sandboxes/{self.id}/checkpoints")
        return CheckpointList.model_validate_json(reply.content).checkpoints

    async def remove_checkpoint(self, checkpoint: str | CheckpointInfo) -> None:
        """Remove a checkpoint (by id, name or the object ``checkpoint()`` returned) and free its disk."""
        ref = checkpoint.id if isinstance(checkpoint, CheckpointInfo) else checkpoint
        _checked(RollbackRequest, {"checkpoint": ref})

        async def live(headers: dict[str, str]) -> None:
            await self._t.request("DELETE", f"/v1/sandboxes/{self.id}/checkpoints/{ref}", headers=headers)

        await self._call("remove_checkpoint", {"checkpoint": ref}, None, live, no_result)

    async def rollback(self, checkpoint: str | CheckpointInfo) -> None:
        """Put this sandbox back to a checkpoint, in place: same id, its files exactly as they were then.
        Every process in it is ended first (a command running now answers that a rollback ended it); a
        container keeps its init, network address and cgroups, a VM has its memory restored, a function
        sandbox starts again; limits, network policy, volumes and exposed ports stay."""
        ref = checkpoint.id if isinstance(checkpoint, CheckpointInfo) else checkpoint
        body = {"checkpoint": ref}
        _checked(RollbackRequest, body)

        async def live(headers: dict[str, str]) -> SandboxInfo:
            url = f"/v1/sandboxes/{self.id}/rollback"
            reply = await self._t.request("POST", url, json=body, timeout=ROLLBACK_TIMEOUT, headers=headers)
            return SandboxInfo.model_validate_json(reply.content)

        info = await self._call("rollback", body, None, live, model_result(SandboxInfo))
        if info.id == self.id:  # a replayed answer is the recorded sandbox's: keep this one's own
            self._info = info
