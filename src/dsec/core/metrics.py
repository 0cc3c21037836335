"""The node's Prometheus metrics (GET /metrics).

Counters and histograms are updated where things happen; figures that describe the present (sandboxes
by kind and state, the queue, capacity, each sandbox's CPU used against its request) are read from the
live table, the admission and the usage monitor when scraped, so they cannot drift from them. Each node
has its own registry: several daemons
(or tests) in one process do not mix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..protocol.pools import WarmPoolInfo
from ..protocol.run import PoolInfo
from ..tenancy import OPERATOR, Caller
from .history import CreationHistory
from .sandboxes import Sandboxes
from .usage import UsageMonitor

Pools = Callable[[Caller], list[PoolInfo]]  # the function pools a caller may see
WarmPools = Callable[[Caller], list[WarmPoolInfo]]  # the warm pools of sandboxes (core/warm.py)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PHASES = ("queue", "rootfs", "runtime", "total", "first_exec")
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# cpu used / cpu requested over a sampling interval: the "90% use <= 5%" question is bucket 0.05
USE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0)


class Remembered(Protocol):
    """What an API remembers to answer repeated requests (the server's Idempotency-Key memory)."""

    def __len__(self) -> int: ...

    @property
    def held(self) -> int: ...

    @property
    def max_bytes(self) -> int: ...


class NodeMetrics:
    def __init__(self, sandboxes: Sandboxes) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.creations = PromCounter("dsec_creations", "Sandboxes created.", ["kind"], registry=r)
        self.failures = PromCounter(
            "dsec_creation_failures",
            "Creations that did not give a sandbox, by reason (the error code).",
            ["kind", "reason"],
            registry=r,
        )
        self.phase = Histogram(
            "dsec_create_phase_seconds",
            "Seconds a creation spent per phase: queue (capacity and a start slot), rootfs, runtime (start "
            "until the agent answers), total; first_exec is the first command's round trip in the daemon.",
            ["kind", "phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "dsec_admission_wait_seconds",
            "Seconds creations that queued waited for capacity.",
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.cpu_use = Histogram(
            "dsec_sandbox_cpu_use_ratio",
            "Per sandbox and sampling interval: CPU used / CPU requested.",
            ["kind"],
            buckets=USE_BUCKETS,
            registry=r,
        )
        self.evictions = PromCounter("dsec_evictions", "Sandboxes evicted under memory pressure.", registry=r)
        self.sandboxes = sandboxes
        self.history = CreationHistory()  # the last hour by minute, for the console's charts
        self.usage: UsageMonitor | None = None
        self.pools: Pools = lambda caller: []
        self.warm: WarmPools = lambda caller: []
        # by API (node, e2b): set by the server that serves it, so a scrape shows what it holds
        self.remembered: dict[str, Remembered] = {}

    def watch(self, usage: UsageMonitor, pools: Pools, warm: WarmPools = lambda caller: []) -> None:
        """Figures of the present come from these once watched (a scrape before shows only counters)."""
        self.usage, self.pools, self.warm = usage, pools, warm
        usage.on_sample = lambda kind, ratio: self.cpu_use.labels(kind).observe(ratio)
        self.registry.register(_Live(self, usage))

    def created(self, kind: str, timings: dict[str, float], owner: str | None = None) -> None:
        self.creations.labels(kind).inc()
        self.history.created(kind, owner)
        for phase, seconds in timings.items():
            if phase in PHASES:
                self.phase.labels(kind, phase).observe(seconds)

    def failed(self, kind: str, reason: str, owner: str | None = None) -> None:
        self.failures.labels(kind, reason).inc()
        self.history.failed(reason, owner)

    def render(self, caller: Caller = OPERATOR) -> bytes:
        """Everything for the operator; a tenant's own sandboxes and pools for a tenant."""
        if caller.operator:
            return generate_latest(self.registry)
        mine = CollectorRegistry(auto_describe=False)
        mine.register(_TenantSlice(self, caller))
        return generate_latest(mine)


POOL_GAUGES = ("workers", "idle", "lent")
POOL_COUNTERS = ("hits", "misses", "made", "destroyed", "resets", "rejected", "waited")


def _sandboxes(sandboxes: Sandboxes, caller: Caller) -> GaugeMetricFamily:
    states = GaugeMetricFamily("dsec_sandboxes", "Live sandboxes by kind and state.", labels=["kind", "state"])
    live = [r for r in sandboxes.live() if caller.owns(r.owner) and (r.pool is None or caller.operator)]
    for (kind, state), n in sorted(Counter((r.kind, r.state.value) for r in live).items()):
        states.add_metric([kind, state], n)
    return states


def _pools(pools: Pools, caller: Caller) -> Iterator[Metric]:
    stats = pools(caller)
    for name in POOL_GAUGES + POOL_COUNTERS:
        family: GaugeMetricFamily | CounterMetricFamily
        if name in POOL_GAUGES:
            family = GaugeMetricFamily(f"dsec_pool_{name}", f"Function pool {name}.", labels=["tenant", "pool"])
        else:
            family = CounterMetricFamily(f"dsec_pool_{name}", f"Function pool {name}.", labels=["tenant", "pool"])
        for p in stats:
            family.add_metric([p.tenant, p.image], getattr(p, name))
        yield family


WARM_GAUGES = {
    "size": "Idle sandboxes the pool is set to keep.",
    "idle": "Idle sandboxes ready to be handed out.",
    "filling": "Sandboxes being made for the pool now.",
}
WARM_COUNTERS = {
    "claims": "Creations served by an idle pooled sandbox.",
    "misses": "Creations that matched the pool but found no idle sandbox of the current version.",
    "refills": "Sandboxes made for the pool.",
    "drained": "Idle sandboxes killed because the pool's image moved to a new version.",
    "reclaimed": "Idle sandboxes killed to give their capacity to a real creation.",
    "failures": "Refills that failed.",
}


def _warm(warm: WarmPools, caller: Caller) -> Iterator[Metric]:
    pools = warm(caller)
    labels = ["pool", "tenant", "kind"]
    for name, doc in WARM_GAUGES.items():
        gauge = GaugeMetricFamily(f"dsec_warm_pool_{name}", doc, labels=labels)
        for p in pools:
            value = p.spec.size if name == "size" else getattr(p, name)
            gauge.add_metric([p.name, p.spec.tenant or OPERATOR.tenant, p.spec.kind], value)
        yield gauge
    for name, doc in WARM_COUNTERS.items():
        counter = CounterMetricFamily(f"dsec_warm_pool_{name}", doc, labels=labels)
        for p in pools:
            counter.add_metric([p.name, p.spec.tenant or OPERATOR.tenant, p.spec.kind], getattr(p, name))
        yield counter


def _remembered(memories: dict[str, Remembered]) -> Iterator[Metric]:
    keys = GaugeMetricFamily(
        "dsec_idempotency_keys", "Idempotency-Keys remembered (their answers kept for repeats).", labels=["api"]
    )
    size = GaugeMetricFamily(
        "dsec_idempotency_bytes", "What the remembered answers hold in the daemon's memory.", labels=["api"]
    )
    limit = GaugeMetricFamily("dsec_idempotency_bytes_limit", "What the remembered answers may hold.", labels=["api"])
    for api, memory in sorted(memories.items()):
        keys.add_metric([api], len(memory))
        size.add_metric([api], memory.held)
        limit.add_metric([api], memory.max_bytes)
    yield from (keys, size, limit)


class _TenantSlice(Collector):
    def __init__(self, metrics: NodeMetrics, caller: Caller) -> None:
        self.metrics, self.caller = metrics, caller

    def collect(self) -> Iterator[Metric]:
        yield _sandboxes(self.metrics.sandboxes, self.caller)
        yield from _pools(self.metrics.pools, self.caller)
        yield from _warm(self.metrics.warm, self.caller)


class _Live(Collector):
    def __init__(self, metrics: NodeMetrics, usage: UsageMonitor) -> None:
        self.metrics, self.usage = metrics, usage

    def collect(self) -> Iterator[Metric]:
        sandboxes, usage = self.metrics.sandboxes, self.usage
        adm = sandboxes.admission
        yield _sandboxes(sandboxes, OPERATOR)
        yield from _pools(self.metrics.pools, OPERATOR)
        yield from _warm(self.metrics.warm, OPERATOR)
        queued = GaugeMetricFamily("dsec_admission_queued", "Creations waiting for capacity.", labels=["tenant"])
        for q in adm.queues():
            queued.add_metric([q.tenant], q.waiting)
        yield queued
        for name, doc, res in (
            ("capacity", "What the node has for sandboxes.", adm.capacity),
            ("allocatable", "Capacity x oversubscription ratio.", adm.allocatable),
            ("requested", "Sum of the requests admitted.", adm.requested),
        ):
            g = GaugeMetricFamily(f"dsec_node_{name}", doc, labels=["resource"])
            g.add_metric(["cpu"], res.cpu)
            g.add_metric(["memory"], float(res.memory))
            yield g
        yield from _remembered(self.metrics.remembered)
        pressure = GaugeMetricFamily("dsec_node_memory_pressure", "Share of the node's memory in use (0-1).")
        pressure.add_metric([], usage.pressure)
        yield pressure
        labels = ["sandbox", "kind", "tenant"]
        req = GaugeMetricFamily("dsec_sandbox_cpu_requested_cores", "CPU requested.", labels=labels)
        used = GaugeMetricFamily("dsec_sandbox_cpu_used_cores", "CPU used over the last interval.", labels=labels)
        mem = GaugeMetricFamily("dsec_sandbox_memory_used_bytes", "Memory charged to the sandbox.", labels=labels)
        mreq = GaugeMetricFamily("dsec_sandbox_memory_requested_bytes", "Memory requested.", labels=labels)
        for rec in sandboxes.live():
            key = [rec.id, rec.kind, rec.owner or ""]
            req.add_metric(key, rec.limits.cpu)
            mreq.add_metric(key, float(rec.limits.mem_request()))
            u = usage.usage.get(rec.id)
            if u is not None:
                used.add_metric(key, u.cpu_used)
                mem.add_metric(key, float(u.memory))
        yield from (req, used, mem, mreq)
