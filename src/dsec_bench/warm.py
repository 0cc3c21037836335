"""The lifecycle bench's warm-pool phase: create → first exec, and create → exec → kill, when every
creation is handed a sandbox from a warm pool (docs/pools.md) instead of having one made."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from rich.console import Console

from dsec import AsyncClient, AsyncSandbox, WarmPoolInfo

from .common import Json, summarize

POOL = "dsec-bench-warm"
POOL_SIZE = 4
REFILL_WITHIN = 120.0  # s the pool may take to be full again between two samples
# s the host is left idle before each creation of the second run: back to back, as every other figure of
# this bench is taken, a creation comes as soon as the pool is full again; after an idle pause the first
# command pays the host's wake-up (on this VM host about 10 ms, in any sandbox, pooled or not)
IDLE_S = 0.5


async def full_pool(client: AsyncClient, name: str, size: int, within: float = REFILL_WITHIN) -> WarmPoolInfo:
    """Wait (untimed) until pool ``name`` holds ``size`` idle sandboxes, so that every measured creation
    finds one; the pool as it is then."""
    deadline = time.monotonic() + within
    while True:
        pool = next(p for p in await client.warm_pools() if p.name == name)
        if pool.idle >= size:
            return pool
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm pool {name} has {pool.idle} of {size} idle after {within:g} s: {pool}")
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
    whole cycle, back to back and after the host idled, what the daemon spent on each claim, and how
    many were not served (misses)."""
    await client.set_warm_pool(POOL, image, POOL_SIZE)
    claims: list[float] = []
    try:
        await full_pool(client, POOL, POOL_SIZE)

        pause = 0.0

        async def cycle() -> tuple[float, float]:
            await full_pool(client, POOL, POOL_SIZE)
            await asyncio.sleep(pause)
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

        cycles = await sample(console, "dsec warm create → exec true → kill", n, cycle)
        pause = IDLE_S
        idle = await sample(console, f"dsec warm create → exec true → kill ({IDLE_S:g} s idle before)", n, cycle)
        pool = next(p for p in await client.warm_pools() if p.name == POOL)
    finally:
        await client.remove_warm_pool(POOL)
    return {
        "pool_size": POOL_SIZE,
        "create_to_first_exec": summarize([c[0] for c in cycles]),
        "create_exec_kill": summarize([c[1] for c in cycles]),
        "after_idle": {
            "idle_s": IDLE_S,
            "create_to_first_exec": summarize([c[0] for c in idle]),
            "create_exec_kill": summarize([c[1] for c in idle]),
        },
        "daemon_claim": summarize(claims) if claims else None,
        "claims": pool.claims,
        "misses": pool.misses,
    }
