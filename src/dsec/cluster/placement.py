"""Where creations go: pure placement over what the nodes last reported (``GET /v1/node``), no I/O.

A node admits a creation while the sum of admitted requests stays within its allocatable figures
(capacity x oversubscription ratio), per resource, and queues or refuses the rest. The gateway mirrors
that from the nodes' last status, a second old at most: it tries first the nodes the demand fits, with
empty admission queues first, leaving the largest share of the node free first (which spreads a burst
instead of filling one node). The node's own admission stays the authority: a node that refuses is
skipped for the next candidate, and the figures here are only a forecast.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ..protocol.node import NodeStatus
from ..protocol.sandbox import Limits

EPSILON = 1e-9  # CPU figures are sums of floats: 0.1 x 3 must fit in 0.3


@dataclass(frozen=True)
class Demand:
    """What admission counts of one creation: the CPU request (cores) and the memory request (bytes)."""

    cpu: float
    memory: int

    @classmethod
    def of(cls, limits: Limits) -> Demand:
        return cls(cpu=limits.cpu, memory=limits.mem_request())


@dataclass
class NodeView:
    """One node as placement sees it. ``free_*`` may go negative while reservations outrun a status."""

    name: str
    healthy: bool
    free_cpu: float
    free_memory: int
    allocatable_cpu: float
    allocatable_memory: int
    queued: int = 0

    @classmethod
    def of(cls, status: NodeStatus, *, healthy: bool = True, name: str | None = None) -> NodeView:
        return cls(
            name=name or status.node,
            healthy=healthy,
            free_cpu=status.free.cpu,
            free_memory=status.free.memory,
            allocatable_cpu=status.allocatable.cpu,
            allocatable_memory=status.allocatable.memory,
            queued=status.queued,
        )

    def fits(self, d: Demand) -> bool:
        return self.healthy and self.free_cpu + EPSILON >= d.cpu and self.free_memory >= d.memory

    def share_left(self, d: Demand) -> float:
        """The smaller of the CPU and memory shares of the node still free once ``d`` is placed."""
        cpu = (self.free_cpu - d.cpu) / self.allocatable_cpu if self.allocatable_cpu > 0 else -1.0
        mem = (self.free_memory - d.memory) / self.allocatable_memory if self.allocatable_memory > 0 else -1.0
        return min(cpu, mem)

    def reserve(self, d: Demand, count: int = 1) -> None:
        """Count ``count`` creations as admitted until the next status says what really happened."""
        self.free_cpu -= d.cpu * count
        self.free_memory -= d.memory * count

    def release(self, d: Demand) -> None:
        self.free_cpu += d.cpu
        self.free_memory += d.memory

    def refused(self) -> None:
        """The node answered 429: treat it as full until its next status."""
        self.free_cpu = min(self.free_cpu, 0.0)
        self.free_memory = min(self.free_memory, 0)


def _key(n: NodeView, d: Demand) -> tuple[bool, bool, float, str]:
    return (not n.fits(d), n.queued > 0, -n.share_left(d), n.name)


def candidates(nodes: Iterable[NodeView], d: Demand) -> list[str]:
    """Healthy nodes in the order to try: the demand fits first (empty queues before queues, the most
    free share left after placing first), then those it does not fit (their admission queues or refuses)."""
    return [n.name for n in sorted((n for n in nodes if n.healthy), key=lambda n: _key(n, d))]


def pick(nodes: Iterable[NodeView], d: Demand) -> str | None:
    """The best node the demand fits, or None."""
    fitting = [n for n in nodes if n.fits(d)]
    return min(fitting, key=lambda n: _key(n, d)).name if fitting else None


def split(nodes: Sequence[NodeView], d: Demand, count: int) -> dict[str, int]:
    """How many of ``count`` alike creations go to each healthy node: one at a time to the best node
    they fit, as if admitted there; what fits nowhere is spread over the healthy nodes in proportion to
    their allocatable CPU, so each node's queue decides (wait or 429). The views are not changed."""
    views = [replace(n) for n in nodes if n.healthy]
    out: dict[str, int] = {}
    if not views or count <= 0:
        return out
    heap = [(_key(n, d), i) for i, n in enumerate(views)]
    heapq.heapify(heap)
    placed = 0
    while placed < count and heap:
        _, i = heapq.heappop(heap)
        n = views[i]
        if not n.fits(d):
            break  # the key puts fitting nodes first: nothing else fits either
        n.reserve(d)
        out[n.name] = out.get(n.name, 0) + 1
        placed += 1
        heapq.heappush(heap, (_key(n, d), i))
    for name, extra in _proportional(views, count - placed).items():
        out[name] = out.get(name, 0) + extra
    return {name: k for name, k in out.items() if k}


def _proportional(views: Sequence[NodeView], count: int) -> dict[str, int]:
    """``count`` spread by allocatable CPU (largest remainders; evenly when no node reports any)."""
    if count <= 0:
        return {}
    weights = [max(v.allocatable_cpu, 0.0) for v in views]
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(views), float(len(views))
    exact = [count * w / total for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(views)), key=lambda i: (-(exact[i] - shares[i]), views[i].name))
    for i in by_remainder[: count - sum(shares)]:
        shares[i] += 1
    return {v.name: s for v, s in zip(views, shares, strict=True) if s}


def chunks(items: Sequence[int], counts: dict[str, int]) -> dict[str, list[int]]:
    """Consecutive runs of ``items`` of the sizes ``counts`` gives, in the order of ``counts``."""
    out: dict[str, list[int]] = {}
    start = 0
    for name, k in counts.items():
        out[name] = list(items[start : start + k])
        start += k
    return out
