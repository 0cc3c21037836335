"""Warm pools (docs/pools.md): set, listed and removed at run time. Operator only."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..protocol.pools import PoolName, WarmPoolInfo, WarmPoolList, WarmPoolSpec
from .auth import OperatorDep
from .routes import _ERRORS, Mgr

router = APIRouter(prefix="/v1", responses=_ERRORS)


@router.get("/warm-pools", response_model=WarmPoolList)
async def list_pools(mgr: Mgr, caller: OperatorDep) -> WarmPoolList:
    """Every warm pool: what its sandboxes are, how many idle ones it keeps and holds, and its counters
    (claims, misses, refills, drained, reclaimed, failures). Operator only."""
    return WarmPoolList(pools=mgr.warm_pools(caller=caller))


@router.put("/warm-pools/{name}", response_model=WarmPoolInfo)
async def set_pool(name: PoolName, body: WarmPoolSpec, mgr: Mgr, _: OperatorDep) -> WarmPoolInfo:
    """Add the pool or change it (a new size keeps its idle sandboxes; anything else replaces them). It
    fills in the background, within what the node has free. Operator only."""
    return mgr.set_warm_pool(name, body)


@router.delete("/warm-pools/{name}", status_code=204)
async def remove_pool(name: PoolName, mgr: Mgr, _: OperatorDep) -> Response:
    """Remove the pool and kill its idle sandboxes (claimed ones are their claimants'). Operator only."""
    mgr.remove_warm_pool(name)
    return Response(status_code=204)
