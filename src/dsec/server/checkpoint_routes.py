"""A sandbox's checkpoints: take one, list them, remove one, roll back to one in place.

Taking, removing and rolling back are trajectory calls (a bound sandbox's carry their position) like
an exec: a rebuild re-applies them, so it takes the same checkpoints and rolls back to the same ones."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response

from ..core.manager import SandboxManager
from ..protocol.checkpoints import CHECKPOINT_REF, CheckpointInfo, CheckpointList, CheckpointRequest, RollbackRequest
from ..protocol.sandbox import SandboxInfo
from ..tenancy import Caller
from .auth import CallerDep
from .routes import _ERRORS, Mgr, Seq, _json, _mark

router = APIRouter(prefix="/v1", responses=_ERRORS)

CheckpointParam = Annotated[str, Path(pattern=CHECKPOINT_REF, description="The checkpoint's id or name.")]


@router.post("/sandboxes/{sandbox_id}/checkpoints", response_model=CheckpointInfo, status_code=201)
async def take_checkpoint(
    sandbox_id: str, body: CheckpointRequest, mgr: Mgr, caller: CallerDep, seq: Seq = None
) -> Response:
    """Keep the sandbox's files as they are now (its writable layer, packed on the node's disk)."""
    info, replayed = await mgr.actions.call(sandbox_id, "checkpoint", body, seq=seq, caller=caller)
    return _mark(_json(info, 201), replayed)


@router.get("/sandboxes/{sandbox_id}/checkpoints", response_model=CheckpointList)
async def list_checkpoints(sandbox_id: str, mgr: Mgr, caller: CallerDep) -> CheckpointList:
    return CheckpointList(checkpoints=mgr.list_checkpoints(sandbox_id, caller=caller))


@router.delete("/sandboxes/{sandbox_id}/checkpoints/{checkpoint}", status_code=204)
async def remove_checkpoint(
    sandbox_id: str, checkpoint: CheckpointParam, mgr: Mgr, caller: CallerDep, seq: Seq = None
) -> Response:
    _, replayed = await mgr.actions.call(
        sandbox_id, "remove_checkpoint", {"checkpoint": checkpoint}, seq=seq, caller=caller
    )
    return _mark(Response(status_code=204), replayed)


@router.post("/sandboxes/{sandbox_id}/rollback", response_model=SandboxInfo)
async def rollback(
    sandbox_id: str, body: RollbackRequest, mgr: Mgr, caller: CallerDep, request: Request, seq: Seq = None
) -> Response:
    """Put the sandbox back at the checkpoint, same id: its processes ended, its files as they were (a
    container keeps its init, network and cgroups; a VM's memory is restored; others start again)."""
    return await run_rollback(mgr, request.scope, sandbox_id, body, seq, caller)


async def run_rollback(
    mgr: SandboxManager,
    scope: MutableMapping[str, Any],
    sandbox_id: str,
    body: RollbackRequest,
    seq: int | None,
    caller: Caller,
) -> Response:
    """The rollback route's work once its request is parsed (also done by fast_calls.FastCalls)."""
    info, replayed = await mgr.actions.call(sandbox_id, "rollback", body, seq=seq, caller=caller)
    return _mark(_json(info), replayed)
