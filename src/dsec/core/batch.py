"""Batch creation: ``count`` sandboxes alike, each reported as soon as it is ready or has failed.

Every sandbox of a batch goes through the same create path as a single one (admission, its tenant's
queue, trajectories), so a batch larger than the node waits its turn instead of failing; the ones that
cannot get capacity before their deadline are reported ``overloaded`` with the rest still delivered.
If the caller goes away, creations not yet finished are cancelled: none of them is left half-made
(admission comes before any record), and the ones already reported stay the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ..errors import DsecError, InvalidRequest
from ..protocol.node import BatchCreate, BatchEvent
from ..protocol.sandbox import CreateSandbox, ErrorBody
from ..tenancy import Caller

if TYPE_CHECKING:
    from .manager import SandboxManager


def check(req: BatchCreate) -> None:
    if req.trajectories is not None:
        if len(req.trajectories) != req.count:
            raise InvalidRequest(f"'trajectories' has {len(req.trajectories)} ids for a batch of {req.count}")
        if len(set(req.trajectories)) != req.count:
            raise InvalidRequest("'trajectories' names a trajectory twice")


async def create_many(mgr: SandboxManager, req: BatchCreate, caller: Caller) -> AsyncIterator[BatchEvent]:
    check(req)
    events: asyncio.Queue[BatchEvent] = asyncio.Queue()

    async def one(index: int) -> None:
        trajectory = req.trajectories[index] if req.trajectories is not None else None
        spec = CreateSandbox.model_validate({**req.sandbox.model_dump(), "trajectory": trajectory})
        try:
            info = await mgr.create(spec, caller=caller)
        except DsecError as e:
            events.put_nowait(BatchEvent(index=index, error=ErrorBody(code=e.code, message=e.message, detail=e.detail)))
        except ValueError as e:
            events.put_nowait(BatchEvent(index=index, error=ErrorBody(code=InvalidRequest.code, message=str(e))))
        except Exception as e:
            body = ErrorBody(code="internal", message=f"internal error: {type(e).__name__}: {e}")
            events.put_nowait(BatchEvent(index=index, error=body))
        else:
            events.put_nowait(BatchEvent(index=index, sandbox=info))

    tasks = [asyncio.create_task(one(i)) for i in range(req.count)]
    created = failed = 0
    try:
        for _ in range(req.count):
            event = await events.get()
            if event.sandbox is not None:
                created += 1
            else:
                failed += 1
            yield event
        yield BatchEvent(done=True, created=created, failed=failed)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # made but never reported (the caller left first): nobody knows their ids, so they go now
        while not events.empty():
            left = events.get_nowait().sandbox
            if left is not None:
                with contextlib.suppress(DsecError):
                    await mgr.kill(left.id)
