"""WebSocket through an exposed port: the client's connection (ASGI, accepted by uvicorn) relayed message
by message to a WebSocket connection the proxy opens to the server in the sandbox (wsproto, client side).

Each hop keeps its own protocol state (pings are answered where they arrive; fragments are joined before a
message is passed on); messages, subprotocol and close codes pass through. The server's answer to the
handshake decides the client's: accepted with the subprotocol it chose, or refused with its status.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.types import Receive, Scope, Send
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)

from ..errors import PortUnreachable

READ_SIZE = 64 << 10
HANDSHAKE_TIMEOUT = 30.0
SKIPPED = frozenset({b"host", b"connection", b"upgrade", b"sec-websocket-key", b"sec-websocket-version"})
SKIPPED_PREFIX = b"sec-websocket-"


def _extra_headers(scope: Scope, prefix: str) -> list[tuple[bytes, bytes]]:
    out = [(n, v) for n, v in scope.get("headers", []) if n not in SKIPPED and not n.startswith(SKIPPED_PREFIX)]
    return [*out, (b"x-forwarded-prefix", prefix.rstrip("/").encode())]


async def deny(scope: Scope, send: Send, status: int, body: bytes) -> None:
    """Refuse the handshake with ``status`` where the server lets us say it, else as uvicorn does (403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


class Relay:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.ws = WSConnection(ConnectionType.CLIENT)
        self._parts: list[Any] = []

    async def handshake(self, port: int, target: str, scope: Scope, prefix: str) -> AcceptConnection:
        request = Request(
            host=f"127.0.0.1:{port}",
            target=target,
            subprotocols=list(scope.get("subprotocols") or []),
            extra_headers=_extra_headers(scope, prefix),
        )
        self.writer.write(self.ws.send(request))
        await self.writer.drain()
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):
            while True:
                data = await self.reader.read(READ_SIZE)
                self.ws.receive_data(data or None)
                for event in self.ws.events():
                    if isinstance(event, AcceptConnection):
                        return event
                    if isinstance(event, RejectConnection):
                        raise PortUnreachable(f"the server on port {port} refused the WebSocket ({event.status_code})")
                if not data:
                    raise PortUnreachable(f"the server on port {port} closed before answering the WebSocket")

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

    async def _deliver(self, send: Send, last: TextMessage | BytesMessage) -> None:
        parts, self._parts = self._parts, []
        if isinstance(last, TextMessage):
            await send({"type": "websocket.send", "text": "".join(parts)})
        else:
            await send({"type": "websocket.send", "bytes": b"".join(parts)})
