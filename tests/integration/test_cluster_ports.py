"""Exposed ports through the cluster gateway: two real node daemons behind ``dsec cluster gateway``, a
server in a sandbox on one of them, reached at the URL ``expose`` gives, which is the gateway's.

The gateway holds no port's secret and adds no token to this traffic: the node checks the secret, and
the server in the sandbox never sees the operator's token. Bodies are streamed through the gateway both
ways, which its peak memory shows: with a server that reads slowly and a client that does, it stays
far below the bodies that pass."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dsec

from .static_cluster import Cluster, static_cluster
from .wsclient import ws_talk

HERE = Path(__file__).parent
BIG = 128 << 20  # each way: far more than the gateway may hold
MAX_GROWTH = 48 << 20  # of the gateway's peak resident memory while BIG passes each way


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with static_cluster("dsec-ports-cluster-") as running:
        yield running


def _serve(sb: dsec.Sandbox) -> None:
    sb.files.write("/srv/http_echo.py", (HERE / "http_echo.py").read_bytes())
    sb.files.write("/srv/ws_echo.py", (HERE / "ws_echo.py").read_bytes())
    sb.files.write("/srv/www/hi.txt", b"hello from inside\n")
    sb.exec("nohup python3 /srv/http_echo.py 8000 /srv/www >/tmp/http.log 2>&1 &")
    sb.exec("nohup python3 /srv/ws_echo.py 8300 >/tmp/ws.log 2>&1 &")


def _wait(url: str) -> httpx.Response:
    """The first answer that is not 502: the server just started in the sandbox may not listen yet."""
    deadline = time.monotonic() + 60
    while True:
        reply = httpx.get(url, timeout=10)
        if reply.status_code != 502 or time.monotonic() > deadline:
            return reply
        time.sleep(0.2)


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def _node(cluster: Cluster, url: str) -> dsec.Client:
    return dsec.Client(url=url, token=cluster.token)


def _pieces(total: int, size: int = 1 << 16) -> Iterator[bytes]:
    block = bytes(range(256)) * (size // 256)
    for _ in range(total // size):
        yield block


@pytest.mark.timeout(600)
def test_a_port_is_reached_through_the_gateway_streamed_both_ways(cluster: Cluster) -> None:
    sb = dsec.Sandbox.create(client=cluster.client(), timeout=600)
    try:
        _serve(sb)
        base = sb.expose(8000)
        assert base.startswith(cluster.url + "/ports/" + sb.id + "/8000/")
        assert cluster.token not in base and all(url not in base for url, _, _ in cluster.nodes)
        reply = _wait(base + "hi.txt")
        assert (reply.status_code, reply.text) == (200, "hello from inside\n")

        # what the server is told: its own Host, where it was reached, and no token of the operator's
        told = dict(httpx.get(base + "headers", timeout=30).json())
        assert told["host"] == "127.0.0.1:8000" and "authorization" not in told
        assert told["x-forwarded-host"] == cluster.url.removeprefix("http://")
        assert told["x-forwarded-prefix"] == base.removeprefix(cluster.url).rstrip("/")
        own = httpx.get(base + "headers", headers={"Authorization": "Bearer the-client's-own"}, timeout=30)
        assert dict(own.json())["authorization"] == "Bearer the-client's-own"

        small = bytes(range(256)) * 4000  # a body of known length, in more than one piece
        posted = httpx.post(base + "upload", content=small, timeout=60)
        assert (posted.status_code, posted.text) == (200, f"{len(small)} {hashlib.sha256(small).hexdigest()}")

        gateway_pid = cluster.gateway.pid
        before = _peak_rss(gateway_pid)
        started = time.monotonic()
        digest = hashlib.sha256()
        for piece in _pieces(BIG):
            digest.update(piece)
        up = httpx.post(base + "slow", content=_pieces(BIG), timeout=300)  # chunked, to a slow reader
        assert (up.status_code, up.text) == (200, f"{BIG} {digest.hexdigest()}")
        uploaded = time.monotonic() - started
        started = time.monotonic()
        got, size = hashlib.sha256(), 0
        with httpx.stream("GET", base + f"bytes?n={BIG}", timeout=300) as down:
            assert down.status_code == 200
            for chunk in down.iter_bytes():
                got.update(chunk)
                size += len(chunk)
                time.sleep(len(chunk) / (40 << 20))  # a client slower than the server
        downloaded = time.monotonic() - started
        want = hashlib.sha256((bytes(range(251)) * (BIG // 251 + 1))[:BIG]).hexdigest()
        assert (size, got.hexdigest()) == (BIG, want)
        growth = _peak_rss(gateway_pid) - before
        print(
            f"\n[dsec] through the gateway: {BIG >> 20} MiB up in {uploaded:.2f} s, down in {downloaded:.2f} s; "
            f"the gateway's peak memory grew {growth / (1 << 20):.1f} MiB"
        )
        assert growth < MAX_GROWTH

        # a client that leaves an endless stream: the node, and the gateway in front of it, let go of
        # the server's connection (it sees its writes fail), rather than read on for nobody
        node_url = next(url for url, _, _ in cluster.nodes if sb.id in {i.id for i in _node(cluster, url).list()})
        for n, url in enumerate((node_url + base.removeprefix(cluster.url), base), start=1):
            with httpx.stream("GET", url + "forever", timeout=30) as stream:
                assert next(stream.iter_bytes()).startswith(b"tick")
            deadline = time.monotonic() + 30
            while sb.exec("cat /tmp/forever.log 2>/dev/null").stdout.count("gone") < n:
                assert time.monotonic() < deadline, f"the server kept streaming to nobody ({url})"
                time.sleep(0.2)

        # WebSocket, through the gateway to the node and on into the sandbox
        ws_base = sb.expose(8300)
        deadline = time.monotonic() + 30
        while True:
            chosen, answers, code = ws_talk(ws_base + "ws?x=1", ["hello", b"\x00\x01" * 40000], ["env.v1"])
            if chosen is not None or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert (chosen, answers, code) == ("env.v1", ["/ws?x=1 hello", b"\x00\x01" * 40000], 4001)

        # refused by the node, as it refuses its own clients: a wrong secret, a port not exposed
        tampered = base[:-3] + ("a" if base[-3] != "a" else "b") + base[-2:]
        wrong = httpx.get(tampered + "hi.txt", timeout=30)
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "not_found"
        assert ws_talk(ws_base.replace("/8300/", "/8301/") + "ws", ["x"], [])[1] == [404]
        assert ws_talk(tampered.replace("/8000/", "/8300/") + "ws", ["x"], [])[1] == [404]
        nobody = httpx.get(base.replace(sb.id, "sb-000000000000") + "hi.txt", timeout=30)
        assert nobody.status_code == 404 and json.loads(nobody.text)["error"]["code"] == "not_found"
    finally:
        sb.kill()
    assert httpx.get(base + "hi.txt", timeout=30).status_code == 404  # gone with the sandbox


def test_run_code_reaches_its_context_through_the_gateway(cluster: Cluster) -> None:
    """run_code is a sandbox route like exec: the gateway takes it to the node, whose sandbox keeps the state."""
    sb = dsec.Sandbox.create(image="dsec/debian:12", client=cluster.client(), timeout=600)
    try:
        assert sb.run_code("total = sum(range(10))").error is None
        r = sb.run_code("total * 2")
        assert (r.text, r.engine) == ("90", "python")
        assert sb.code_contexts() == ["default"]
    finally:
        sb.kill()
