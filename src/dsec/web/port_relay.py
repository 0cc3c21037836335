"""One request, or one WebSocket, relayed to a server on a sandbox's loopback over a connection to it
that the caller opened: the node's port proxy (server/port_proxy.py) and the E2B API's ports
(e2b/ports.py) find, check and open the port each their own way, then hand the connection here.

The request is spoken to the server as HTTP/1.1 with h11, both bodies streamed through: nothing is held
whole, and a slow side slows the other instead of filling memory. The server sees ``Host:
127.0.0.1:{port}``, as a client on the sandbox's loopback would send, and where it was reached from in
``X-Forwarded-Host``, ``X-Forwarded-Proto`` (kept as they came when a proxy in front, such as the cluster
gateway, set them) and ``X-Forwarded-Prefix``. WebSockets are relayed message by message (ws_relay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import h11
from starlette.types import Message, Receive, Scope, Send

from ..errors import DsecError, InvalidRequest, PortUnreachable
from .disconnect import unless_gone
from .ws_relay import Refused, Relay, Unsendable, client_headers, deny

log = logging.getLogger("dsec.ports")

READ_SIZE = 64 << 10
IDLE_TIMEOUT = 300.0  # seconds without a byte from the sandbox's server before the request fails
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
)
# set here, whatever the client sent: the server's own Host, and the prefix of the proxy it was reached by
OURS = frozenset({b"host", b"x-forwarded-prefix"})

ErrorShape = Callable[[DsecError], tuple[int, bytes]]  # an error as (status, JSON body) of the API serving it


@dataclass(frozen=True)
class Hop:
    """Where a request goes in the sandbox, and what its server is told."""

    port: int
    target: str  # the path and query for the server, percent-encoded as the client sent them
    prefix: str = ""  # the URL's path up to the port's root ("" when the server's root is the URL's)
    drop: frozenset[bytes] = field(default_factory=frozenset)  # the client's headers that stop here
    host: str | None = None  # the Host the server is told (None: its own address, 127.0.0.1:PORT)


class _ClientGone(Exception):
    """The client disconnected before its request was sent on: nobody waits for an answer."""


def dsec_error(e: DsecError) -> tuple[int, bytes]:
    return e.http_status, json.dumps({"error": {"code": e.code, "message": e.message, "detail": e.detail}}).encode()


def raw_path(scope: Scope) -> str:
    """The request's path as the client sent it (percent-encoded): what the sandbox's server gets."""
    raw = scope.get("raw_path")
    return raw.decode("latin-1") if isinstance(raw, bytes) else str(scope.get("path", ""))


def request_target(scope: Scope, rest: str) -> str:
    """``rest`` and the query, as the request line to the server carries them (visible ASCII only)."""
    query: bytes = scope.get("query_string", b"")
    target = rest + ("?" + query.decode("latin-1") if query else "")
    if not all(0x21 <= ord(c) <= 0x7E for c in target):
        raise InvalidRequest("the request's path holds characters a request line cannot carry: percent-encode them")
    return target


def forwarded(scope: Scope, prefix: str) -> list[tuple[bytes, bytes]]:
    """Where the server was reached from: the client's Host and scheme, unless a proxy in front said so
    already (its X-Forwarded-Host and -Proto then pass on as they came), and the prefix."""
    headers = scope.get("headers", [])
    names = {n for n, _ in headers}
    out = []
    if b"x-forwarded-host" not in names:
        out.append((b"x-forwarded-host", next((v for n, v in headers if n == b"host"), b"")))
    if b"x-forwarded-proto" not in names:
        out.append((b"x-forwarded-proto", b"https" if scope.get("scheme") in ("https", "wss") else b"http"))
    if prefix:
        out.append((b"x-forwarded-prefix", prefix.rstrip("/").encode()))
    return out


def upstream_headers(scope: Scope, hop: Hop) -> list[tuple[bytes, bytes]]:
    """The client's headers for the sandbox's server: its own Host, hop-by-hop ones and ``hop.drop``
    left out, a body of unknown length (the client's was chunked) sent chunked again."""
    out = [(b"host", (hop.host or f"127.0.0.1:{hop.port}").encode())]
    for name, value in scope.get("headers", []):
        if name == b"transfer-encoding":
            out.append((name, b"chunked"))
        elif name not in HOP_BY_HOP and name not in OURS and name not in hop.drop:
            out.append((name, value))
    return [*out, *forwarded(scope, hop.prefix), (b"connection", b"close")]


def _response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(n.lower(), v) for n, v in headers if n.lower() not in HOP_BY_HOP]


async def refuse(scope: Scope, send: Send, status: int, body: bytes) -> None:
    """An error answer of the proxy's own, to an HTTP request or a WebSocket's handshake."""
    if scope["type"] == "websocket":
        await deny(scope, send, status, body)
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def relay(
    scope: Scope, receive: Receive, send: Send, sock: socket.socket, hop: Hop, errors: ErrorShape = dsec_error
) -> None:
    """Carry one request (or WebSocket) over ``sock``, a connection opened to the sandbox's port, which
    is closed when it is over."""
    if scope["type"] == "websocket":
        await _websocket(scope, receive, send, sock, hop, errors)
    else:
        await _exchange(scope, receive, send, sock, hop, errors)


async def _websocket(
    scope: Scope, receive: Receive, send: Send, sock: socket.socket, hop: Hop, errors: ErrorShape
) -> None:
    try:
        reader, writer = await asyncio.open_connection(sock=sock)
    except OSError:
        sock.close()
        raise
    try:
        if (await receive())["type"] != "websocket.connect":
            return
        relay = Relay(reader, writer)
        headers = client_headers(scope, OURS | hop.drop) + forwarded(scope, hop.prefix)
        try:
            subprotocols = list(scope.get("subprotocols") or [])
            accepted = await relay.handshake(f"127.0.0.1:{hop.port}", hop.target, subprotocols, headers)
        except Unsendable as e:
            await deny(scope, send, *errors(InvalidRequest(f"the WebSocket's handshake cannot be passed on: {e}")))
            return
        except (Refused, OSError, TimeoutError) as e:
            why = f"refused the WebSocket ({e.status})" if isinstance(e, Refused) else f"did not answer: {e}"
            await deny(scope, send, *errors(PortUnreachable(f"the server on port {hop.port} {why}")))
            return
        await send({"type": "websocket.accept", "subprotocol": accepted.subprotocol})
        await relay.run(receive, send)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _exchange(
    scope: Scope, receive: Receive, send: Send, sock: socket.socket, hop: Hop, errors: ErrorShape
) -> None:
    # the socket itself, not asyncio streams: a stream that failed to write (a server that answered
    # and closed before reading the whole request) refuses to hand over what it had already read
    loop = asyncio.get_running_loop()
    conn = h11.Connection(h11.CLIENT)
    started = False

    async def answering(message: Message) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        try:
            head = conn.send(
                h11.Request(method=scope["method"], target=hop.target, headers=upstream_headers(scope, hop))
            )
        except h11.LocalProtocolError as e:  # a header the client's server took and HTTP/1.1 does not
            await refuse(scope, send, *errors(InvalidRequest(f"the request cannot be passed on: {e}")))
            return
        await loop.sock_sendall(sock, head)
        try:
            await _send_body(receive, conn, sock)
        except OSError as e:  # the server may have answered without reading it all (413, 501): read on
            log.debug("port %d: request body not taken whole: %s", hop.port, e)
        # a client that leaves ends the answer (an endless event stream included) and the connection
        await unless_gone(receive, _relay_response(conn, sock, answering), f"port {hop.port}")
    except _ClientGone:
        return
    except (OSError, h11.ProtocolError, TimeoutError) as e:
        if started:  # the answer is under way: all that can be done is to cut it short
            log.info("port %d: response cut short: %s", hop.port, e)
            return
        err = PortUnreachable(f"port {hop.port} of the sandbox did not answer properly: {e}")
        await refuse(scope, send, *errors(err))
    finally:
        sock.close()


async def _send_body(receive: Receive, conn: h11.Connection, sock: socket.socket) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        body = message.get("body", b"")
        if body:
            await asyncio.get_running_loop().sock_sendall(sock, conn.send(h11.Data(data=body)))
        if not message.get("more_body", False):
            await asyncio.get_running_loop().sock_sendall(sock, conn.send(h11.EndOfMessage()))
            return


async def _relay_response(conn: h11.Connection, sock: socket.socket, send: Send) -> None:
    """Stream the server's answer to the client."""
    started = False
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, READ_SIZE), IDLE_TIMEOUT)
            conn.receive_data(data)
            continue
        if isinstance(event, h11.InformationalResponse):
            continue  # 100 Continue and the like: the client's body was sent whole already
        if isinstance(event, h11.Response):
            headers = _response_headers(event.headers)
            await send({"type": "http.response.start", "status": event.status_code, "headers": headers})
            started = True
        elif isinstance(event, h11.Data):
            await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            if not started:
                raise OSError("the server closed the connection without an answer")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
