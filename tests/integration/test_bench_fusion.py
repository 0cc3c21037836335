"""`dsec bench fusion`, small, through the CLI against a daemon it starts itself: every system measured
(the SandboxFusion API, podman run --rm and crun run on the same image), the JSON's shape, no failed
call, and nothing left behind (the bench's mounts, its sandboxes, its podman containers)."""

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

from .conftest import IMAGES_DIR

pytestmark = pytest.mark.timeout(900)  # a first run builds dsec/code:1 and imports it into podman


@pytest.fixture(autouse=True)
def _env() -> None:
    """The bench starts a daemon of its own: the session's shared daemon is not needed here."""


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsec-bench-fusion-"))
    d.chmod(0o755)  # sandboxes' users traverse the state directory
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_bench_measures_every_system_at_tiny_scale(work: Path) -> None:
    out = work / "fusion.json"
    argv = [sys.executable, "-m", "dsec", "bench", "fusion", "--n", "3", "--calls", "4", "--json", str(out)]
    argv += ["--state-dir", str(work / "state"), "--repository", str(IMAGES_DIR / "repository")]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=880,
        env={**os.environ, "COLUMNS": "200"},
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bench"] == "fusion" and set(data["systems"]) == {"fusion", "podman", "crun"}
    for system in ("fusion", "podman", "crun"):
        assert data["latency"][system]["n"] == 3 and data["latency"][system]["p50_ms"] > 0, system
        rates = data["throughput"][system]
        assert [e["concurrency"] for e in rates] == [1, 8, 32]
        assert all(e["ok"] == e["calls"] == 4 and e["calls_per_s"] > 0 for e in rates), rates
    assert set(data["comparison"]) == {"podman", "crun"}
    assert data["versions"]["sandbox_fusion"] == "sandbox-fusion 0.3.7"
    assert data["versions"]["python"].startswith("/opt/dsec-code/bin/python3 3.11")
    assert any(p["image"].startswith("dsec/code:1") and p["hits"] > 0 for p in data["pools"]), data["pools"]
    # the daemon stopped and released the node; the bench's containers are gone
    assert str(work / "state") not in Path("/proc/self/mountinfo").read_text()
    left = subprocess.run(
        ["podman", "ps", "-aq", "--filter", "label=dsec-bench=fusion"], capture_output=True, text=True, timeout=60
    )
    assert left.stdout.split() == []
