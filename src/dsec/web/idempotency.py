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
import struct
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


# What an entry costs beyond its bytes (measured with tracemalloc, tests/unit/web/test_idempotency.py): a
# running one, its slots and request line; a kept one, packed in one bytes object (the key, the object's
# header, its place in the ordered dict). A kept answer is one object, not a dozen small ones: thousands
# of small objects that live for minutes, made among each request's short-lived ones, keep CPython's
# arenas from being returned and the daemon's resident memory grows well past what they hold.
ENTRY_COST = 400
PACKED_COST = 320
_HEAD = struct.Struct("<dHBBIIH")  # expires, status, complete, digest given, request length, body length, headers
_PAIR = struct.Struct("<II")
_NO_BODY = 0xFFFFFFFF
_DIGEST = blake3.blake3.digest_size  # of a request body (Entry.body_digest)


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

    async def wait(self) -> None:
        if not self.settled:
            if self.waiters is None:
                self.waiters = asyncio.Event()
            await self.waiters.wait()

    def settle(self) -> None:
        """Finished (a cut-off answer is never replayed, so its body goes)."""
        self.settled = True
        if not self.complete:
            self.body = None
        if self.waiters is not None:
            self.waiters.set()
            self.waiters = None


def pack(entry: Entry) -> bytes:
    """A settled entry as one bytes object."""
    body = entry.body
    parts: list[bytes | bytearray] = [
        _HEAD.pack(
            entry.expires,
            entry.status or 0,
            entry.complete,
            entry.body_digest is not None,
            len(entry.request),
            _NO_BODY if body is None else len(body),
            len(entry.headers),
        ),
        entry.request,
        entry.body_digest or b"",
    ]
    for name, value in entry.headers:
        parts += [_PAIR.pack(len(name), len(value)), name, value]
    parts.append(body or b"")
    return b"".join(parts)


def unpack(blob: bytes) -> Entry:
    expires, status, complete, digested, request_len, body_len, count = _HEAD.unpack_from(blob)
    at = _HEAD.size
    request, at = blob[at : at + request_len], at + request_len
    digest = None
    if digested:
        digest, at = blob[at : at + _DIGEST], at + _DIGEST
    headers = []
    for _ in range(count):
        n, v = _PAIR.unpack_from(blob, at)
        at += _PAIR.size
        headers.append((blob[at : at + n], blob[at + n : at + n + v]))
        at += n + v
    body = None if body_len == _NO_BODY else blob[at : at + body_len]
    return Entry(request, expires, True, None, digest, status or None, tuple(headers), body, bool(complete))


def _cost(value: Entry | bytes) -> int:
    if isinstance(value, bytes):
        return PACKED_COST + len(value)
    return ENTRY_COST + len(value.request)


class Memory:
    """The kept answers (packed), and the entries of requests that still run, oldest first; bounded by
    count, bytes and age."""

    def __init__(self, window: float = WINDOW_S, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.window = window
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, Entry | bytes] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held(self) -> int:
        """What the entries cost (an estimate that errs high: see ENTRY_COST)."""
        return self._bytes

    def get(self, ident: bytes) -> Entry | None:
        """The request that still runs under this key, or the answer kept for it (settled)."""
        self._expire()
        value = self._entries.get(ident)
        return unpack(value) if isinstance(value, bytes) else value

    def claim(self, ident: bytes, request: bytes) -> Entry:
        entry = Entry(request, time.monotonic() + self.window)
        self._entries[ident] = entry
        self._bytes += _cost(entry)
        return entry

    def settle(self, ident: bytes, entry: Entry, keep: bool) -> None:
        """The owner finished: keep its answer (packed, counting its bytes), or forget the key."""
        entry.settle()
        if self._entries.get(ident) is entry:
            if keep:
                packed = pack(entry)
                self._entries[ident] = packed  # keeps its place: the order is the claims'
                self._bytes += _cost(packed) - _cost(entry)
            else:
                self._drop(ident)
        self._shrink()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            ident, oldest = next(iter(self._entries.items()))
            if not isinstance(oldest, bytes) or _HEAD.unpack_from(oldest)[0] > now:
                break  # a request that still runs is never forgotten (its repeats wait for it)
            self._drop(ident)

    def _shrink(self) -> None:
        """Drop the oldest answers while over a bound: O(1) a request (no pass over the whole memory)."""
        turned = 0
        while (len(self._entries) > self.max_entries or self._bytes > self.max_bytes) and turned < len(self._entries):
            ident, value = next(iter(self._entries.items()))
            if isinstance(value, bytes):
                self._drop(ident)
            else:  # one that still runs is never dropped (its repeats wait for it): passed over
                self._entries.move_to_end(ident)
                turned += 1

    def _drop(self, ident: bytes) -> None:
        self._bytes -= _cost(self._entries.pop(ident))


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
            if entry.settled:
                await self._replay(entry, request, scope, receive, send)
                return
            await entry.wait()  # a repeat of a request that still runs waits for its answer
            # then looks again: its answer kept, or not (nothing took effect) and this one runs
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
