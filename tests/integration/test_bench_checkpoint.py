"""`dsec bench checkpoint`, small, end to end through the CLI against a daemon it starts: container and
function sandboxes measured at both diff sizes (a kind's refusal is recorded instead: the unit tests)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_bench.checkpoint import MEASURES, RATIOS

from .conftest import IMAGES_DIR

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _env() -> None:
    """The bench starts a daemon of its own: the session's shared daemon is not needed here."""


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsec-bench-checkpoint-"))
    d.chmod(0o755)  # sandboxes' users traverse the state directory
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(150)
def test_checkpoint_bench_measures_containers_and_functions(work: Path) -> None:
    argv = [sys.executable, "-m", "dsec", "bench", "checkpoint", "--kinds", "container,function"]
    argv += ["--rounds", "2", "--big-mb", "4", "--json", str(work / "result.json"), "--out", str(work / "plots")]
    argv += ["--state-dir", str(work / "state"), "--repository", str(IMAGES_DIR / "repository")]
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=140, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((work / "result.json").read_text())
    assert data["bench"] == "checkpoint" and data["failures"] == []
    assert {"when", "host", "params", "targets", "plots"} <= set(data)
    assert data["params"]["rounds"] == 2 and data["params"]["big_mb"] == 4

    for kind, size, diff_bytes in (
        (k, size, n) for k in ("container", "function") for size, n in (("small", 8192), ("big", 4 << 20))
    ):
        assert data["kinds"][kind]["status"] == "measured"
        entry = data["kinds"][kind][size]
        assert "error" not in entry and entry["diff"]["bytes"] == diff_bytes
        # only containers' copies come from a warm pool (checkpoint_pool.POOLED)
        pooled = kind == "container"
        measured = set(MEASURES) - (set() if pooled else {"fork8_pooled_all_answered"})
        assert set(entry["measurements"]) == measured
        for stats in entry["measurements"].values():
            assert stats["n"] == 2 and 0 < stats["p50_ms"] <= stats["max_ms"] < 60_000
        m = entry["measurements"]
        assert m["rollback_call"]["max_ms"] <= m["rollback_first_exec"]["max_ms"]
        assert m["fork8_call"]["max_ms"] <= m["fork8_all_answered"]["max_ms"]
        assert set(entry["ratios"]) == set(RATIOS)
        assert all(r > 0 for name, r in entry["ratios"].items() if pooled or name != "create8_over_fork8_pooled")
    # the big diff's random bytes are in its checkpoint: packing does not shrink them
    container = data["kinds"]["container"]
    assert container["big"]["checkpoint_bytes"] >= 4 << 20 > container["small"]["checkpoint_bytes"]

    targets = data["targets"]
    assert all(isinstance(t["met"], bool) and t["value"] > 0 for t in targets.values()), targets
    assert set(data["plots"]) == {
        f"checkpoint-{k}-{p}.png" for k in ("container", "function") for p in ("p50", "rollback-cdf")
    }
    for plot in data["plots"]:
        png = (work / "plots" / plot).read_bytes()
        assert png[:8] == PNG_MAGIC and len(png) > 1000, plot
    # nothing the bench made outlives it: no mount under its state dir, its snapshots gone from its repository
    assert str(work / "state") not in Path("/proc/self/mountinfo").read_text()
    names = {bytes.fromhex(t.stem).decode() for t in (work / "state" / "repository" / "tags").rglob("*.json")}
    # dsec/busybox, seeded; the function kind's snapshots stay while idle pooled workers were made from them
    # (a function pool shrinks when idle; an image they alone use is not removed meanwhile)
    assert "dsec/busybox:latest" in names and all("-function-" in n for n in names - {"dsec/busybox:latest"}), names
