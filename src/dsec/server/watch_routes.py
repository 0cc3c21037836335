"""What the console watches: a node's last hour of creations, a sandbox's usage series, and its commands'
output live as Server-Sent Events (the browser's EventSource reads them)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.responses import StreamingResponse

from ..core.exec_feed import FeedEvent
from ..errors import DsecError
from ..protocol.node import NodeHistory, UsageSeries
from ..protocol.sandbox import TERMINAL_STATES
from .auth import CallerDep
from .routes import _ERRORS, Mgr

router = APIRouter(prefix="/v1", responses=_ERRORS)
SandboxId = Annotated[str, Path(max_length=128)]
RECONNECT_MS = 1000  # what an EventSource waits before it opens the stream again
KEEPALIVE_S = 15.0  # a comment line this often: proxies keep the stream open, and a gone sandbox is noticed


@router.get("/node/history", response_model=NodeHistory)
async def history(mgr: Mgr, caller: CallerDep) -> NodeHistory:
    """The last hour of creations, one bucket per minute (a tenant: its own)."""
    return mgr.history(caller=caller)


@router.get("/sandboxes/{sandbox_id}/usage", response_model=UsageSeries)
async def usage(sandbox_id: SandboxId, mgr: Mgr, caller: CallerDep) -> UsageSeries:
    """The sandbox's measured CPU and memory over the last minutes (sampled every few seconds)."""
    return mgr.usage_series(sandbox_id, caller=caller)


@router.get(
    "/sandboxes/{sandbox_id}/execs/live",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "start, output, end, lost, gone events."}},
)
async def execs_live(
    sandbox_id: SandboxId,
    mgr: Mgr,
    caller: CallerDep,
    timeout: Annotated[
        float,
        Query(gt=0, le=3600, description="Seconds the stream stays open; then it ends (an EventSource reconnects)."),
    ] = 600.0,
) -> StreamingResponse:
    """The sandbox's commands from now on, as they run: ``start`` (exec number, command), ``output``
    (stream, text), ``end`` (exit code or error); ``lost`` when the reader fell behind; ``gone`` when
    the sandbox ended. Every stream ends after ``timeout``: no client holds one forever unawares."""
    watching = mgr.watch_execs(sandbox_id, caller=caller)  # refused here, before the stream starts
    deadline = time.monotonic() + timeout

    async def events() -> AsyncIterator[bytes]:
        with watching as watcher:
            yield f"retry: {RECONNECT_MS}\n: watching\n\n".encode()
            while (left := deadline - time.monotonic()) > 0:
                try:
                    event = await asyncio.wait_for(watcher.next(), min(KEEPALIVE_S, left))
                except TimeoutError:
                    if _ended(mgr, sandbox_id, caller):
                        yield _sse(FeedEvent("gone"))
                        return
                    yield b": keepalive\n\n"
                    continue
                yield _sse(event)

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _ended(mgr: Mgr, sandbox_id: str, caller: CallerDep) -> bool:
    try:
        return mgr.info(sandbox_id, caller=caller).state in TERMINAL_STATES
    except DsecError:
        return True


def _sse(event: FeedEvent) -> bytes:
    fields = {"exec": event.exec} if event.exec else {}
    for name in ("cmd", "stream", "data", "exit_code", "error"):
        value = getattr(event, name)
        if value is not None or (name == "exit_code" and event.kind == "end"):
            fields[name] = value
    if event.kind == "lost":
        fields["dropped"] = event.dropped
    return f"event: {event.kind}\ndata: {json.dumps(fields)}\n\n".encode()
