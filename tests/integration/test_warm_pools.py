"""Warm pools over real sandboxes: a claim is a fresh sandbox (no file, randomness or clock of another
claimant), for the container, function and microvm kinds; and a restarted daemon never re-adopts idle
pooled sandboxes."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import dsec

from .conftest import Daemon, require_kind, scratch_dir, shut_down, start_daemon

PROBE = (
    "test -e /tmp/claimed && echo dirty || echo clean; "
    "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s"
)


def pool(client: dsec.Client, name: str) -> dsec.WarmPoolInfo:
    return next(p for p in client.warm_pools() if p.name == name)


def wait_idle(client: dsec.Client, name: str, n: int, within: float = 60.0) -> dsec.WarmPoolInfo:
    deadline = time.monotonic() + within
    while True:
        p = pool(client, name)
        if p.idle >= n:
            return p
        assert time.monotonic() < deadline, f"pool {name} has {p.idle} idle of {n} after {within:g} s: {p}"
        time.sleep(0.1)


def use_and_dirty(sb: dsec.Sandbox) -> tuple[str, str, float]:
    """What a claimant finds (clean or dirty, 16 random bytes, its clock's distance from the host's),
    leaving a file behind."""
    state, rand, clock = sb.exec(PROBE).stdout.split()
    skew = int(clock) - time.time()
    assert sb.exec("echo mine > /tmp/claimed").exit_code == 0
    return state, rand, skew


def claims_are_fresh(client: dsec.Client, name: str, create: Callable[..., dsec.Sandbox]) -> None:
    """Two claimants of one pool: each gets its own sandbox, as if new."""
    seen: list[tuple[str, str, float]] = []
    for i in range(2):
        before = pool(client, name).claims
        sb = create(labels={"claimant": str(i)}, env={"WHO": f"c{i}"}, timeout=120)
        try:
            info = sb.info()
            assert pool(client, name).claims == before + 1, "the creation was not served from the pool"
            assert info.labels == {"claimant": str(i)} and info.env == {"WHO": f"c{i}"}
            assert abs(info.created_at.timestamp() - time.time()) < 30
            assert 119 <= (info.expires_at - info.created_at).total_seconds() <= 120.01
            assert "claim" in info.timings
            assert sb.exec("echo $WHO").stdout.strip() == f"c{i}"
            assert sb.id in {s.id for s in client.list(labels={"claimant": str(i)})}
            seen.append(use_and_dirty(sb))
        finally:
            sb.kill()
        if i == 0:
            wait_idle(client, name, 1, within=300)
    assert [s[0] for s in seen] == ["clean", "clean"]  # no file of the other claimant
    assert seen[0][1] != seen[1][1]  # no shared randomness
    for _, _, skew in seen:
        assert abs(skew) < 3  # the host's clock, whatever time the sandbox spent idle in the pool


@pytest.fixture
def container_pool(daemon: Daemon) -> Iterator[dsec.Client]:
    client = daemon.client()
    client.set_warm_pool("it-container", "dsec/busybox", 2, limits={"memory": "128Mi"})
    try:
        yield client
    finally:
        client.remove_warm_pool("it-container")


@pytest.mark.timeout(300)
def test_container_claims_are_fresh_sandboxes_and_the_pool_refills(container_pool: dsec.Client) -> None:
    client = container_pool
    wait_idle(client, "it-container", 2)
    assert not [s for s in client.list() if s.image == "dsec/busybox" and s.labels == {}]  # members are not listed
    claims_are_fresh(
        client,
        "it-container",
        lambda **kw: dsec.Sandbox.create(image="dsec/busybox", memory="128Mi", client=client, **kw),
    )
    p = wait_idle(client, "it-container", 2)
    assert p.claims == 2 and p.refills >= 4 and p.failures == 0
    metrics = client.metrics()
    assert 'dsec_warm_pool_claims_total{kind="container",pool="it-container",tenant="admin"} 2.0' in metrics
    assert 'dsec_warm_pool_idle{kind="container",pool="it-container",tenant="admin"} 2.0' in metrics
    assert [w.name for w in client.node().warm_pools] == ["it-container"]


@pytest.mark.timeout(300)
def test_what_differs_is_made_for_itself(container_pool: dsec.Client) -> None:
    client = container_pool
    wait_idle(client, "it-container", 2)
    client.create_volume("it-warm-vol", size="16Mi")
    made = [
        dsec.Sandbox.create(image="dsec/busybox", memory="256Mi", client=client),  # other limits
        dsec.Sandbox.create(image="dsec/busybox", memory="128Mi", network="full", client=client),
        dsec.Sandbox.create(image="dsec/busybox", memory="128Mi", volumes={"/data": "it-warm-vol"}, client=client),
    ]
    try:
        p = pool(client, "it-container")
        assert (p.claims, p.misses, p.idle) == (0, 0, 2)
        assert all("claim" not in sb.info().timings for sb in made)
    finally:
        for sb in made:
            sb.kill()
        client.remove_volume("it-warm-vol")


@pytest.mark.timeout(300)
def test_function_kind_claims_are_fresh(daemon: Daemon) -> None:
    client = daemon.client()
    require_kind(client, "function")
    client.set_warm_pool("it-function", "dsec/busybox", 1, kind="function")
    try:
        wait_idle(client, "it-function", 1, within=120)
        claims_are_fresh(
            client,
            "it-function",
            lambda **kw: dsec.Sandbox.create(image="dsec/busybox", kind="function", client=client, **kw),
        )
    finally:
        client.remove_warm_pool("it-function")


@pytest.mark.timeout(900)
def test_a_microvm_pool_restores_from_its_template_with_its_own_clock_and_randomness(daemon: Daemon) -> None:
    client = daemon.client()
    require_kind(client, "microvm")
    # the first VM of a shape boots and saves the template later ones restore from (the kind's own
    # doing): made here, so that the pool's members are restored ones
    deadline = time.monotonic() + 300
    while True:
        sb = dsec.Sandbox.create(image="dsec/busybox", kind="microvm", memory="192Mi", client=client)
        restored = sb.info().started_from == "snapshot"
        sb.kill()
        if restored:
            break
        assert time.monotonic() < deadline, "no microVM was restored from a template within 5 minutes"
        time.sleep(2)
    client.set_warm_pool("it-microvm", "dsec/busybox", 1, kind="microvm", limits={"memory": "192Mi"})
    try:
        wait_idle(client, "it-microvm", 1, within=300)
        time.sleep(5)  # sat idle in the pool: its clock must still be right when claimed

        def create(**kw: Any) -> dsec.Sandbox:
            sb = dsec.Sandbox.create(image="dsec/busybox", kind="microvm", memory="192Mi", client=client, **kw)
            assert sb.info().started_from == "snapshot", "a pooled microVM was not restored from its template"
            return sb

        claims_are_fresh(client, "it-microvm", create)
    finally:
        client.remove_warm_pool("it-microvm")


def containers(state: Path) -> set[str]:
    root = state / "run" / "crun"
    runtime = "crun" if root.exists() else "runc"
    root = root if root.exists() else state / "run" / "runc"
    out = subprocess.run([runtime, "--root", str(root), "list", "--format", "json"], capture_output=True, text=True)
    return {c["id"] for c in json.loads(out.stdout or "[]")}


@pytest.mark.timeout(300)
def test_a_restarted_daemon_kills_idle_pooled_sandboxes_and_refills() -> None:
    with scratch_dir("dsec-warm-restart-") as work:
        d = start_daemon(work / "state", "--warm", "dsec/busybox:memory=128Mi=2")
        try:
            client = d.client()
            assert [p.name for p in client.warm_pools()] == ["dsec-busybox-container"]
            wait_idle(client, "dsec-busybox-container", 2, within=120)
            claimed = dsec.Sandbox.create(image="dsec/busybox", memory="128Mi", client=client)
            wait_idle(client, "dsec-busybox-container", 2)
            before = containers(d.state_dir)
            assert claimed.id in before and len(before) == 3
            d.stop(signal.SIGKILL)  # a crash: nothing was cleaned up
            assert containers(d.state_dir) == before
            d2 = start_daemon(d.state_dir)  # no pools this time
            d.proc = d2.proc
            client = d2.client()
            assert client.warm_pools() == []
            assert containers(d.state_dir) == {claimed.id}  # the idle ones were killed, not re-adopted
            again = dsec.Sandbox.connect(claimed.id, client=client)
            assert again.info().state == dsec.State.running and again.exec("true").exit_code == 0
            assert "killed idle warm-pool sandbox" in d.log.read_text()
            assert [s.id for s in client.list()] == [claimed.id]
            client.set_warm_pool("again", "dsec/busybox", 1, limits={"memory": "128Mi"})
            wait_idle(client, "again", 1)
            d2.stop()  # a clean stop: the idle member goes with the daemon, the claimed one stays
            assert containers(d.state_dir) == {claimed.id}
            d3 = start_daemon(d.state_dir)
            d.proc = d3.proc
            dsec.Sandbox.connect(claimed.id, client=d3.client()).kill()
        finally:
            shut_down(d)
