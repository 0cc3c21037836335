"""One-shot runs: a sandbox for exactly one command (by default a warm function worker), then gone.

A run goes through the same create / write / exec / kill path as any sandbox, so tenants, quotas,
limits, network policy and the audit apply unchanged; it only saves the caller the round trips.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..errors import DsecError
from ..protocol.run import PoolInfo, RunBatch, RunBatchResult, RunOutcome, RunRequest, RunResult
from ..protocol.sandbox import CreateSandbox, ErrorBody
from ..tenancy import OPERATOR, Caller
from .files import FileActions
from .lifecycle import Lifecycle

log = logging.getLogger("dsec.run")

# a run's sandbox lives this much longer than its command may: writing its files and tearing it down
TTL_MARGIN = 120.0


class Runner:
    def __init__(self, lifecycle: Lifecycle, files: FileActions) -> None:
        self.lifecycle = lifecycle
        self.files = files

    async def run(self, req: RunRequest, *, caller: Caller = OPERATOR) -> RunResult:
        life = self.lifecycle
        create = CreateSandbox(
            image=req.image,
            kind=req.kind,
            limits=req.limits,
            timeout=req.timeout + TTL_MARGIN,
            env=req.env,
            network=req.network,
            labels={"dsec.run": "1"},
        )
        info = await life.create(create, caller=caller, persist=False)
        try:
            rec = life.sandboxes.get(info.id, caller)
            warm = life.sandboxes.backends[rec.kind].lent_warm(rec)
            for path, data in req.file_bytes().items():
                await self.files.write_file(
                    info.id, path, data, 0o755 if path.endswith(".sh") else 0o644, caller=caller
                )
            res = await life.exec(info.id, req.exec_request(), caller=caller)
        finally:
            try:
                await life.kill(info.id, caller=caller)
            except DsecError as e:  # the result stands; the sandbox is reaped by its time to live
                log.warning("run %s: could not stop its sandbox: %s", info.id, e)
        return RunResult(**res.model_dump(), sandbox=info.id, warm=warm)

    async def run_many(self, batch: RunBatch, *, caller: Caller = OPERATOR) -> RunBatchResult:
        started = time.monotonic()
        gate = asyncio.Semaphore(batch.concurrency)

        async def one(req: RunRequest) -> RunOutcome:
            async with gate:
                try:
                    return RunOutcome(result=await self.run(req, caller=caller))
                except DsecError as e:
                    return RunOutcome(error=ErrorBody(code=e.code, message=e.message, detail=e.detail))

        outcomes = await asyncio.gather(*(one(r) for r in batch.runs))
        return RunBatchResult(outcomes=list(outcomes), seconds=time.monotonic() - started)

    def pools(self, caller: Caller = OPERATOR) -> list[PoolInfo]:
        """The warm pools this caller may see: its own tenant's, or all for the operator."""
        out = [p for backend in self.lifecycle.sandboxes.backends.values() for p in backend.pool_stats()]
        return [p for p in out if caller.operator or p.tenant == caller.tenant]
