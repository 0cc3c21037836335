"""Commands on a pseudo-terminal through the container agent: the real agent (agent.c) run as a plain
process with its control socket on fd 3 makes the terminal and passes its master back; the channel
takes from the agent nothing but a terminal's master (a fake agent on a socketpair offers it others)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.errors import BackendError
from dsec.kinds.container import agent
from dsec.kinds.container.agent import MAX_WAITING_FDS, AgentChannel, terminal_master
from dsec.protocol.terminal import PtySize

REPLY = struct.Struct("<cIq")
ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
SIZE = PtySize(rows=24, cols=80)


def frame(kind: bytes, exec_id: int, value: int) -> bytes:
    return struct.pack("<I", REPLY.size) + REPLY.pack(kind, exec_id, value)


def open_fds() -> set[int]:
    """The descriptors this process holds (probed: listing /proc/self/fd would count its own)."""
    held = set()
    for fd in range(4096):
        try:
            os.fstat(fd)
        except OSError:
            continue
        held.add(fd)
    return held


# ---- the real agent ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the sandbox agent")
    return agent.build(tmp_path_factory.mktemp("agent"))


@pytest.fixture
async def channel(agent_bin: Path) -> AsyncIterator[AgentChannel]:
    ours, theirs = socket.socketpair()

    def on_fd_3() -> None:
        os.dup2(theirs.fileno(), 3)

    # pass_fds keeps 3 open: the descriptors not listed are closed after preexec_fn has run
    proc = await asyncio.create_subprocess_exec(str(agent_bin), preexec_fn=on_fd_3, pass_fds=(3, theirs.fileno()))
    theirs.close()
    chan = AgentChannel(ours)
    try:
        await chan.wait_ready(5)
        yield chan
    finally:
        await chan.aclose()
        proc.kill()  # without its daemon the agent parks and waits for another: it never exits by itself
        await proc.wait()


async def _read_until(master: int, pattern: str, within: float = 5.0) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    seen = b""
    os.set_blocking(master, False)
    while not re.search(pattern, seen.decode(errors="replace")):
        assert loop.time() < deadline, f"no {pattern!r} in {seen!r}"
        try:
            seen += os.read(master, 65536)
        except BlockingIOError:
            await asyncio.sleep(0.01)
        except OSError:  # EIO: every descriptor of the slave is closed
            break
    return seen.decode(errors="replace")


async def test_the_agent_runs_a_command_on_a_terminal_it_made(channel: AgentChannel) -> None:
    script = (
        "tty; stty size; [ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo all-three; exec 3</dev/tty && echo has-ctty; "
        'read -r line; echo "got:$line"'
    )
    procs = os.open("/dev/null", os.O_WRONLY)  # stands for the exec cgroup's cgroup.procs
    try:
        pid, exited, master = await channel.spawn_terminal(["sh", "-c", script], ENV, "/", procs, SIZE, None)
    finally:
        os.close(procs)
    try:
        assert pid > 0 and terminal_master(master)
        text = await _read_until(master, "has-ctty")
        assert re.search(r"^/dev/pts/\d+\r$", text, re.M) and "24 80\r\n" in text and "all-three\r\n" in text
        os.write(master, b"typed\n")
        text = await _read_until(master, "got:typed")
        assert "typed\r\n" in text  # echoed by the terminal
        status = await asyncio.wait_for(exited, 5)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(master)


async def test_a_terminal_of_a_given_size(channel: AgentChannel) -> None:
    procs = os.open("/dev/null", os.O_WRONLY)
    try:
        _, exited, master = await channel.spawn_terminal(
            ["stty", "size"], ENV, "/", procs, PtySize(rows=50, cols=200), None
        )
    finally:
        os.close(procs)
    try:
        assert "50 200\r\n" in await _read_until(master, "50 200")
        assert os.waitstatus_to_exitcode(await asyncio.wait_for(exited, 5)) == 0
    finally:
        os.close(master)


# ---- what the channel takes from an agent ---------------------------------------------------------------


async def _offer(descriptor: int | None) -> tuple[int | BaseException, set[int]]:
    """A fake agent answers a terminal exec with an 'M' carrying ``descriptor`` (None: no 'M'); returns
    what spawn_terminal gave and the descriptors the test process holds afterwards."""
    ours, theirs = socket.socketpair()
    chan = AgentChannel(ours)
    before = open_fds()
    try:
        task = asyncio.create_task(chan.spawn_terminal(["sh"], [], "/", theirs.fileno(), SIZE, None))
        await asyncio.sleep(0.05)
        theirs.recv(1 << 16, socket.MSG_DONTWAIT)
        if descriptor is not None:
            payload = frame(b"M", 1, 0)
            theirs.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", descriptor))])
        theirs.sendall(frame(b"S", 1, 4242))
        try:
            got: int | BaseException = (await asyncio.wait_for(task, 5))[2]
        except BackendError as e:
            got = e
        held = open_fds() - before
    finally:
        await chan.aclose()
        theirs.close()
    return got, held


async def test_the_channel_takes_a_terminals_master() -> None:
    master, slave = os.openpty()
    try:
        got, held = await _offer(master)
        assert isinstance(got, int) and got in held and terminal_master(got)
        os.close(got)
    finally:
        os.close(master)
        os.close(slave)


async def test_the_channel_refuses_anything_else_and_keeps_none_of_it(tmp_path: Path) -> None:
    r, w = os.pipe()
    master, slave = os.openpty()
    regular = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
    try:
        for offered in (r, slave, regular):  # a pipe, a terminal's slave side, a file
            got, held = await _offer(offered)
            assert isinstance(got, BackendError) and "without sending its terminal" in str(got)
            assert held == set(), f"kept {held} of descriptor {offered}"
        got, held = await _offer(None)
        assert isinstance(got, BackendError)
    finally:
        for fd in (r, w, master, slave, regular):
            os.close(fd)


def _send_fds(sock: socket.socket, count: int) -> None:
    for _ in range(count):
        fd = os.open("/dev/null", os.O_RDONLY)
        sock.sendmsg([b"\x00"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
        os.close(fd)


async def test_unclaimed_descriptors_are_bounded_and_closed() -> None:
    ours, theirs = socket.socketpair()
    chan = AgentChannel(ours)
    before = open_fds()
    try:
        _send_fds(theirs, 4)  # no terminal asked for: the channel reads none (the kernel drops them)
        await asyncio.sleep(0.1)
        assert open_fds() - before == set()
        task = asyncio.create_task(chan.spawn_terminal(["sh"], [], "/", theirs.fileno(), SIZE, None))
        await asyncio.sleep(0.05)
        theirs.recv(1 << 16, socket.MSG_DONTWAIT)
        before = open_fds()
        _send_fds(theirs, 3 * MAX_WAITING_FDS)  # while one is: no frame claims these
        await asyncio.sleep(0.1)
        assert 0 < len(open_fds() - before) <= MAX_WAITING_FDS
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await chan.aclose()
        theirs.close()
    assert open_fds() - before == set()
