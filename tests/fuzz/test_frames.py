"""Fuzzing the daemon's side of the two in-sandbox agents' channels: the container agent's replies
(kinds/container/agent.py) and the microVM guest agent's frames (kinds/microvm/channel.py). Both
agents run inside the sandbox, where its root could speak in their place. Whatever they send, the
reader never raises, every waiting call ends (with its result, or the agent's failure, or SandboxGone
once the channel ends), and a frame that claims more than a frame may hold drops the channel at once
instead of being buffered."""

from __future__ import annotations

import asyncio
import socket
import struct

from hypothesis import example, given
from hypothesis import strategies as st

from dsec.errors import BackendError, LimitExceeded, SandboxGone
from dsec.kinds.container import agent
from dsec.kinds.container.agent import AgentChannel
from dsec.kinds.microvm import channel
from dsec.kinds.microvm.channel import GuestChannel
from dsec.protocol.sandbox import ExecResult

from .budget import fuzz, outcome

REPLY = struct.Struct("<cIq")
GUEST_HEADER = struct.Struct("<IcI")
SETTLE = 2.0  # seconds for the daemon's side to settle once the agent has said everything


@st.composite
def agent_replies(draw: st.DrawFn) -> bytes:
    """One length-prefixed reply: well formed (for exec 1, mostly), of another size, or lying about it."""
    kind = draw(st.sampled_from([b"R", b"S", b"F", b"X", b"Z", b"\0"]))
    body = REPLY.pack(kind, draw(st.sampled_from([1, 1, 2, 0, 2**32 - 1])), draw(st.integers(-(2**63), 2**63 - 1)))
    body = draw(st.one_of(st.just(body), st.just(body), st.binary(max_size=40)))
    size = draw(st.sampled_from([len(body)] * 4 + [0, len(body) + 3, agent.MAX_FRAME + 1, 2**32 - 1]))
    return struct.pack("<I", size) + body


def _claims_too_much(frames: list[bytes], limit: int, header: struct.Struct, size_of: int = 0) -> bool:
    """Whether a frame before the stream goes out of step claims more than ``limit``."""
    stream = b"".join(frames)
    pos = 0
    while pos + header.size <= len(stream):
        (size,) = struct.unpack_from("<I", stream, pos)
        if size > limit:
            return True
        if size < size_of:
            return False  # the guest channel drops the connection there
        pos += 4 + size
    return False


async def _container(frames: list[bytes], close: bool) -> None:
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    crashed: list[dict[str, object]] = []  # the channel reads in a loop callback: its exceptions land here
    loop.set_exception_handler(lambda _loop, context: crashed.append(context))
    chan = AgentChannel(ours)
    started: asyncio.Future[int] = loop.create_future()
    exited: asyncio.Future[int] = loop.create_future()
    chan._started[1], chan._exited[1] = started, exited  # an exec in flight, as spawn() leaves it
    try:
        theirs.sendall(b"".join(frames))
        if close:
            theirs.shutdown(socket.SHUT_WR)
        for _ in range(int(SETTLE / 0.005)):  # until the channel stops reading, or SETTLE
            if not chan._reading or crashed:
                break
            await asyncio.sleep(0.005)
        assert not crashed, crashed
        if not close:  # the stream is still open: only a frame claiming too much may have ended it
            assert not chan._reading, "a frame claiming more than MAX_FRAME was waited for"
        assert not chan._reading
        assert chan.closed
        for fut in (started, exited, chan._ready):
            assert fut.done()
            if fut.exception() is not None:
                assert isinstance(fut.exception(), BackendError | SandboxGone | LimitExceeded)
        outcome(f"start: {type(started.exception()).__name__ if started.exception() else 'pid'}")
    finally:
        await chan.aclose()
        theirs.close()


@fuzz(500)
@given(frames=st.lists(agent_replies(), max_size=6))
# a reply claiming 4 GiB, its bytes still coming: the channel buffered them, without bound
@example(frames=[struct.pack("<I", 2**32 - 1) + bytes(64)])
# a start failure whose errno is past a C int: os.strerror's OverflowError killed the reader
@example(frames=[struct.pack("<I", REPLY.size) + REPLY.pack(b"F", 1, 2**40)])
def test_container_agent_replies_settle_every_call(frames: list[bytes]) -> None:
    huge = _claims_too_much(frames, agent.MAX_FRAME, struct.Struct("<I"))
    asyncio.run(_container(frames, close=not huge))


@st.composite
def guest_frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from([b"O", b"e", b"S", b"X", b"F", b"p", b"t", b"R", b"Q"]))
    ident = draw(st.sampled_from([1, 1, 1, 2, 0, 2**32 - 1]))
    payload = draw(
        st.one_of(
            st.binary(max_size=24),
            st.integers(-(2**31), 2**31 - 1).map(lambda s: struct.pack("<i", s)),
            st.tuples(st.integers(-(2**31), 2**31 - 1), st.integers(0, 255)).map(lambda t: struct.pack("<iB", *t)),
            st.integers(-(2**63), 2**63 - 1).map(lambda p: struct.pack("<q", p)),
        )
    )
    size = draw(st.sampled_from([5 + len(payload)] * 5 + [0, 4, 5 + len(payload) + 7, channel.MAX_FRAME + 1]))
    return GUEST_HEADER.pack(size, kind, ident) + payload


async def _guest(frames: list[bytes], version: bytes) -> None:
    huge = _claims_too_much(frames, channel.MAX_FRAME, GUEST_HEADER, size_of=5)
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    chan = GuestChannel(reader, writer)
    try:
        theirs.sendall(GUEST_HEADER.pack(5 + len(version), b"R", 0) + version)
        await chan.wait_ready(SETTLE)
        run = asyncio.ensure_future(chan.run(["true"], {}, "/", None, timeout=30, output_limit=16))
        await asyncio.sleep(0)  # the exec is registered (id 1) and sent
        theirs.sendall(b"".join(frames))
        if not huge:  # else the stream stays open: the frame claiming too much alone must end the call
            theirs.shutdown(socket.SHUT_WR)
        done, _ = await asyncio.wait({run}, timeout=SETTLE)
        assert done, "a call did not end when the agent went away or claimed a frame too large"
        try:
            result = run.result()
        except SandboxGone:
            outcome("exec: agent gone")
        else:
            assert isinstance(result, ExecResult)
            assert result.exit_code is None or 0 <= result.exit_code <= 255
            assert len(result.stdout) <= 16 * 4 and len(result.stderr) <= 16 * 4 + 200
            outcome(f"exec: exit {result.exit_code}")
    finally:
        await chan.aclose()
        theirs.close()
    assert chan._task.done() and (chan._task.cancelled() or chan._task.exception() is None)


@fuzz(500)
@given(frames=st.lists(guest_frames(), max_size=6), version=st.binary(max_size=12))
def test_guest_agent_frames_settle_every_call(frames: list[bytes], version: bytes) -> None:
    asyncio.run(_guest(frames, version))
