"""The container agent's channel when a fork is refused: the agent answers EAGAIN while the sandbox is
at its pids limit (the processes of a command just killed are still being reaped). The channel tries
again for a while, then fails with a clear limit error, not a 500. A fake agent on a socketpair speaks
the agent's frames."""

from __future__ import annotations

import asyncio
import errno
import socket
import struct

import pytest

from dsec.errors import LimitExceeded
from dsec.kinds.container import agent
from dsec.kinds.container.agent import AgentChannel, ProcessLimit

REPLY = struct.Struct("<cIq")


async def _fake_agent(sock: socket.socket, refusals: int, seen: list[int]) -> None:
    """Answer spawn requests: EAGAIN ``refusals`` times, then a pid; ``seen``: the exec ids asked for."""
    loop = asyncio.get_running_loop()
    while True:
        head = await loop.sock_recv(sock, 4)
        if not head:
            return
        (size,) = struct.unpack("<I", head)
        body = b""
        while len(body) < size:
            body += await loop.sock_recv(sock, size - len(body))
        exec_id = struct.unpack_from("<I", body, 1)[0]
        seen.append(exec_id)
        if len(seen) <= refusals:
            reply = REPLY.pack(b"F", exec_id, errno.EAGAIN)
        else:
            reply = REPLY.pack(b"S", exec_id, 4242)
        await loop.sock_sendall(sock, struct.pack("<I", REPLY.size) + reply)


async def _spawn_with(refusals: int) -> tuple[int | BaseException, list[int]]:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    chan = AgentChannel(ours)
    seen: list[int] = []
    fake = asyncio.create_task(_fake_agent(theirs, refusals, seen))
    try:
        try:
            pid: int | BaseException = (await asyncio.wait_for(chan.spawn(["true"], [], "/", []), 10))[0]
        except LimitExceeded as e:
            pid = e
    finally:
        fake.cancel()
        await chan.aclose()
        theirs.close()
    return pid, seen


async def test_a_refused_fork_is_tried_again_until_the_pids_are_free() -> None:
    pid, seen = await _spawn_with(refusals=3)
    assert pid == 4242
    assert len(seen) == 4 and len(set(seen)) == 4  # each try is a request of its own


async def test_a_sandbox_that_stays_at_its_limit_gets_a_clear_limit_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "SPAWN_RETRY_S", 0.2)
    loop = asyncio.get_running_loop()
    began = loop.time()
    error, seen = await _spawn_with(refusals=1000)
    assert isinstance(error, ProcessLimit) and error.code == "limit_exceeded"
    assert "process limit" in str(error)
    assert 0.15 <= loop.time() - began < 2 and len(seen) >= 3
