"""One-shot runs and the warm pools that serve them."""

from __future__ import annotations

from fastapi import APIRouter

from ..protocol.run import PoolList, RunBatch, RunBatchResult, RunRequest, RunResult
from .auth import CallerDep
from .routes import _ERRORS, Mgr

router = APIRouter(prefix="/v1", responses=_ERRORS)


@router.post("/run", response_model=RunResult)
async def run(body: RunRequest, mgr: Mgr, caller: CallerDep) -> RunResult:
    """Run one command or one piece of code in a sandbox that exists only for this call (by default a
    worker lent from the warm pool of the function kind, reset and verified after)."""
    return await mgr.runner.run(body, caller=caller)


@router.post("/run/batch", response_model=RunBatchResult)
async def run_batch(body: RunBatch, mgr: Mgr, caller: CallerDep) -> RunBatchResult:
    """Many one-shot runs at once, ``concurrency`` in flight; each run's outcome is its result or its error."""
    return await mgr.runner.run_many(body, caller=caller)


@router.get("/pools", response_model=PoolList)
async def pools(mgr: Mgr, caller: CallerDep) -> PoolList:
    """The warm pools of function workers (a tenant sees its own)."""
    return PoolList(pools=mgr.runner.pools(caller))
