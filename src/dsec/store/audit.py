"""The audit log: one record per authenticated (or refused) API call, in its own SQLite file.

Recording must cost an exec next to nothing, so a call only appends a tuple to a list in memory; a
background task writes the batch in one transaction off the event loop every ``FLUSH_INTERVAL``
(and at shutdown). A daemon that is killed loses at most that last fraction of a second of records.
A separate file from the state database keeps these writes from queueing behind sandbox records.
Retention: records older than ``keep_days`` and beyond the newest ``max_records`` are deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .db import open_private

log = logging.getLogger("dsec.audit")

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    tenant TEXT,
    method TEXT NOT NULL,
    route TEXT NOT NULL,
    sandbox TEXT,
    status INTEGER NOT NULL,
    duration_ms REAL NOT NULL,
    command TEXT
);
CREATE INDEX IF NOT EXISTS audit_time ON audit(time);
DROP INDEX IF EXISTS audit_sandbox;
DROP INDEX IF EXISTS audit_tenant;
CREATE INDEX IF NOT EXISTS audit_sandbox_time ON audit(sandbox, time);
CREATE INDEX IF NOT EXISTS audit_tenant_time ON audit(tenant, time);
"""
# Queries go newest first by (time, id): time is when a call ended, on the wall clock, so it usually
# follows id, but a clock set back would break paging by time if the order were id's. The indexes carry
# the rowid (id) after their columns: each filter's rows come out in that order without a sort.
FLUSH_INTERVAL = 0.25
PRUNE_INTERVAL = 60.0
MAX_FLUSH = 4096  # a flush writes at most this many; the rest wait for the next tick
MAX_PENDING = 200_000  # a stuck disk must not grow the daemon's memory without bound
COMMAND_BYTES = 256
DEFAULT_KEEP_DAYS = 90.0
DEFAULT_MAX_RECORDS = 1_000_000


@dataclass(frozen=True, slots=True)
class Entry:
    time: float
    tenant: str | None  # None: the token was missing, wrong or revoked
    method: str
    route: str  # the route template, e.g. /v1/sandboxes/{sandbox_id}/exec
    sandbox: str | None
    status: int
    duration_ms: float
    command: str | None = None


def command_head(cmd: str | Sequence[str]) -> str:
    """The first COMMAND_BYTES bytes of a command (an argv joined by spaces), cut on a character boundary."""
    text = cmd if isinstance(cmd, str) else " ".join(cmd)
    raw = text.encode(errors="replace")[:COMMAND_BYTES]
    return raw.decode(errors="ignore")


class AuditLog:
    def __init__(
        self, path: Path, *, keep_days: float = DEFAULT_KEEP_DAYS, max_records: int = DEFAULT_MAX_RECORDS
    ) -> None:
        if keep_days <= 0 or max_records <= 0:
            raise ValueError("audit retention must be positive")
        self.path = path
        self.keep_days = keep_days
        self.max_records = max_records
        self.dropped = 0  # records lost because the writer could not keep up
        self._db = open_private(path, SCHEMA)
        self._db_lock = threading.Lock()
        self._pending: list[Entry] = []
        self._task: asyncio.Task[None] | None = None
        self._last_prune = 0.0
        self._closed = False

    def record(self, entry: Entry) -> None:
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append(entry)

    async def start(self) -> None:
        if self._task is None:
            await asyncio.to_thread(self.prune)
            self._task = asyncio.create_task(self._flush_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not self._closed:
            while batch := self._take():
                self._insert(batch)
            self._closed = True
            # under the lock: a flush cancelled above was awaiting a thread that may still be inserting,
            # and closing a connection under a running statement crashes the process (a segfault in CI)
            with self._db_lock:
                self._db.close()

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL)
            try:
                await self.flush()
                if time.time() - self._last_prune >= PRUNE_INTERVAL:
                    await asyncio.to_thread(self.prune)
            except Exception:  # never let a full disk end auditing for the daemon's lifetime
                log.exception("writing audit records failed")

    async def flush(self) -> None:
        while batch := self._take():
            await asyncio.to_thread(self._insert, batch)

    def _take(self) -> list[Entry]:
        # on the event loop's thread, like record(): nothing is appended while the list is cut
        batch = self._pending[:MAX_FLUSH]
        del self._pending[:MAX_FLUSH]
        return batch

    def _insert(self, batch: list[Entry]) -> None:
        rows = [
            (e.time, e.tenant, e.method, e.route, e.sandbox, e.status, round(e.duration_ms, 3), e.command)
            for e in batch
        ]
        with self._db_lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT INTO audit (time, tenant, method, route, sandbox, status, duration_ms, command) "
                    "VALUES (?,?,?,?,?,?,?,?)",
                    rows,
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def prune(self, now: float | None = None) -> int:
        """Apply the retention bounds; returns how many records went."""
        now = time.time() if now is None else now
        self._last_prune = now
        with self._db_lock:
            gone = self._db.execute("DELETE FROM audit WHERE time < ?", (now - self.keep_days * 86400,)).rowcount
            row = self._db.execute(
                "SELECT id FROM audit ORDER BY id DESC LIMIT 1 OFFSET ?", (self.max_records,)
            ).fetchone()
            if row is not None:
                gone += self._db.execute("DELETE FROM audit WHERE id <= ?", (row[0],)).rowcount
        return gone

    async def query(
        self,
        *,
        tenant: str | None = None,
        sandbox: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 100,
        include_unknown: bool = True,
    ) -> list[Entry]:
        """The newest ``limit`` matching records, oldest first; pending ones are written first.

        ``until``: only records older than it, to the microsecond (a record's time counts as its whole
        microsecond, floored, as the API shows it). Paging back with ``until`` = the oldest time received
        loses nothing: a page never ends inside a microsecond; it holds every record of its oldest
        microsecond, even beyond ``limit``."""
        await self.flush()
        until_us = None if until is None else round(until * 1_000_000)
        return await asyncio.to_thread(self._select, tenant, sandbox, since, until_us, limit, include_unknown)

    def _select(
        self,
        tenant: str | None,
        sandbox: str | None,
        since: float | None,
        until_us: int | None,
        limit: int,
        include_unknown: bool,
    ) -> list[Entry]:
        where: list[str] = []
        args: list[str | float] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        elif not include_unknown:
            where.append("tenant IS NOT NULL")
        if sandbox is not None:
            where.append("sandbox = ?")
            args.append(sandbox)
        if since is not None:
            where.append("time >= ?")
            args.append(since)
        if until_us is not None:
            # loose, for the index on time; then exact: floor(time in µs) < until_us, computed as Python
            # computes it (the same product of doubles)
            where += ["time < ?", "time * 1000000 < ?"]
            args += [(until_us + 1) / 1_000_000, until_us]
        columns = "time, tenant, method, route, sandbox, status, duration_ms, command"
        order = "ORDER BY time DESC, id DESC"
        with self._db_lock:
            rows = self._db.execute(
                f"SELECT id, {columns} FROM audit {_where(where)} {order} LIMIT ?", (*args, limit)
            ).fetchall()
            if len(rows) == limit:  # the rest of the oldest record's microsecond, so that paging skips none
                last_id, last_time = rows[-1][0], rows[-1][1]
                edge = math.floor(last_time * 1_000_000)
                tied = [*where, "time >= ?", "time * 1000000 >= ?", "(time < ? OR (time = ? AND id < ?))"]
                rows += self._db.execute(
                    f"SELECT id, {columns} FROM audit {_where(tied)} {order}",
                    (*args, (edge - 1) / 1_000_000, edge, last_time, last_time, last_id),
                ).fetchall()
        return [Entry(*row[1:]) for row in reversed(rows)]


def _where(conditions: list[str]) -> str:
    return f"WHERE {' AND '.join(conditions)}" if conditions else ""
