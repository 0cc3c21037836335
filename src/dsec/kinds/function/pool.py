"""Warm pools of function workers: one pool per key, growth on demand, idle shrinking, backpressure.

The pool knows nothing of containers: a worker is anything with a ``destroy`` the owner performs.
``Pools`` holds the bookkeeping (who is idle, who is lent, how many exist per key and per tenant) and
the policy (when to make, when to wait, when to shrink); the backend supplies ``make``, ``reset`` and
``destroy``. Every transition happens on the event loop, so the counters need no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ...errors import DsecError, QuotaExceeded

log = logging.getLogger("dsec.function")

W = TypeVar("W")
# how long a caller waits for a worker being reset before making a new one instead
RESET_WAIT = 0.05


@dataclass(frozen=True)
class PoolConfig:
    max_workers: int = 64  # per key: lent + idle + being made or reset
    min_idle: int = 0  # per key: kept warm (prewarmed pools set this)
    idle_ttl: float = 60.0  # seconds an idle worker above min_idle lives
    max_uses: int = 500  # a worker is replaced after this many users, however clean it looks
    tenant_max: int = 256  # workers (all keys) one tenant may hold at once
    acquire_timeout: float = 30.0  # how long a caller waits for a worker before 429


@dataclass
class Stats:
    hits: int = 0  # served by an idle warm worker
    misses: int = 0  # had to make one
    made: int = 0
    destroyed: int = 0
    resets: int = 0  # reset and verified clean, back in the pool
    rejected: int = 0  # failed verification or hostile use: destroyed instead of reused
    waited: int = 0  # callers that queued for a worker (backpressure)


@dataclass
class Pool(Generic[W]):
    key: Hashable
    tenant: str
    config: PoolConfig
    label: str = ""  # what `dsec ps` shows (image, limits)
    template: Any = None  # what the owner needs to make a worker of this key
    idle: deque[tuple[W, float]] = field(default_factory=deque)  # (worker, idle since)
    total: int = 0  # every worker of the key that exists or is being made
    lent: int = 0
    stats: Stats = field(default_factory=Stats)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class Pools(Generic[W]):
    def __init__(
        self,
        make: Callable[[Pool[W]], Awaitable[W]],
        reset: Callable[[W], Awaitable[str | None]],
        destroy: Callable[[W], Awaitable[None]],
        default: PoolConfig | None = None,
    ) -> None:
        self._make, self._reset, self._destroy = make, reset, destroy
        self.default = default or PoolConfig()
        self.pools: dict[Hashable, Pool[W]] = {}
        self._tenant_total: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    def pool(
        self, key: Hashable, tenant: str, label: str = "", config: PoolConfig | None = None, template: Any = None
    ) -> Pool[W]:
        p = self.pools.get(key)
        if p is None:
            p = Pool(key=key, tenant=tenant, config=config or self.default, label=label, template=template)
            self.pools[key] = p
        return p

    def tenant_total(self, tenant: str) -> int:
        return self._tenant_total.get(tenant, 0)

    # ---- lending ---------------------------------------------------------------------------------

    async def acquire(self, pool: Pool[W]) -> tuple[W, bool]:
        """A clean worker of the pool's key and whether it was warm: an idle one, one whose reset is about
        to finish, a new one, or (at the maximum) the next one returned, waiting at most
        ``acquire_timeout`` before QuotaExceeded."""
        started = time.monotonic()
        deadline = started + pool.config.acquire_timeout
        queued = False
        while True:
            if self.closed:
                raise DsecError("the function pools are shutting down")
            if pool.idle:
                worker, _ = pool.idle.pop()  # the most recently used: warmest caches
                pool.lent += 1
                pool.stats.hits += 1
                self.keep_warm(pool)
                return worker, True
            resetting = pool.total - pool.lent - len(pool.idle)
            if resetting > 0 and time.monotonic() - started < RESET_WAIT:
                # a reset takes a few ms, a new worker tens: wait for the reset first
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(pool.changed.wait(), RESET_WAIT)
                continue
            if pool.total < pool.config.max_workers and self.tenant_total(pool.tenant) < pool.config.tenant_max:
                pool.stats.misses += 1
                worker = await self._grow(pool)
                pool.lent += 1
                self.keep_warm(pool)
                return worker, False
            if not queued:
                pool.stats.waited += 1
                queued = True
            left = deadline - time.monotonic()
            if left <= 0:
                raise QuotaExceeded(
                    f"no function worker free for {pool.label or pool.key} within {pool.config.acquire_timeout:g}s: "
                    f"{pool.total} of at most {pool.config.max_workers} in this pool, "
                    f"{self.tenant_total(pool.tenant)} of at most {pool.config.tenant_max} for tenant {pool.tenant!r}"
                )
            changed = pool.changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    def release(self, pool: Pool[W], worker: W, tainted: str | None, uses: int) -> None:
        """Give a worker back after its user is done: reset and verified in the background, then idle
        again; destroyed instead when its use was hostile (``tainted``: why) or it is worn out."""
        pool.lent -= 1
        if tainted is None and uses >= pool.config.max_uses:
            tainted = f"served {uses} users"
        self._spawn(self._recycle(pool, worker, tainted))

    async def _recycle(self, pool: Pool[W], worker: W, tainted: str | None) -> None:
        why = tainted
        if why is None:
            try:
                why = await self._reset(worker)
            except Exception as e:  # a reset that breaks is a failed verification, never a reuse
                why = f"reset failed: {type(e).__name__}: {e}"
        if why is None and not self.closed:
            pool.stats.resets += 1
            pool.idle.append((worker, time.monotonic()))
            pool.notify()
            return
        pool.stats.rejected += 1
        log.info("function worker of %s replaced: %s", pool.label or pool.key, why)
        await self._retire(pool, worker)
        self.keep_warm(pool)

    # ---- growing and shrinking ------------------------------------------------------------------

    async def _grow(self, pool: Pool[W]) -> W:
        pool.total += 1
        self._tenant_total[pool.tenant] = self.tenant_total(pool.tenant) + 1
        try:
            worker = await self._make(pool)
        except BaseException:
            self._forget(pool)
            raise
        pool.stats.made += 1
        return worker

    def keep_warm(self, pool: Pool[W]) -> None:
        """Make workers in the background until min_idle are idle or being made."""
        if self.closed:
            return
        spare = pool.total - pool.lent - len(pool.idle)  # being made or reset right now
        want = pool.config.min_idle - len(pool.idle) - max(0, spare)
        room = min(pool.config.max_workers - pool.total, pool.config.tenant_max - self.tenant_total(pool.tenant))
        for _ in range(max(0, min(want, room))):
            self._spawn(self._prewarm_one(pool))

    async def _prewarm_one(self, pool: Pool[W]) -> None:
        try:
            worker = await self._grow(pool)
        except DsecError as e:
            log.warning("could not pre-warm a function worker for %s: %s", pool.label or pool.key, e)
            return
        pool.idle.append((worker, time.monotonic()))
        pool.notify()

    async def shrink(self, now: float | None = None) -> int:
        """Destroy workers idle longer than idle_ttl, keeping min_idle per pool; returns how many."""
        now = time.monotonic() if now is None else now
        victims: list[tuple[Pool[W], W]] = []
        for pool in self.pools.values():
            keep: deque[tuple[W, float]] = deque()
            # the oldest idle sit at the left: they go first, and only above min_idle
            excess = len(pool.idle) - pool.config.min_idle
            for worker, since in pool.idle:
                if excess > 0 and now - since >= pool.config.idle_ttl:
                    victims.append((pool, worker))
                    excess -= 1
                else:
                    keep.append((worker, since))
            pool.idle = keep
        for pool, worker in victims:
            await self._retire(pool, worker)
        return len(victims)

    async def _retire(self, pool: Pool[W], worker: W) -> None:
        try:
            await self._destroy(worker)
        except Exception:
            log.exception("destroying a function worker of %s failed", pool.label or pool.key)
        pool.stats.destroyed += 1
        self._forget(pool)

    def _forget(self, pool: Pool[W]) -> None:
        pool.total -= 1
        self._tenant_total[pool.tenant] = max(0, self.tenant_total(pool.tenant) - 1)
        pool.notify()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self) -> None:
        """Wait for the resets and pre-warms in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        self.closed = True
        await self.settle()
        for pool in self.pools.values():
            while pool.idle:
                worker, _ = pool.idle.popleft()
                await self._retire(pool, worker)
            pool.notify()
