"""The lifecycle bench's warm-pool phase: create → first exec, and create → exec → kill, when every
creation is handed a sandbox from a warm pool (docs/pools.md) instead of having one made."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from rich.console import Console

from dsec import AsyncClient, AsyncSandbox

from .common import Json, summarize

POOL = "dsec-bench-warm"
POOL_SIZE = 4
REFILL_WITHIN = 120.0  # s the pool may take to be full again between two samples
# s the full pool rests before a measured creation: a pool's idle sandboxes are usually claimed a while
# after they were made; claimed within ~0.3 s of a refill, the first exec shares this 2-core host with
# what the kernel still does after that creation (measured apart, as just_refilled)
SETTLE_S = 0.5


async def _full(client: AsyncClient, size: int) -> None:
    """Wait (untimed) until the pool is full again, so every measured creation finds an idle sandbox."""
    deadline = time.monotonic() + REFILL_WITHIN
    while True:
        pool = next(p for p in await client.warm_pools() if p.name == POOL)
        if pool.idle >= size:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm pool {POOL} has {pool.idle} of {size} idle after {REFILL_WITHIN:g} s: {pool}")
        await asyncio.sleep(0.02)


async def bench_warm(
    console: Console,
    client: AsyncClient,
    image: str,
    n: int,
    labels: dict[str, str],
    sample: Callable[..., Awaitable[list[tuple[float, ...]]]],
    run_true: Callable[[AsyncSandbox], Awaitable[None]],
) -> Json:
    """Creations served by a pool of the bench image (default limits, no network): their first exec and
    whole cycle with the pool at rest and right after a refill, what the daemon spent on each claim,
    and how many were not served (misses)."""
    await client.set_warm_pool(POOL, image, POOL_SIZE)
    claims: list[float] = []
    try:
        await _full(client, POOL_SIZE)

        settle = SETTLE_S

        async def cycle() -> tuple[float, float]:
            await _full(client, POOL_SIZE)
            await asyncio.sleep(settle)
            t0 = time.perf_counter()
            sb = await client.create(image=image, labels=labels)
            await run_true(sb)
            t1 = time.perf_counter()
            await sb.kill()
            t2 = time.perf_counter()
            info = await sb.info()  # untimed: what the daemon spent on the claim
            if "claim" in info.timings:
                claims.append(info.timings["claim"])
            return t1 - t0, t2 - t0

        cycles = await sample(console, "dsec warm create → exec true → kill (pool at rest)", n, cycle)
        settle = 0.0
        busy = await sample(console, "dsec warm create → exec true → kill (just refilled)", n, cycle)
        pool = next(p for p in await client.warm_pools() if p.name == POOL)
    finally:
        await client.remove_warm_pool(POOL)
    return {
        "pool_size": POOL_SIZE,
        "settle_s": SETTLE_S,
        "create_to_first_exec": summarize([c[0] for c in cycles]),
        "create_exec_kill": summarize([c[1] for c in cycles]),
        # claimed as soon as the pool is full again: the last refill's creation is still settling
        "just_refilled": {
            "create_to_first_exec": summarize([c[0] for c in busy]),
            "create_exec_kill": summarize([c[1] for c in busy]),
        },
        "daemon_claim": summarize(claims) if claims else None,
        "claims": pool.claims,
        "misses": pool.misses,
    }
