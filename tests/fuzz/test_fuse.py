"""Fuzzing the FUSE server's request handling (images/fuse.py), with a SOCK_SEQPACKET socket standing in
for /dev/fuse (one read, one request; one write, one reply, as the device does): whatever arrives,
reading never raises, every request whose header can be read gets exactly one well-formed answer
(FORGETs none: the kernel expects none), and a read never answers more than was asked."""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

from dsec.images import fuse
from dsec.images.fuse import FlatDirectory, FuseServer

from .budget import fuzz, outcome

IN_HEADER = struct.Struct("<IIQQIIIHH")
OUT_HEADER = struct.Struct("<IiQ")
READ_IN = struct.Struct("<QQII")
INIT_IN = struct.Struct("<IIIII")
SIZE = 8192
CONTENT = bytes(i % 251 for i in range(SIZE))
OPCODES = [
    *(fuse.LOOKUP, fuse.GETATTR, fuse.OPEN, fuse.READ, fuse.OPENDIR, fuse.READDIR, fuse.STATFS, fuse.INIT),
    *(fuse.FORGET, fuse.BATCH_FORGET, fuse.INTERRUPT, fuse.RELEASE, fuse.FLUSH, fuse.WRITE, fuse.SETXATTR),
    *(fuse.GETXATTR, fuse.CREATE, fuse.ACCESS, 0, 99, 2**32 - 1),
]
NO_ANSWER = {fuse.FORGET, fuse.BATCH_FORGET}


class Layer(FlatDirectory):
    async def lookup(self, name: str) -> int | None:
        return SIZE if name == "layer" else None

    async def read(self, name: str, offset: int, size: int) -> bytes:
        await asyncio.sleep(0)  # a fetch: the read's task yields
        return CONTENT[offset : offset + size]

    def names(self) -> list[str]:
        return ["layer"]


def _body(opcode: int, draw: st.DrawFn) -> bytes:
    if opcode in (fuse.READ, fuse.READDIR):
        offset = draw(st.one_of(st.integers(0, SIZE + 10), st.just(2**64 - 1)))
        size = draw(st.one_of(st.integers(0, 5000), st.sampled_from([fuse.MAX_READ, 2**32 - 1])))
        return READ_IN.pack(0, offset, size, 0)
    if opcode == fuse.LOOKUP:
        return draw(st.sampled_from([b"layer\0", b"nope\0", b"layer", b"", b"\xff\xfe\0", b".\0", b"..\0"]))
    if opcode == fuse.INIT:
        major = draw(st.sampled_from([7, 6, 8]))
        flags = draw(st.integers(0, 2**32 - 1))
        return INIT_IN.pack(major, draw(st.integers(0, 50)), draw(st.integers(0, 2**32 - 1)), flags, flags)
    if opcode == fuse.OPEN:
        return struct.pack("<II", draw(st.integers(0, 2**32 - 1)), 0)
    return b""


@st.composite
def requests(draw: st.DrawFn, unique: int) -> bytes:
    """One request: well formed, or cut short, or with a length field that lies, or noise."""
    opcode = draw(st.sampled_from(OPCODES))
    nodeid = draw(st.sampled_from([fuse.ROOT_ID, 2, 3, 0, 2**64 - 1]))
    body = _body(opcode, draw)
    cut = draw(st.one_of(st.none(), st.integers(0, len(body))))
    if cut is not None:
        body = body[:cut]
    length = draw(st.sampled_from([IN_HEADER.size + len(body)] * 3 + [0, 7, 2**32 - 1]))
    raw = IN_HEADER.pack(length, opcode, unique, nodeid, 0, 0, 0, 0, 0) + body
    if draw(st.integers(0, 9)) == 0:
        raw = draw(st.binary(max_size=IN_HEADER.size + 8))
        raw = raw[:8] + struct.pack("<Q", unique) + raw[16:] if len(raw) >= IN_HEADER.size else raw
    return raw


@st.composite
def sessions(draw: st.DrawFn) -> list[bytes]:
    count = draw(st.integers(1, 12))
    return [draw(requests(unique=2 * i + 2)) for i in range(count)]


async def _serve(batch: list[bytes]) -> list[bytes]:
    kernel, device = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = FuseServer(Layer(), Path("/nonexistent"))
    device.setblocking(False)
    server.fd = device.detach()
    kernel.setblocking(False)
    try:
        for raw in batch:
            kernel.send(raw)
        server._on_readable()  # one drain, as the event loop's reader callback does
        for _ in range(100):
            if not server._tasks:
                break
            await asyncio.sleep(0.001)
        assert not server._tasks, "a request is still unanswered"
        replies = []
        while True:
            try:
                replies.append(kernel.recv(1 << 21))
            except BlockingIOError:
                return replies
    finally:
        server._close()
        kernel.close()


def _expected(batch: list[bytes]) -> list[int]:
    """The ids that must be answered, in the order read (nothing is read after a DESTROY)."""
    ids = []
    for raw in batch:
        if len(raw) < IN_HEADER.size:
            continue  # no header: nobody to answer
        _, opcode, unique = IN_HEADER.unpack_from(raw)[:3]
        if opcode not in NO_ANSWER:
            ids.append(unique)
        if opcode == fuse.DESTROY:
            break
    return ids


@fuzz(600)
@given(batch=sessions())
@example(batch=[IN_HEADER.pack(IN_HEADER.size, fuse.READ, 2, 2, 0, 0, 0, 0, 0)])  # a READ with no body
def test_every_readable_request_gets_exactly_one_well_formed_answer(batch: list[bytes]) -> None:
    replies = asyncio.run(_serve(batch))
    answered: dict[int, tuple[int, bytes]] = {}
    for reply in replies:
        length, error, unique = OUT_HEADER.unpack_from(reply)
        assert length == len(reply), "a reply's length field must be its size"
        assert -4095 <= error <= 0
        assert error == 0 or length == OUT_HEADER.size, "an error carries no payload"
        assert unique not in answered, f"request {unique} answered twice"
        answered[unique] = (error, reply[OUT_HEADER.size :])
    assert sorted(answered) == sorted(_expected(batch))
    for raw in batch:
        if len(raw) >= IN_HEADER.size + READ_IN.size and IN_HEADER.unpack_from(raw)[1] == fuse.READ:
            unique = IN_HEADER.unpack_from(raw)[2]
            error, data = answered.get(unique, (0, b""))
            assert error != 0 or len(data) <= READ_IN.unpack_from(raw, IN_HEADER.size)[2]
    outcome(
        f"{len(answered)} answered, {sum(1 for e, _ in answered.values() if e == 0)} ok, errors "
        + ",".join(sorted({errno.errorcode.get(-e, str(e)) for e, _ in answered.values() if e}))
    )
