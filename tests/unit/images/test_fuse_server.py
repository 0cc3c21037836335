"""The FUSE server's answers, spoken over a pipe instead of /dev/fuse (no root, no mount): every request
it reads gets exactly one answer, whatever arrives with it. The same over the real kernel is in
tests/integration/test_fuse_deadline.py."""

from __future__ import annotations

import asyncio
import errno
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.images import fuse
from dsec.images.fuse import FlatDirectory, FuseServer

IN_HEADER = struct.Struct("<IIQQIIIHH")
OUT_HEADER = struct.Struct("<IiQ")
READ_IN = struct.Struct("<QQII")
INT_REQ_BIT = 1  # the kernel's id of an INTERRUPT: its request's id with the low bit set


class Layer(FlatDirectory):
    async def lookup(self, name: str) -> int | None:
        return 8192 if name == "layer" else None

    async def read(self, name: str, offset: int, size: int) -> bytes:
        await asyncio.sleep(0.01)  # a fetch: the read's task yields at least once
        return bytes([offset // 4096 + 1]) * size


def request(opcode: int, unique: int, nodeid: int, body: bytes) -> memoryview:
    return memoryview(IN_HEADER.pack(IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 0, 0, 0) + body)


@pytest.fixture
def served() -> Iterator[tuple[FuseServer, int]]:
    """A server whose device is a pipe: what it writes is read back from the other end."""
    replies, device = os.pipe()
    os.set_blocking(replies, False)
    server = FuseServer(Layer(), Path("/nonexistent"))
    server.fd = device
    try:
        yield server, replies
    finally:
        os.close(replies)
        server._close()


def answers(replies: int) -> dict[int, tuple[int, bytes]]:
    out: dict[int, tuple[int, bytes]] = {}
    try:
        data = os.read(replies, 1 << 20)
    except BlockingIOError:
        return out
    while data:
        length, error, unique = OUT_HEADER.unpack_from(data)
        assert unique not in out, f"request {unique} answered twice"
        out[unique] = (error, data[OUT_HEADER.size : length])
        data = data[length:]
    return out


async def looked_up(server: FuseServer, replies: int) -> int:
    server._dispatch(request(fuse.LOOKUP, 2, fuse.ROOT_ID, b"layer\0"))
    await asyncio.sleep(0.05)
    error, _ = answers(replies)[2]
    assert error == 0
    return server._ino_by_name["layer"]


async def test_an_interrupt_read_with_its_request_still_gets_the_request_answered(
    served: tuple[FuseServer, int],
) -> None:
    # the reader was signalled (a shell's SIGCHLD) while its READ waited in the kernel's queue: the
    # kernel queues the INTERRUPT as soon as the READ is read, so one drain of the device reads both
    server, replies = served
    ino = await looked_up(server, replies)
    server._dispatch(request(fuse.READ, 10, ino, READ_IN.pack(0, 4096, 4096, 0)))
    server._dispatch(request(fuse.INTERRUPT, 10 | INT_REQ_BIT, 0, struct.pack("<Q", 10)))
    await asyncio.sleep(0.2)
    got = answers(replies)
    assert got[10] == (0, b"\x02" * 4096)  # the read, answered in full: no EINTR for EROFS to fail on
    assert got[10 | INT_REQ_BIT] == (-errno.ENOSYS, b"")  # the kernel stops sending interrupts
    assert not server._tasks


async def test_a_request_cancelled_before_it_ran_is_still_answered(served: tuple[FuseServer, int]) -> None:
    server, replies = served
    ino = await looked_up(server, replies)
    server._dispatch(request(fuse.READ, 12, ino, READ_IN.pack(0, 0, 4096, 0)))
    server._tasks[12].cancel()  # before its first step: _run's own handler never sees it
    await asyncio.sleep(0.05)
    assert answers(replies) == {12: (-errno.EINTR, b"")}
