"""proc.FdReader: a pipe read to EOF by the event loop's reader callback, without a task."""

from __future__ import annotations

import asyncio
import os

import pytest

from dsec.errors import LimitExceeded
from dsec.proc import FdReader


async def test_every_chunk_is_handed_over_then_eof_resolves_done() -> None:
    r, w = os.pipe()
    got: list[bytes] = []
    reader = FdReader(r, got.append, chunk=4)
    os.write(w, b"0123456789")
    await asyncio.sleep(0.01)
    assert b"".join(got) == b"0123456789" and not reader.done.done()
    os.write(w, b"ab")
    os.close(w)
    await asyncio.wait_for(reader.done, 5)
    assert b"".join(got) == b"0123456789ab" and reader.done.result() is None
    reader.close()  # after EOF: harmless
    os.close(r)


async def test_an_error_of_the_consumer_ends_the_reading_with_it() -> None:
    r, w = os.pipe()
    calls = 0

    def refuse(data: bytes) -> None:
        nonlocal calls
        calls += 1
        raise LimitExceeded("too much")

    reader = FdReader(r, refuse)
    os.write(w, b"x")
    with pytest.raises(LimitExceeded):
        await asyncio.wait_for(reader.done, 5)
    os.write(w, b"more")  # no longer read: the fd left the event loop
    await asyncio.sleep(0.01)
    assert calls == 1
    os.close(w)
    os.close(r)


async def test_close_leaves_the_fd_to_its_owner_and_cancels_done() -> None:
    r, w = os.pipe()
    got: list[bytes] = []
    reader = FdReader(r, got.append)
    reader.close()
    assert reader.done.cancelled()
    os.write(w, b"late")
    await asyncio.sleep(0.01)
    assert got == [] and os.read(r, 10) == b"late"  # still open, no longer watched
    os.close(w)
    os.close(r)
