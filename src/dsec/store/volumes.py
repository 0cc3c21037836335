"""Named volumes' records in the daemon's state database: name, owner, size, when made.

Only the facts that outlive the daemon are kept here. Which sandboxes mount a volume now is not: it
follows from the live sandboxes' records (each keeps its mounts), and the core rebuilds it from them
after a restart.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import VolumeExists
from .db import open_private

SCHEMA = """
CREATE TABLE IF NOT EXISTS volumes (
    name TEXT PRIMARY KEY,
    owner TEXT,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL
);
"""


@dataclass(frozen=True)
class Volume:
    name: str
    owner: str | None  # the tenant that made it; None: the operator's, which every tenant may read
    size: int
    created_at: float


class VolumeStore:
    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        # the sandbox and tenant stores write the same file through connections of their own
        self._db = open_private(path, SCHEMA, busy_timeout_ms=5000)

    def close(self) -> None:
        self._db.close()

    def add(self, name: str, owner: str | None, size: int) -> Volume:
        volume = Volume(name, owner, size, time.time())
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO volumes (name, owner, size, created_at) VALUES (?,?,?,?)",
                    (name, owner, size, volume.created_at),
                )
            except sqlite3.IntegrityError:
                raise VolumeExists(f"a volume named {name!r} exists on this node") from None
        return volume

    def get(self, name: str) -> Volume | None:
        with self._lock:
            row = self._db.execute(
                "SELECT name, owner, size, created_at FROM volumes WHERE name = ?", (name,)
            ).fetchone()
        return Volume(*row) if row else None

    def all(self) -> list[Volume]:
        with self._lock:
            rows = self._db.execute("SELECT name, owner, size, created_at FROM volumes ORDER BY name").fetchall()
        return [Volume(*row) for row in rows]

    def delete(self, name: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM volumes WHERE name = ?", (name,))
