"""The E2B API of a cluster: two real node daemons (TCP, each serving the E2B API) behind ``dsec cluster
gateway --e2b-listen``, driven by the unmodified ``e2b`` SDK through the gateway alone."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

import dsec

from .port_servers import TOKEN, fetch, serve
from .static_cluster import Cluster, static_cluster
from .wsclient import ws_talk

e2b = pytest.importorskip("e2b")
from e2b import Sandbox, SandboxQuery  # noqa: E402
from e2b.exceptions import SandboxNotFoundException, SandboxNotRunningException  # noqa: E402
from e2b.sandbox.commands.command_handle import CommandExitException  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with static_cluster("dsec-e2b-cluster-") as running:
        yield running


def test_the_sdk_through_the_gateway_reaches_every_node(cluster: Cluster) -> None:
    tag = secrets.token_hex(4)
    boxes = [Sandbox.create(metadata={"run": tag}, timeout=300, **cluster.opts()) for _ in range(4)]
    try:
        homes = {}
        for url, _, _ in cluster.nodes:
            client = dsec.Client(url=url, token=cluster.token)
            for info in client.list():
                homes[info.id] = url
        assert {homes[b.sandbox_id] for b in boxes} == {url for url, _, _ in cluster.nodes}  # spread over both
        for i, box in enumerate(boxes):
            assert box.commands.run(f"echo box{i}").stdout == f"box{i}\n"
            box.files.write("/tmp/id.bin", bytes([i]) * 1000)
            assert bytes(box.files.read("/tmp/id.bin", format="bytes")) == bytes([i]) * 1000
        cat = boxes[0].commands.run("cat", background=True, stdin=True)
        boxes[0].commands.send_stdin(cat.pid, "via the gateway\n")
        boxes[0].commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "via the gateway\n"
        sleeper = boxes[1].commands.run("sleep 60", background=True)
        assert boxes[1].commands.kill(sleeper.pid) is True
        with pytest.raises(CommandExitException):
            sleeper.wait()
        pages = Sandbox.list(query=SandboxQuery(metadata={"run": tag}), limit=3, **cluster.opts())
        listed = pages.next_items()
        assert len(listed) == 3 and pages.has_next
        listed += pages.next_items()
        seen = [s.sandbox_id for s in listed]
        assert sorted(seen) == sorted(b.sandbox_id for b in boxes) and not pages.has_next
        started = [s.started_at for s in listed]
        assert started == sorted(started, reverse=True)  # merged newest first, E2B's order when none is named
        info = Sandbox.get_info(boxes[2].sandbox_id, **cluster.opts())
        assert info.metadata == {"run": tag} and info.state.value == "running"
        boxes[3].set_timeout(120)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info("sb-000000000000", **cluster.opts())
        with pytest.raises(SandboxNotRunningException):
            Sandbox.connect(boxes[3].sandbox_id, **cluster.opts()).kill()
            boxes[3].commands.run("true")
    finally:
        for box in boxes:
            box.kill()
    assert Sandbox.list(query=SandboxQuery(metadata={"run": tag}), **cluster.opts()).next_items() == []


def test_get_host_through_the_gateway(cluster: Cluster) -> None:
    """A sandbox's port through the gateway's E2B listener: the host get_host names is the gateway's, the
    node checks the traffic token, and the server sees no token of the operator's."""
    box = Sandbox.create(timeout=300, **cluster.opts())
    try:
        serve(box)
        host = box.get_host(8000)
        assert host == f"8000-{box.sandbox_id}.localhost:{urlsplit(cluster.e2b_url).port}"  # not the node's
        assert Sandbox.connect(box.sandbox_id, **cluster.opts()).get_host(8000) == host
        token = box.traffic_access_token
        reply = fetch(cluster.e2b_url, host, "/hi.txt", token)
        assert (reply.status_code, reply.text) == (200, "hello from inside\n")
        told = dict(fetch(cluster.e2b_url, host, "/headers", token).json())
        assert told["host"] == "127.0.0.1:8000" and told["x-forwarded-host"] == host
        assert not {"authorization", "x-api-key", TOKEN, "e2b-sandbox-id", "e2b-sandbox-port"} & set(told)
        body = bytes(range(256)) * 16384
        posted = fetch(cluster.e2b_url, host, "/upload", token, "POST", content=body)
        assert posted.text == f"{len(body)} {hashlib.sha256(body).hexdigest()}"
        assert fetch(cluster.e2b_url, host, "/hi.txt", None).status_code == 403  # refused by the node
        assert fetch(cluster.e2b_url, host, "/hi.txt", "not-the-token").status_code == 403
        gone = host.replace(box.sandbox_id, "sb-000000000000")
        assert fetch(cluster.e2b_url, gone, "/hi.txt", token, patient=False).status_code == 502
        ws_host, pass_token = box.get_host(8300), [(TOKEN.encode(), str(token).encode())]
        deadline = time.monotonic() + 30
        while True:
            chosen, answers, code = ws_talk(cluster.e2b_url + "/ws", ["hi"], ["v1"], host=ws_host, headers=pass_token)
            if chosen is not None or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert (chosen, answers, code) == ("v1", ["/ws hi"], 4001)
        assert ws_talk(cluster.e2b_url + "/ws", ["hi"], [], host=ws_host)[1] == [403]
    finally:
        box.kill()


def test_a_wrong_key_and_a_lost_node(cluster: Cluster) -> None:
    with pytest.raises(e2b.AuthenticationException):
        Sandbox.create(**(cluster.opts() | {"api_key": "not-the-cluster-token"}))
    url, _, proc = cluster.nodes[1]
    client = dsec.Client(url=url, token=cluster.token)
    boxes: list[Sandbox] = []
    while len(boxes) < 6 and not any(b.sandbox_id in {i.id for i in client.list()} for b in boxes):
        boxes.append(Sandbox.create(timeout=300, **cluster.opts()))  # placement spreads: soon one on n2
    on_lost = [b for b in boxes if b.sandbox_id in {i.id for i in client.list()}]
    assert on_lost, "placement never chose the second node"
    for info in client.list():  # the node goes, and its sandboxes with it
        dsec.Sandbox.connect(info.id, client=client).kill()
    proc.kill()
    proc.wait()
    try:
        time.sleep(1.5)  # two missed health checks at 0.2 s: the gateway calls the node lost
        for box in on_lost:
            with pytest.raises(SandboxNotRunningException):
                box.commands.run("true")
        survivor = Sandbox.create(timeout=300, **cluster.opts())  # placed on the node that is left
        assert survivor.commands.run("echo still serving").stdout == "still serving\n"
        survivor.kill()
    finally:
        for box in boxes:
            if box not in on_lost:
                box.kill()
