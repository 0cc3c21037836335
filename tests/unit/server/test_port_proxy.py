"""The node's port proxy without a daemon or a sandbox: how it reads a port's address, what it tells the
server and drops, how it checks secrets, bounds connections and answers failures. The "sandbox's server"
is a thread speaking HTTP/1.1 (h11) on the far end of a socket pair the fake backend hands the proxy."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import h11
import pytest

from dsec.errors import InvalidRequest, PortUnreachable
from dsec.protocol.ports import MAX_CONNECTIONS
from dsec.server.port_proxy import split_path
from dsec.store.records import SandboxRecord
from dsec.web.port_relay import Hop, forwarded, request_target, upstream_headers

from ..conftest import AUTH, Api

# ---- reading the address -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "parts"),
    [
        ("/ports/sb-1/8000/s3cret/", ("sb-1", 8000, "s3cret", "/")),
        ("/ports/sb-1/8000/s3cret", ("sb-1", 8000, "s3cret", "/")),
        ("/ports/sb-1/1/s/a/b%20c/", ("sb-1", 1, "s", "/a/b%20c/")),
        ("/ports/sb-1/65535/s/", ("sb-1", 65535, "s", "/")),
        ("/ports/sb-1/08000/s/x", ("sb-1", 8000, "s", "/x")),
    ],
)
def test_an_address_splits_into_sandbox_port_secret_and_the_servers_path(
    path: str, parts: tuple[str, int, str, str]
) -> None:
    assert split_path(path) == parts


@pytest.mark.parametrize(
    "path",
    [
        "/ports/",
        "/ports/sb-1",
        "/ports/sb-1/8000",
        "/ports/sb-1/8000/",  # no secret
        "/ports//8000/s/",  # no sandbox
        "/ports/sb-1/0/s/",
        "/ports/sb-1/65536/s/",
        "/ports/sb-1/-1/s/",
        "/ports/sb-1/80a/s/",
        "/ports/sb-1/\uff18\uff10/s/",  # digits, but not ASCII ones
        "/ports/sb-1/000008000/s/",
        "/v1/sandboxes",
    ],
)
def test_a_malformed_address_is_refused(path: str) -> None:
    with pytest.raises(InvalidRequest):
        split_path(path)


def test_the_request_line_keeps_the_clients_encoding_and_refuses_what_it_cannot_carry() -> None:
    assert request_target({"query_string": b"a=1&b=%20"}, "/x%2Fy") == "/x%2Fy?a=1&b=%20"
    assert request_target({}, "/") == "/"
    for bad in ("/a b", "/caf\u00e9", "/a\x7f"):
        with pytest.raises(InvalidRequest):
            request_target({}, bad)


# ---- what the server is told -------------------------------------------------------------------------


def _scope(headers: list[tuple[bytes, bytes]], scheme: str = "http") -> dict[str, Any]:
    return {"type": "http", "scheme": scheme, "headers": headers}


def test_the_server_gets_its_own_host_no_hop_by_hop_headers_and_where_it_was_reached() -> None:
    client = [
        (b"host", b"node:7000"),
        (b"connection", b"keep-alive, x-secret"),
        (b"keep-alive", b"timeout=5"),
        (b"te", b"trailers"),
        (b"upgrade", b"h2c"),
        (b"transfer-encoding", b"chunked"),
        (b"x-forwarded-prefix", b"/spoofed"),
        (b"cookie", b"a=1"),
        (b"authorization", b"Bearer the-clients-own"),
        (b"e2b-traffic-access-token", b"tok"),
    ]
    hop = Hop(8000, "/x", "/ports/sb-1/8000/s/", frozenset({b"e2b-traffic-access-token"}))
    out = upstream_headers(_scope(client), hop)
    assert out[0] == (b"host", b"127.0.0.1:8000") and out[-1] == (b"connection", b"close")
    assert out[1:-1] == [
        (b"transfer-encoding", b"chunked"),  # the body is chunked again, whatever the client's framing
        (b"cookie", b"a=1"),
        (b"authorization", b"Bearer the-clients-own"),
        (b"x-forwarded-host", b"node:7000"),
        (b"x-forwarded-proto", b"http"),
        (b"x-forwarded-prefix", b"/ports/sb-1/8000/s"),
    ]


def test_a_proxy_in_front_says_where_the_client_was() -> None:
    """The cluster gateway sets X-Forwarded-Host and -Proto: they pass on as they came, not overwritten
    with the gateway's own request to the node."""
    client = [(b"host", b"10.0.0.2:7000"), (b"x-forwarded-host", b"gw:443"), (b"x-forwarded-proto", b"https")]
    names = [n for n, _ in upstream_headers(_scope(client), Hop(80, "/"))]
    assert names.count(b"x-forwarded-host") == 1 and names.count(b"x-forwarded-proto") == 1
    assert forwarded(_scope(client), "") == []
    assert forwarded({"type": "websocket", "scheme": "wss", "headers": [(b"host", b"h")]}, "/p/") == [
        (b"x-forwarded-host", b"h"),
        (b"x-forwarded-proto", b"https"),
        (b"x-forwarded-prefix", b"/p"),
    ]


# ---- through the proxy -------------------------------------------------------------------------------


class Server:
    """The sandbox's server: each connection handed to the proxy is one request, parsed with h11 on a
    thread; it keeps what it was sent and answers ``answer`` (raw bytes, so a test can break HTTP)."""

    def __init__(self) -> None:
        self.requests: list[tuple[h11.Request, bytes]] = []
        self.answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\nx-from: inside\r\n\r\nhello"

    def connect(self) -> socket.socket:
        ours, theirs = socket.socketpair()
        threading.Thread(target=self._serve, args=(theirs,), daemon=True).start()
        ours.setblocking(False)
        return ours

    def _serve(self, sock: socket.socket) -> None:
        conn = h11.Connection(h11.SERVER)
        request: h11.Request | None = None
        body = b""
        with sock:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(sock.recv(65536))
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            assert request is not None
            self.requests.append((request, body))
            sock.sendall(self.answer)


@pytest.fixture
def server(api: Api) -> Server:
    srv = Server()

    async def connect_port(rec: SandboxRecord, port: int) -> socket.socket:
        if port != 8000:
            raise PortUnreachable(f"nothing answers on port {port} inside the sandbox")
        return srv.connect()

    api.backend.check_ports = lambda: None  # type: ignore[method-assign]
    api.backend.connect_port = connect_port  # type: ignore[method-assign]
    return srv


def _expose(api: Api, sandbox_id: str, port: int = 8000) -> str:
    reply = api.client.post(f"/v1/sandboxes/{sandbox_id}/ports", json={"port": port}, headers=AUTH)
    assert reply.status_code == 200, reply.text
    path: str = reply.json()["path"]
    return path


def test_a_request_reaches_the_server_and_its_answer_comes_back(api: Api, server: Server) -> None:
    sid = str(api.create()["id"])
    path = _expose(api, sid)
    reply = api.client.post(
        path + "a/b%2Fc?x=1", content=b"payload", headers={"x-mine": "1", "authorization": "Bearer own"}
    )
    assert (reply.status_code, reply.text, reply.headers["x-from"]) == (200, "hello", "inside")
    request, body = server.requests[-1]
    assert (request.method, request.target, body) == (b"POST", b"/a/b%2Fc?x=1", b"payload")
    told = dict(request.headers)
    assert told[b"host"] == b"127.0.0.1:8000" and told[b"x-mine"] == b"1"
    assert told[b"authorization"] == b"Bearer own"  # the client's own, never the API's token
    assert told[b"x-forwarded-prefix"] == path.rstrip("/").encode()
    assert api.manager.ports._open == {}  # the connection was counted, then given back


def test_every_wrong_address_gets_the_same_404(api: Api, server: Server) -> None:
    sid = str(api.create()["id"])
    path = _expose(api, sid)
    secret = path.rstrip("/").rsplit("/", 1)[1]
    wrong = [
        path.replace(secret, secret[:-1] + ("A" if secret[-1] != "A" else "B")),  # a secret one letter off
        path.replace(secret, secret[:8]),  # a prefix of it
        path.replace("/8000/", "/8001/"),  # a port not exposed
        path.replace(sid, "sb-000000000000"),  # no such sandbox
    ]
    bodies = set()
    for url in wrong:
        reply = api.client.get(url)
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found", url
        bodies.add(reply.text)
    assert len(bodies) == 1  # nothing tells which part was wrong
    assert server.requests == []
    api.client.delete(f"/v1/sandboxes/{sid}/ports/8000", headers=AUTH)
    assert api.client.get(path).status_code == 404  # unexposed
    assert api.client.post("/ports/sb-1/port/secret/").json()["error"]["code"] == "invalid_request"


def test_the_sandboxs_connections_are_bounded(api: Api, server: Server) -> None:
    sid = str(api.create()["id"])
    path = _expose(api, sid)
    api.manager.ports._open[sid] = MAX_CONNECTIONS
    reply = api.client.get(path)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "limit_exceeded"
    api.manager.ports._open[sid] = MAX_CONNECTIONS - 1
    assert api.client.get(path).status_code == 200
    assert api.manager.ports._open[sid] == MAX_CONNECTIONS - 1


def test_nothing_listening_and_a_broken_server_are_502(api: Api, server: Server) -> None:
    sid = str(api.create()["id"])
    closed = api.client.get(_expose(api, sid, 8001))  # the backend finds nothing on 8001
    assert closed.status_code == 502 and closed.json()["error"]["code"] == "port_unreachable"
    path = _expose(api, sid)
    for answer in (b"", b"this is not HTTP\r\n\r\n"):
        server.answer = answer
        reply = api.client.get(path)
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "port_unreachable", answer
    assert api.manager.ports._open == {}


def test_an_answer_the_server_cuts_short_is_cut_short(api: Api, server: Server) -> None:
    sid = str(api.create()["id"])
    path = _expose(api, sid)
    server.answer = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part"
    reply = api.client.get(path)  # no second answer after the first began: fewer bytes than announced
    assert (reply.status_code, reply.headers["content-length"], reply.content) == (200, "100", b"only part")
    assert api.manager.ports._open == {}


def test_a_killed_sandboxs_ports_are_gone(api: Api, server: Server) -> None:
    sid = str(api.create()["id"])
    path = _expose(api, sid)
    assert api.client.get(path).status_code == 200
    assert api.client.delete(f"/v1/sandboxes/{sid}", headers=AUTH).status_code == 200
    reply = api.client.get(path)
    assert reply.status_code == 404 and json.loads(reply.text)["error"]["code"] == "not_found"
