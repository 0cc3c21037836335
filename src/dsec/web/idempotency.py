"""Idempotency keys: a mutating request sent twice runs once.

A client that loses its connection after writing a request cannot know whether the request arrived, so
it cannot safely send it again: for ``POST /exec`` that could run a non-idempotent command twice. With
an ``Idempotency-Key`` header (the SDK sends one with every POST, PUT, PATCH and DELETE, and keeps it
for its retries), the daemon remembers the request's answer for a window and answers a repeat from
memory:

- a repeat that arrives while the first still runs waits for it, then gets its answer;
- a finished answer is replayed as it was (status, headers and body, marked ``Idempotent-Replayed``);
- an answer that says nothing happened (429, 499, 503) is not kept: a repeat runs afresh;
- an answer that was cut off (a stream whose client went away: the command was stopped) or too large
  to keep is not run again: the repeat gets a 409 that says so;
- the same key with another method, path, query or body is a client's mistake: 409.

Keys are scoped to the caller's credentials (a digest of its authorization headers), so one tenant can
neither read nor block another's. Memory is bounded (entries, bytes, window); the daemon's restart
forgets every key.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import blake3
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import IdempotencyConflict, InvalidRequest

HEADER = b"idempotency-key"
REPLAYED = (b"idempotent-replayed", b"true")
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# answers that mean nothing took effect: the key is released, and a repeat runs afresh
NOT_KEPT = frozenset({429, 499, 503})
MAX_KEY = 255
WINDOW_S = 300.0
MAX_ENTRIES = 100_000
MAX_BYTES = 64 << 20  # what the kept answers cost in all (Entry.size)
MAX_REPLAY_BODY = 8 << 20  # one answer larger than this is remembered as done but not replayed
MAX_DIGESTED = 256 << 20  # a repeat's body is hashed up to the largest upload the API takes
# the headers that say who is calling, on the node API (bearer), the E2B control API and envd
CREDENTIALS = (b"authorization", b"x-api-key", b"x-access-token", b"e2b-sandbox-id")

ErrorReply = Callable[[int, str, str], Callable[[Scope, Receive, Send], Awaitable[None]]]


# what a kept answer costs beyond its bytes (measured with tracemalloc, tests/unit/server/test_idempotency.py):
# the entry's slots, its place in the ordered dict, its key; and each header pair's two bytes objects
ENTRY_COST = 400
HEADER_COST = 120


@dataclass(eq=False, slots=True)
class Entry:
    request: bytes  # method, path and query of the first request
    expires: float
    settled: bool = False
    # made only when a repeat arrives while the first still runs (most keys are never repeated)
    waiters: asyncio.Event | None = None
    body_digest: bytes | None = None  # of the first request's body, when the app read all of it
    status: int | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes | bytearray | None = field(default_factory=bytearray)  # None: not replayable
    complete: bool = False  # the whole answer was sent (not cut off)
    counted: int = 0  # the bytes the memory counts for it

    @property
    def size(self) -> int:
        headers = sum(len(k) + len(v) + HEADER_COST for k, v in self.headers)
        return ENTRY_COST + len(self.request) + len(self.body or b"") + headers

    async def wait(self) -> None:
        if not self.settled:
            if self.waiters is None:
                self.waiters = asyncio.Event()
            await self.waiters.wait()

    def settle(self) -> None:
        """Finished: kept in its smallest form (a cut-off answer is never replayed, so its body goes)."""
        self.settled = True
        self.body = bytes(self.body) if self.body is not None and self.complete else None
        if self.waiters is not None:
            self.waiters.set()
            self.waiters = None


class Memory:
    """The kept answers, oldest first; bounded by count, bytes and age."""

    def __init__(self, window: float = WINDOW_S, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.window = window
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held(self) -> int:
        """What the kept answers cost (an estimate that errs high: see ENTRY_COST)."""
        return self._bytes

    def get(self, ident: bytes) -> Entry | None:
        self._expire()
        return self._entries.get(ident)

    def claim(self, ident: bytes, request: bytes) -> Entry:
        entry = Entry(request, time.monotonic() + self.window)
        self._entries[ident] = entry
        self._count(entry)
        return entry

    def settle(self, ident: bytes, entry: Entry, keep: bool) -> None:
        """The owner finished: keep its answer (counting its bytes), or forget the key."""
        entry.settle()
        if self._entries.get(ident) is entry:
            if keep:
                self._count(entry)
            else:
                self._drop(ident, entry)
        self._shrink()

    def _count(self, entry: Entry) -> None:
        size = entry.size
        self._bytes += size - entry.counted
        entry.counted = size

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            ident, oldest = next(iter(self._entries.items()))
            if oldest.expires > now or not oldest.settled:
                break
            self._drop(ident, oldest)

    def _shrink(self) -> None:
        """Drop the oldest answers while over a bound: O(1) a request (no pass over the whole memory)."""
        turned = 0
        while (len(self._entries) > self.max_entries or self._bytes > self.max_bytes) and turned < len(self._entries):
            ident, entry = next(iter(self._entries.items()))
            if entry.settled:
                self._drop(ident, entry)
            else:  # one that still runs is never dropped (its repeats wait for it): passed over
                self._entries.move_to_end(ident)
                turned += 1

    def _drop(self, ident: bytes, entry: Entry) -> None:
        del self._entries[ident]
        self._bytes -= entry.counted


class Idempotency:
    """ASGI middleware; ``error`` makes the API's own error answer (status, code, message)."""

    def __init__(self, app: ASGIApp, error: ErrorReply, memory: Memory | None = None) -> None:
        self.app = app
        self.error = error
        self.memory = memory if memory is not None else Memory()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in MUTATING:
            await self.app(scope, receive, send)
            return
        key = next((v for k, v in scope["headers"] if k == HEADER), None)
        if key is None:
            await self.app(scope, receive, send)
            return
        if not 0 < len(key) <= MAX_KEY or not all(0x21 <= b <= 0x7E for b in key):
            problem = InvalidRequest(f"Idempotency-Key must be 1-{MAX_KEY} visible ASCII characters")
            await self.error(400, problem.code, problem.message)(scope, receive, send)
            return
        ident = _ident(scope, key)
        request = b"%s %s?%s" % (scope["method"].encode(), scope.get("raw_path") or b"", scope.get("query_string", b""))
        while (entry := self.memory.get(ident)) is not None:
            await entry.wait()  # a repeat of a request that still runs waits for its answer
            if self.memory.get(ident) is entry:
                await self._replay(entry, request, scope, receive, send)
                return
            # the first one's answer was not kept (nothing took effect): this one runs
        await self._run(ident, self.memory.claim(ident, request), scope, receive, send)

    async def _run(self, ident: bytes, entry: Entry, scope: Scope, receive: Receive, send: Send) -> None:
        hasher = blake3.blake3()
        read_all = False

        async def hashed() -> Message:
            nonlocal read_all
            message = await receive()
            if message["type"] == "http.request":
                hasher.update(message.get("body", b""))
                read_all = read_all or not message.get("more_body", False)
            return message

        async def kept(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry.status = int(message["status"])
                entry.headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body":
                if entry.body is not None:
                    entry.body += message.get("body", b"")
                    if len(entry.body) > MAX_REPLAY_BODY:
                        entry.body = None
                entry.complete = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, hashed, kept)
        finally:
            entry.body_digest = hasher.digest() if read_all else None
            self.memory.settle(ident, entry, keep=entry.status is not None and entry.status not in NOT_KEPT)

    async def _replay(self, entry: Entry, request: bytes, scope: Scope, receive: Receive, send: Send) -> None:
        digest = await _body_digest(receive)
        if request != entry.request or (entry.body_digest is not None and digest not in (None, entry.body_digest)):
            problem = IdempotencyConflict(
                "this Idempotency-Key was used for another request "
                f"({entry.request.decode(errors='replace')[:200]}); a key names one request"
            )
        elif not entry.complete or entry.body is None:
            why = "was cut off while it ran (its client went away)" if not entry.complete else "is too large to keep"
            problem = IdempotencyConflict(
                f"the request with this Idempotency-Key already ran (status {entry.status}) and its answer {why}: "
                "it is not run again"
            )
        else:
            assert entry.status is not None
            await send({"type": "http.response.start", "status": entry.status, "headers": [*entry.headers, REPLAYED]})
            await send({"type": "http.response.body", "body": bytes(entry.body)})
            return
        await self.error(problem.http_status, problem.code, problem.message)(scope, receive, send)


def _ident(scope: Scope, key: bytes) -> bytes:
    h = blake3.blake3()
    for name, value in scope["headers"]:
        if name in CREDENTIALS:
            h.update(name + b"\0" + value + b"\0")
    h.update(b"\1" + key)
    return h.digest()


async def _body_digest(receive: Receive) -> bytes | None:
    """The digest of a repeat's body (read, not kept); None when it was not read to its end."""
    hasher = blake3.blake3()
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > MAX_DIGESTED:
            return None
        hasher.update(chunk)
        if not message.get("more_body", False):
            return hasher.digest()
