"""The reverse proxy to sandboxes' exposed ports, in front of the node API on the daemon's listener.

``/ports/{sandbox}/{port}/{secret}/{rest}`` is answered here, outside the API's middleware (its traffic is
the sandbox's, not calls to be audited, limited as JSON or replayed by idempotency keys); everything else
goes on to the API. Each request gets a fresh connection to the port on the sandbox's loopback (made by
the kind, core/ports.py), speaks HTTP/1.1 to it with h11 and streams both bodies through: nothing is held
whole, and a slow side slows the other instead of filling memory. The server sees ``Host:
127.0.0.1:{port}``, as a client on the sandbox's loopback would send, and where it was reached from in
``X-Forwarded-Host``, ``X-Forwarded-Proto`` and ``X-Forwarded-Prefix``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Iterable

import h11
from starlette.types import ASGIApp, Receive, Scope, Send

from ..core.manager import SandboxManager
from ..core.ports import PortActions
from ..errors import DsecError, InvalidRequest, PortUnreachable
from ..protocol.ports import PORTS_PREFIX
from ..web.errors import error_response
from .port_websocket import Relay, deny

log = logging.getLogger("dsec.ports")

READ_SIZE = 64 << 10
IDLE_TIMEOUT = 300.0  # seconds without a byte from the sandbox's server before the request fails
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
)


class _ClientGone(Exception):
    """The client disconnected before its request was sent on: nobody waits for an answer."""


def split_path(path: str) -> tuple[str, int, str, str]:
    """``/ports/{sandbox}/{port}/{secret}/{rest}`` → (sandbox, port, secret, "/" + rest)."""
    parts = path[len(PORTS_PREFIX) :].split("/", 3)
    if len(parts) < 3 or not parts[1].isdigit() or not parts[0] or not parts[2]:
        raise InvalidRequest("a port's address is /ports/{sandbox}/{port}/{secret}/...")
    return parts[0], int(parts[1]), parts[2], "/" + (parts[3] if len(parts) == 4 else "")


def upstream_headers(scope: Scope, port: int, prefix: str) -> list[tuple[bytes, bytes]]:
    """The client's headers for the sandbox's server: its own Host, hop-by-hop ones dropped, a body of
    unknown length (the client's was chunked) sent chunked again."""
    out = [(b"host", f"127.0.0.1:{port}".encode())]
    host = b""
    for name, value in scope.get("headers", []):
        if name == b"host":
            host = value
        elif name == b"transfer-encoding":
            out.append((name, b"chunked"))
        elif name not in HOP_BY_HOP:
            out.append((name, value))
    out += [
        (b"x-forwarded-host", host),
        (b"x-forwarded-proto", scope.get("scheme", "http").encode()),
        (b"x-forwarded-prefix", prefix.rstrip("/").encode()),
        (b"connection", b"close"),
    ]
    return out


def _response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(n.lower(), v) for n, v in headers if n.lower() not in HOP_BY_HOP]


def _target(scope: Scope, rest: str) -> str:
    query: bytes = scope.get("query_string", b"")
    return rest + ("?" + query.decode("latin-1") if query else "")


def _error_body(e: DsecError) -> bytes:
    return json.dumps({"error": {"code": e.code, "message": e.message, "detail": e.detail}}).encode()


async def _websocket(
    scope: Scope,
    receive: Receive,
    send: Send,
    stream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    port: int,
    target: str,
    prefix: str,
) -> None:
    reader, writer = stream
    try:
        if (await receive())["type"] != "websocket.connect":
            return
        relay = Relay(reader, writer)
        try:
            accepted = await relay.handshake(port, target, scope, prefix)
        except (DsecError, OSError, TimeoutError) as e:
            err = e if isinstance(e, DsecError) else PortUnreachable(f"port {port}: {e}")
            await deny(scope, send, err.http_status, _error_body(err))
            return
        await send({"type": "websocket.accept", "subprotocol": accepted.subprotocol})
        await relay.run(receive, send)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class PortProxy:
    def __init__(self, app: ASGIApp, manager: SandboxManager) -> None:
        self.app = app
        self.manager = manager  # looked up per request: tests swap the manager behind one app

    @property
    def ports(self) -> PortActions:
        return self.manager.ports

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] not in ("http", "websocket") or not path.startswith(PORTS_PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            sandbox_id, port, secret, rest = split_path(path)
            sock = await self.ports.connect(sandbox_id, port, secret)
        except DsecError as e:
            if scope["type"] == "websocket":
                await deny(scope, send, e.http_status, _error_body(e))
            else:
                await error_response(e.http_status, e.code, e.message, e.detail)(scope, receive, send)
            return
        self.ports.opened(sandbox_id)
        try:
            prefix = path[: len(path) - len(rest) + 1]
            if scope["type"] == "websocket":
                stream = await asyncio.open_connection(sock=sock)
                await _websocket(scope, receive, send, stream, port, _target(scope, rest), prefix)
            else:
                await self._exchange(scope, receive, send, sock, port, rest, prefix)
        finally:
            self.ports.closed(sandbox_id)

    async def _exchange(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        sock: socket.socket,
        port: int,
        rest: str,
        prefix: str,
    ) -> None:
        # the socket itself, not asyncio streams: a stream that failed to write (a server that answered
        # and closed before reading the whole request) refuses to hand over what it had already read
        loop = asyncio.get_running_loop()
        conn = h11.Connection(h11.CLIENT)
        target = _target(scope, rest)
        started = False
        try:
            headers = upstream_headers(scope, port, prefix)
            await loop.sock_sendall(
                sock, conn.send(h11.Request(method=scope["method"], target=target, headers=headers))
            )
            try:
                await _send_body(receive, conn, sock)
            except OSError as e:  # the server may have answered without reading it all (413, 501): read on
                log.debug("port %d: request body not taken whole: %s", port, e)
            started = await _relay_response(conn, sock, send)
        except _ClientGone:
            return
        except (OSError, h11.ProtocolError, TimeoutError) as e:
            if started:  # the answer is under way: all that can be done is to cut it short
                log.info("port %d: response cut short: %s", port, e)
                return
            err = PortUnreachable(f"port {port} of the sandbox did not answer properly: {e}")
            await error_response(err.http_status, err.code, err.message)(scope, receive, send)
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


async def _relay_response(conn: h11.Connection, sock: socket.socket, send: Send) -> bool:
    """Stream the server's answer to the client; True once its start was sent."""
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
            return started
