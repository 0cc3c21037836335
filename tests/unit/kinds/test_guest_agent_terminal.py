"""Commands on a pseudo-terminal through the microvm/vm guest agent, run as a plain process on one end of
a socketpair (``--fd``) and driven by GuestChannel with an ExecIO that asks for a terminal: the command's
stdio and controlling terminal are the terminal's slave, its output is one stream, input is typed on it
(echoed, ^C interrupts), a resize reaches the command as SIGWINCH, and a kill ends it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from dsec.errors import InvalidRequest, InvalidState, KindUnavailable
from dsec.kinds.execio import ExecIO
from dsec.protocol.sandbox import ExecResult
from dsec.protocol.terminal import PtySize

from .test_guest_agent import ENV, Agent, agent_bin, chan_of, start_agent  # noqa: F401 (agent_bin: a fixture)

SIZE = PtySize(rows=24, cols=80)


@pytest.fixture
async def agent(agent_bin: os.PathLike[str]) -> AsyncIterator[Agent]:  # noqa: F811
    async with start_agent(agent_bin) as a:  # type: ignore[arg-type]
        yield a


@dataclass
class Terminal:
    io: ExecIO
    task: asyncio.Task[ExecResult]
    seen: bytearray = field(default_factory=bytearray)
    streams: set[str] = field(default_factory=set)
    _more: asyncio.Event = field(default_factory=asyncio.Event)

    def output(self, stream: str, data: bytes) -> None:
        self.streams.add(stream)
        self.seen += data
        self._more.set()

    async def until(self, pattern: str, within: float = 5.0) -> str:
        """The output so far, once it matches ``pattern``."""

        async def wait() -> str:
            while not re.search(pattern, self.seen.decode(errors="replace")):
                self._more.clear()
                await self._more.wait()
            return self.seen.decode(errors="replace")

        return await asyncio.wait_for(wait(), within)


@asynccontextmanager
async def terminal(agent: Agent, script: str, size: PtySize = SIZE) -> AsyncIterator[Terminal]:
    io = ExecIO(pty=size)
    box: list[Terminal] = []

    def forward(stream: str, data: bytes) -> None:
        box[0].output(stream, data)

    task = asyncio.create_task(chan_of(agent).run(["sh", "-c", script], ENV, "/", None, 20, 1 << 20, forward, io=io))
    term = Terminal(io, task)
    box.append(term)
    await asyncio.wait_for(io.started.wait(), 5)
    try:
        yield term
    finally:
        if not task.done():
            io.send_signal(signal.SIGKILL)
        await asyncio.wait_for(task, 5)


async def test_the_terminal_is_the_commands_controlling_terminal_and_stdio(agent: Agent) -> None:
    script = (
        "tty; stty size; [ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo all-three; "
        "echo on-stderr >&2; exec 3</dev/tty && echo has-ctty"
    )
    async with terminal(agent, script) as term:
        result = await asyncio.wait_for(term.task, 5)
    text = term.seen.decode()
    assert re.search(r"^/dev/pts/\d+\r$", text, re.M), text
    assert "24 80\r\n" in text and "all-three\r\n" in text and "has-ctty\r\n" in text
    assert "on-stderr\r\n" in text and term.streams == {"stdout"}  # one stream: the terminal's
    assert result.exit_code == 0 and result.stderr == ""


async def test_input_is_typed_on_the_terminal(agent: Agent) -> None:
    script = 'read -r line; echo "got:$line"; while :; do sleep 0.1; done; echo not-reached'
    async with terminal(agent, script) as term:
        term.io.feed(b"hello there\n")
        text = await term.until("got:hello there")
        assert "hello there\r\n" in text  # the line discipline echoed what was typed
        # ^C: SIGINT for the terminal's foreground group (again if it fell between a fork and an exec,
        # where the shell's handler, not the command's default, takes it)
        for _ in range(20):
            term.io.feed(b"\x03")
            done, _ = await asyncio.wait({term.task}, timeout=0.5)
            if done:
                break
        result = await asyncio.wait_for(term.task, 5)
    assert result.signal == signal.SIGINT and "not-reached" not in term.seen.decode()


async def test_a_resize_reaches_the_command(agent: Agent) -> None:
    script = "trap 'stty size; echo winched' WINCH; echo armed; while :; do sleep 0.05; done"
    async with terminal(agent, script) as term:
        await term.until("armed")
        term.io.resize(PtySize(rows=30, cols=100))
        text = await term.until("winched")
        assert "30 100\r\nwinched" in text
        assert term.io.pty == PtySize(rows=30, cols=100)
        term.io.send_signal(signal.SIGKILL)
        result = await asyncio.wait_for(term.task, 5)
    assert result.signal == signal.SIGKILL


async def test_output_written_just_before_the_exit_is_all_there(agent: Agent) -> None:
    async with terminal(agent, "head -c 300000 /dev/zero | tr '\\0' a; echo; echo END") as term:
        result = await asyncio.wait_for(term.task, 10)
    text = term.seen.decode()
    assert result.exit_code == 0 and text.count("a") == 300000 and text.endswith("END\r\n")


async def test_resizing_a_command_without_a_terminal_or_after_its_end_is_refused(agent: Agent) -> None:
    io = ExecIO()
    io.close_stdin()
    await chan_of(agent).run(["true"], ENV, "/", None, 5, 1000, io=io)
    with pytest.raises(InvalidRequest, match="terminal"):
        io.resize(SIZE)
    async with terminal(agent, "exit 3") as term:
        assert (await asyncio.wait_for(term.task, 5)).exit_code == 3
    with pytest.raises(InvalidState, match="ended"):
        term.io.resize(SIZE)


async def test_an_agent_older_than_terminals_is_refused_one(agent: Agent) -> None:
    chan = chan_of(agent)
    chan.version = "dsec-guest-agent/1"
    with pytest.raises(KindUnavailable, match="predates terminals"):
        await chan.run(["true"], ENV, "/", None, 5, 1000, io=ExecIO(pty=SIZE))
