"""HTTP/1.1 answers read off asyncio streams, parsed by httptools: the one parser of dsec's two clients
of its own servers, the SDK's transport (``sdk/uds.py``) and the gateway's client for its nodes
(``cluster/wire.py``). Each turns a ``ReadFailed`` into its own errors; the connection is closed first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Literal

import httptools

READ_CHUNK = 1 << 16
# A status line and headers may take this much; past it the connection is dropped (httptools sets no
# bound, so a server that kept sending headers would grow the client for ever).
MAX_HEAD = 64 << 10

Failure = Literal["timeout", "io", "closed", "head", "malformed"]


class ReadFailed(Exception):
    """The answer could not be read: ``why`` says how (``cause`` is the underlying error, if any)."""

    def __init__(self, why: Failure, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.why = why
        self.cause = cause


class Connection:
    """One keep-alive connection; ``idle_since`` is when it last went back to its pool."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = time.monotonic()

    def usable(self, expiry: float) -> bool:
        # a connection the server closed (EOF already seen) or that sat idle too long is not reused
        fresh = time.monotonic() - self.idle_since < expiry
        return fresh and not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Answer:
    """One response as it arrives: ``status`` and ``headers`` once ``headers_done``; body chunks queue in
    ``body`` until taken. ``lower``: header names lower-cased (the gateway matches them as bytes)."""

    def __init__(self, lower: bool = False) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte came back (a request that got none never reached the server)
        self._lower = lower
        self._head_bytes = 0
        self._parser = httptools.HttpResponseParser(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower() if self._lower else name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()  # only meaningful inside this callback

    async def feed(self, conn: Connection, timeout: float | None) -> None:
        """Read what the server sent next and parse it."""
        try:
            # asyncio.timeout, not wait_for: wait_for runs the read as a task of its own, a task switch
            # and a turn of the event loop more for every read
            async with asyncio.timeout(timeout):
                data = await conn.reader.read(READ_CHUNK)
        except TimeoutError as e:
            raise ReadFailed("timeout", f"no answer within {timeout:g} s", e) from e
        except OSError as e:
            raise ReadFailed("io", str(e), e) from e
        if not data:
            raise ReadFailed("closed", "the connection closed before the answer was complete")
        self.received = True
        if not self.headers_done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD + READ_CHUNK:  # the last read may hold body bytes too
                raise ReadFailed("head", f"the answer's headers are over {MAX_HEAD} bytes")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            raise ReadFailed("malformed", str(e), e) from e
