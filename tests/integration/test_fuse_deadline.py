"""The FUSE server answers a request it cannot serve in time with EIO, before the kernel's request
timeout: at that timeout the kernel aborts the whole connection, and every layer mounted from it (every
sandbox's image) fails at once. Seen in the full suite: one wedged read took a daemon's layers down."""

from __future__ import annotations

import asyncio
import errno
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from dsec.images.fuse import FlatDirectory, FuseServer

SIZE = 8192


class OneFileHangs(FlatDirectory):
    def __init__(self) -> None:
        self.files = {"hangs": SIZE, "serves": SIZE}

    async def lookup(self, name: str) -> int | None:
        return self.files.get(name)

    async def read(self, name: str, offset: int, size: int) -> bytes:
        if name == "hangs":
            await asyncio.Event().wait()  # a fetch that never completes
        return b"x" * max(0, min(size, SIZE - offset))

    def names(self) -> list[str]:
        return list(self.files)


def read(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


async def test_a_wedged_read_fails_alone_and_the_mount_lives_on() -> None:
    mnt = Path(tempfile.mkdtemp(prefix="dsec-fuse-", dir="/tmp"))
    server = FuseServer(OneFileHangs(), mnt, request_timeout=4)
    await server.start()
    try:
        started = time.monotonic()
        with pytest.raises(OSError) as failed:
            await asyncio.to_thread(read, mnt / "hangs")
        took = time.monotonic() - started
        assert failed.value.errno == errno.EIO
        # each request answered at our deadline (3 s), before the kernel's (4 s); the kernel asks twice
        # (its readahead, then the read itself), so the reader waits 3 or 6 s
        assert 2.5 < took < 7, took
        assert await asyncio.to_thread(read, mnt / "serves") == b"x" * SIZE
        assert not server.closed.is_set()  # the connection was not aborted
    finally:
        await server.stop()
        shutil.rmtree(mnt, ignore_errors=True)
