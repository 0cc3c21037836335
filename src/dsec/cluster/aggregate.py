"""Cluster-wide answers made of the nodes' own: the summed node status, merged lists, merged metrics."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..protocol.node import HistoryBucket, NodeHistory, NodeStatus, Ratios, Resources, SandboxUsage, TenantQueue
from ..protocol.sandbox import SandboxInfo
from ..protocol.version import __version__


def _sum(parts: Iterable[Resources]) -> Resources:
    cpu, memory = 0.0, 0
    for r in parts:
        cpu += r.cpu
        memory += r.memory
    return Resources(cpu=round(cpu, 6), memory=memory)


def _add_counts(into: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def node_total(name: str, statuses: Sequence[NodeStatus], top: int = 0) -> NodeStatus:
    """One NodeStatus for the cluster: sums of the nodes' figures. The ratios are the effective ones
    (allocatable / capacity); memory pressure is the worst node's, as that is where evictions start."""
    capacity = _sum(s.capacity for s in statuses)
    allocatable = _sum(s.allocatable for s in statuses)
    sandboxes: dict[str, dict[str, int]] = {}
    owners: dict[str, int] = {}
    starting: dict[str, int] = {}
    slots: dict[str, int] = {}
    queues: dict[str, TenantQueue] = {}
    for s in statuses:
        for kind, states in s.sandboxes.items():
            _add_counts(sandboxes.setdefault(kind, {}), states)
        _add_counts(owners, s.owners)
        _add_counts(starting, s.starting)
        _add_counts(slots, s.start_slots)
        for q in s.queues:
            seen = queues.get(q.tenant)
            queues[q.tenant] = (
                q
                if seen is None
                else TenantQueue(
                    tenant=q.tenant, waiting=seen.waiting + q.waiting, oldest_s=max(seen.oldest_s, q.oldest_s)
                )
            )
    used: list[SandboxUsage] = sorted((u for s in statuses for u in s.top), key=lambda u: -u.cpu_used)
    kinds = sorted({k for s in statuses for k in s.kinds})
    missing = {k: why for s in statuses for k, why in s.unavailable.items() if k not in kinds}
    return NodeStatus(
        node=name,
        version=__version__,
        kinds=kinds,
        unavailable=dict(sorted(missing.items())),
        capacity=capacity,
        ratios=Ratios(
            cpu=round(allocatable.cpu / capacity.cpu, 6) if capacity.cpu else 0.0,
            memory=round(allocatable.memory / capacity.memory, 6) if capacity.memory else 0.0,
        ),
        allocatable=allocatable,
        requested=_sum(s.requested for s in statuses),
        free=_sum(s.free for s in statuses),
        used=_sum(s.used for s in statuses),
        sandboxes=sandboxes,
        owners=dict(sorted(owners.items())),
        queued=sum(s.queued for s in statuses),
        queues=sorted(queues.values(), key=lambda q: q.tenant),
        starting=starting,
        start_slots=slots,
        memory_pressure=max((s.memory_pressure for s in statuses), default=0.0),
        evictions=sum(s.evictions for s in statuses),
        top=used[:top] if top > 0 else [],
        checkpoints={k: v for s in reversed(statuses) for k, v in s.checkpoints.items()},
    )


def by_creation(infos: Iterable[SandboxInfo]) -> list[SandboxInfo]:
    """A merged sandbox list in the order a node lists its own (oldest first), ids breaking ties."""
    return sorted(infos, key=lambda i: (i.created_at, i.id))


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def merge_metrics(texts: Sequence[tuple[str, str]]) -> str:
    """Prometheus text from several nodes as one: every sample gains a ``node`` label, and each metric
    family is written once (its HELP and TYPE, then every node's samples), as the format requires."""
    families: dict[str, list[str]] = {}  # family -> its HELP/TYPE lines, then samples
    order: list[str] = []
    for node, text in texts:
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(maxsplit=3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    if family not in families:
                        families[family] = []
                        order.append(family)
                    if not any(x.startswith(f"# {parts[1]} {family} ") or x == line for x in families[family]):
                        families[family].insert(sum(1 for x in families[family] if x.startswith("#")), line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, rest = m.group(1), m.group(2), m.group(3)
            if not family or not name.startswith(family):
                family = name
                if family not in families:
                    families[family] = []
                    order.append(family)
            inner = labels[1:-1] if labels else ""
            if re.search(r'(^|,)\s*node="', inner):  # the node named itself already
                families[family].append(line)
                continue
            tag = f'node="{_label(node)}"'
            families[family].append(f"{name}{{{tag + (',' + inner if inner else '')}}}{rest}")
    return "".join(line + "\n" for family in order for line in families[family])


def history_total(histories: Sequence[NodeHistory]) -> NodeHistory:
    """The nodes' last hours added minute by minute (their buckets start on the same wall-clock minutes)."""
    created: dict[int, dict[str, int]] = {}
    failed: dict[int, dict[str, int]] = {}
    for h in histories:
        for b in h.buckets:
            _add_counts(created.setdefault(b.at, {}), b.created)
            _add_counts(failed.setdefault(b.at, {}), b.failed)
    buckets = [HistoryBucket(at=at, created=created[at], failed=failed[at]) for at in sorted(created)]
    return NodeHistory(step_s=histories[0].step_s if histories else 60, buckets=buckets[-60:])
