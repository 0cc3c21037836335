"""Group commit for the trajectory log: every write waits until a transaction holding it committed,
and the writes that arrive while one commits share the next. Thousands of trajectories writing at
once cost one transaction per batch, not one each; a lone write pays one commit.

Two writers with the same contract (``write`` waits for the commit; ``post`` queues a write that nobody
waits for, e.g. a replay's count, which must not make a call answered from the log wait on the log):
- ``LogWriter`` commits on a thread of its own: for commits that wait on a disk sync (SQLite with
  ``durable``) or on a network round trip (PostgreSQL), which must not stall the event loop.
- ``InlineWriter`` commits on the event loop itself: for SQLite without a sync, whose commit is a
  write into the WAL (~70 µs measured here). The round trip to a thread and back costs more than that
  (~0.25 ms), twice per logged call. A write that finds the log idle commits at once; while writes come
  closer together than ``BUSY_GAP``, they are gathered and committed together at the end of the loop
  iteration, so a burst of trajectories shares commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from typing import Any

from ...store.trajectories import TrajectoryStore, Write

log = logging.getLogger("dsec.trajectory")

MAX_GROUP = 512  # calls written by one group commit
BUSY_GAP = 0.0005  # seconds since the last commit under which writes are gathered, not committed at once
_STOP = object()


class InlineWriter:
    def __init__(self, store: TrajectoryStore) -> None:
        self.store = store
        self.commits = 0
        self.writes = 0
        self._pending: list[tuple[Write, asyncio.Future[object] | None]] = []
        self._last = 0.0

    async def write(self, w: Write) -> object:
        now = time.monotonic()
        if not self._pending and now - self._last > BUSY_GAP:
            self._last = now
            self.commits += 1
            self.writes += 1
            return self.store.write([w])[0]  # a lone write's failure raises here
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((w, fut))
        return await asyncio.shield(fut)

    def post(self, w: Write) -> None:
        """Commit ``w`` with the next batch (at the end of this loop iteration at the latest), unawaited:
        its failure is logged."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((w, None))

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:  # close() committed them already
            return
        self._last = time.monotonic()
        try:
            results: list[object] = self.store.write([w for w, _ in batch])
        except Exception as e:
            log.error("trajectory log write failed: %s", e)
            results = [e] * len(batch)
        self.commits += 1
        self.writes += len(batch)
        for (_, fut), res in zip(batch, results, strict=True):
            if fut is None:
                _unawaited(res)
            else:
                _settle(fut, res)

    def close(self) -> None:
        if self._pending:  # writes made after the last iteration ran: commit them before the store closes
            self._flush()


class LogWriter:
    def __init__(self, store: TrajectoryStore) -> None:
        self.store = store
        self.commits = 0
        self.writes = 0
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="dsec-trajectory-writer", daemon=True)
        self._thread.start()

    async def write(self, w: Write) -> object:
        """Run ``w`` in a transaction; returns when it committed (its exception if it failed)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
        self._q.put((w, fut, loop))
        return await asyncio.shield(fut)  # a cancelled caller does not un-write; it stops waiting

    def post(self, w: Write) -> None:
        """Commit ``w`` with the next batch, unawaited: its failure is logged."""
        self._q.put((w, None, None))

    def close(self) -> None:
        self._q.put(_STOP)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            batch = [item]
            stop = False
            while len(batch) < MAX_GROUP:
                try:
                    more = self._q.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                batch.append(more)
            try:
                results: list[object] = self.store.write([w for w, _, _ in batch])
            except Exception as e:  # the store itself failed (disk full, server gone): every write fails
                log.error("trajectory log write failed: %s", e)
                results = [e] * len(batch)
            self.commits += 1
            self.writes += len(batch)
            for (_, fut, loop), res in zip(batch, results, strict=True):
                if fut is None:
                    _unawaited(res)
                    continue
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                    loop.call_soon_threadsafe(_settle, fut, res)
            if stop:
                return


def _unawaited(res: object) -> None:
    if isinstance(res, BaseException):
        log.warning("trajectory log write (unawaited) failed: %s", res)


def _settle(fut: asyncio.Future[object], res: object) -> None:
    if fut.done():
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)
