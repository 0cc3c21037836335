"""Admission, usage, eviction, batches and `dsec top` on a real node: real containers, real cgroups.

The node here is made small on purpose (--cpu-capacity 1 --cpu-ratio 1: four default sandboxes), so
a burst of a dozen is already "far beyond capacity".
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dsec
from dsec.errors import Overloaded
from dsec.isolation import cgroups
from dsec.sdk.aio import AsyncClient, AsyncSandbox

from .conftest import Daemon, shut_down, start_daemon

IMAGE = "dsec/busybox"
MiB = 1 << 20


@pytest.fixture(scope="module")
def small() -> Iterator[Daemon]:
    state = Path(tempfile.mkdtemp(prefix="dsec-scale-"))
    os.chmod(state, 0o755)
    flags = ["--cpu-capacity", "1", "--cpu-ratio", "1", "--memory-capacity", "700M", "--evict-at", "0.8"]
    d = start_daemon(state, *flags, "--queue-timeout", "2", "--node-name", "small-node", e2b=True)
    try:
        yield d
    finally:
        shut_down(d)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def client(small: Daemon) -> Iterator[dsec.Client]:
    c = small.client()
    yield c
    for info in c.list():
        dsec.Sandbox.connect(info.id, client=c).kill()


def test_requests_become_the_reservation_and_use_is_measured(client: dsec.Client) -> None:
    busy = dsec.Sandbox.create(IMAGE, client=client, memory="256Mi", memory_request="48Mi")
    idle = dsec.Sandbox.create(IMAGE, client=client)
    layout = cgroups.detect()
    if layout.mode == "v2":
        low = (layout.unified_dir(f"dsec/{busy.id}") / "memory.low").read_text().strip()
        assert int(low) == 48 * MiB
    else:
        soft = Path(f"/sys/fs/cgroup/memory/dsec/{busy.id}/memory.soft_limit_in_bytes").read_text()
        assert int(soft) == 48 * MiB
    info = busy.info()
    assert info.node == "small-node"
    assert {"queue", "rootfs", "runtime", "total"} <= set(info.timings)
    busy.exec("(while :; do :; done) >/dev/null 2>&1 &")
    assert "first_exec" in busy.info().timings
    deadline = time.monotonic() + 20
    while True:
        top = {u.id: u for u in client.node(top=10).top}
        if (busy.id in top and top[busy.id].cpu_used > 0.5) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert top[busy.id].cpu_used > 0.5, top  # a spinning core, against a request of 0.25
    assert top[idle.id].cpu_used < 0.1
    assert top[busy.id].memory_request == 48 * MiB and top[busy.id].memory_used > 0
    assert client.node().cpu_use_le_5pct == 0.5  # the idle one is, the spinning one is not
    metrics = client.metrics()
    assert 'dsec_sandbox_cpu_use_ratio_count{kind="container"}' in metrics
    assert f'dsec_sandbox_cpu_used_cores{{kind="container",sandbox="{busy.id}",tenant="admin"}}' in metrics


def test_memory_pressure_evicts_the_sandbox_furthest_above_its_request(client: dsec.Client) -> None:
    # 700M for sandboxes, eviction at 80%: 250 + 350 MiB held is past it
    modest = dsec.Sandbox.create(IMAGE, client=client, memory="512Mi", memory_request="32Mi")
    greedy = dsec.Sandbox.create(IMAGE, client=client, memory="512Mi", memory_request="32Mi")
    bystander = dsec.Sandbox.create(IMAGE, client=client, memory="64Mi", memory_request="32Mi")
    # dd's buffer stays allocated while the pipe's reader does not read
    modest.exec("dd if=/dev/zero bs=250M count=1 2>/dev/null | sleep 300 &")
    greedy.exec("dd if=/dev/zero bs=350M count=1 2>/dev/null | sleep 300 &")
    deadline = time.monotonic() + 30
    # an eviction passes through stopping: wait for where it ends
    while greedy.info().state in (dsec.State.running, dsec.State.stopping) and time.monotonic() < deadline:
        time.sleep(0.5)
    info = greedy.info()
    assert info.state == dsec.State.failed, info
    assert info.reason is not None and info.reason.startswith("evicted under memory pressure"), info.reason
    assert "against a request of 32Mi" in info.reason
    time.sleep(3)  # pressure is back under the line: nobody else goes
    assert modest.info().state == dsec.State.running
    assert bystander.exec("echo fine").stdout == "fine\n"
    status = client.node()
    assert status.evictions == 1
    assert "dsec_evictions_total 1.0" in client.metrics()


def test_a_burst_far_beyond_capacity_is_queued_and_served(small: Daemon) -> None:
    async def burst() -> tuple[list[dict[str, float]], int, int]:
        client = AsyncClient(url=small.url, token=small.token)
        peak_queue = 0

        async def one(i: int) -> dict[str, float]:
            sb = await AsyncSandbox.create(IMAGE, client=client, labels={"burst": "1"})
            try:
                assert (await sb.exec(["echo", str(i)])).stdout == f"{i}\n"
                await asyncio.sleep(0.3)
                return (await sb.info()).timings
            finally:
                await sb.kill()

        async def watch() -> None:
            nonlocal peak_queue
            while True:
                peak_queue = max(peak_queue, (await client.node()).queued)
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            timings = await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            watcher.cancel()
        # raw: no waiting, no retry -> refused at once with Retry-After, nothing left behind
        held = [await AsyncSandbox.create(IMAGE, client=client) for _ in range(4)]
        refused = 0
        for _ in range(3):
            try:
                await AsyncSandbox.create(IMAGE, client=client, queue_timeout=0, wait_for_capacity=0)
            except Overloaded as e:
                assert e.retry_after >= 1
                refused += 1
        live = len(await client.list())
        for sb in held:
            await sb.kill()
        await client.aclose()
        return list(timings), peak_queue, refused * 100 + live

    timings, peak_queue, refused_live = asyncio.run(burst())
    assert len(timings) == 16  # every one of 16 creations on a node that takes 4 got its sandbox
    assert peak_queue >= 4
    assert sum(1 for t in timings if t["queue"] > 0.1) >= 8
    assert refused_live == 3 * 100 + 4  # three 429s, and only the four held sandboxes exist


def test_a_creation_whose_caller_left_is_cancelled(small: Daemon, client: dsec.Client) -> None:
    e2b = pytest.importorskip("e2b")
    held = [dsec.Sandbox.create(IMAGE, client=client) for _ in range(4)]  # the node is full
    uds = httpx.HTTPTransport(uds=small.url.removeprefix("unix://"))
    auth = {"authorization": f"Bearer {small.token}"}
    with httpx.Client(transport=uds, base_url="http://dsec", headers=auth, timeout=1.0) as http:
        with pytest.raises(httpx.ReadTimeout):  # gives up while its creation waits (up to 60 s)
            http.post("/v1/sandboxes", json={"image": IMAGE, "queue_timeout": 60, "labels": {"left": "dsec"}})
    with pytest.raises(httpx.TimeoutException):  # the SDK's transport gives up; the node would wait 2 s
        opts = {"api_key": small.token, "api_url": small.e2b_url, "sandbox_url": small.e2b_url}
        e2b.Sandbox.create(IMAGE, metadata={"left": "e2b"}, request_timeout=0.5, **opts)
    deadline = time.monotonic() + 10
    while client.node().queued and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.node().queued == 0
    held[0].kill()
    time.sleep(1)  # room again: a creation still queued would be made now
    assert len(client.list()) == 3 and client.node().requested.cpu == 0.75
    creates = [r for r in client.audit(limit=50) if r.method == "POST" and r.route.endswith("/sandboxes")]
    assert [(r.route, r.status) for r in creates[-2:]] == [("/v1/sandboxes", 499), ("e2b /v2/sandboxes", 499)]


def test_create_many_streams_sandboxes_through_the_sync_sdk(client: dsec.Client) -> None:
    indexes = []
    # four fit at once; the last two wait in the node's queue until the loop has killed two of those
    for sb in dsec.Sandbox.create_many(6, IMAGE, client=client, queue_timeout=60):
        assert isinstance(sb, dsec.Sandbox), sb
        indexes.append(sb.batch_index)
        assert sb.exec("echo hi").stdout == "hi\n"
        sb.kill()
    assert sorted(indexes) == list(range(6))
    assert client.list() == []


def test_dsec_top_shows_the_node(small: Daemon, client: dsec.Client) -> None:
    sb = dsec.Sandbox.create(IMAGE, client=client)
    out = subprocess.run(
        [sys.executable, "-m", "dsec", "top", "--once", "--url", small.url, "--token", small.token],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert "node small-node" in out.stdout
    assert sb.id in out.stdout and "container: 1 running" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "dsec", "top", "--once", "--url", small.url, "--token", "wrong"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unauthorized" in bad.stderr


def test_a_restarted_daemon_counts_the_sandboxes_it_readopts(small: Daemon) -> None:
    c = small.client()
    kept = dsec.Sandbox.create(IMAGE, client=c, cpu=0.5)
    small.stop()
    again = start_daemon(small.state_dir, "--cpu-capacity", "1", "--cpu-ratio", "1", "--memory-capacity", "700M")
    small.proc, small.url, small.token = again.proc, again.url, again.token
    c = small.client()
    status = c.node()
    assert status.requested.cpu == 0.5 and status.sandboxes == {"container": {"running": 1}}
    dsec.Sandbox.connect(kept.id, client=c).kill()
    assert c.node().requested.cpu == 0
