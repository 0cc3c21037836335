"""Admission, batches, node status, metrics, quotas and eviction through the real HTTP app and SDK, on
the fake backend (the real node is tested in tests/integration/test_scale.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from dsec.core.admission import AdmissionOptions
from dsec.core.manager import SandboxManager
from dsec.core.usage import Usage
from dsec.errors import DsecError, Overloaded
from dsec.images.store import ImageStore
from dsec.protocol.sandbox import State
from dsec.sdk.aio import AsyncClient, AsyncSandbox

from ..conftest import IMAGE, TOKEN, FakeBackend, ManagerSwitch, make_image

BASE = "http://dsec"
MiB = 1 << 20
# four default sandboxes (0.25 cpu each) fill this node
SMALL = AdmissionOptions(cpu_capacity=1, memory_capacity=64 << 30, cpu_ratio=1, queue_timeout=0.3, node_name="n1")


class Node:
    def __init__(self, app: FastAPI, mgr: SandboxManager, backend: FakeBackend) -> None:
        self.app, self.mgr, self.backend = app, mgr, backend
        self.https: list[httpx.AsyncClient] = []

    def http(self, token: str = TOKEN) -> httpx.AsyncClient:
        h = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url=BASE, headers={"authorization": f"Bearer {token}"}
        )
        self.https.append(h)
        return h

    async def client(self, token: str = TOKEN) -> AsyncClient:
        client = AsyncClient(url=BASE, token=token)
        await client._transport.http.aclose()
        client._transport.http = self.http(token)
        return client


@pytest.fixture
async def node(workdir: Path, shared_app: tuple[FastAPI, ManagerSwitch]) -> AsyncIterator[Node]:
    async with running_node(workdir, shared_app, SMALL) as n:
        yield n


@contextlib.asynccontextmanager
async def running_node(
    workdir: Path, shared_app: tuple[FastAPI, ManagerSwitch], admission: AdmissionOptions
) -> AsyncIterator[Node]:
    """A node of fake container sandboxes behind the real app, admitting as ``admission`` says."""
    app, switch = shared_app
    make_image(workdir / "images", IMAGE, env={"PATH": "/usr/bin:/bin"})
    mgr = SandboxManager(
        state_dir=workdir / "state",
        images=ImageStore(workdir / "images", lazy=False, mount=False),
        kinds=["container"],
        admission=admission,
    )
    backend = FakeBackend(mgr.ctx)
    mgr.backends["container"] = backend
    switch.target = mgr
    await mgr.start()  # httpx's ASGI transport runs no lifespan: do what it would
    mgr.tenants.set_operator_token(TOKEN)
    n = Node(app, mgr, backend)
    try:
        yield n
    finally:
        for h in n.https:
            await h.aclose()
        await mgr.close()
        switch.target = None


async def fill(http: httpx.AsyncClient, n: int = 4) -> list[str]:
    ids = []
    for _ in range(n):
        reply = await http.post("/v1/sandboxes", json={"image": IMAGE})
        assert reply.status_code == 201, reply.text
        ids.append(reply.json()["id"])
    return ids


async def test_a_full_node_answers_429_with_retry_after_and_creates_nothing(node: Node) -> None:
    http = node.http()
    await fill(http)
    reply = await http.post("/v1/sandboxes", json={"image": IMAGE, "queue_timeout": 0.1})
    assert reply.status_code == 429
    assert int(reply.headers["retry-after"]) >= 1
    err = reply.json()["error"]
    assert err["code"] == "overloaded" and err["detail"]["retry_after"] >= 1
    assert len(node.backend.created) == 4  # nothing was made for the refused one
    assert len(node.mgr.store.all()) == 4  # and nothing recorded either
    text = (await http.get("/metrics")).text
    assert 'dsec_creation_failures_total{kind="container",reason="overloaded"} 1.0' in text


async def test_a_queued_creation_runs_once_capacity_frees(node: Node) -> None:
    http = node.http()
    ids = await fill(http)
    pending = asyncio.create_task(http.post("/v1/sandboxes", json={"image": IMAGE, "queue_timeout": 5}))
    await asyncio.sleep(0.1)
    status = (await http.get("/v1/node")).json()
    assert status["queued"] == 1 and status["queues"][0]["tenant"] == "admin"
    assert (await http.delete(f"/v1/sandboxes/{ids[0]}")).status_code == 200
    reply = await asyncio.wait_for(pending, 5)
    assert reply.status_code == 201, reply.text
    timings = reply.json()["timings"]
    assert timings["queue"] >= 0.05 and timings["total"] >= timings["queue"]
    assert reply.json()["node"] == "n1"
    assert "dsec_admission_wait_seconds_count 1.0" in (await http.get("/metrics")).text


async def test_node_status_adds_up(node: Node) -> None:
    http = node.http()
    await fill(http, 3)
    s = (await http.get("/v1/node", params={"top": 10})).json()
    assert s["node"] == "n1" and s["kinds"] == ["container"]
    assert s["capacity"]["cpu"] == 1 and s["allocatable"]["cpu"] == 1
    assert s["requested"] == {"cpu": 0.75, "memory": 3 * 128 * MiB}
    assert s["free"]["cpu"] == 0.25
    assert s["sandboxes"] == {"container": {"running": 3}}
    assert len(s["top"]) == 3 and s["top"][0]["cpu_request"] == 0.25
    assert s["start_slots"]["container"] >= 1


async def test_batch_streams_each_sandbox_and_reports_the_ones_refused(node: Node) -> None:
    http = node.http()
    body = {"count": 6, "sandbox": {"image": IMAGE, "queue_timeout": 0.2}}
    reply = await http.post("/v1/sandboxes/batch", json=body)
    assert reply.status_code == 200
    events = [json.loads(line) for line in reply.text.splitlines()]
    assert events[-1] == {"done": True, "created": 4, "failed": 2}
    items = events[:-1]
    assert sorted(e["index"] for e in items) == list(range(6))
    made = [e for e in items if "sandbox" in e]
    refused = [e for e in items if "error" in e]
    assert len(made) == 4 and {e["error"]["code"] for e in refused} == {"overloaded"}
    assert sorted(node.backend.created) == sorted(e["sandbox"]["id"] for e in made)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"count": 2, "trajectories": ["a"]}, "has 1 ids for a batch of 2"),
        ({"count": 2, "trajectories": ["a", "a"]}, "twice"),
        ({"count": 1, "sandbox": {"trajectory": "t"}}, "sandbox.trajectory: Extra inputs"),  # 'trajectories' binds
        ({"count": 0}, "count"),
        ({"count": 10_001}, "count"),
    ],
)
async def test_bad_batches_are_refused_before_anything_is_made(node: Node, body: dict[str, object], why: str) -> None:
    reply = await node.http().post("/v1/sandboxes/batch", json=body)
    assert reply.status_code == 400 and why in reply.json()["error"]["message"]
    assert node.backend.created == []


async def test_sdk_waits_out_a_full_node_and_create_many_yields_errors_in_place(node: Node) -> None:
    client = await node.client()
    sandboxes = [await AsyncSandbox.create(IMAGE, client=client) for _ in range(4)]
    with pytest.raises(Overloaded):
        await AsyncSandbox.create(IMAGE, client=client, queue_timeout=0, wait_for_capacity=0)

    async def free_one_soon() -> None:
        await asyncio.sleep(0.5)
        await sandboxes[0].kill()

    killer = asyncio.create_task(free_one_soon())
    # the node answers 429 after 0.1 s; the SDK waits Retry-After and asks again until it fits
    late = await asyncio.wait_for(AsyncSandbox.create(IMAGE, client=client, queue_timeout=0.1), 10)
    await killer
    assert late.id not in [s.id for s in sandboxes]
    await late.kill()
    got = [item async for item in AsyncSandbox.create_many(3, IMAGE, client=client, queue_timeout=0.1)]
    made = [g for g in got if isinstance(g, AsyncSandbox)]
    failed = [g for g in got if isinstance(g, DsecError)]
    assert len(made) == 1 and len(failed) == 2
    assert {f.index for f in failed} | {made[0].batch_index} == {0, 1, 2}
    assert all(isinstance(f, Overloaded) for f in failed)


async def test_quotas_bound_one_tenant(node: Node) -> None:
    op = node.http()
    created = (await op.post("/v1/tenants", json={"name": "team"})).json()
    tenant = node.http(created["token"])
    assert (await op.get("/v1/tenants/team/quota")).json() == {"sandboxes": None, "cpu": None, "memory": None}
    reply = await op.put("/v1/tenants/team/quota", json={"sandboxes": 1})
    assert reply.status_code == 200 and reply.json()["sandboxes"] == 1
    assert (await tenant.post("/v1/sandboxes", json={"image": IMAGE})).status_code == 201
    refused = await tenant.post("/v1/sandboxes", json={"image": IMAGE, "queue_timeout": 0.05})
    assert refused.status_code == 429 and "quota" in refused.json()["error"]["message"]
    assert (await op.post("/v1/sandboxes", json={"image": IMAGE})).status_code == 201  # the node has room
    # only the operator sets quotas, and the operator has none
    assert (await tenant.put("/v1/tenants/team/quota", json={"sandboxes": 9})).status_code == 403
    assert (await op.put("/v1/tenants/admin/quota", json={"sandboxes": 9})).status_code == 409
    assert (await op.put("/v1/tenants/nobody/quota", json={"sandboxes": 9})).status_code == 404
    assert (await op.put("/v1/tenants/team/quota", json={"cpu": -1})).status_code == 400
    # a tenant sees only its own sandboxes in the node's top list, and cannot read the metrics
    top = (await tenant.get("/v1/node", params={"top": 10})).json()["top"]
    assert [s["owner"] for s in top] == ["team"]
    # sandboxes per tenant (the console's fleet page): the operator sees all, a tenant its own count
    assert (await op.get("/v1/node")).json()["owners"] == {"admin": 1, "team": 1}
    assert (await tenant.get("/v1/node")).json()["owners"] == {"team": 1}
    # the last hour of creations: a tenant's own, the operator's whole (one refusal by quota among them)
    mine_now = (await tenant.get("/v1/node/history")).json()["buckets"][-1]
    assert mine_now["created"] == {"container": 1} and mine_now["failed"] == {"overloaded": 1}
    all_now = (await op.get("/v1/node/history")).json()["buckets"][-1]
    assert all_now["created"] == {"container": 2}
    mine = await tenant.get("/metrics")
    assert mine.status_code == 200  # its own slice: its sandboxes and pools, not the node's figures
    assert 'dsec_sandboxes{kind="container",state="running"} 1.0' in mine.text
    assert "dsec_node_allocatable" not in mine.text and "dsec_creations_total" not in mine.text
    assert (await op.get("/v1/metrics")).text.count("dsec_node_allocatable{") == 2  # same as /metrics
    # the quota survives a restart of the store
    assert node.mgr.tenants.quota("team") is not None


async def test_metrics_count_creations_by_phase(node: Node) -> None:
    http = node.http()
    [sid] = await fill(http, 1)
    await http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})
    text = (await http.get("/metrics")).text
    assert 'dsec_creations_total{kind="container"} 1.0' in text
    for phase in ("queue", "runtime", "total", "first_exec"):
        assert f'dsec_create_phase_seconds_count{{kind="container",phase="{phase}"}} 1.0' in text
    assert 'dsec_sandboxes{kind="container",state="running"} 1.0' in text
    assert 'dsec_node_allocatable{resource="cpu"} 1.0' in text
    assert f'dsec_sandbox_cpu_requested_cores{{kind="container",sandbox="{sid}",tenant="admin"}} 0.25' in text


async def test_eviction_takes_the_sandbox_furthest_above_its_request(node: Node) -> None:
    http = node.http()
    ids = await fill(http, 3)
    mon = node.mgr.usage
    mon.usage = {
        ids[0]: Usage(0, 100 * MiB, 0),  # within its 128 MiB request
        ids[1]: Usage(0, 300 * MiB, 0),  # 172 MiB above
        ids[2]: Usage(0, 200 * MiB, 0),  # 72 MiB above
    }
    victim = mon.victim()
    assert victim is not None and victim[0] == ids[1]
    assert "300Mi against a request of 128Mi" in victim[1]
    mon.pressure = 0.99
    await node.mgr.evict(*victim)
    info = (await http.get(f"/v1/sandboxes/{ids[1]}")).json()
    assert info["state"] == State.failed.value and info["reason"].startswith("evicted under memory pressure")
    assert node.mgr.admission.requested.cpu == 0.5  # its request went back to the node
    assert "dsec_evictions_total 1.0" in (await http.get("/metrics")).text


async def test_a_trajectory_resumed_with_another_queue_timeout_has_not_diverged(node: Node) -> None:
    http = node.http()
    first = await http.post("/v1/sandboxes", json={"image": IMAGE, "trajectory": "q/1", "queue_timeout": 1})
    assert first.status_code == 201, first.text
    again = await http.post("/v1/sandboxes", json={"image": IMAGE, "trajectory": "q/1", "queue_timeout": 9})
    assert again.status_code in (200, 201), again.text
    assert again.json()["id"] == first.json()["id"]
    other = await http.post("/v1/sandboxes", json={"image": IMAGE, "trajectory": "q/1", "labels": {"x": "y"}})
    assert other.status_code == 409 and other.json()["error"]["code"] == "trajectory_diverged"


async def test_a_live_exec_stream_ends_after_its_timeout(node: Node) -> None:
    """GET .../execs/live is open until its timeout (an EventSource then reconnects, after the retry the
    stream names): no client holds a stream forever without asking for it."""
    http = node.http()
    [sid] = await fill(http, 1)
    started = time.monotonic()
    reply = await http.get(f"/v1/sandboxes/{sid}/execs/live", params={"timeout": 0.5})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    assert reply.content.startswith(b"retry: 1000\n") and time.monotonic() - started < 5
    for bad in (0, -1, 3601):
        assert (await http.get(f"/v1/sandboxes/{sid}/execs/live", params={"timeout": bad})).status_code == 400
