"""The gateway's HTTP/1.1 client for its nodes: pooled keep-alive connections on asyncio streams, answers
parsed by httptools, bodies passed through as bytes.

Not httpx: building an httpx request and response (URL parsing, header objects, cookie extraction)
cost about two thirds of the gateway's time per exec when profiled, more than the I/O itself. A pass-
through needs none of it: the caller's method, path and headers go out as they came, and the node's
status, headers and body chunks come back as they are. The client also keeps hold of every connection
it opened, so that closing it (a node declared lost) fails at once the calls still waiting on that
node, even where a dead peer would never send a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from urllib.parse import urlparse

from ..protocol.http1 import MAX_HEAD, Answer, Connection, ReadFailed

CONNECT_TIMEOUT = 3.0
KEEPALIVE_EXPIRY = 30.0  # below the daemon's 120 s: a pooled connection is never one the node is closing
MAX_IDLE = 256
Headers = list[tuple[bytes, bytes]]
# set here from the URL, the body and the token; the caller's copies are dropped
OWN_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection"})


class Broken(Exception):
    """The node could not be reached (``sent`` False: the request never left), or the connection broke
    or timed out after the request was sent (it may or may not have taken effect)."""

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


def _message(failure: ReadFailed) -> str:
    if failure.why in ("timeout", "io"):
        cause = failure.cause
        return f"reading the answer failed: {type(cause).__name__}: {cause}"
    if failure.why == "closed":
        return "the node closed the connection before the answer was complete"
    if failure.why == "head":
        return f"the answer's headers are over {MAX_HEAD} bytes"
    return f"malformed answer: {failure.cause}"


class Response:
    """A node's answer: status and headers at once, the body as it arrives (``chunks``) or whole
    (``read``). Use ``async with`` or ``close()``: a fully read answer gives its connection back."""

    def __init__(self, client: NodeClient, conn: Connection, timeout: float | None) -> None:
        self._client = client
        self._conn: Connection | None = conn
        self._timeout = timeout
        self._answer = Answer(lower=True)

    @property
    def status(self) -> int:
        return self._answer.status

    @property
    def headers(self) -> Headers:
        return self._answer.headers

    @property
    def received(self) -> bool:
        return self._answer.received

    async def _feed(self) -> None:
        conn = self._conn
        if conn is None:
            raise Broken("the answer was closed", sent=True)
        try:
            await self._answer.feed(conn, self._timeout)
        except ReadFailed as e:
            self._drop()
            raise Broken(_message(e), sent=True) from e

    async def _start(self) -> None:
        while not self._answer.headers_done:
            await self._feed()

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    async def chunks(self) -> AsyncIterator[bytes]:
        body = self._answer.body
        while True:
            while body:
                yield body.pop(0)
            if self._answer.complete:
                self._release()
                return
            await self._feed()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def lines(self) -> AsyncIterator[bytes]:
        rest = b""
        async for chunk in self.chunks():
            rest += chunk
            *whole, rest = rest.split(b"\n")
            for line in whole:
                yield line
        if rest:
            yield rest

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._answer.keep_alive:
                self._client._idle_add(conn)
            else:
                self._client._forget(conn)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client._forget(conn)

    async def close(self) -> None:
        if self._answer.complete:
            self._release()
        else:
            self._drop()  # unread: the connection cannot carry another request

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


# not passed back to the caller: they describe one connection, not the answer (RFC 9110 7.6.1), or the
# gateway's own server adds them
RESPONSE_DROP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
    | {b"date", b"server"}
)


@dataclass
class Reply:
    """A node's whole answer."""

    status: int
    headers: Headers
    content: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    def error(self) -> tuple[str, str, dict[str, object]]:
        """(code, message, detail) of an error answer (a node's, or any HTTP error)."""
        try:
            err = json.loads(self.content)["error"]
            return str(err["code"]), str(err["message"]), dict(err.get("detail") or {})
        except (ValueError, KeyError, TypeError):
            return "internal", f"HTTP {self.status}: {self.content[:300].decode(errors='replace')}", {}

    def response_headers(self) -> Headers:
        """The headers to pass back with the content (which the gateway may send re-framed)."""
        return [(k, v) for k, v in self.headers if k not in RESPONSE_DROP and k != b"content-length"]


class NodeClient:
    """Keep-alive connections to one node (``http://HOST:PORT`` or ``unix:///path``)."""

    def __init__(self, url: str, token: str) -> None:
        parsed = urlparse(url)
        self.unix = parsed.path if parsed.scheme == "unix" else None
        if self.unix is None and (parsed.scheme != "http" or not parsed.hostname or parsed.port is None):
            raise ValueError(f"node URL {url!r}: use http://HOST:PORT or unix:///path")
        self.host, self.port = parsed.hostname or "", parsed.port or 0
        self.url = url
        self._host_header = b"dsec" if self.unix else f"{self.host}:{self.port}".encode()
        self._auth = (b"authorization", f"Bearer {token}".encode())
        self._idle: list[Connection] = []
        self._open: set[Connection] = set()
        self.closed = False

    async def _connect(self) -> Connection:
        if self.closed:
            raise Broken(f"the connections to {self.url} are closed", sent=False)
        try:
            if self.unix is not None:
                opening = asyncio.open_unix_connection(self.unix, limit=1 << 20)
            else:
                opening = asyncio.open_connection(self.host, self.port, limit=1 << 20)
            reader, writer = await asyncio.wait_for(opening, CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as e:
            raise Broken(f"cannot connect to {self.url}: {type(e).__name__}: {e}", sent=False) from e
        conn = Connection(reader, writer)
        self._open.add(conn)
        return conn

    @property
    def authority(self) -> str:
        """What the Host header to this node says."""
        return self._host_header.decode()

    def _idle_add(self, conn: Connection) -> None:
        if self.closed or len(self._idle) >= MAX_IDLE or not conn.usable(KEEPALIVE_EXPIRY):
            self._forget(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _forget(self, conn: Connection) -> None:
        conn.close()
        self._open.discard(conn)

    def _head(
        self, method: str, target: str, headers: Iterable[tuple[bytes, bytes]], length: int | None, authorize: bool
    ) -> bytes:
        lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode(), target.encode("latin-1"), self._host_header)]
        authorized = not authorize
        for k, v in headers:
            if k in OWN_HEADERS:
                continue
            authorized = authorized or k == b"authorization"
            lines.append(b"%s: %s\r\n" % (k, v))
        if not authorized:
            lines.append(b"%s: %s\r\n" % self._auth)
        lines.append(b"transfer-encoding: chunked\r\n" if length is None else b"content-length: %d\r\n" % length)
        lines.append(b"\r\n")
        return b"".join(lines)

    async def send(
        self,
        method: str,
        target: str,
        headers: Iterable[tuple[bytes, bytes]] = (),
        body: bytes | AsyncIterator[bytes] = b"",
        *,
        length: int | None = None,
        timeout: float | None = None,
        authorize: bool = True,
    ) -> Response:
        """Send a request; the answer once its status and headers are in. ``headers``: lowercase names.
        A streamed ``body`` goes with ``length`` as its content-length, chunked without one, each chunk
        only once the node has taken the ones before (its memory, and ours, hold no whole upload).
        ``authorize`` False: the operator's token is not added (traffic for a sandbox's own server)."""
        replayable = isinstance(body, bytes)
        head = self._head(method, target, headers, len(body) if isinstance(body, bytes) else length, authorize)
        reuse = replayable  # a stream cannot be sent twice: it goes on a new connection
        while True:
            conn = None
            while reuse and self._idle:
                candidate = self._idle.pop()
                if candidate.usable(KEEPALIVE_EXPIRY):
                    conn = candidate
                    break
                self._forget(candidate)
            reused = conn is not None
            conn = conn or await self._connect()
            resp = Response(self, conn, timeout)
            try:
                if isinstance(body, bytes):
                    conn.writer.write(head + body)
                else:
                    conn.writer.write(head)
                    async for chunk in body:
                        if chunk:
                            conn.writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if length is None else chunk)
                            await conn.writer.drain()
                    if length is None:
                        conn.writer.write(b"0\r\n\r\n")
                await conn.writer.drain()
                await resp._start()
                return resp
            except (OSError, Broken) as e:
                self._forget(conn)
                # an idle connection the node had closed fails before any byte comes back: the request
                # never reached the node, so it goes once more on a new connection
                if reused and not resp.received:
                    reuse = False
                    continue
                if isinstance(e, Broken):
                    raise
                raise Broken(f"sending to {self.url} failed: {e}", sent=True) from e
            except BaseException:
                self._forget(conn)
                raise

    @contextlib.asynccontextmanager
    async def stream(self) -> AsyncIterator[Connection]:
        """A new connection for the caller alone (a WebSocket to pass through), never pooled; closed
        when the caller is done, or at once when the client is (a node declared lost)."""
        conn = await self._connect()
        try:
            yield conn
        finally:
            self._forget(conn)

    async def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes = b"",
        headers: Iterable[tuple[bytes, bytes]] = (),
        timeout: float | None = None,
    ) -> Reply:
        """A request and its whole answer (``timeout``: for all of it)."""
        if timeout is not None:
            try:
                return await asyncio.wait_for(self.request(method, target, body=body, headers=headers), timeout)
            except TimeoutError:
                raise Broken(f"{method} {target} on {self.url}: no answer within {timeout:g} s", sent=True) from None
        async with await self.send(method, target, headers, body) as resp:
            return Reply(resp.status, resp.headers, await resp.read())

    async def aclose(self) -> None:
        """Close every connection, those in use included: their calls fail now with ``Broken``."""
        self.closed = True
        self._idle.clear()
        for conn in list(self._open):
            self._forget(conn)
