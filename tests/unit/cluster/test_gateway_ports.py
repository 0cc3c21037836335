"""Sandboxes' ports through the gateway, against fake nodes over real loopback HTTP: routed by sandbox to
its node, passed on with no token of the gateway's, bodies streamed, refusals and bounds. (The node's
proxy itself, and the whole path into a real sandbox, are tested elsewhere: tests/unit/server and
tests/integration/test_cluster_ports.py.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from dsec.cluster.e2b import _set_domain
from dsec.cluster.ports import GatewayPorts, PortTraffic
from dsec.protocol.ports import MAX_CONNECTIONS
from dsec.web.port_relay import dsec_error

from ...fakes.cluster import TOKEN, Harness

AUTH = {"authorization": f"Bearer {TOKEN}"}


async def _sandboxes(h: Harness, n: int) -> list[str]:
    async with httpx.AsyncClient(base_url=h.url, headers=AUTH) as http:
        ids = []
        for _ in range(n):
            reply = await http.post("/v1/sandboxes", json={"image": "img"})
            assert reply.status_code == 201, reply.text
            ids.append(str(reply.json()["id"]))
        return ids


def _pieces(total: int, size: int = 1 << 16) -> Iterator[bytes]:
    for _ in range(total // size):
        yield b"x" * size


async def test_a_ports_request_goes_to_the_sandboxs_node_without_the_gateways_token(cluster: Harness) -> None:
    ids = await _sandboxes(cluster, 4)
    homes = {sid: entry.node.name for sid, entry in cluster.gateway.directory.entries.items()}
    assert set(homes.values()) == {"a", "b"}
    async with httpx.AsyncClient(base_url=cluster.url) as http:
        for sid in ids:
            reply = await http.get(f"/ports/{sid}/8000/s3cret/a/b%2Fc?x=1", headers={"x-mine": "1"})
            assert reply.status_code == 200, reply.text
            said = reply.json()
            told = dict(said["headers"])
            assert said["node"] == homes[sid] and said["target"] == f"/ports/{sid}/8000/s3cret/a/b%2Fc"
            assert said["query"] == "x=1" and told["x-mine"] == "1"
            assert "authorization" not in told  # the operator's token is never added to port traffic
            assert told["x-forwarded-host"] == cluster.url.removeprefix("http://")
            assert told["x-forwarded-proto"] == "http"
        own = await http.get(f"/ports/{ids[0]}/8000/s/", headers={"authorization": "Basic dXNlcjo="})
        assert dict(own.json()["headers"])["authorization"] == "Basic dXNlcjo="  # the client's own passes


async def test_bodies_of_any_framing_pass_through(cluster: Harness) -> None:
    (sid,) = await _sandboxes(cluster, 1)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
        sized = await http.post(f"/ports/{sid}/8000/s/up", content=b"y" * (3 << 20))
        assert sized.json()["size"] == 3 << 20
        chunked = await http.post(f"/ports/{sid}/8000/s/up", content=_aiter(_pieces(5 << 20)))
        assert chunked.json()["size"] == 5 << 20
        assert "content-length" not in dict(chunked.json()["headers"])


async def _aiter(pieces: Iterator[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


async def test_what_opens_nothing_is_the_nodes_404(cluster: Harness) -> None:
    (sid,) = await _sandboxes(cluster, 1)
    async with httpx.AsyncClient(base_url=cluster.url) as http:
        wrong = await http.get(f"/ports/{sid}/8000/wrong/")  # the node's refusal, passed back
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "not_found"
        for path in ("/ports/sb-nowhere/8000/s/", "/ports/a%2Fb/8000/s/", "/ports/" + "x" * 200 + "/1/s/"):
            reply = await http.get(path)
            assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found", path
        api = await http.get("/v1/sandboxes")  # the API's own paths still need the token
        assert api.status_code == 401


async def test_a_sandboxs_connections_are_bounded_at_the_gateway() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        raise AssertionError("a request over the bound is not read")

    traffic = PortTraffic(gateway=None)  # type: ignore[arg-type]
    traffic._open["sb-1"] = MAX_CONNECTIONS
    scope = {"type": "http", "method": "GET", "path": "/ports/sb-1/1/s/", "headers": []}
    await traffic.through(None, None, scope, receive, send, "sb-1", [], dsec_error)  # type: ignore[arg-type]
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"])["error"]["code"] == "limit_exceeded"
    assert traffic._open["sb-1"] == MAX_CONNECTIONS


async def test_a_websocket_elsewhere_is_refused() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the API has no WebSockets")

    ports = GatewayPorts(app, gateway=None, traffic=None)  # type: ignore[arg-type]
    scope = {"type": "websocket", "path": "/v1/sandboxes", "raw_path": b"/v1/sandboxes", "headers": []}
    await ports(scope, None, send)  # type: ignore[arg-type]
    assert sent == [{"type": "websocket.close", "code": 1008}]  # no denial extension: uvicorn's 403


def test_answers_naming_a_sandbox_give_the_gateways_domain() -> None:
    node = {"sandboxID": "sb-1", "domain": "localhost:5001", "envdAccessToken": "t"}
    assert _set_domain(node, "gw:443") == node | {"domain": "gw:443"}
    forked = [{"sandbox": node}, {"error": {"code": 400, "message": "no"}}]
    assert _set_domain(forked, "gw:443") == [{"sandbox": node | {"domain": "gw:443"}}, forked[1]]
    assert _set_domain({"code": 404, "message": "gone"}, "gw:443") == {"code": 404, "message": "gone"}
