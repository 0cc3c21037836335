"""The live side of one exec, for callers that drive a command while it runs (the process API, e.g. the
E2B compatibility layer): standard input fed as it comes, the command's pid once it started, and
signals sent to its process tree.

With ``pty`` the command runs on a pseudo-terminal of that size instead of pipes: the terminal's slave
is its controlling terminal and its standard input, output and error, what is fed is typed on the
terminal, its output (one stream) is reported as ``stdout``, and ``resize`` changes the terminal's size
while it runs (the kernel sends the command SIGWINCH). The terminal is made inside the sandbox, in its
own devpts, by the kind's agent.

The core is the producer (``feed``, ``close_stdin``, ``send_signal``); the kind is the consumer
(``next_chunk``) and reports the start (``attach``) and the end (``detach``). The exit status is still
observed by the kind on the host side, as for every exec: nothing here comes from inside the sandbox.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from ..errors import InvalidRequest, InvalidState, LimitExceeded
from ..protocol.terminal import PtySize

# Bytes of stdin that may wait for a command that does not read them: past it, a feed is refused
# rather than letting a client grow the daemon's memory without bound.
MAX_PENDING_STDIN = 16 << 20


class ExecIO:
    def __init__(self, max_pending: int = MAX_PENDING_STDIN, pty: PtySize | None = None) -> None:
        self.max_pending = max_pending
        self.pty = pty  # the terminal's size (the latest asked for); None: pipes
        self.pid: int | None = None
        self.started = asyncio.Event()
        self._chunks: deque[bytes] = deque()
        self._pending = 0
        self._stdin_closed = False
        self._wake = asyncio.Event()
        self._taken = asyncio.Event()  # set when the command takes input (or ends): feeders waiting for room
        self._signal: Callable[[int], None] | None = None
        self._resize: Callable[[PtySize], None] | None = None
        self._ended = False

    # ---- the producer's side (the core) -------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Queue ``data`` for the command's standard input."""
        if self._ended:
            raise InvalidState("the command has ended")
        if self._stdin_closed:
            raise InvalidState("the command's standard input is closed")
        if self._pending + len(data) > self.max_pending:
            raise LimitExceeded(
                f"the command is not reading its standard input: {self._pending} bytes are waiting, "
                f"and {len(data)} more would pass the {self.max_pending}-byte bound"
            )
        if data:
            self._chunks.append(bytes(data))
            self._pending += len(data)
            self._wake.set()

    async def room(self, limit: int) -> None:
        """Wait until at most ``limit`` bytes of input are queued (or the command ended): a feeder that
        streams waits here instead of growing the queue to its bound."""
        while self._pending > limit and not self._ended:
            self._taken.clear()
            await self._taken.wait()

    def close_stdin(self) -> None:
        """End of input: the command reads EOF once what was queued is consumed (closing twice is fine)."""
        self._stdin_closed = True
        self._wake.set()

    def send_signal(self, sig: int) -> None:
        """Deliver ``sig`` to the command's process tree (SIGKILL: the whole tree, daemonised children too)."""
        if self._ended:
            raise InvalidState("the command has ended")
        if self._signal is None:
            raise InvalidState("the command has not started yet")
        self._signal(sig)

    def resize(self, size: PtySize) -> None:
        """Give the command's terminal a new size (its foreground process group gets SIGWINCH)."""
        if self.pty is None:
            raise InvalidRequest("the command does not run on a terminal")
        if self._ended:
            raise InvalidState("the command has ended")
        if self._resize is None:
            raise InvalidState("the command has not started yet")
        self._resize(size)
        self.pty = size

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def stdin_closed(self) -> bool:
        return self._stdin_closed

    # ---- the kind's side ----------------------------------------------------------------------------

    def attach(self, pid: int, signal: Callable[[int], None], resize: Callable[[PtySize], None] | None = None) -> None:
        """The command runs as ``pid`` (inside the sandbox); ``signal`` delivers a signal to its tree;
        ``resize`` sets its terminal's size (a kind gives it for a command it runs on a terminal)."""
        self.pid = pid
        self._signal = signal
        self._resize = resize
        self.started.set()

    def detach(self) -> None:
        """The command ended: no more signals, and what was queued for it is dropped."""
        self._ended = True
        self._signal = None
        self._resize = None
        self._chunks.clear()
        self._pending = 0
        self._wake.set()
        self._taken.set()

    async def next_chunk(self) -> bytes | None:
        """The next piece of standard input; None once input is closed (or the command ended)."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._pending -= len(chunk)
                self._taken.set()
                return chunk
            if self._stdin_closed or self._ended:
                return None
            self._wake.clear()
            await self._wake.wait()
