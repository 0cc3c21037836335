"""Sandbox records in SQLite (WAL). Writes are small and few per sandbox, so they run inline."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from ..protocol.sandbox import Limits, State
from .db import open_private
from .records import SandboxRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    image TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    limits TEXT NOT NULL,
    env TEXT NOT NULL,
    labels TEXT NOT NULL,
    runtime TEXT NOT NULL,
    image_digest TEXT NOT NULL DEFAULT '',
    owner TEXT NOT NULL DEFAULT 'admin'
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
"""


# named, not `*`: a database migrated with ALTER TABLE has its columns in the order they were added
COLUMNS = "id, kind, image, state, reason, created_at, expires_at, limits, env, labels, runtime, image_digest, owner"


class SandboxStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = open_private(path, SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(sandboxes)")}
        if "image_digest" not in columns:  # a state database from before image versions
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN image_digest TEXT NOT NULL DEFAULT ''")
        if "owner" not in columns:  # a state database from before tenants: everything is the operator's
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN owner TEXT NOT NULL DEFAULT 'admin'")

    def close(self) -> None:
        self._db.close()

    def put(self, rec: SandboxRecord) -> None:
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO sandboxes ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    rec.id,
                    rec.kind,
                    rec.image,
                    rec.state.value,
                    rec.reason,
                    rec.created_at,
                    rec.expires_at,
                    rec.limits.model_dump_json(),
                    json.dumps(rec.env),
                    json.dumps(rec.labels),
                    json.dumps(rec.persisted()),
                    rec.image_digest,
                    rec.owner,
                ),
            )

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {COLUMNS} FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return _row(row) if row else None

    def all(self, states: set[State] | None = None) -> list[SandboxRecord]:
        with self._lock:
            if states is None:
                rows = self._db.execute(f"SELECT {COLUMNS} FROM sandboxes ORDER BY created_at").fetchall()
            else:
                marks = ",".join("?" * len(states))
                rows = self._db.execute(
                    f"SELECT {COLUMNS} FROM sandboxes WHERE state IN ({marks}) ORDER BY created_at",
                    tuple(s.value for s in states),
                ).fetchall()
        return [_row(r) for r in rows]

    def delete_older_than(self, ts: float, states: set[State]) -> int:
        marks = ",".join("?" * len(states))
        with self._lock:
            cur = self._db.execute(
                f"DELETE FROM sandboxes WHERE expires_at < ? AND state IN ({marks})",
                (ts, *(s.value for s in states)),
            )
        return cur.rowcount


def _row(row: tuple[object, ...]) -> SandboxRecord:
    (sid, kind, image, state, reason, created, expires, limits, env, labels, runtime, image_digest, owner) = row
    rec = SandboxRecord(
        id=str(sid),
        kind=str(kind),
        image=str(image),
        state=State(str(state)),
        reason=None if reason is None else str(reason),
        created_at=float(created),  # type: ignore[arg-type]
        expires_at=float(expires),  # type: ignore[arg-type]
        limits=Limits.model_validate_json(str(limits)),
        env=json.loads(str(env)),
        labels=json.loads(str(labels)),
        image_digest=str(image_digest),
        owner=str(owner),
    )
    rec.restore(json.loads(str(runtime)))
    return rec
