"""The trajectory log, read back: list, one trajectory, its recorded calls (paged), removal.

Trajectory ids contain slashes ("job-17/rollout-3"), so they travel as a query parameter.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response

from ..protocol.sandbox import TRAJECTORY_ID
from ..protocol.trajectory import RecordedCall, RecordedCalls, ReplayedCalls, TrajectoryInfo, TrajectoryList
from ..store.trajectories import CallRow, TrajectoryRow
from .auth import CallerDep
from .routes import _ERRORS, Mgr

router = APIRouter(prefix="/v1", responses=_ERRORS)

TrajectoryId = Annotated[str, Query(pattern=TRAJECTORY_ID, description="The trajectory's id.")]
PAGE_BYTES = 8 << 20  # a page of calls stops growing past this many bytes of results


@router.get("/trajectories", response_model=TrajectoryList)
async def list_trajectories(
    mgr: Mgr,
    caller: CallerDep,
    prefix: Annotated[str, Query(max_length=200)] = "",
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> TrajectoryList:
    """The caller's trajectories, most recently written first."""
    rows = await mgr.trajectories.find(caller, prefix, limit)
    return TrajectoryList(trajectories=[_info(r) for r in rows])


@router.get("/trajectories/info", response_model=TrajectoryInfo)
async def trajectory_info(id: TrajectoryId, mgr: Mgr, caller: CallerDep) -> TrajectoryInfo:
    return _info(await mgr.trajectories.info(id, caller))


@router.get("/trajectories/calls", response_model=RecordedCalls)
async def trajectory_calls(
    id: TrajectoryId,
    mgr: Mgr,
    caller: CallerDep,
    start: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> Response:
    """Recorded calls from position ``start``, in order; ``next`` is where the following page starts."""
    rows = await mgr.trajectories.calls(id, caller, start, limit)
    calls: list[RecordedCall] = []
    size = 0
    for row in rows:
        calls.append(_call(row))
        size += len(row.result or "") + len(row.result_blob or b"")
        if size > PAGE_BYTES:
            break
    more = len(calls) < len(rows) or len(rows) == limit
    page = RecordedCalls(calls=calls, next=calls[-1].seq + 1 if calls and more else None)
    return Response(content=page.model_dump_json(), media_type="application/json")


@router.post("/trajectories/replayed", status_code=204)
async def trajectory_replayed(id: TrajectoryId, body: ReplayedCalls, mgr: Mgr, caller: CallerDep) -> Response:
    """A client answered the calls ``start``..``end - 1`` from the log itself: each counts one replay."""
    await mgr.trajectories.replayed_by_client(id, caller, body.start, body.end)
    return Response(status_code=204)


@router.delete("/trajectories", status_code=204)
async def remove_trajectory(id: TrajectoryId, mgr: Mgr, caller: CallerDep) -> Response:
    """Forget a trajectory and its calls (refused while its sandbox runs)."""
    await mgr.trajectories.remove(id, caller)
    return Response(status_code=204)


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _info(row: TrajectoryRow) -> TrajectoryInfo:
    return TrajectoryInfo(
        id=row.id,
        sandbox_id=row.sandbox_id,
        kind=row.kind,
        image=row.image,
        created_at=_ts(row.created_at),
        updated_at=_ts(row.updated_at),
        length=row.length,
        closed=row.closed,
        rebuilds=row.rebuilds,
    )


def _call(row: CallRow) -> RecordedCall:
    return RecordedCall(
        seq=row.seq,
        op=row.op,
        digest=row.digest,
        request=json.loads(row.request),
        status=row.status,
        result=json.loads(row.result) if row.result else None,
        result_bytes=base64.b64encode(row.result_blob).decode() if row.result_blob is not None else None,
        payload_bytes=len(row.payload or b""),
        started_at=_ts(row.started_at),
        duration_ms=row.duration_ms,
        note=row.note,
        replays=row.replays,
        replayed_at=None if row.replayed_at is None else _ts(row.replayed_at),
    )
