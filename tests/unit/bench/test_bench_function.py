"""The function bench's pure parts: call checks, throughput entries, ratios and targets, the exit status."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from typing import Any

import pytest

from dsec_bench import function as fb
from dsec_bench.common import summarize


def entry(c: int, rate: float | None, failures: dict[str, int] | None = None, mode: str = "tasks") -> dict[str, Any]:
    # wall chosen so that rate_entry computes ``rate`` back from 100 calls
    return fb.rate_entry(c, 100, Counter(failures or {}), 100 / rate if rate else 0.0, mode, {"daemon": 0.5})


def latency(p50s: dict[str, dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system, workloads in p50s.items():
        out[system] = {w: summarize([v / 1000.0] * 3) for w, v in workloads.items()}
    return out


def throughput(fn: list[float], ct: list[float], host: list[float], batch: list[float] | None = None) -> dict[str, Any]:
    def col(rates: list[float], mode: str = "tasks") -> list[dict[str, Any]]:
        return [entry(c, r, mode=mode) for c, r in zip(fb.CONCURRENCY, rates, strict=True)]

    return {
        "function": {"tasks": col(fn), "run_many": col(batch or fn, "run_many")},
        "container": {"tasks": col(ct)},
        "host": {"tasks": col(host)},
    }


def test_check_wants_exit_zero_and_the_expected_output() -> None:
    assert fb.check("shell", 0, "") is None
    assert fb.check("python", 0, "1\n") is None
    assert fb.check("python", 0, "2\n") == "unexpected output"
    assert fb.check("shell", 1, "") == "exit 1"
    assert fb.check("shell", None, "") == "exit None"  # killed by its timeout: no exit code


def test_rate_entry_counts_only_successes_and_cpu_per_call() -> None:
    e = fb.rate_entry(8, 200, Counter({"exit 1": 2, "quota_exceeded": 8}), 2.0, "tasks", {"daemon": 1.0, "bench": 0.2})
    assert e["ok"] == 190
    assert e["calls_per_s"] == 95.0
    assert e["failures"] == {"exit 1": 2, "quota_exceeded": 8}
    assert e["cpu_ms_per_call"] == {"daemon": 5.0, "bench": 1.0}
    assert fb.rate_entry(1, 10, Counter(), 0.0, "tasks", {})["calls_per_s"] is None


def test_rates_skip_errors_and_measurements_with_failed_calls() -> None:
    entries = [entry(1, 100.0), entry(8, 300.0, {"exit 1": 1}), {"concurrency": 64, "error": "RuntimeError: x"}]
    assert fb.rates(entries) == {1: 100.0}
    assert fb.rates({"error": "x"}) == {}


def test_judge_meets_every_target() -> None:
    lat = latency({"function": {"shell": 4.0, "python": 9.0}, "container": {"shell": 80.0, "python": 120.0}})
    lat["host"] = latency({"host": {"shell": 1.0, "python": 8.0}})["host"]
    tp = throughput(fn=[200.0, 550.0, 600.0], ct=[10.0, 40.0, 50.0], host=[800.0, 1600.0, 1500.0])
    ratios, targets = fb.judge(lat, tp)
    assert ratios["function_tasks_over_container_calls_per_s"] == {"1": 20.0, "8": 13.75, "64": 12.0}
    assert ratios["host_over_function_tasks_calls_per_s"]["8"] == pytest.approx(2.91, abs=0.01)
    assert ratios["function_p50_over_host_p50"] == {"shell": 4.0, "python": 1.12}
    assert ratios["container_p50_over_function_p50"] == {"shell": 20.0, "python": 13.33}
    assert {k: t["met"] for k, t in targets.items()} == {
        "shell_p50_le_5ms": True,
        "python_p50_le_10ms": True,
        "calls_per_s_ge_500": True,
        "ge_10x_fresh_container": True,
    }
    assert targets["calls_per_s_ge_500"]["value"] == 600.0
    assert targets["calls_per_s_ge_500"]["concurrency"] == 64
    assert targets["ge_10x_fresh_container"]["value"] == 12.0  # best vs best: 600 / 50
    assert "interpreter start-up included" in targets["python_p50_le_10ms"]["target"]


def test_judge_misses_and_unknowns() -> None:
    lat = latency({"function": {"shell": 10.7, "python": 44.0}, "host": {"shell": 1.3, "python": 16.0}})
    lat["container"] = {"shell": {"concurrency": 1, "error": "DsecError: no"}, "python": {"error": "no"}}
    tp = throughput(fn=[86.0, 88.0, 62.0], ct=[17.0, 37.0, 16.0], host=[548.0, 747.0, 360.0])
    tp["container"]["tasks"] = [{"concurrency": c, "error": "x"} for c in fb.CONCURRENCY]
    ratios, targets = fb.judge(lat, tp)
    assert targets["shell_p50_le_5ms"] == {"target": targets["shell_p50_le_5ms"]["target"], "value": 10.7, "met": False}
    assert targets["python_p50_le_10ms"]["met"] is False
    assert targets["calls_per_s_ge_500"]["met"] is False
    assert targets["calls_per_s_ge_500"]["concurrency"] == 8
    # the fresh containers failed: the comparison is unknown, not missed
    assert targets["ge_10x_fresh_container"] == targets["ge_10x_fresh_container"] | {"value": None, "met": None}
    assert ratios["container_p50_over_function_p50"] == {"shell": None, "python": None}
    assert ratios["function_tasks_over_container_calls_per_s"] == {"1": None, "8": None, "64": None}


def test_failed_counts_failed_calls_and_failed_measurements() -> None:
    lat = latency({"function": {"shell": 5.0, "python": 9.0}, "container": {}, "host": {}})
    tp = throughput(fn=[1.0, 1.0, 1.0], ct=[1.0, 1.0, 1.0], host=[1.0, 1.0, 1.0])
    assert fb.failed(lat, tp) == 0
    tp["function"]["tasks"][2] = entry(64, 5.0, {"quota_exceeded": 3})
    tp["container"]["tasks"][0] = {"concurrency": 1, "error": "x"}
    lat["host"]["python"] = {"concurrency": 1, "error": "RuntimeError: host python latency: a call failed"}
    assert fb.failed(lat, tp) == 5


def test_cpu_now_reads_this_process() -> None:
    cpu = fb.cpu_now({"me": os.getpid()})
    assert set(cpu) == {"me"} and cpu["me"] > 0


def test_host_call_runs_the_bare_workloads() -> None:
    # the lower bound of the bench: no daemon, no sandbox
    assert asyncio.run(fb.host_call("shell")) is None
    if os.path.exists(fb.HOST_PYTHON):
        assert asyncio.run(fb.host_call("python")) is None


def test_the_json_names_the_python_start_up_choice() -> None:
    assert "per call" in fb.PYTHON_STARTUP and "no pre-started interpreter" in fb.PYTHON_STARTUP
    json.dumps(fb.WORKLOADS)  # goes into the JSON as is
    assert fb.TARGETS == {"shell_p50_ms": 5.0, "python_p50_ms": 10.0, "calls_per_s": 500.0, "over_container": 10.0}
