"""An httpx transport for the daemon's unix socket or plain-HTTP TCP port (a node or a cluster gateway):
HTTP/1.1 on asyncio streams, parsed by httptools.

httpx stays the client (requests, timeouts, streaming, errors); only the connection layer is replaced.
httpcore's generic layer (anyio, h11, pure-Python parsing) costs ~3 ms per call on a slow 2-core host,
more than the daemon spends running a command; this one costs a fraction of that. https URLs keep using
httpx's own transport (TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httptools
import httpx

READ_CHUNK = 1 << 16
# A response's status line and headers may take this much; past it the connection is dropped (httptools
# sets no bound, so a server that kept sending headers would grow the client for ever).
MAX_HEAD = 64 << 10


class _Parser:
    """httptools callbacks, collecting one response."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.head_bytes = 0
        self.body: list[bytes] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        # only meaningful inside this callback: the parser resets right after it
        self.keep_alive = self.parser.should_keep_alive()


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = time.monotonic()

    def usable(self, expiry: float) -> bool:
        # a connection the daemon closed (EOF already seen) or that sat idle too long is not reused
        return not self.reader.at_eof() and not self.writer.is_closing() and time.monotonic() - self.idle_since < expiry

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Body(httpx.AsyncByteStream):
    def __init__(self, transport: UnixTransport, conn: _Connection, p: _Parser, read_timeout: float | None) -> None:
        self._transport = transport
        self._conn = conn
        self._p = p
        self._timeout = read_timeout
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            while True:
                while self._p.body:
                    yield self._p.body.pop(0)
                if self._p.complete:
                    break
                await self._transport._feed(self._conn, self._p, self._timeout)
            self._done = True
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if self._done and self._p.keep_alive:
            self._transport._release(conn)
        else:
            conn.close()


class UnixTransport(httpx.AsyncBaseTransport):
    def __init__(self, path: str, max_idle: int = 128, keepalive_expiry: float = 30.0) -> None:
        self.path = path
        self.max_idle = max_idle
        self.keepalive_expiry = keepalive_expiry
        self._idle: list[_Connection] = []

    async def _connect(self, timeout: float | None, reuse: bool = True) -> tuple[_Connection, bool]:
        while reuse and self._idle:
            conn = self._idle.pop()
            if conn.usable(self.keepalive_expiry):
                return conn, True
            conn.close()
        try:
            reader, writer = await asyncio.wait_for(self._open(), timeout)
        except TimeoutError as e:
            raise httpx.ConnectTimeout(f"connecting to {self.path} timed out") from e
        except OSError as e:
            raise httpx.ConnectError(f"cannot connect to {self.path}: {e}") from e
        return _Connection(reader, writer), False

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(self.path, limit=1 << 20)

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) < self.max_idle and conn.usable(self.keepalive_expiry):
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    async def _feed(self, conn: _Connection, p: _Parser, timeout: float | None) -> None:
        try:
            data = await asyncio.wait_for(conn.reader.read(READ_CHUNK), timeout)
        except TimeoutError as e:
            conn.close()
            raise httpx.ReadTimeout("the daemon did not answer in time") from e
        except OSError as e:
            conn.close()
            raise httpx.ReadError(str(e)) from e
        if not data:
            conn.close()
            raise httpx.RemoteProtocolError("the daemon closed the connection before the response was complete")
        p.received = True
        if not p.headers_done:
            p.head_bytes += len(data)
            if p.head_bytes > MAX_HEAD + READ_CHUNK:  # the last read may hold body bytes too
                conn.close()
                raise httpx.RemoteProtocolError(f"the response's headers are over {MAX_HEAD} bytes")
        try:
            p.parser.feed_data(data)
        except httptools.HttpParserError as e:
            conn.close()
            raise httpx.RemoteProtocolError(f"malformed response: {e}") from e

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        reuse = True
        while True:
            conn, reused = await self._connect(timeouts.get("connect"), reuse)
            p = _Parser()
            try:
                await self._send(conn, request, timeouts.get("write"))
                while not p.headers_done:
                    await self._feed(conn, p, timeouts.get("read"))
                break
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                conn.close()
                # A pooled connection the daemon closed while idle fails before a single byte comes
                # back; the request never reached it, so it goes once more on a new connection.
                if reused and not p.received:
                    reuse = False
                    continue
                raise
            except BaseException:
                conn.close()
                raise
        status = p.parser.get_status_code()
        return httpx.Response(
            status, headers=p.headers, stream=_Body(self, conn, p, timeouts.get("read")), request=request
        )

    async def _send(self, conn: _Connection, request: httpx.Request, timeout: float | None) -> None:
        headers = list(request.headers.raw)
        chunked = any(k.lower() == b"transfer-encoding" for k, _ in headers)
        head = [b"%s %s HTTP/1.1\r\n" % (request.method.encode(), request.url.raw_path)]
        head += [b"%s: %s\r\n" % (k, v) for k, v in headers]
        conn.writer.write(b"".join(head) + b"\r\n")
        assert isinstance(request.stream, httpx.AsyncByteStream)
        async for chunk in request.stream:
            if chunked:
                conn.writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunk else b"")
            elif chunk:
                conn.writer.write(chunk)
        if chunked:
            conn.writer.write(b"0\r\n\r\n")
        try:
            await asyncio.wait_for(conn.writer.drain(), timeout)
        except TimeoutError as e:
            raise httpx.WriteTimeout("writing the request timed out") from e
        except OSError as e:
            raise httpx.WriteError(str(e)) from e

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class TcpTransport(UnixTransport):
    """The same over TCP (asyncio sets TCP_NODELAY on its sockets)."""

    def __init__(self, host: str, port: int, max_idle: int = 128, keepalive_expiry: float = 30.0) -> None:
        super().__init__(f"{host}:{port}", max_idle, keepalive_expiry)
        self.host, self.port = host, port

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port, limit=1 << 20)
