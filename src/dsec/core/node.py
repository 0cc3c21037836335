"""A node's status: capacity, what is admitted and queued, what sandboxes use (GET /v1/node)."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from ..protocol.node import NodeStatus, Resources, SandboxUsage
from ..protocol.sandbox import State
from ..protocol.version import __version__
from ..tenancy import ADMIN, Caller

if TYPE_CHECKING:
    from .manager import SandboxManager


def node_status(mgr: SandboxManager, caller: Caller, top: int = 0) -> NodeStatus:
    adm = mgr.admission
    live = mgr.sandboxes.live()
    counts: dict[str, dict[str, int]] = {}
    for (kind, state), n in sorted(Counter((r.kind, r.state.value) for r in live).items()):
        counts.setdefault(kind, {})[state] = n
    # per tenant: the operator sees every tenant's count, a tenant its own (pooled ones are nobody's yet)
    owners = Counter(r.owner or ADMIN for r in live if r.pool is None and caller.owns(r.owner))
    cpu_used, mem_used = mgr.usage.used()
    now = time.time()
    usage = []
    if top > 0:
        for rec in live:
            if not caller.owns(rec.owner) or rec.pool is not None:  # pooled ones: in warm_pools
                continue
            u = mgr.usage.usage.get(rec.id)
            usage.append(
                SandboxUsage(
                    id=rec.id,
                    kind=rec.kind,
                    owner=rec.owner,
                    state=rec.state.value,
                    cpu_request=rec.limits.cpu,
                    cpu_used=round(u.cpu_used, 4) if u else 0.0,
                    memory_request=rec.limits.mem_request(),
                    memory_limit=rec.limits.memory,
                    memory_used=u.memory if u else 0,
                    age_s=round(now - rec.created_at, 1),
                )
            )
        usage.sort(key=lambda s: (s.cpu_used, s.memory_used), reverse=True)
    ratios = [u.cpu_used / r.limits.cpu for r in live if (u := mgr.usage.usage.get(r.id)) is not None]
    return NodeStatus(
        node=mgr.node_name,
        version=__version__,
        kinds=sorted(mgr.backends),
        unavailable=dict(sorted(mgr.unavailable.items())),
        capacity=adm.capacity,
        ratios=adm.ratios,
        allocatable=adm.allocatable,
        requested=adm.requested,
        free=adm.free,
        used=Resources(cpu=round(cpu_used, 4), memory=mem_used),
        sandboxes=counts,
        owners=dict(sorted(owners.items())),
        queued=adm.queued,
        queues=adm.queues(),
        starting=dict(Counter(r.kind for r in live if r.state == State.creating)),
        start_slots={k: b.start_bound() or mgr.max_concurrent_creates for k, b in mgr.backends.items()},
        memory_pressure=round(mgr.usage.pressure, 4),
        evictions=mgr.usage.evictions,
        cpu_use_le_5pct=round(sum(1 for x in ratios if x <= 0.05) / len(ratios), 4) if ratios else None,
        top=usage[:top],
        e2b_url=mgr.e2b_url,
        warm_pools=mgr.warm_pools(caller=caller),
        checkpoints={k: b.checkpoint_support() for k, b in sorted(mgr.backends.items())},
    )
