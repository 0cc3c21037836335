"""Admission: requests against capacity x ratio, the fair per-tenant queue, deadlines answered 429 with
Retry-After, tenant quotas, and nothing half-made when a creation is refused or abandoned."""

from __future__ import annotations

import asyncio
import time

import pytest

from dsec.core.admission import Admission, AdmissionOptions, Claim
from dsec.errors import InvalidRequest, Overloaded, QuotaExceeded
from dsec.protocol.node import TenantQuota

GiB = 1 << 30


def node(cpu: float = 2, ratio: float = 1, memory: int = 4 * GiB, **kw: object) -> Admission:
    opts = AdmissionOptions(cpu_capacity=cpu, memory_capacity=memory, cpu_ratio=ratio, memory_ratio=1.0, **kw)  # type: ignore[arg-type]
    return Admission(opts)


def test_allocatable_is_capacity_times_ratio() -> None:
    adm = Admission(AdmissionOptions(cpu_capacity=2, memory_capacity=10 * GiB, cpu_ratio=8, memory_ratio=1.2))
    assert adm.allocatable.cpu == 16
    assert adm.allocatable.memory == int(12 * GiB)
    assert adm.free.cpu == 16 and adm.requested.cpu == 0


def test_defaults_come_from_the_host() -> None:
    adm = Admission()
    assert adm.capacity.cpu >= 1
    assert 0 < adm.capacity.memory < adm.allocatable.memory  # memory oversubscribed 1.2x by default
    assert adm.ratios.cpu == 8.0


async def test_admits_while_requests_fit_then_queues_until_a_release() -> None:
    adm = node(cpu=1, ratio=1)
    for i in range(4):
        assert await adm.admit(Claim("a", 0.25, 1 << 20), 1.0) == 0.0
        adm.bind(f"sb-{i}", Claim("a", 0.25, 1 << 20))
    assert adm.free.cpu == 0
    waiter = asyncio.create_task(adm.admit(Claim("a", 0.25, 1 << 20), 5.0))
    await asyncio.sleep(0.05)
    assert not waiter.done() and adm.queued == 1
    adm.release("sb-2")
    waited = await asyncio.wait_for(waiter, 1)
    assert 0.04 < waited < 1 and adm.queued == 0
    assert adm.requested.cpu == 1.0


async def test_deadline_answers_overloaded_with_retry_after_and_holds_nothing() -> None:
    adm = node(cpu=1, ratio=1)
    await adm.admit(Claim("a", 1, 1), 1)
    with pytest.raises(Overloaded) as info:
        await adm.admit(Claim("b", 0.5, 1), 0.1)
    err = info.value
    assert err.http_status == 429 and err.retry_after >= 1
    assert "no capacity" in err.message and "within 0.1 s" in err.message
    assert adm.queued == 0 and adm.requested.cpu == 1 and adm.refused["queue_timeout"] == 1
    # no wait asked for: answered at once
    with pytest.raises(Overloaded):
        await asyncio.wait_for(adm.admit(Claim("b", 0.5, 1), 0), 0.05)


async def test_retry_after_follows_the_recent_release_rate() -> None:
    adm = node(cpu=1, ratio=1)
    assert adm.retry_after(0) == 5.0  # nothing released yet: a guess
    now = time.monotonic()
    # a load that began 10 s ago and released 30 sandboxes since: 3 per second
    adm._last_idle = now - 10
    adm._releases.extend(now - 10 + i / 3 for i in range(30))
    assert adm.retry_after(0) == 1.0  # the floor
    assert adm.retry_after(29) == pytest.approx(10.0, rel=0.05)  # judged over 10 s, not over a minute
    assert adm.retry_after(1000) == 60.0  # capped
    # the same releases while creations have waited for five minutes: 30 in the last minute
    adm._last_idle = now - 300
    assert adm.retry_after(14) == pytest.approx(30.0, rel=0.05)


async def test_queue_full_is_answered_at_once() -> None:
    adm = node(cpu=1, ratio=1, max_queue=2)
    await adm.admit(Claim("a", 1, 1), 1)
    waiting = [asyncio.create_task(adm.admit(Claim("a", 1, 1), 5)) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded, match="queue is full"):
        await adm.admit(Claim("b", 0.1, 1), 5)
    assert adm.refused["queue_full"] == 1
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert adm.queued == 0  # a caller that went away leaves no waiter behind


async def test_tenants_are_served_in_turn_not_in_arrival_order() -> None:
    adm = node(cpu=1, ratio=1)
    await adm.admit(Claim("busy", 1, 1), 1)
    adm.bind("first", Claim("busy", 1, 1))
    order: list[str] = []

    async def one(tenant: str, n: int) -> None:
        await adm.admit(Claim(tenant, 1, 1), 10)
        order.append(tenant)
        adm.bind(f"{tenant}-{n}", Claim(tenant, 1, 1))

    # tenant "burst" queues 5 creations before tenant "solo" asks for one
    tasks = [asyncio.create_task(one("burst", i)) for i in range(5)]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(one("solo", 0)))
    await asyncio.sleep(0.01)
    assert adm.queued == 6
    adm.release("first")
    await asyncio.sleep(0.01)
    adm.release("burst-0")
    await asyncio.sleep(0.01)
    # one of burst's, then solo's own: it did not wait behind burst's other four
    assert order == ["burst", "solo"]
    for i in range(1, 5):
        adm.release("solo-0" if i == 1 else f"burst-{i - 1}")
        await asyncio.sleep(0.01)
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert order == ["burst", "solo", "burst", "burst", "burst", "burst"]


async def test_a_large_head_does_not_block_other_tenants() -> None:
    adm = node(cpu=2, ratio=1)
    await adm.admit(Claim("a", 1.5, 1), 1)
    big = asyncio.create_task(adm.admit(Claim("big", 1.0, 1), 5))  # needs 1, only 0.5 free
    await asyncio.sleep(0.01)
    small = await asyncio.wait_for(adm.admit(Claim("small", 0.5, 1), 5), 1)  # fits: served at once
    assert small >= 0 and not big.done()
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)


async def test_requests_larger_than_the_node_are_invalid_not_queued() -> None:
    adm = node(cpu=2, ratio=8, memory=1 * GiB)
    with pytest.raises(InvalidRequest, match="admits at most 16 "):
        await adm.admit(Claim("a", 17, 1), 10)
    with pytest.raises(InvalidRequest, match="of memory"):
        await adm.admit(Claim("a", 1, 2 * GiB), 10)
    assert adm.queued == 0


async def test_tenant_quota_queues_its_own_creations_only() -> None:
    quotas = {"capped": TenantQuota(sandboxes=2, cpu=1.0)}
    adm = Admission(AdmissionOptions(cpu_capacity=64, memory_capacity=64 * GiB, cpu_ratio=1), quota_of=quotas.get)
    for i in range(2):
        await adm.admit(Claim("capped", 0.25, 1), 0)
        adm.bind(f"c{i}", Claim("capped", 0.25, 1))
    with pytest.raises(Overloaded, match="quota is used up"):
        await adm.admit(Claim("capped", 0.25, 1), 0.05)
    assert await adm.admit(Claim("other", 0.25, 1), 0) == 0.0  # other tenants are not held up
    with pytest.raises(QuotaExceeded, match="this sandbox alone asks 2"):
        await adm.admit(Claim("capped", 2, 1), 10)  # can never fit its quota: refused at once
    waiter = asyncio.create_task(adm.admit(Claim("capped", 0.25, 1), 5))
    await asyncio.sleep(0.01)
    adm.release("c0")
    assert await asyncio.wait_for(waiter, 1) > 0
    assert adm.tenant_usage("capped").sandboxes == 2


async def test_force_and_release_are_idempotent() -> None:
    adm = node(cpu=1, ratio=1)
    adm.force("sb-1", Claim("a", 0.5, 1))
    adm.force("sb-1", Claim("a", 0.5, 1))
    assert adm.requested.cpu == 0.5
    adm.release("sb-1")
    adm.release("sb-1")
    assert adm.requested.cpu == 0 and adm.admitted == 0
