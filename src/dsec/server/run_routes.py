"""One-shot runs, the warm pools that serve them, and the node's metrics."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from ..run_models import PoolList, RunBatch, RunBatchResult, RunRequest, RunResult
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


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(mgr: Mgr, caller: CallerDep) -> str:
    """Prometheus text format: live sandboxes by kind and state, and the warm pools' sizes and counters
    (a tenant sees its own)."""
    lines = [
        "# HELP dsec_sandboxes Live sandboxes by kind and state.",
        "# TYPE dsec_sandboxes gauge",
    ]
    counts = Counter((i.kind, i.state.value) for i in mgr.list(caller=caller))
    for (kind, state), n in sorted(counts.items()):
        lines.append(f'dsec_sandboxes{{kind="{kind}",state="{state}"}} {n}')
    gauges = ("workers", "idle", "lent")
    counters = ("hits", "misses", "made", "destroyed", "resets", "rejected", "waited")
    stats = mgr.runner.pools(caller)
    for name in gauges + counters:
        mtype = "gauge" if name in gauges else "counter"
        metric = f"dsec_pool_{name}" + ("_total" if mtype == "counter" else "")
        lines += [f"# HELP {metric} Function pool {name}.", f"# TYPE {metric} {mtype}"]
        for p in stats:
            image = p.image.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'{metric}{{tenant="{p.tenant}",pool="{image}"}} {getattr(p, name)}')
    return "\n".join(lines) + "\n"
