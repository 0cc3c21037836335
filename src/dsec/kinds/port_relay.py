"""A connection to a port inside a sandbox that the host cannot enter (a VM's guest), made by a command.

The sandbox's own busybox runs ``nc 127.0.0.1 PORT`` as an ordinary exec whose standard input and output
carry the connection's bytes, and the caller gets one end of a socket pair whose other end is pumped to
and from that exec. So every kind that runs commands can reach its loopback, with the exec path's own
limits and accounting; the cost is a process in the sandbox per connection.

Output arrives as the kind reads it, without a way to slow the command down, so what waits for a slow
client is bounded (``MAX_BUFFERED``): past it the connection is cut, never the daemon's memory grown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from ..protocol.sandbox import MAX_EXEC_TIMEOUT_S, ExecRequest, ExecResult
from .execio import ExecIO

log = logging.getLogger("dsec.ports")

MAX_BUFFERED = 16 << 20
READ_SIZE = 64 << 10
DRAIN_TIMEOUT = 30.0  # seconds for the client to take the answer's end once the command has ended

Run = Callable[[ExecRequest, Callable[[str, bytes], None], ExecIO], Coroutine[Any, Any, ExecResult]]

_relays: set[asyncio.Task[None]] = set()  # running pumps: referenced until they end


async def connect_by_exec(run: Run, busybox: str, port: int) -> socket.socket:
    """One end of a socket pair joined to 127.0.0.1:``port`` inside the sandbox through ``run``."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    req = ExecRequest(
        cmd=[busybox, "nc", "127.0.0.1", str(port)], timeout=MAX_EXEC_TIMEOUT_S, user="root", output_limit=1024
    )
    task = asyncio.create_task(_pump(run, req, ours), name=f"dsec-port-relay-{port}")
    _relays.add(task)
    task.add_done_callback(_relays.discard)
    return theirs


async def _pump(run: Run, req: ExecRequest, sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    io = ExecIO()
    out: asyncio.Queue[bytes] = asyncio.Queue()
    buffered = 0
    overflow = asyncio.Event()

    def on_output(stream: str, data: bytes) -> None:
        nonlocal buffered
        if stream != "stdout" or not data:
            return
        buffered += len(data)
        if buffered > MAX_BUFFERED:
            overflow.set()
        out.put_nowait(data)

    async def to_client() -> None:
        nonlocal buffered
        while data := await out.get():  # b"": the command ended and everything before it was sent
            buffered -= len(data)
            await loop.sock_sendall(sock, data)

    async def from_client() -> None:
        while True:
            data = await loop.sock_recv(sock, READ_SIZE)
            if not data:
                io.close_stdin()
                return
            await io.room(MAX_BUFFERED // 2)  # a command that does not read is waited for, not queued for
            io.feed(data)

    command = asyncio.create_task(run(req, on_output, io))
    sender = asyncio.create_task(to_client())
    others = [asyncio.create_task(from_client()), asyncio.create_task(overflow.wait())]
    try:
        # the command ends, the client goes (the proxy closes only once it is done), or output overflows
        await asyncio.wait([command, sender, *others], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in others:
            t.cancel()
        if not command.done():
            with contextlib.suppress(Exception):
                io.send_signal(signal.SIGKILL)
        with contextlib.suppress(BaseException):
            await command
    try:
        # what the server said last reaches the client before the end (a server may answer and close
        # without reading the whole request: an early 413, a 501); a send cut short would lose bytes
        if not overflow.is_set() and not sender.done():
            out.put_nowait(b"")
            await asyncio.wait_for(sender, DRAIN_TIMEOUT)
        # the end of the answer, then whatever the client still sends is read and dropped until it
        # closes: a unix socket closed with unread input resets its peer, which could lose the answer
        sock.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(DRAIN_TIMEOUT):
            while await loop.sock_recv(sock, READ_SIZE):
                pass
    except (OSError, TimeoutError) as e:
        log.debug("port relay: %s", e)
    finally:
        sender.cancel()
        sock.close()
