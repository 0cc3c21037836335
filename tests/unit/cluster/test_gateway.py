"""The cluster gateway against fake node daemons over real loopback HTTP: placement and retry of
creations, routing by sandbox id, merged lists and batches, streaming, node loss, trajectories, auth.
The SDK is used unchanged, pointed at the gateway."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest

import dsec
from dsec.protocol.node import BatchEvent
from dsec.protocol.sandbox import CreateSandbox, SandboxInfo, State

from ...fakes.cluster import TOKEN, Harness, start

AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def cluster() -> AsyncIterator[Harness]:
    h = await start({"a": 8.0, "b": 8.0, "c": 8.0})
    try:
        yield h
    finally:
        await h.close()


def client(h: Harness) -> dsec.AsyncClient:
    return dsec.AsyncClient(url=h.url, token=TOKEN)


async def wait_for(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_creations_spread_over_nodes_and_calls_reach_the_owner(cluster: Harness) -> None:
    c = client(cluster)
    sbs = [await dsec.AsyncSandbox.create(image="dsec/busybox", client=c) for _ in range(6)]
    assert Counter(sb._info.node for sb in sbs) == {"a": 2, "b": 2, "c": 2}
    for sb in sbs:
        res = await sb.exec("echo hi")
        assert res.stdout == f"{sb._info.node}:{sb.id}:echo hi:None\n"  # the owning node ran it
    await c.aclose()


async def test_a_full_node_is_skipped_and_only_all_refusing_is_429(cluster: Harness) -> None:
    cluster.fake("a").full = True
    cluster.fake("b").free_cpu = 16.0  # looks best, refuses anyway
    cluster.fake("b").full = True
    await cluster.gateway.nodes.check_all()
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH) as http:
        reply = await http.post("/v1/sandboxes", json={"image": "x"})
        assert reply.status_code == 201 and reply.json()["node"] == "c"
        assert cluster.fake("b").creates == 1  # tried first, refused
        cluster.fake("c").full = True
        reply = await http.post("/v1/sandboxes", json={"image": "x"})
    assert reply.status_code == 429
    assert reply.headers["retry-after"] == "2"
    err = reply.json()["error"]
    assert err["code"] == "overloaded" and err["detail"]["retry_after"] == 2.0
    assert "node c" in err["message"]


async def test_when_nothing_fits_only_one_node_queues_the_creation(cluster: Harness) -> None:
    for f in cluster.fakes:
        f.free_cpu, f.full = 0.0, True  # every node reports itself full: each would queue, then refuse
    await cluster.gateway.nodes.check_all()
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH) as http:
        reply = await http.post("/v1/sandboxes", json={"image": "x"})
    assert reply.status_code == 429
    assert sum(f.creates for f in cluster.fakes) == 1  # the caller waits out one queue, not three


async def test_invalid_create_is_400_without_touching_nodes(cluster: Harness) -> None:
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH) as http:
        reply = await http.post("/v1/sandboxes", json={"image": "x", "timeout": -1})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"
    assert sum(f.creates for f in cluster.fakes) == 0


async def test_a_caller_that_leaves_its_create_makes_the_gateway_leave_the_node(cluster: Harness) -> None:
    for f in cluster.fakes:
        f.stall = True
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/sandboxes", json={"image": "x"})
    # the node sees its caller go (a real node then cancels the creation), and nothing is resent
    await wait_for(lambda: sum(f.left for f in cluster.fakes) == 1)
    assert sum(f.creates for f in cluster.fakes) == 1
    for f in cluster.fakes:
        f.stall = False
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH) as http:
        assert (await http.post("/v1/sandboxes", json={"image": "x"})).status_code == 201


async def test_list_merges_every_node_in_creation_order(cluster: Harness) -> None:
    c = client(cluster)
    made = [await dsec.AsyncSandbox.create(image="x", labels={"job": str(i % 2)}, client=c) for i in range(5)]
    listed = await c.list()
    assert [i.id for i in listed] == [sb.id for sb in made]
    assert [i.id for i in await c.list(labels={"job": "1"})] == [made[1].id, made[3].id]
    await c.aclose()


async def test_streamed_exec_streams_through(cluster: Harness) -> None:
    c = client(cluster)
    sb = await dsec.AsyncSandbox.create(image="x", client=c)
    stream = sb.exec_stream("work")
    first = await asyncio.wait_for(stream.__anext__(), 5)  # arrives while the node still holds the rest
    assert (first.type, first.data) == ("stdout", "first\n")
    cluster.fake(sb._info.node or "").release.set()
    rest = [e async for e in stream]
    assert [e.type for e in rest] == ["stdout", "result"]
    await c.aclose()


async def test_large_bodies_stream_both_ways(cluster: Harness) -> None:
    c = client(cluster)
    sb = await dsec.AsyncSandbox.create(image="x", client=c)
    data = os.urandom(5 << 20)  # many ASGI messages on the way in, many chunks on the way out
    await sb.files.write("/tmp/big", data)
    assert cluster.fake(sb._info.node or "").files[(sb.id, "/tmp/big")] == data
    assert await sb.files.read("/tmp/big") == data
    await c.aclose()


async def test_a_sandbox_made_elsewhere_is_found_by_asking(cluster: Harness) -> None:
    node = cluster.fake("b")
    info = node.make(CreateSandbox(image="x"))  # made on the node directly: the gateway never saw it
    c = client(cluster)
    sb = await dsec.AsyncSandbox.connect(info.id, client=c)
    assert sb._info.node == "b"
    assert (await sb.exec("x")).stdout.startswith("b:")
    with pytest.raises(dsec.SandboxNotFound):
        await dsec.AsyncSandbox.connect("sb-nowhere", client=c)
    await c.aclose()


async def test_a_lost_nodes_sandboxes_read_lost_and_creations_go_elsewhere(cluster: Harness) -> None:
    c = client(cluster)
    sbs = [await dsec.AsyncSandbox.create(image="x", labels={"t": "1"}, client=c) for _ in range(3)]
    victim = next(sb for sb in sbs if sb._info.node == "b")
    await cluster.fake("b").stop()
    node = cluster.gateway.nodes.by_name("b")
    assert node is not None
    await wait_for(lambda: node.lost)
    info = await victim.info()
    assert info.state == State.lost and info.reason and info.reason.startswith("node b was lost:")
    with pytest.raises(dsec.SandboxGone, match="node b was lost"):
        await victim.exec("true")
    killed = await c._transport.request("DELETE", f"/v1/sandboxes/{victim.id}")  # a no-op, like any finished one
    assert SandboxInfo.model_validate_json(killed.content).state == State.lost
    assert victim.id not in {i.id for i in await c.list()}  # lost is finished: only `all` lists it
    everything = (await c._transport.request("GET", "/v1/sandboxes", params={"all": "true"})).json()
    assert {s["id"]: s["state"] for s in everything["sandboxes"]}[victim.id] == "lost"
    after = [await dsec.AsyncSandbox.create(image="x", client=c) for _ in range(4)]
    assert {sb._info.node for sb in after} == {"a", "c"}
    status = (await c._transport.request("GET", "/v1/cluster")).json()
    health = {n["name"]: n["health"] for n in status["nodes"]}
    assert health == {"a": "healthy", "b": "lost", "c": "healthy"}
    await c.aclose()


async def test_a_call_waiting_on_a_node_that_dies_ends_with_an_error(cluster: Harness) -> None:
    c = client(cluster)
    sb = next(s for s in [await dsec.AsyncSandbox.create(image="x", client=c) for _ in range(3)] if s._info.node == "a")
    events: list[str] = []

    async def consume() -> None:
        async for e in sb.exec_stream("work"):
            events.append(e.type)

    task = asyncio.create_task(consume())
    await wait_for(lambda: events == ["stdout"])
    fake = cluster.fake("a")
    fake.srv.force_exit = True  # the node goes away with the stream open
    fake.srv.should_exit = True
    with pytest.raises((dsec.DaemonUnreachable, dsec.SandboxGone, dsec.DsecError)):
        await asyncio.wait_for(task, 10)
    await c.aclose()


async def test_trajectory_creation_goes_where_its_sandbox_lives(cluster: Harness) -> None:
    home = cluster.fake("c")
    made = home.make(CreateSandbox(image="x", trajectory="job/1"))
    for f in cluster.fakes:  # a shared log: every node can say where the trajectory's sandbox is
        f.trajectories["job/1"] = made.id
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH) as http:
        reply = await http.post("/v1/sandboxes", json={"image": "x", "trajectory": "job/1"})
        assert reply.status_code == 201 and reply.json()["node"] == "c"
        # its node lost: the creation is placed anywhere else (that node rebuilds it from the log)
        await home.stop()
        node = cluster.gateway.nodes.by_name("c")
        assert node is not None
        await wait_for(lambda: node.lost)
        reply = await http.post("/v1/sandboxes", json={"image": "x", "trajectory": "job/1"})
        assert reply.status_code == 201 and reply.json()["node"] in ("a", "b")


async def batch(h: Harness, body: dict[str, object]) -> list[BatchEvent]:
    async with httpx.AsyncClient(base_url=h.url, headers=AUTH) as http:
        reply = await http.post("/v1/sandboxes/batch", json=body)
        assert reply.status_code == 200
        return [BatchEvent.model_validate_json(line) for line in reply.text.splitlines() if line.strip()]


async def test_batch_is_split_merged_and_reindexed(cluster: Harness) -> None:
    events = await batch(cluster, {"count": 12, "sandbox": {"image": "x"}})
    assert events[-1].done and events[-1].created == 12 and events[-1].failed == 0
    items = events[:-1]
    assert sorted(e.index for e in items if e.index is not None) == list(range(12))
    assert Counter(e.sandbox.node for e in items if e.sandbox) == {"a": 4, "b": 4, "c": 4}
    # every sandbox of the batch is routable afterwards
    c = client(cluster)
    for e in items[:3]:
        assert e.sandbox is not None
        assert (await (await dsec.AsyncSandbox.connect(e.sandbox.id, client=c)).exec("x")).exit_code == 0
    await c.aclose()


async def test_batch_items_a_node_refuses_go_to_the_others(cluster: Harness) -> None:
    cluster.fake("a").overload_after = 1
    cluster.fake("b").full = True
    events = await batch(cluster, {"count": 9, "sandbox": {"image": "x"}})
    assert events[-1].created == 9 and events[-1].failed == 0
    assert Counter(e.sandbox.node for e in events[:-1] if e.sandbox) == {"a": 1, "c": 8}
    for name in "ac":
        cluster.fake(name).full = True
    events = await batch(cluster, {"count": 3, "sandbox": {"image": "x"}})
    assert events[-1].created == 0 and events[-1].failed == 3
    assert {e.error.code for e in events[:-1] if e.error} == {"overloaded"}


async def test_node_status_is_the_sum_and_metrics_are_labelled(cluster: Harness) -> None:
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH) as http:
        await http.post("/v1/sandboxes", json={"image": "x", "limits": {"cpu": 2}})
        await cluster.gateway.nodes.check_all()
        total = (await http.get("/v1/node")).json()
        assert total["allocatable"]["cpu"] == 24.0 and total["free"]["cpu"] == 22.0
        text = (await http.get("/metrics")).text
    assert text.count("# TYPE dsec_sandboxes gauge") == 1
    assert {f'dsec_sandboxes{{node="{n}",kind="container"}}' for n in "abc"} <= {
        line.rsplit(" ", 1)[0] for line in text.splitlines()
    }


async def test_auth_and_refused_routes(cluster: Harness) -> None:
    async with httpx.AsyncClient(base_url=cluster.url) as http:
        health = await http.get("/v1/health")
        assert health.status_code == 200 and health.json()["ok"] is True
        assert (await http.get("/v1/sandboxes")).status_code == 401
        wrong = await http.get("/v1/sandboxes", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
        gc = await http.post("/v1/images/gc", headers=AUTH)
        assert gc.status_code == 409 and "gc" in gc.json()["error"]["message"]
        tenants = await http.post("/v1/tenants", headers=AUTH, json={"name": "x"})
        assert tenants.status_code == 400
        # a method a node API path does not have: a 405 naming those it has, as a node answers
        for method, path, allow in (("PATCH", "/metrics", "GET, HEAD"), ("DELETE", "/v1/health", "GET, HEAD")):
            refused = await http.request(method, path, headers=AUTH)
            assert refused.status_code == 405 and refused.headers["allow"] == allow, (method, path)
        assert (await http.get("/v1/node", params={"top": "-1"}, headers=AUTH)).status_code == 400
        # an id no request line can carry is asked for percent-encoded: not found, not a 500
        assert (await http.get("/v1/sandboxes/\u00e9\U0001f600?x", headers=AUTH)).status_code == 404


async def test_no_healthy_node_is_a_clear_error_not_a_hang(cluster: Harness) -> None:
    for f in cluster.fakes:
        await f.stop()
    await wait_for(lambda: not cluster.gateway.nodes.routable())
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=10) as http:
        reply = await http.post("/v1/sandboxes", json={"image": "x"})
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "daemon_unreachable"


async def test_a_creation_sent_before_the_first_health_answers_waits_for_them() -> None:
    # a gateway just started: its first polls are out but the nodes take 0.3 s to answer
    h = await start({"a": 8.0, "b": 8.0}, interval=0.2, status_delay=0.3, heard=False)
    try:
        assert not h.gateway.nodes.routable()
        async with httpx.AsyncClient(base_url=h.url, headers=AUTH, timeout=10) as http:
            reply = await http.post("/v1/sandboxes", json={"image": "x"})
            assert reply.status_code == 201, reply.text
            for f in h.fakes:
                await f.stop()
            await wait_for(lambda: not h.gateway.nodes.routable())
            started = time.monotonic()
            reply = await http.post("/v1/sandboxes", json={"image": "x"})
        # nodes known to be lost are not waited for
        assert reply.status_code == 503 and time.monotonic() - started < 0.5
    finally:
        await h.close()


async def test_nodes_with_one_name_are_told_apart() -> None:
    # no background polls during the test: on a loaded host one slow answer makes a node suspect (not
    # placed on), which is health's business, not naming's, and skewed the spread checked below
    h = await start({"a": 8.0, "b": 8.0}, interval=60.0)
    try:
        h.fake("b").name = "a"  # e.g. two daemons left at the default name, the host name
        await h.gateway.nodes.check_all()
        names = sorted(n.name for n in h.gateway.nodes.nodes)
        assert names[0] == "a" and names[1].startswith("a@http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=h.url, headers=AUTH) as http:
            for _ in range(4):
                assert (await http.post("/v1/sandboxes", json={"image": "x"})).status_code == 201
        assert [f.creates for f in h.fakes] == [2, 2]
    finally:
        await h.close()


async def test_a_repeated_creation_is_answered_again_not_placed_again(cluster: Harness) -> None:
    """The gateway remembers Idempotency-Keys: the SDK's repeat of a creation whose answer was lost must
    not make a second sandbox (perhaps on another node); a refusal (429) is not remembered."""
    body = CreateSandbox(image="dsec/busybox").model_dump(mode="json")
    headers = {**AUTH, "idempotency-key": "create-1"}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as http:
        first = await http.post("/v1/sandboxes", json=body, headers=headers)
        again = await http.post("/v1/sandboxes", json=body, headers=headers)
        assert first.status_code == again.status_code == 201 and first.json()["id"] == again.json()["id"]
        assert again.headers["idempotent-replayed"] == "true"
        assert sum(f.creates for f in cluster.fakes) == 1
        for f in cluster.fakes:
            f.full = True
        await cluster.gateway.nodes.check_all()
        refused = await http.post("/v1/sandboxes", json=body, headers={**AUTH, "idempotency-key": "create-2"})
        assert refused.status_code == 429
        for f in cluster.fakes:
            f.full = False
        await cluster.gateway.nodes.check_all()
        later = await http.post("/v1/sandboxes", json=body, headers={**AUTH, "idempotency-key": "create-2"})
        assert later.status_code == 201 and "idempotent-replayed" not in later.headers
