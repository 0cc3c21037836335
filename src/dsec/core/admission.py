"""Admission: a node takes a sandbox while its requests fit, and queues the rest fairly.

Each sandbox requests cpu and memory (``Limits.cpu``, ``Limits.mem_request()``). The node admits it while
the requests it holds, this one included, stay within capacity x ratio for both resources (CPU is
oversubscribed 8x by default: most agent sandboxes idle while the model thinks), and within the
tenant's own quota. What does not fit waits in its tenant's queue; tenants are served in turn (round
robin over the heads of their queues), so one tenant's burst of thousands cannot starve another's
single request. A waiter whose deadline passes, or that finds the queue full, is answered
``Overloaded`` (HTTP 429) with a Retry-After estimated from the recent rate of releases: nothing was
created, the caller may simply try again.

A request larger than the node could ever admit, or than its tenant's quota, is refused at once.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InvalidRequest, Overloaded, QuotaExceeded
from ..protocol.node import Ratios, Resources, TenantQueue, TenantQuota

DEFAULT_CPU_RATIO = 8.0
DEFAULT_MEMORY_RATIO = 1.2
DEFAULT_QUEUE_TIMEOUT = 30.0
DEFAULT_MAX_QUEUE = 100_000
RATE_WINDOW_S = 60.0


def format_size(n: int) -> str:
    for unit, factor in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.4g}{unit}"
    return f"{n}B"


def host_cpus() -> float:
    return float(len(os.sched_getaffinity(0)))


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_reserve(total: int) -> int:
    """Memory kept back for the host and the daemon: 1 GiB plus 5% (kubelet's habit of a fixed floor)."""
    return min(total // 2, (1 << 30) + total // 20)


@dataclass(frozen=True)
class AdmissionOptions:
    cpu_capacity: float | None = None  # cores for sandboxes; default: the cpus this daemon may run on
    memory_capacity: int | None = None  # bytes for sandboxes; default: host memory minus a reserve
    cpu_ratio: float = DEFAULT_CPU_RATIO
    memory_ratio: float = DEFAULT_MEMORY_RATIO
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT  # default wait of a creation that does not fit
    max_queue: int = DEFAULT_MAX_QUEUE  # creations waiting at once, all tenants
    node_name: str | None = None

    def capacity(self) -> Resources:
        mem = self.memory_capacity
        if mem is None:
            total = host_memory()
            mem = total - default_reserve(total)
        return Resources(cpu=self.cpu_capacity if self.cpu_capacity is not None else host_cpus(), memory=mem)


@dataclass(slots=True)
class Claim:
    tenant: str
    cpu: float
    memory: int


@dataclass(slots=True)
class _Waiter:
    claim: Claim
    since: float
    granted: asyncio.Future[None]


@dataclass(slots=True)
class _Held:
    sandboxes: int = 0
    cpu: float = 0.0
    memory: int = 0


@dataclass
class Admission:
    options: AdmissionOptions = field(default_factory=AdmissionOptions)
    quota_of: Callable[[str], TenantQuota | None] = lambda _tenant: None

    def __post_init__(self) -> None:
        self.capacity = self.options.capacity()
        self.ratios = Ratios(cpu=self.options.cpu_ratio, memory=self.options.memory_ratio)
        self.allocatable = Resources(
            cpu=self.capacity.cpu * self.ratios.cpu, memory=int(self.capacity.memory * self.ratios.memory)
        )
        self.held: dict[str, Claim] = {}  # sandbox id -> what it was admitted with
        self._by_tenant: dict[str, _Held] = collections.defaultdict(_Held)
        self._total = _Held()
        self._queues: dict[str, collections.deque[_Waiter]] = {}  # insertion order = service order
        self._releases: collections.deque[float] = collections.deque()
        self.refused: collections.Counter[str] = collections.Counter()  # why creations were turned away
        self._last_idle = time.monotonic()  # when the queue was last empty: the current load began after
        # frees capacity held by idle warm-pool sandboxes for a claim that does not fit (core/warm.py):
        # a real creation never waits behind sandboxes made ahead for one that may never come
        self.reclaim: Callable[[Claim], None] = lambda _claim: None

    # ---- figures -----------------------------------------------------------------------------------

    @property
    def admitted(self) -> int:
        """Claims held now: sandboxes bound to one, and creations admitted but not yet made."""
        return self._total.sandboxes

    @property
    def requested(self) -> Resources:
        return Resources(cpu=round(self._total.cpu, 6), memory=self._total.memory)

    @property
    def free(self) -> Resources:
        return Resources(
            cpu=round(self.allocatable.cpu - self._total.cpu, 6), memory=self.allocatable.memory - self._total.memory
        )

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def queues(self) -> list[TenantQueue]:
        now = time.monotonic()
        return [
            TenantQueue(tenant=t, waiting=len(q), oldest_s=round(now - q[0].since, 3))
            for t, q in self._queues.items()
            if q
        ]

    def tenant_usage(self, tenant: str) -> _Held:
        return self._by_tenant.get(tenant) or _Held()

    # ---- admitting ---------------------------------------------------------------------------------

    def check(self, claim: Claim) -> None:
        """Refuse what could never be admitted here, whatever else ends."""
        if claim.cpu > self.allocatable.cpu + 1e-9:
            raise InvalidRequest(
                f"the sandbox requests {claim.cpu:g} cpu; this node admits at most {self.allocatable.cpu:g} "
                f"({self.capacity.cpu:g} cores x {self.ratios.cpu:g})"
            )
        if claim.memory > self.allocatable.memory:
            raise InvalidRequest(
                f"the sandbox requests {format_size(claim.memory)} of memory; this node admits at most "
                f"{format_size(self.allocatable.memory)} ({format_size(self.capacity.memory)} x "
                f"{self.ratios.memory:g})"
            )
        quota = self.quota_of(claim.tenant)
        if quota is None:
            return
        for name, asked, bound in (
            ("sandboxes", 1, quota.sandboxes),
            ("cpu", claim.cpu, quota.cpu),
            ("memory", claim.memory, quota.memory),
        ):
            if bound is not None and asked > bound + 1e-9:
                raise QuotaExceeded(
                    f"tenant {claim.tenant}'s quota allows {bound:g} {name} in all; this sandbox alone asks {asked:g}",
                    detail={"quota": name, "limit": bound},
                )

    def _fits_node_only(self, claim: Claim) -> bool:
        return (
            self._total.cpu + claim.cpu <= self.allocatable.cpu + 1e-9
            and self._total.memory + claim.memory <= self.allocatable.memory
        )

    def _fits(self, claim: Claim) -> bool:
        if not self._fits_node_only(claim):
            return False
        quota = self.quota_of(claim.tenant)
        if quota is None:
            return True
        mine = self.tenant_usage(claim.tenant)
        return (
            (quota.sandboxes is None or mine.sandboxes + 1 <= quota.sandboxes)
            and (quota.cpu is None or mine.cpu + claim.cpu <= quota.cpu + 1e-9)
            and (quota.memory is None or mine.memory + claim.memory <= quota.memory)
        )

    def _take(self, claim: Claim) -> None:
        for held in (self._total, self._by_tenant[claim.tenant]):
            held.sandboxes += 1
            held.cpu += claim.cpu
            held.memory += claim.memory

    async def admit(self, claim: Claim, timeout: float | None) -> float:
        """Wait until ``claim`` fits (within ``timeout`` seconds; None: the node's default); returns the
        seconds waited. The claim is then held until :meth:`bind` names its sandbox and :meth:`release`."""
        self.check(claim)
        timeout = self.options.queue_timeout if timeout is None else timeout
        if not self._fits(claim):
            self.reclaim(claim)  # its share of what idle warm-pool sandboxes hold (queued or not)
        if not self.queued and self._fits(claim):
            self._take(claim)
            return 0.0
        if self.queued >= self.options.max_queue:
            self.refused["queue_full"] += 1
            raise Overloaded(
                f"the node's creation queue is full ({self.queued} waiting)",
                detail={"retry_after": self.retry_after(self.queued), "queued": self.queued},
            )
        if timeout <= 0:
            self.refused["no_capacity"] += 1
            raise self._overloaded(claim, 0.0, self.queued)
        if not self.queued:
            self._last_idle = time.monotonic()
        waiter = _Waiter(claim, time.monotonic(), asyncio.get_running_loop().create_future())
        self._queues.setdefault(claim.tenant, collections.deque()).append(waiter)
        self._dispatch()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), timeout)
        except (TimeoutError, asyncio.CancelledError) as e:
            if waiter.granted.done() and not waiter.granted.cancelled():
                # granted in the same instant: give it back, the caller is gone or out of time
                self._untake(claim)
                self._dispatch()
            else:
                waiter.granted.cancel()
                self._drop(waiter)
            if isinstance(e, asyncio.CancelledError):
                raise
            self.refused["queue_timeout"] += 1
            raise self._overloaded(claim, timeout, self.queued) from None
        return time.monotonic() - waiter.since

    def room_now(self, claim: Claim) -> bool:
        """``claim`` would be admitted at once without reclaiming anything (warm-pool refills take only
        what real creations leave free: nothing while any wait)."""
        return not self.queued and self._fits(claim)

    def fits_after(self, claim: Claim, freed: list[Claim]) -> bool:
        """Whether ``claim`` would fit once ``freed`` (claims held now) were released."""
        cpu, memory = sum(f.cpu for f in freed), sum(f.memory for f in freed)
        if (
            self._total.cpu - cpu + claim.cpu > self.allocatable.cpu + 1e-9
            or self._total.memory - memory + claim.memory > self.allocatable.memory
        ):
            return False
        quota = self.quota_of(claim.tenant)
        if quota is None:
            return True
        mine = [f for f in freed if f.tenant == claim.tenant]
        held = self.tenant_usage(claim.tenant)
        return (
            (quota.sandboxes is None or held.sandboxes - len(mine) + 1 <= quota.sandboxes)
            and (quota.cpu is None or held.cpu - sum(f.cpu for f in mine) + claim.cpu <= quota.cpu + 1e-9)
            and (quota.memory is None or held.memory - sum(f.memory for f in mine) + claim.memory <= quota.memory)
        )

    def force(self, sandbox_id: str, claim: Claim) -> None:
        """Hold what a sandbox that already runs (re-adopted after a restart) was admitted with."""
        if sandbox_id not in self.held:
            self._take(claim)
            self.held[sandbox_id] = claim

    def bind(self, sandbox_id: str, claim: Claim) -> None:
        self.held[sandbox_id] = claim

    def cancel(self, claim: Claim) -> None:
        """Give back an admitted claim whose sandbox was never made."""
        self._untake(claim)
        self._dispatch()

    def release(self, sandbox_id: str) -> None:
        claim = self.held.pop(sandbox_id, None)
        if claim is None:
            return
        self._untake(claim)
        now = time.monotonic()
        self._releases.append(now)
        while self._releases and self._releases[0] < now - RATE_WINDOW_S:
            self._releases.popleft()
        self._dispatch()

    def _untake(self, claim: Claim) -> None:
        for held in (self._total, self._by_tenant[claim.tenant]):
            held.sandboxes -= 1
            held.cpu -= claim.cpu
            held.memory -= claim.memory
        if self._by_tenant[claim.tenant].sandboxes <= 0:
            self._by_tenant.pop(claim.tenant, None)

    def _dispatch(self) -> None:
        """Serve the tenants' queues in turn while heads fit; a served tenant goes to the back."""
        progress = True
        while progress and self._queues:
            progress = False
            for tenant in list(self._queues):
                queue = self._queues[tenant]
                while queue and queue[0].granted.done():  # a waiter that gave up
                    queue.popleft()
                if not queue:
                    del self._queues[tenant]
                    continue
                head = queue[0]
                if not self._fits(head.claim):
                    continue
                queue.popleft()
                self._take(head.claim)
                head.granted.set_result(None)
                del self._queues[tenant]
                if queue:
                    self._queues[tenant] = queue  # to the back of the rotation
                progress = True

    def _drop(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.claim.tenant)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:
            return
        if not queue:
            del self._queues[waiter.claim.tenant]
        self._dispatch()  # a large head that left may unblock smaller ones behind it

    # ---- answers -----------------------------------------------------------------------------------

    def retry_after(self, ahead: int) -> float:
        """Seconds until a place is likely free for one more, from the releases of the last minute."""
        now = time.monotonic()
        recent = [t for t in self._releases if t >= now - RATE_WINDOW_S]
        if not recent:
            return 5.0
        # over the time the window really covers: a burst 10 s old must not be judged over a minute
        span = max(1.0, min(RATE_WINDOW_S, now - min(recent[0], self._last_idle)))
        rate = len(recent) / span
        return float(min(60.0, max(1.0, (ahead + 1) / rate)))

    def _overloaded(self, claim: Claim, waited: float, ahead: int) -> Overloaded:
        free = self.free
        why = "its tenant's quota is used up" if self._fits_node_only(claim) else "the node is full"
        return Overloaded(
            f"no capacity for a sandbox requesting {claim.cpu:g} cpu and {format_size(claim.memory)} within "
            f"{waited:g} s: {why} (free: {free.cpu:g} cpu, {format_size(max(0, free.memory))}; "
            f"{ahead} creations waiting)",
            detail={"retry_after": self.retry_after(ahead), "queued": ahead, "waited": waited},
        )
