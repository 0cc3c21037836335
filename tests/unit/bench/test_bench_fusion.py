"""The SandboxFusion bench's pure parts: a peer's call and its check, a throughput measurement, the
comparison of dsec against each peer, and what makes the exit status 1."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from dsec_bench import fusion as fb
from dsec_bench.common import summarize
from dsec_bench.function import rate_entry


def entries(rates: list[float | None], failures: dict[str, int] | None = None) -> list[dict[str, Any]]:
    out = []
    for c, rate in zip(fb.CONCURRENCY, rates, strict=True):
        if rate is None:
            out.append({"concurrency": c, "error": "RuntimeError: boom"})
        else:
            out.append(rate_entry(c, 100, Counter(failures or {}), 100 / rate, "threads", {"daemon": 0.1}))
    return out


def test_a_peer_call_checks_exit_status_and_output(tmp_path: Path) -> None:
    assert fb.command_call(lambda: ["printf", "1\\n"], tmp_path)() is None
    assert fb.command_call(lambda: ["printf", "2\\n"], tmp_path)() == "unexpected output"
    assert fb.command_call(lambda: ["sh", "-c", "echo nope; exit 3"], tmp_path)() == "exit 3: nope\n"
    assert fb.command_call(lambda: ["/nonexistent/program"], tmp_path)() == "FileNotFoundError"
    assert list(tmp_path.iterdir()) == []  # each call's output file is removed


def test_sustained_counts_calls_and_failures() -> None:
    made: list[int] = []

    def call() -> str | None:
        made.append(1)
        return "exit 1: no" if len(made) % 4 == 0 else None

    e = fb.sustained(Console(quiet=True), "t", call, 40, 8, {"bench": os.getpid()})
    assert len(made) == 8 + 40  # an untimed round of the same load first
    assert e["calls"] == 40 and e["ok"] == 30 and e["failures"] == {"exit 1": 10} and e["concurrency"] == 8
    assert e["calls_per_s"] > 0 and set(e["cpu_ms_per_call"]) == {"bench"}


def test_comparison_is_per_concurrency_and_best_against_best() -> None:
    lat = {"fusion": summarize([0.02] * 3), "podman": summarize([0.4] * 3), "crun": summarize([0.08] * 3)}
    tp = {"fusion": entries([40, 120, 100]), "podman": entries([2, 5, None]), "crun": entries([10, 30, 40])}
    out = fb.compare(lat, tp)
    assert out["podman"]["fusion_over_peer_calls_per_s"] == {"1": 20.0, "8": 24.0, "32": None}
    assert out["podman"]["best_fusion_over_best_peer_calls_per_s"] == 24.0
    assert out["podman"]["peer_p50_over_fusion_p50"] == 20.0
    assert out["crun"]["best_fusion_over_best_peer_calls_per_s"] == 3.0
    assert "crun" not in fb.compare(lat, {k: v for k, v in tp.items() if k != "crun"})


def test_a_measurement_with_failed_calls_counts_for_nothing_and_fails_the_run() -> None:
    lat = {"fusion": summarize([0.02] * 3)}
    tp = {"fusion": entries([40, 120, 100], {"status Failed": 2}), "crun": entries([10, 30, 40])}
    assert fb.rates(tp["fusion"]) == {}
    assert fb.failed(lat, tp) == 6
    assert fb.failed(lat, {"crun": entries([10, 30, 40])}) == 0
    assert fb.failed({"fusion": {"error": "RuntimeError: x"}}, {"crun": entries([10, None, 40])}) == 2


def test_the_peers_start_only_from_the_daemons_mounted_layers(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not mounted"), fb.merged_rootfs([tmp_path], tmp_path):
        pass


def test_latencies_take_the_systems_in_turn_and_drop_one_that_fails() -> None:
    order: list[str] = []

    def call(name: str, fail_at: int | None = None) -> fb.Call:
        def one() -> str | None:
            order.append(name)
            return "exit 1: no" if fail_at is not None and order.count(name) == fail_at else None

        return one

    systems = {"fusion": call("fusion"), "podman": call("podman"), "crun": call("crun", fail_at=fb.WARMUP + 3)}
    out = fb.latencies(Console(quiet=True), systems, 40, 100)
    timed = order[3 * fb.WARMUP :]
    assert timed[:6] == ["fusion", "podman", "crun", "podman", "crun", "fusion"]  # the order rotates
    assert out["fusion"]["n"] == 40 and out["podman"]["n"] == fb.PODMAN_N  # podman: fewer samples
    assert out["crun"] == {"error": "a call failed: exit 1: no"}


def test_podman_gets_fewer_samples_than_the_others() -> None:
    assert fb.samples("fusion", 200, 400, 32) == (200, 400) == fb.samples("crun", 200, 400, 32)
    assert fb.samples("podman", 200, 400, 1) == (fb.PODMAN_N, fb.PODMAN_MIN_CALLS)
    assert fb.samples("podman", 200, 400, 32) == (fb.PODMAN_N, 64)
    assert fb.samples("podman", 3, 4, 32) == (3, 4)
