"""The node's capacity and metrics, batch creation, and tenant quotas (issue 8)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from ..core import batch
from ..core.metrics import CONTENT_TYPE
from ..core.node import node_status
from ..protocol.names import TenantName
from ..protocol.node import MAX_TOP, BatchCreate, NodeStatus, TenantQuota
from .auth import CallerDep, OperatorDep
from .routes import _ERRORS, Mgr

router = APIRouter(prefix="/v1", responses=_ERRORS)
metrics_router = APIRouter()


@router.get("/node", response_model=NodeStatus)
async def node(
    mgr: Mgr,
    caller: CallerDep,
    top: Annotated[int, Query(ge=0, le=MAX_TOP, description="Also list this many of the caller's sandboxes.")] = 0,
) -> NodeStatus:
    """Capacity, oversubscription, what is admitted and queued, measured use; with ``top``, the caller's
    sandboxes using the most CPU."""
    return node_status(mgr, caller, top)


@router.post(
    "/sandboxes/batch",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "BatchEvent lines, summary last."}},
)
async def create_batch(body: BatchCreate, mgr: Mgr, caller: CallerDep, request: Request) -> StreamingResponse:
    """Create ``count`` sandboxes alike. Answers one JSON line per sandbox as it becomes ready or fails
    (``index``, then ``sandbox`` or ``error``), then a summary line (``done``, ``created``, ``failed``).
    Creations beyond capacity queue like single ones."""
    batch.check(body)
    events = batch.create_many(mgr, body, caller)

    async def lines() -> AsyncIterator[str]:
        async for event in events:
            yield event.model_dump_json(exclude_defaults=True) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.get("/tenants/{name}/quota", response_model=TenantQuota)
async def get_quota(name: TenantName, mgr: Mgr, _: OperatorDep) -> TenantQuota:
    """What the tenant may hold on this node at once. Operator only."""
    mgr.tenants.get(name)
    return mgr.tenants.quota(name) or TenantQuota()


@router.put("/tenants/{name}/quota", response_model=TenantQuota)
async def set_quota(name: TenantName, body: TenantQuota, mgr: Mgr, _: OperatorDep) -> TenantQuota:
    """Bound what the tenant may hold at once (fields left out: no bound of its own). Creations past
    it wait in the tenant's queue like creations past the node's capacity. Operator only."""
    return mgr.tenants.set_quota(name, body)


_PROMETHEUS: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}
}


@metrics_router.get("/metrics", response_class=Response, responses=_PROMETHEUS)
@router.get("/metrics", response_class=Response, responses=_PROMETHEUS)
async def metrics(mgr: Mgr, caller: CallerDep) -> Response:
    """Prometheus text format. The operator gets the node's: creations and failures by reason, create
    phases, the queue, capacity and requests, every sandbox's CPU and memory used against its request,
    evictions, the warm pools. A tenant gets its own live sandboxes and pools."""
    return Response(mgr.metrics.render(caller), media_type=CONTENT_TYPE)
