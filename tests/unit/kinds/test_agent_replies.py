"""The container agent channel reads the agent's replies from the event loop's reader callback: frames
split across reads or several in one, an oversized frame (no agent's: the channel is dropped), and the
agent going away (every waiting exec fails with SandboxGone). A fake agent on a socketpair speaks the
agent's frames."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from dsec.errors import SandboxGone
from dsec.kinds.container.agent import MAX_FRAME, AgentChannel

REPLY = struct.Struct("<cIq")


def frame(kind: bytes, exec_id: int, value: int) -> bytes:
    return struct.pack("<I", REPLY.size) + REPLY.pack(kind, exec_id, value)


async def _started(theirs: socket.socket, chan: AgentChannel) -> asyncio.Task[tuple[int, asyncio.Future[int]]]:
    task = asyncio.create_task(chan.spawn(["true"], [], "/", []))
    await asyncio.sleep(0.01)
    theirs.recv(1 << 16)  # the exec request
    return task


async def test_split_and_joined_frames_each_resolve_their_exec() -> None:
    ours, theirs = socket.socketpair()
    chan = AgentChannel(ours)
    try:
        task = await _started(theirs, chan)
        both = frame(b"S", 1, 4242) + frame(b"X", 1, 7 << 8)
        theirs.sendall(both[:3])  # part of the length
        await asyncio.sleep(0.01)
        theirs.sendall(both[3:20])  # the rest of 'started', part of 'exited'
        pid, exited = await asyncio.wait_for(task, 5)
        assert pid == 4242 and not exited.done()
        theirs.sendall(both[20:])
        assert await asyncio.wait_for(exited, 5) == 7 << 8
        theirs.sendall(frame(b"R", 0, 0) + frame(b"S", 99, 1))  # a hello's answer, a stray reply: ignored
        await asyncio.sleep(0.01)
        assert not chan.closed
    finally:
        await chan.aclose()
        theirs.close()


@pytest.mark.parametrize("ending", ["eof", "oversized"])
async def test_a_lost_or_lying_agent_fails_every_waiting_exec(ending: str) -> None:
    ours, theirs = socket.socketpair()
    chan = AgentChannel(ours)
    try:
        task = await _started(theirs, chan)
        theirs.sendall(frame(b"S", 1, 4242))
        _, exited = await asyncio.wait_for(task, 5)
        if ending == "eof":
            theirs.close()
        else:
            theirs.sendall(struct.pack("<I", MAX_FRAME + 1) + b"\0" * 64)
        with pytest.raises(SandboxGone):
            await asyncio.wait_for(exited, 5)
        assert chan.closed
        with pytest.raises(SandboxGone):
            await chan.spawn(["true"], [], "/", [])
    finally:
        await chan.aclose()
        theirs.close()
