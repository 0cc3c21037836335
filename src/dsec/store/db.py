"""The daemon's SQLite files: private (0600 before SQLite first writes), WAL, autocommit."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path


def open_private(path: Path, schema: str, *, busy_timeout_ms: int = 0) -> sqlite3.Connection:
    """A connection to ``path`` (created 0600) with ``schema`` applied. WAL with synchronous=NORMAL: a
    committed transaction survives a daemon crash; a power loss may drop the last ones.
    ``busy_timeout_ms``: for a file another connection of the daemon writes too."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    if busy_timeout_ms:
        db.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    db.executescript(schema)
    return db
