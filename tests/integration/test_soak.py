"""`dsec bench soak` for two minutes against a real daemon it starts: every kind churned (few VMs), hostile
workloads contained, and every counter of the node back to its baseline afterwards (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dsec
from dsec_bench import accounting
from dsec_bench.churn import VM_WORKLOADS, WORKLOADS
from dsec_bench.soak import KINDS, quiet

from .conftest import shut_down, start_daemon

MINUTES = 2
# warm-up (VM boots and templates under TCG: about a minute and a half), the churn, then up to the
# soak's settle time before and after it, each
RUN_TIMEOUT = 60 * MINUTES + 240 + 2 * 180
Soak = tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]  # the run, its JSON, its directory


@pytest.fixture(autouse=True)
def _env() -> None:
    """The soak starts a daemon of its own: the session's shared daemon is not needed here."""


@pytest.fixture(scope="module")
def soak() -> Iterator[Soak]:
    d = Path(tempfile.mkdtemp(prefix="dsec-soak-"))
    d.chmod(0o755)
    argv = [sys.executable, "-m", "dsec", "bench", "soak", "--minutes", str(MINUTES)]
    argv += ["--state-dir", str(d / "state"), "--json", str(d / "soak.json")]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env={**os.environ, "COLUMNS": "200"},
        stdin=subprocess.DEVNULL,
    )
    data = json.loads((d / "soak.json").read_text()) if (d / "soak.json").exists() else {}
    yield proc, data, d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_two_minute_soak_leaks_nothing_and_meets_no_unexpected_error(soak: Soak) -> None:
    proc, data, _ = soak
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert data, out
    acc = data["accounting"]
    leaked = [r for r in acc["diff"] if r["verdict"] == "leak"]
    assert leaked == [], leaked
    assert data["errors"]["unexpected"] == {}, data["errors"]["examples"]["unexpected"]
    assert acc["baseline_quiet"], "the node still held sandboxes when the baseline was taken"
    assert proc.returncode == 0, out


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_soak_churned_every_kind_and_contained_every_hostile_workload(soak: Soak) -> None:
    _, data, _ = soak
    assert data, "the soak wrote no JSON"
    ops = data["operations"]
    assert set(ops) == {"container", "function", "microvm", "vm", "node"}  # node: the image gc now and then
    assert ops["node"]["image.gc"]["n"] >= 1
    for kind in KINDS:
        assert ops[kind]["create"]["n"] >= 1 and ops[kind]["kill"]["n"] >= 1, kind
    assert ops["container"]["snapshot"]["n"] >= 1 and ops["microvm"]["fork"]["n"] >= 1
    # few VMs, many containers
    assert ops["container"]["create"]["n"] > 5 * ops["microvm"]["create"]["n"]
    for kind in ("container", "function"):
        assert set(data["hostile"][kind]) == set(WORKLOADS), kind
        assert all(set(outcomes) == {"contained"} for outcomes in data["hostile"][kind].values()), kind
    for kind in ("microvm", "vm"):
        assert set(data["hostile"].get(kind, {})) <= set(VM_WORKLOADS)
        assert all(set(o) == {"contained"} for o in data["hostile"].get(kind, {}).values()), kind
    # the kill path under a running command, and the reaper's
    assert ops["container"]["kill_mid_exec"]["n"] >= 1 and ops["function"]["expired"]["n"] >= 1


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_soak_accounts_for_every_kind_of_host_object(soak: Soak) -> None:
    _, data, d = soak
    assert data, "the soak wrote no JSON"
    before = data["accounting"]["before"]
    for prefix in (
        "mounts.",
        "cgroups.",
        "uids.",
        "daemon.",
        "fetcher.",
        "qemu.",
        "net.",
        "nft.",
        "sqlite.",
        "files.",
        "cache.",
    ):
        assert any(k.startswith(prefix) for k in before), prefix
    assert before["nft.tables"] == 1  # made in the warm-up, so the churn's network use is judged against it
    assert before["daemon.fds"] > 0 and before["fetcher.fds"] > 0 and before["daemon.rss_kib"] > 0
    assert before["mounts.layers"] >= 1 and before["uids.next_container_base"] >= 0
    assert data["accounting"]["after"]["sqlite.state.sandboxes_finished"] > before["sqlite.state.sandboxes_finished"]
    samples = data["resources_over_time"]
    assert len(samples) >= 3 and all(s["daemon.rss_kib"] > 0 for s in samples)
    # the bench stopped its daemon and released the node
    assert str(d / "state") not in Path("/proc/self/mountinfo").read_text()


def test_the_accounting_sees_a_live_sandbox_and_its_release() -> None:
    """The counters are no vacuous zeros: a container on the network, held by a daemon of the test's own,
    shows in each group it touches; killed, the node comes back to the baseline (the soak's judgement)."""
    state = Path(tempfile.mkdtemp(prefix="dsec-soak-acc-"))
    state.chmod(0o755)
    d = start_daemon(state)
    try:
        client = d.client()
        warm = dsec.Sandbox.create(image="dsec/busybox", client=client, network="full")  # the table, the resolver
        warm.kill()
        node = accounting.Node(state, d.proc.pid)
        known = accounting.Known(node)
        before = _quiet_snapshot(node, known)
        sb = dsec.Sandbox.create(image="dsec/busybox", client=client, network="full")
        assert sb.exec("sleep 300 >/dev/null 2>&1 & echo started").stdout == "started\n"
        held = accounting.snapshot(node, known)
        grew = {r["counter"] for r in accounting.diff(before, held, {}) if r["verdict"] == "leak"}
        # its mounts are in a mount namespace of its own, not the host's table (mounts.sandboxes stays);
        # the daemon holds its bundle's descriptor there instead (daemon.fd.file)
        expected = {"daemon.fd.file", "cgroups.unified", "uids.container_ranges", "sandbox.processes"}
        expected |= {"net.namespaces", "net.interfaces", "net.address_leases", "nft.elements", "nft.chains"}
        expected |= {"sqlite.state.sandboxes", "files.sandbox_bundles", "files.runtime_states"}
        assert expected <= grew, expected - grew
        assert held["sandbox.processes"] - before["sandbox.processes"] == 2  # its agent and the sleep left running
        assert held["mounts.sandboxes"] == before["mounts.sandboxes"]
        sb.kill()
        after = _quiet_snapshot(node, known)
        rows = accounting.diff(
            before, after, {"sqlite.state.sandboxes_finished": RETAINED, "sqlite.audit.audit": RETAINED}
        )
        assert accounting.leaks(rows) == [], [r for r in rows if r["verdict"] == "leak"]
    finally:
        shut_down(d)
        shutil.rmtree(state, ignore_errors=True)


RETAINED = accounting.Allowance("history", retained=True)
# the daemon's own pools and RSS move between two snapshots: not what this test judges
VARIES = ("daemon.rss_kib", "fetcher.rss_kib", "daemon.threads", "fetcher.threads", "daemon.fd", "daemon.fds")


def _quiet_snapshot(node: accounting.Node, known: accounting.Known) -> dict[str, int]:
    deadline = time.monotonic() + 60
    while True:
        snap = {k: v for k, v in accounting.snapshot(node, known).items() if not k.startswith(VARIES)}
        if quiet(snap) or time.monotonic() > deadline:
            return snap
        time.sleep(0.5)
