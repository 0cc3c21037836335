"""The FUSE server over the real kernel. A request it cannot serve in time is answered with EIO before
the kernel's request timeout: at that timeout the kernel aborts the whole connection, and every layer
mounted from it (every sandbox's image) fails at once. Seen in the full suite: one wedged read took a
daemon's layers down. And a reader signalled while its read waits is still answered in full: the
suite's flake of many stops (a sandbox's shell hung in D state in request_wait_answer) was a READ whose
INTERRUPT arrived with it and cancelled it before it ran, so nothing ever answered it."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import subprocess
import sys
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


# opens the file and maps it (the server answers LOOKUP and OPEN), then on "go" touches its second page:
# with MADV_RANDOM the fault asks FUSE for that page synchronously, in this very task, where a signal
# makes the kernel send an INTERRUPT for the READ
READER = """
import mmap, os, signal, sys
signal.signal(signal.SIGUSR1, lambda *_: None)
fd = os.open(sys.argv[1], os.O_RDONLY)
mm = mmap.mmap(fd, 8192, prot=mmap.PROT_READ)
mm.madvise(mmap.MADV_RANDOM)
print("ready", flush=True)
sys.stdin.readline()
print(mm[4096:4100].decode(), flush=True)
"""


async def test_a_read_signalled_before_the_server_took_it_is_answered_in_full() -> None:
    mnt = Path(tempfile.mkdtemp(prefix="dsec-fuse-", dir="/tmp"))
    server = FuseServer(OneFileHangs(), mnt, request_timeout=60)
    await server.start()
    reader = subprocess.Popen(  # noqa: ASYNC220 (started once; it never blocks us)
        [sys.executable, "-c", READER, str(mnt / "serves")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdin is not None and reader.stdout is not None
    try:
        assert await asyncio.to_thread(reader.stdout.readline) == "ready\n"
        # the event loop is held on purpose: the READ waits in the kernel's queue while its reader gets
        # a signal it handles, so reading the READ makes the kernel queue an INTERRUPT right behind it
        reader.stdin.write("go\n")
        reader.stdin.flush()
        time.sleep(0.5)  # noqa: ASYNC251 (the loop is held on purpose)
        os.kill(reader.pid, signal.SIGUSR1)
        time.sleep(0.3)  # noqa: ASYNC251
        line = await asyncio.wait_for(asyncio.to_thread(reader.stdout.readline), 20)
        assert line == "xxxx\n"  # the page itself: neither lost nor failed with EINTR
        assert await asyncio.to_thread(reader.wait, 10) == 0
    finally:
        await server.stop()  # first: a reader still waiting on us is released when the device closes
        reader.kill()
        reader.wait()
        shutil.rmtree(mnt, ignore_errors=True)
