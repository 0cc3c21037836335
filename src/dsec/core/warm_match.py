"""What makes a creation match a warm pool, and a pool's own bookkeeping (no I/O: core/warm.py acts).

A creation is served from a pool only when it asks for what the pool's sandboxes already are: the same
tenant, kind, limits and network policy (``Shape``), and an image that resolves to the version the
pool's sandboxes run. What a pooled sandbox can take on when it is handed out (its labels, environment,
time to live) is not part of the match; what it cannot (named volumes, a trajectory) keeps a creation
away from pools altogether.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from ..images.store import ImageRef
from ..protocol import network as policy
from ..protocol.network import NetworkSpec
from ..protocol.pools import WarmPoolInfo, WarmPoolSpec
from ..protocol.sandbox import CreateSandbox, Limits
from ..tenancy import ADMIN


class Shape(NamedTuple):
    tenant: str
    kind: str
    limits: str  # the validated limits as canonical JSON: '512Mi' and 536870912 are one
    network: str


def shape_of(tenant: str, kind: str, limits: Limits, network: NetworkSpec) -> Shape:
    return Shape(tenant, kind, limits.model_dump_json(), json.dumps(policy.to_json(network), sort_keys=True))


def servable(req: CreateSandbox) -> bool:
    """Whether a pooled sandbox could be this creation at all: one with named volumes or bound to a
    trajectory is always made for itself."""
    return not req.volumes and not req.trajectory


@dataclass
class Stats:
    claims: int = 0
    misses: int = 0
    refills: int = 0
    drained: int = 0
    reclaimed: int = 0
    failures: int = 0


@dataclass
class WarmPool:
    name: str
    spec: WarmPoolSpec
    image: ImageRef | None = None  # the version it fills with now (None until resolved)
    idle: deque[str] = field(default_factory=deque)  # ready members' ids, oldest first
    filling: int = 0
    stats: Stats = field(default_factory=Stats)
    waiting: str | None = None
    retry_at: float = 0.0  # monotonic: no refill before (after a failure)
    failed_in_row: int = 0

    @property
    def tenant(self) -> str:
        return self.spec.tenant or ADMIN

    @property
    def shape(self) -> Shape:
        s = self.spec
        return shape_of(self.tenant, s.kind, s.limits, s.network)

    def serves(self, image: ImageRef) -> bool:
        """Asked for by a creation on ``image``: the same name, or the version the pool runs."""
        return self.image is not None and (self.image.name == image.name or self.image.digest == image.digest)

    def wanted(self) -> int:
        """Members to start making now."""
        return max(0, self.spec.size - len(self.idle) - self.filling)

    def info(self) -> WarmPoolInfo:
        st = self.stats
        return WarmPoolInfo(
            name=self.name,
            spec=self.spec,
            version=self.image.digest if self.image is not None else None,
            idle=len(self.idle),
            filling=self.filling,
            claims=st.claims,
            misses=st.misses,
            refills=st.refills,
            drained=st.drained,
            reclaimed=st.reclaimed,
            failures=st.failures,
            waiting=self.waiting,
        )


def backoff(failed_in_row: int) -> float:
    """Seconds before a pool whose refills keep failing tries again: 1, 2, 4 ... at most 60."""
    return float(min(60, 2 ** max(0, failed_in_row - 1)))
