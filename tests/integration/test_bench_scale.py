"""The scale benches, small, each against a real daemon it starts through the CLI: `dsec bench density`
(held, until full), `dsec bench burst` and its overload mode. Checks the JSON's shape, the plots, and
the invariants the full-size runs are judged by."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import IMAGES_DIR

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _env() -> None:
    """The benches start daemons of their own: the session's shared daemon is not needed here."""


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsec-bench-scale-"))
    d.chmod(0o755)  # sandboxes' users traverse the state directory
    yield d
    shutil.rmtree(d, ignore_errors=True)


def bench(work: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "dsec", "bench", *args, "--out", str(work / "out")]
    argv += ["--state-dir", str(work / "state"), "--repository", str(IMAGES_DIR / "repository")]
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def result(work: Path, name: str, proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data: dict[str, Any] = json.loads((work / "out" / name).read_text())
    for plot in data["plots"]:
        png = (work / "out" / plot).read_bytes()
        assert png[:8] == PNG_MAGIC and len(png) > 1000, plot
    return data


def no_leftovers(work: Path) -> None:
    # the bench stopped its daemon and released the node: no mount is left under its state dir
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(work / "state") not in mounts


def test_density_holds_n_and_samples_as_it_fills(work: Path) -> None:
    proc = bench(work, "density", "--n", "20", "--sample-every", "5")
    data = result(work, "density-container.json", proc)
    d = data["dsec"]
    assert (d["held"], d["attempted"], d["failures"], d["stopped"]) == (20, 20, {}, None)
    assert [s["held"] for s in data["samples"]] == [5, 10, 15, 20]
    assert all(s["creations_per_s"] > 0 and s["create_p50_ms"] > 0 for s in data["samples"])
    assert {"client", "queue", "rootfs", "runtime", "total"} <= set(d["creation"])
    assert d["creation"]["total"]["n"] == 20
    assert d["exec_while_full"]["n"] == 20 and isinstance(d["host_memory_per_sandbox_mib"], float)
    assert d["node_when_held"]["sandboxes"] == {"container": 20}
    assert d["node_when_held"]["requested"]["cpu"] == pytest.approx(20 * 0.005)
    assert data["params"]["requests"] == {"cpu": 0.005, "memory": "64Mi", "memory_request": "8Mi"}
    assert set(data["plots"]) == {f"density-container-{p}.png" for p in ("memory", "latency", "rate")}
    assert set(data["targets"]) and d["kill_all_s"] >= 0
    no_leftovers(work)


def test_density_until_full_finds_where_admission_refuses(work: Path) -> None:
    # 0.1 cores at ratio 1 admit exactly 20 sandboxes of 0.005 cpu: the 21st is answered 429
    proc = bench(
        work,
        "density",
        "--n",
        "5",
        "--until-full",
        "--max",
        "60",
        "--sample-every",
        "10",
        "--serve-arg=--cpu-capacity=0.1",
        "--serve-arg=--cpu-ratio=1",
    )
    data = result(work, "density-container.json", proc)
    d = data["dsec"]
    stop = d["stopped"]
    assert stop["reason"] == "overloaded" and "no capacity" in stop["message"]
    assert stop["held"] == d["held"] == 20
    assert stop["node"]["allocatable"]["cpu"] == pytest.approx(0.1)
    assert stop["node"]["requested"]["cpu"] == pytest.approx(0.1)
    assert d["failures"].get("overloaded", 0) >= 1 and set(d["failures"]) == {"overloaded"}
    assert data["params"]["until_full"] and "--cpu-capacity=0.1" in data["params"]["daemon_flags"]
    no_leftovers(work)


def test_burst_individual_and_batch(work: Path) -> None:
    data = result(work, "burst-container.json", bench(work, "burst", "--n", "30"))
    assert data["headline"] == "individual" and set(data["runs"]) == {"individual", "batch"}
    for run in data["runs"].values():
        assert (run["n"], run["succeeded"], run["failed"], run["failures"]) == (30, 30, 0, {})
        assert run["success_rate"] == 1.0 and run["creations_per_s"] > 0 and run["first_execs_per_s"] > 0
        lat = run["latency"]
        for key in ("client_create", "client_create_to_first_exec", "daemon_total", "daemon_first_exec"):
            assert lat[key]["n"] == 30, key
        assert lat["daemon_service"]["p99_ms"] <= lat["daemon_total"]["max_ms"] + 1e-6
        assert run["node_peak"]["held"] >= 1
    assert data["node_samples"]["individual"] and len(data["plots"]) == 4
    assert data["params"]["requests"]["cpu"] == 0.01
    no_leftovers(work)


def test_overload_ten_times_capacity_fails_no_request(work: Path) -> None:
    proc = bench(work, "burst", "--n", "30", "--overload", "10", "--raw-queue-timeout", "0")
    data = result(work, "overload-container.json", proc)
    assert data["params"]["admitted_at_once"] == 3
    retry, raw = data["rounds"]["sdk_retry"], data["rounds"]["raw"]
    assert (retry["served"], retry["failed"], retry["refused_429"]) == (30, 0, 0)
    assert raw["failed"] == 0 and raw["served"] + raw["refused_429"] == 30 and raw["served_plus_refused_is_n"]
    # 30 at once on room for 3, none allowed to wait: most are refused, each told when to come back
    assert raw["served"] >= 3 and raw["refused_429"] >= 10
    assert raw["refused_with_retry_after"] == raw["refused_429"] == raw["daemon_answered_429"]
    assert raw["retry_after_s"]["min"] > 0
    for r in (retry, raw):
        assert r["node_peak"]["requested_cpu"] <= 0.03 + 1e-9  # never more admitted than the capacity
    assert retry["node_peak"]["queued"] >= 1  # the SDK round queued in the node instead of failing
    assert all(data["targets"].values())
    no_leftovers(work)
