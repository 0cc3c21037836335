"""The warm pools' policy (kinds/function/pool.py) with fake workers: lending, waiting, replacing, shrinking."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from dsec.errors import QuotaExceeded
from dsec.kinds.function.options import FunctionOptions, parse_pool
from dsec.kinds.function.pool import Pool, PoolConfig, Pools


class Fake:
    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.made: list[int] = []
        self.destroyed: list[int] = []
        self.dirty: set[int] = set()  # workers whose reset will fail verification
        self.reset_delay = 0.0

    async def make(self, pool: Pool[int]) -> int:
        await asyncio.sleep(0)
        w = next(self.ids)
        self.made.append(w)
        return w

    async def reset(self, w: int) -> str | None:
        await asyncio.sleep(self.reset_delay)
        return "dirty" if w in self.dirty else None

    async def destroy(self, w: int) -> None:
        self.destroyed.append(w)


def pools(fake: Fake, **config: float) -> Pools[int]:
    return Pools(fake.make, fake.reset, fake.destroy, PoolConfig(**config))  # type: ignore[arg-type]


async def test_a_returned_clean_worker_is_lent_again() -> None:
    fake = Fake()
    p = pools(fake)
    pool = p.pool("k", "t")
    w, warm = await p.acquire(pool)
    assert not warm
    p.release(pool, w, None, 1)
    await p.settle()
    again, warm = await p.acquire(pool)
    assert (again, warm) == (w, True)
    assert (pool.stats.hits, pool.stats.misses, pool.stats.resets) == (1, 1, 1)


async def test_a_hostile_use_or_a_failed_verification_destroys_the_worker() -> None:
    fake = Fake()
    p = pools(fake)
    pool = p.pool("k", "t")
    a, _ = await p.acquire(pool)
    b, _ = await p.acquire(pool)
    fake.dirty.add(b)
    p.release(pool, a, "killed by the OOM killer", 1)
    p.release(pool, b, None, 1)
    await p.settle()
    assert sorted(fake.destroyed) == [a, b]
    assert (pool.total, pool.stats.rejected, pool.stats.resets) == (0, 2, 0)
    c, warm = await p.acquire(pool)
    assert c not in (a, b) and not warm


async def test_a_worn_out_worker_is_replaced() -> None:
    fake = Fake()
    p = pools(fake, max_uses=2)
    pool = p.pool("k", "t")
    w, _ = await p.acquire(pool)
    p.release(pool, w, None, 2)
    await p.settle()
    assert fake.destroyed == [w]


async def test_at_the_maximum_a_caller_waits_for_a_return_then_gets_429() -> None:
    fake = Fake()
    p = pools(fake, max_workers=1, acquire_timeout=0.3)
    pool = p.pool("k", "t")
    w, _ = await p.acquire(pool)
    waiter = asyncio.create_task(p.acquire(pool))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    p.release(pool, w, None, 1)
    got, warm = await asyncio.wait_for(waiter, 2)
    assert (got, warm) == (w, True)
    assert pool.stats.waited == 1
    with pytest.raises(QuotaExceeded, match="no function worker free"):
        await p.acquire(pool)


async def test_a_tenant_limit_spans_its_pools() -> None:
    fake = Fake()
    p = pools(fake, tenant_max=1, acquire_timeout=0.1)
    await p.acquire(p.pool("k1", "alice"))
    with pytest.raises(QuotaExceeded, match="tenant 'alice'"):
        await p.acquire(p.pool("k2", "alice"))
    await p.acquire(p.pool("k3", "bob"))  # another tenant is not held back


async def test_a_caller_waits_briefly_for_a_reset_instead_of_making_a_worker() -> None:
    fake = Fake()
    fake.reset_delay = 0.01
    p = pools(fake)
    pool = p.pool("k", "t")
    w, _ = await p.acquire(pool)
    p.release(pool, w, None, 1)  # its reset is in flight
    again, warm = await p.acquire(pool)
    assert (again, warm) == (w, True) and fake.made == [w]


async def test_idle_workers_above_the_minimum_shrink_and_the_minimum_is_kept_warm() -> None:
    fake = Fake()
    p = pools(fake, idle_ttl=10)
    pool = p.pool("k", "t", config=PoolConfig(min_idle=2, idle_ttl=10))
    p.keep_warm(pool)
    await p.settle()
    assert len(pool.idle) == 2 and len(fake.made) == 2
    burst = [await p.acquire(pool) for _ in range(5)]
    await p.settle()  # lending the two idle ones pre-warmed two more
    for w, _ in burst:
        p.release(pool, w, None, 1)
    await p.settle()
    idle_before = len(pool.idle)
    assert idle_before > 2
    assert await p.shrink(now=time.monotonic() + 5) == 0  # not idle long enough
    assert await p.shrink(now=time.monotonic() + 11) == idle_before - 2
    assert len(pool.idle) == 2 and pool.total == 2


async def test_close_destroys_the_idle_and_refuses_new_callers() -> None:
    fake = Fake()
    p = pools(fake)
    pool = p.pool("k", "t")
    w, _ = await p.acquire(pool)
    p.release(pool, w, None, 1)
    await p.close()
    assert fake.destroyed == [w]
    with pytest.raises(Exception, match="shutting down"):
        await p.acquire(pool)


def test_pool_options_parse_and_refuse_bad_input() -> None:
    assert parse_pool("dsec/debian:12=8").image == "dsec/debian:12"
    opts = FunctionOptions.of(["dsec/busybox=2"], max_workers=4, idle_ttl=5)
    assert (opts.config.max_workers, opts.config.idle_ttl, opts.prewarm[0].count) == (4, 5, 2)
    for bad in ("dsec/busybox", "=3", "img=0", "img=x", "img=99999"):
        with pytest.raises(ValueError, match="IMAGE=N"):
            parse_pool(bad)
    with pytest.raises(ValueError, match="over --function-max"):
        FunctionOptions.of(["img=9"], max_workers=4)
