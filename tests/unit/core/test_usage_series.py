"""The usage series each sandbox keeps (what E2B's metrics with a time range answer from)."""

from __future__ import annotations

import pytest

from dsec.core import usage
from dsec.core.manager import SandboxManager
from dsec.core.usage import Usage

from ...fakes.backend import FakeBackend


def test_samples_are_kept_per_sandbox_bounded_and_asked_by_range(
    fresh: tuple[SandboxManager, FakeBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr, _ = fresh
    monitor = mgr.usage
    clock = [1000.0]
    monkeypatch.setattr(usage.time, "time", lambda: clock[0])
    monkeypatch.setattr(usage, "HISTORY", 3)
    for i in range(5):
        clock[0] = 1000.0 + 2 * i
        monitor._record({"sb-a": Usage(i, 100 * i, 0.0, cpu_used=0.5 * i), "sb-b": Usage(0, 7, 0.0)})
    series = monitor.series("sb-a")
    assert [s.at for s in series] == [1004.0, 1006.0, 1008.0]  # the last HISTORY samples, oldest first
    assert [(s.cpu_used, s.memory) for s in series] == [(1.0, 200), (1.5, 300), (2.0, 400)]
    assert [s.at for s in monitor.series("sb-a", 1005.0, 1008.0)] == [1006.0, 1008.0]
    assert [s.at for s in monitor.series("sb-a", None, 1004.0)] == [1004.0]
    assert monitor.series("sb-a", 900.0, 950.0) == []
    assert monitor.series("sb-nope") == []
    clock[0] = 1010.0
    monitor._record({"sb-b": Usage(0, 8, 0.0)})  # sb-a is no longer sampled: its series goes
    assert monitor.series("sb-a") == [] and len(monitor.series("sb-b")) == 3
