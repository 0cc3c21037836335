"""What sandboxes use, sampled from their cgroups, and eviction under memory pressure.

Every few seconds the monitor reads each live sandbox's cgroup: CPU time (turned into cores used over
the interval, set against the cores it requested) and memory charged. From the same figures it judges
memory pressure: the larger of the host's share of memory in use and the sandboxes' memory against the
node's memory capacity. At or above ``evict_at`` it evicts one sandbox per pass, the one furthest
above its memory request (the kubelet's order: requests are what admission promised, use beyond them
is what gets taken back first); a sandbox within its request is evicted only when none is above, the
largest first. Evicted sandboxes end ``failed`` with a reason that says so and by how much.

Before it comes to that, the kernel throttles: each container's memory.high (cgroup v2) sits below its
limit, and on v1 its soft limit is its request, which global reclaim pushes it back to first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..isolation import cgroups
from ..protocol.sandbox import State
from .admission import format_size
from .sandboxes import Sandboxes

log = logging.getLogger("dsec.usage")

SAMPLE_S = 2.0
DEFAULT_EVICT_AT = 0.95
HISTORY = 300  # samples kept per sandbox (10 minutes at SAMPLE_S): the series E2B's metrics answer from


@dataclass(slots=True)
class Usage:
    cpu_ns: int
    memory: int
    at: float
    cpu_used: float = 0.0  # cores, over the last interval


@dataclass(frozen=True, slots=True)
class Sample:
    """One point of a sandbox's usage series, at a wall-clock time (what callers ask ranges of)."""

    at: float
    cpu_used: float
    memory: int


class _Series:
    """One sandbox's last samples in a ring of flat arrays: at thousands of sandboxes, a deque of sample
    objects would be hundreds of thousands of objects for the garbage collector to walk."""

    __slots__ = ("at", "cpu", "memory", "next", "size")

    def __init__(self, size: int) -> None:
        self.at = array("d", bytes(8 * size))
        self.cpu = array("d", bytes(8 * size))
        self.memory = array("q", bytes(8 * size))
        self.next = 0  # where the next sample goes
        self.size = 0  # how many are kept

    def append(self, at: float, cpu: float, memory: int) -> None:
        i = self.next
        self.at[i], self.cpu[i], self.memory[i] = at, cpu, memory
        self.next = (i + 1) % len(self.at)
        self.size = min(self.size + 1, len(self.at))

    def between(self, start: float | None, end: float | None) -> list[Sample]:
        first = (self.next - self.size) % len(self.at)
        kept = ((first + k) % len(self.at) for k in range(self.size))
        return [
            Sample(self.at[i], self.cpu[i], self.memory[i])
            for i in kept
            if (start is None or self.at[i] >= start) and (end is None or self.at[i] <= end)
        ]


def host_pressure() -> float:
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                fields[key] = int(rest.split()[0])
    total = fields.get("MemTotal", 0)
    return 1.0 - fields.get("MemAvailable", total) / total if total else 0.0


class UsageMonitor:
    def __init__(
        self,
        sandboxes: Sandboxes,
        evict: Callable[[str, str], Awaitable[None]],
        evict_at: float = DEFAULT_EVICT_AT,
    ) -> None:
        self.sandboxes = sandboxes
        self.evict = evict  # sandbox id, why
        self.evict_at = evict_at
        self.usage: dict[str, Usage] = {}
        self.history: dict[str, _Series] = {}  # sandbox id -> its last HISTORY samples
        self.pressure = 0.0
        self.evictions = 0
        self.on_sample: Callable[[str, float], None] | None = None  # kind, cpu used / requested
        self._layout: cgroups.CgroupLayout | None = None

    def _read(self, paths: dict[str, str]) -> dict[str, tuple[int, int]]:
        if self._layout is None:
            self._layout = cgroups.detect()
        out = {}
        for sid, path in paths.items():
            got = self._layout.usage(path)
            if got is not None:
                out[sid] = got
        return out

    async def sample(self) -> None:
        paths: dict[str, str] = {}
        for rec in self.sandboxes.live():
            backend = self.sandboxes.backends.get(rec.kind)
            if backend is None or rec.state not in (State.running, State.paused):
                continue
            path = backend.cgroup(rec)
            if path is not None:
                paths[rec.id] = path
        if not paths:
            self.usage.clear()
            self.history.clear()
            self.pressure = await asyncio.to_thread(host_pressure)
            return
        read = await asyncio.to_thread(self._read, paths)
        now = time.monotonic()
        fresh: dict[str, Usage] = {}
        for sid, (cpu_ns, mem) in read.items():
            last = self.usage.get(sid)
            u = Usage(cpu_ns, mem, now)
            if last is not None and now > last.at and cpu_ns >= last.cpu_ns:
                u.cpu_used = (cpu_ns - last.cpu_ns) / 1e9 / (now - last.at)
                owner = self.sandboxes.find_live(sid)
                if owner is not None and self.on_sample is not None:
                    self.on_sample(owner.kind, u.cpu_used / owner.limits.cpu)
            fresh[sid] = u
        self.usage = fresh
        self._record(fresh)
        sandboxes = sum(u.memory for u in fresh.values()) / max(1, self.sandboxes.admission.capacity.memory)
        self.pressure = max(await asyncio.to_thread(host_pressure), sandboxes)

    def _record(self, fresh: dict[str, Usage]) -> None:
        """Append this pass to each sandbox's series; the series of sandboxes no longer sampled go."""
        wall = time.time()
        for sid in [s for s in self.history if s not in fresh]:
            del self.history[sid]
        for sid, u in fresh.items():
            series = self.history.get(sid)
            if series is None:
                series = self.history[sid] = _Series(HISTORY)
            series.append(wall, u.cpu_used, u.memory)

    def series(self, sandbox_id: str, start: float | None = None, end: float | None = None) -> list[Sample]:
        """The sandbox's kept samples taken within [start, end] (wall-clock seconds; None: unbounded),
        oldest first."""
        series = self.history.get(sandbox_id)
        return series.between(start, end) if series is not None else []

    def used(self) -> tuple[float, int]:
        return sum(u.cpu_used for u in self.usage.values()), sum(u.memory for u in self.usage.values())

    def victim(self) -> tuple[str, str] | None:
        """The sandbox to evict and why, or None."""
        best: tuple[int, int, str] | None = None
        for sid, u in self.usage.items():
            rec = self.sandboxes.find_live(sid)
            if rec is None or rec.state != State.running:
                continue
            over = u.memory - rec.limits.mem_request()
            rank = (1 if over > 0 else 0, over if over > 0 else u.memory)
            if best is None or rank > best[:2]:
                best = (rank[0], rank[1], sid)
        if best is None:
            return None
        sid = best[2]
        rec = self.sandboxes.find_live(sid)
        assert rec is not None  # found just above, with no await in between
        used = self.usage[sid].memory
        return sid, (
            f"evicted under memory pressure ({self.pressure:.0%} of the node's memory in use): it used "
            f"{format_size(used)} against a request of {format_size(rec.limits.mem_request())}"
        )

    async def pass_once(self) -> None:
        await self.sample()
        if self.pressure < self.evict_at:
            return
        chosen = self.victim()
        if chosen is None:
            return
        sid, reason = chosen
        log.warning("sandbox %s %s", sid, reason)
        self.evictions += 1
        self.usage.pop(sid, None)
        await self.evict(sid, reason)

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_S)
            try:
                await self.pass_once()
            except Exception:  # the monitor must survive whatever one sandbox's cgroup does
                log.exception("usage pass failed")
