"""The live feed of a sandbox's commands for whoever watches it (the console's sandbox page): each exec's
start, output and end, as they happen. Nobody watching costs one dictionary lookup per exec; a watcher
that reads too slowly loses events (counted, and told so), never slows the command down."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..protocol.types import Command

MAX_QUEUED = 2000  # events a watcher may be behind before it loses some
MAX_DATA = 64 << 10  # bytes of one output event: a chunk past this is cut (the exec's own result is whole)


@dataclass(frozen=True, slots=True)
class FeedEvent:
    kind: str  # start | output | end | lost
    exec: int = 0
    cmd: str | None = None
    stream: str | None = None
    data: str | None = None
    exit_code: int | None = None
    error: str | None = None
    dropped: int = 0


class Watcher:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[FeedEvent] = asyncio.Queue(MAX_QUEUED)
        self.dropped = 0

    def put(self, event: FeedEvent) -> None:
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1

    async def next(self) -> FeedEvent:
        if self.dropped and self.queue.empty():
            dropped, self.dropped = self.dropped, 0
            return FeedEvent("lost", dropped=dropped)
        return await self.queue.get()


class ExecFeed:
    def __init__(self) -> None:
        self._watchers: dict[str, set[Watcher]] = {}
        self._numbers = itertools.count(1)

    def watching(self, sandbox_id: str) -> bool:
        return sandbox_id in self._watchers

    @contextmanager
    def watch(self, sandbox_id: str) -> Iterator[Watcher]:
        watcher = Watcher()
        self._watchers.setdefault(sandbox_id, set()).add(watcher)
        try:
            yield watcher
        finally:
            watchers = self._watchers.get(sandbox_id)
            if watchers is not None:
                watchers.discard(watcher)
                if not watchers:
                    del self._watchers[sandbox_id]

    def _send(self, sandbox_id: str, event: FeedEvent) -> None:
        for watcher in self._watchers.get(sandbox_id, ()):
            watcher.put(event)

    def started(self, sandbox_id: str, cmd: Command) -> int:
        number = next(self._numbers)
        shown = cmd if isinstance(cmd, str) else " ".join(cmd)
        self._send(sandbox_id, FeedEvent("start", number, cmd=shown[:4096]))
        return number

    def output(self, sandbox_id: str, number: int, stream: str, data: bytes) -> None:
        text = data[:MAX_DATA].decode(errors="replace")
        self._send(sandbox_id, FeedEvent("output", number, stream=stream, data=text))

    def ended(self, sandbox_id: str, number: int, exit_code: int | None, error: str | None = None) -> None:
        self._send(sandbox_id, FeedEvent("end", number, exit_code=exit_code, error=error))
