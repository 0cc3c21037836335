"""An httpx transport for the daemon's unix socket or plain-HTTP TCP port (a node or a cluster gateway):
HTTP/1.1 on asyncio streams, parsed by httptools.

httpx stays the client (requests, timeouts, streaming, errors); only the connection layer is replaced.
httpcore's generic layer (anyio, h11, pure-Python parsing) costs ~3 ms per call on a slow 2-core host,
more than the daemon spends running a command; this one costs a fraction of that. https URLs keep using
httpx's own transport (TLS).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx

from ..protocol.http1 import MAX_HEAD, Answer, Connection, ReadFailed


def _error(failure: ReadFailed) -> httpx.TransportError:
    if failure.why == "timeout":
        return httpx.ReadTimeout("the daemon did not answer in time")
    if failure.why == "io":
        return httpx.ReadError(str(failure))
    if failure.why == "closed":
        return httpx.RemoteProtocolError("the daemon closed the connection before the response was complete")
    if failure.why == "head":
        return httpx.RemoteProtocolError(f"the response's headers are over {MAX_HEAD} bytes")
    return httpx.RemoteProtocolError(f"malformed response: {failure.cause}")


class _Body(httpx.AsyncByteStream):
    def __init__(self, transport: UnixTransport, conn: Connection, p: Answer, read_timeout: float | None) -> None:
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
        self._idle: list[Connection] = []

    async def _connect(self, timeout: float | None, reuse: bool = True) -> tuple[Connection, bool]:
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
        return Connection(reader, writer), False

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(self.path, limit=1 << 20)

    def _release(self, conn: Connection) -> None:
        if len(self._idle) < self.max_idle and conn.usable(self.keepalive_expiry):
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    async def _feed(self, conn: Connection, p: Answer, timeout: float | None) -> None:
        try:
            await p.feed(conn, timeout)
        except ReadFailed as e:
            conn.close()
            raise _error(e) from e

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        reuse = True
        while True:
            conn, reused = await self._connect(timeouts.get("connect"), reuse)
            p = Answer()
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
        return httpx.Response(
            p.status, headers=p.headers, stream=_Body(self, conn, p, timeouts.get("read")), request=request
        )

    async def _send(self, conn: Connection, request: httpx.Request, timeout: float | None) -> None:
        headers = list(request.headers.raw)
        chunked = any(k.lower() == b"transfer-encoding" for k, _ in headers)
        head = [b"%s %s HTTP/1.1\r\n" % (request.method.encode(), request.url.raw_path)]
        head += [b"%s: %s\r\n" % (k, v) for k, v in headers]
        head.append(b"\r\n")
        if isinstance(request.stream, httpx.ByteStream) and not chunked:
            # a body already in memory goes with its head in one write: one segment, one wake-up of the
            # server, which would otherwise start the request on the head and read the body on a second
            head += request.stream
            conn.writer.write(b"".join(head))
        else:
            conn.writer.write(b"".join(head))
            assert isinstance(request.stream, httpx.AsyncByteStream)
            async for chunk in request.stream:
                if chunked:
                    conn.writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunk else b"")
                elif chunk:
                    conn.writer.write(chunk)
            if chunked:
                conn.writer.write(b"0\r\n\r\n")
        await self._drain(conn, timeout)

    @staticmethod
    async def _drain(conn: Connection, timeout: float | None) -> None:
        if not conn.writer.transport.get_write_buffer_size() and not conn.writer.is_closing():
            return  # all of it went out at once (the usual case): nothing to wait for
        try:
            async with asyncio.timeout(timeout):
                await conn.writer.drain()
        except TimeoutError as e:
            raise httpx.WriteTimeout("writing the request timed out") from e
        except OSError as e:
            raise httpx.WriteError(str(e)) from e

    async def exchange(self, request: bytes, timeout: float | None) -> httpx.Response:
        """One whole request (head and body, as bytes) and its whole answer, without building httpx's
        request and response machinery around them (~0.2 ms of a call on a slow host): the SDK's calls
        with a JSON or empty body. Failures are the httpx errors ``handle_async_request`` raises, and a
        pooled connection the server closed while idle is retried the same way."""
        reuse = True
        while True:
            conn, reused = await self._connect(timeout, reuse)
            p = Answer()
            try:
                conn.writer.write(request)
                await self._drain(conn, timeout)
                while not p.complete:
                    await self._feed(conn, p, timeout)
                break
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                conn.close()
                if reused and not p.received:
                    reuse = False
                    continue
                raise
            except BaseException:
                conn.close()
                raise
        if p.keep_alive:
            self._release(conn)
        else:
            conn.close()
        return httpx.Response(p.status, headers=p.headers, content=b"".join(p.body))

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
