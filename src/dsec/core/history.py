"""The last hour of creations, minute by minute: how many sandboxes each kind gave and why creations
failed, per owner, so the console can chart a node's (or a tenant's) rate without a metrics server."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable

from ..protocol.node import HistoryBucket, NodeHistory
from ..tenancy import Caller

STEP_S = 60
KEPT = 60  # buckets: one hour


class CreationHistory:
    def __init__(self, step_s: int = STEP_S, kept: int = KEPT, clock: Callable[[], float] = time.time) -> None:
        self.step_s, self.kept, self.clock = step_s, kept, clock
        # (bucket start, counts keyed by (owner, "created" | "failed", kind or reason)), oldest first
        self._buckets: deque[tuple[int, Counter[tuple[str | None, str, str]]]] = deque(maxlen=kept)

    def _now_bucket(self) -> Counter[tuple[str | None, str, str]]:
        start = int(self.clock()) // self.step_s * self.step_s
        if not self._buckets or self._buckets[-1][0] != start:
            self._buckets.append((start, Counter()))
        return self._buckets[-1][1]

    def created(self, kind: str, owner: str | None) -> None:
        self._now_bucket()[(owner, "created", kind)] += 1

    def failed(self, reason: str, owner: str | None) -> None:
        self._now_bucket()[(owner, "failed", reason)] += 1

    def view(self, caller: Caller) -> NodeHistory:
        """Every minute of the last hour, oldest first (empty minutes too, so a chart's axis is even);
        a tenant's own creations only."""
        now = int(self.clock()) // self.step_s * self.step_s
        kept = {start: counts for start, counts in self._buckets}
        buckets = []
        for start in range(now - (self.kept - 1) * self.step_s, now + 1, self.step_s):
            created: Counter[str] = Counter()
            failed: Counter[str] = Counter()
            for (owner, outcome, what), n in kept.get(start, Counter()).items():
                if caller.operator or owner == caller.tenant:
                    (created if outcome == "created" else failed)[what] += n
            buckets.append(HistoryBucket(at=start, created=dict(created), failed=dict(failed)))
        return NodeHistory(step_s=self.step_s, buckets=buckets)
