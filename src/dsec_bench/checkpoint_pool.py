"""The checkpoint bench's fork(8) served by a warm pool: the copies are idle sandboxes of the parent's
image version, put on the checkpoint's files in place, where the kind can (``Backend.reroot``).

The alternative stays what a user without checkpoints has: eight creations from a snapshot image, which
no pool serves (a snapshot is a new image). The pool is refilled, untimed, before each round.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from dsec import AsyncClient, AsyncSandbox, DsecError
from dsec.protocol.checkpoints import CheckpointInfo

from .warm import full_pool

POOLED = ("container",)  # the kinds whose copies a warm pool serves
POOL = "dsec-bench-fork"
REFILL_WITHIN = 300.0


@contextlib.asynccontextmanager
async def warm_pool(client: AsyncClient, image: str, kind: str, disk: str, size: int) -> AsyncIterator[bool]:
    """A pool of ``size`` for sandboxes like the bench's (its image, kind and disk limit); yields
    whether the kind is measured with one."""
    if kind not in POOLED:
        yield False
        return
    await client.set_warm_pool(POOL, image, size, kind=kind, limits={"disk": disk})
    try:
        yield True
    finally:
        with contextlib.suppress(DsecError):
            await client.remove_warm_pool(POOL)


async def pooled_fork(
    client: AsyncClient,
    sb: AsyncSandbox,
    base: CheckpointInfo,
    n: int,
    answered: Callable[[AsyncSandbox], Awaitable[None]],
) -> float:
    """Once the pool is full (untimed): ``fork(n, checkpoint=base)`` → every copy ``answered``; the
    seconds that took. Fails unless all n came from the pool, as the figure would not be what it says."""
    before = (await full_pool(client, POOL, n, REFILL_WITHIN)).claims
    t0 = time.perf_counter()
    copies = await sb.fork(n, checkpoint=base)
    try:
        if copies.failed:
            index, e = copies.failed[0]
            raise RuntimeError(f"{len(copies.failed)} of {n} pooled copies failed; copy {index}: {e}")
        await asyncio.gather(*(answered(c) for c in copies))
        seconds = time.perf_counter() - t0
        claims = next(p for p in await client.warm_pools() if p.name == POOL).claims - before
        if claims != n:
            raise RuntimeError(f"the warm pool served {claims} of the {n} copies")
        return seconds
    finally:
        await asyncio.gather(*(c.kill() for c in copies), return_exceptions=True)
