"""A WebSocket relayed message by message: the client's connection (ASGI, accepted by uvicorn) and one this
side opens to the server (wsproto, client side) over a stream it is given. The node's port proxy opens it
to the server in the sandbox; the cluster gateway, to the node's port proxy.

Each hop keeps its own protocol state (pings are answered where they arrive; fragments are joined before a
message is passed on); messages, subprotocol and close codes pass through. The server's answer to the
handshake decides the client's: accepted with the subprotocol it chose, or refused (``Refused``) with its
status. Both sides are read only as fast as the other takes what was read: uvicorn's ``send`` waits while
the client's socket is full, and a message from the server is bounded as uvicorn bounds the client's.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import h11
from starlette.types import Receive, Scope, Send
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError

READ_SIZE = 64 << 10
HANDSHAKE_TIMEOUT = 30.0
MAX_MESSAGE = 16 << 20  # uvicorn's own bound on a client's message (ws_max_size)
MAX_REFUSAL = 64 << 10  # of a refusal's body, passed on to the client
TOO_BIG = 1009  # the close code for a message over the bound (RFC 6455 7.4.1)
# made by wsproto for the hop it opens, or describing one connection only
SKIPPED = frozenset({b"host", b"connection", b"upgrade", b"keep-alive", b"proxy-connection", b"te"})
SKIPPED_PREFIX = b"sec-websocket-"
JSON = [(b"content-type", b"application/json")]


class Unsendable(ValueError):
    """The client's handshake cannot be passed on (a header its server took that HTTP/1.1 does not)."""


class Refused(Exception):
    """The server answered the handshake with ``status`` instead of switching protocols."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.headers, self.body = status, headers, body


def client_headers(scope: Scope, drop: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """The client's handshake headers that go on to the server (cookies, origin, authorization of its
    own): not those wsproto makes for the next hop, nor ``drop``."""
    return [
        (n, v)
        for n, v in scope.get("headers", [])
        if n not in SKIPPED and not n.startswith(SKIPPED_PREFIX) and n not in drop
    ]


async def deny(
    scope: Scope, send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Refuse the handshake with ``status`` where the server lets us say it, else as uvicorn does (403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        out = [(n, v) for n, v in (JSON if headers is None else headers) if n != b"content-length"]
        out.append((b"content-length", str(len(body)).encode()))
        await send({"type": "websocket.http.response.start", "status": status, "headers": out})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


class Relay:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.ws = WSConnection(ConnectionType.CLIENT)
        self._parts: list[Any] = []
        self._size = 0

    async def handshake(
        self, host: str, target: str, subprotocols: list[str], headers: list[tuple[bytes, bytes]]
    ) -> AcceptConnection:
        """Open the server's side; ``Refused`` if it answers otherwise, ``ConnectionError`` if it closes
        first, ``TimeoutError`` if it does not answer in time, ``Unsendable`` if it cannot be asked."""
        request = Request(host=host, target=target, subprotocols=subprotocols, extra_headers=headers)
        try:
            opening = self.ws.send(request)
        except (h11.LocalProtocolError, LocalProtocolError) as e:
            raise Unsendable(str(e)) from e
        self.writer.write(opening)
        await self.writer.drain()
        refused: RejectConnection | None = None
        body = b""
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):
            while True:
                data = await self.reader.read(READ_SIZE)
                self.ws.receive_data(data or None)
                for event in self.ws.events():
                    if isinstance(event, AcceptConnection):
                        return event
                    if isinstance(event, RejectConnection):
                        refused = event
                        if not event.has_body:
                            raise Refused(event.status_code, list(event.headers), b"")
                    elif isinstance(event, RejectData) and refused is not None:
                        body = (body + event.data)[:MAX_REFUSAL]
                        if event.body_finished:
                            raise Refused(refused.status_code, list(refused.headers), body)
                if not data:
                    if refused is not None:
                        raise Refused(refused.status_code, list(refused.headers), body)
                    raise ConnectionResetError("the server closed the connection before answering the WebSocket")

    async def run(self, receive: Receive, send: Send) -> None:
        """Relay until either side closes; the other is then closed with the same code."""
        upstream = asyncio.create_task(self._from_server(send))
        downstream = asyncio.create_task(self._from_client(receive))
        try:
            await asyncio.wait({upstream, downstream}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (upstream, downstream):
                task.cancel()
            await asyncio.gather(upstream, downstream, return_exceptions=True)

    async def _from_client(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                with contextlib.suppress(Exception):
                    await self._to_server(CloseConnection(code=message.get("code", 1000)))
                return
            if message.get("bytes") is not None:
                await self._to_server(BytesMessage(data=message["bytes"]))
            elif message.get("text") is not None:
                await self._to_server(TextMessage(data=message["text"]))

    async def _to_server(self, event: Any) -> None:
        self.writer.write(self.ws.send(event))
        await self.writer.drain()

    async def _from_server(self, send: Send) -> None:
        while True:
            data = await self.reader.read(READ_SIZE)
            self.ws.receive_data(data or None)
            for event in self.ws.events():
                if isinstance(event, Ping):
                    await self._to_server(event.response())
                elif isinstance(event, TextMessage | BytesMessage):
                    self._parts.append(event.data)
                    self._size += len(event.data)
                    if self._size > MAX_MESSAGE:
                        await self._too_big(send)
                        return
                    if event.message_finished:
                        await self._deliver(send, event)
                elif isinstance(event, CloseConnection):
                    with contextlib.suppress(Exception):
                        await self._to_server(event.response())
                    await send({"type": "websocket.close", "code": event.code, "reason": event.reason or ""})
                    return
            if not data:
                await send({"type": "websocket.close", "code": 1001})  # the server went away
                return

    async def _too_big(self, send: Send) -> None:
        reason = f"a message over {MAX_MESSAGE} bytes"
        with contextlib.suppress(Exception):
            await self._to_server(CloseConnection(code=TOO_BIG, reason=reason))
        await send({"type": "websocket.close", "code": TOO_BIG, "reason": reason})

    async def _deliver(self, send: Send, last: TextMessage | BytesMessage) -> None:
        parts, self._parts, self._size = self._parts, [], 0
        if isinstance(last, TextMessage):
            await send({"type": "websocket.send", "text": "".join(parts)})
        else:
            await send({"type": "websocket.send", "bytes": b"".join(parts)})
