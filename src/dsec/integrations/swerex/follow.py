"""Following a session's output: one driver call (and, past each chunk, the next ``follow``) streamed
into a buffer that waits can match patterns against while the stream stays open."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Protocol

from dsec import ExecResult

from .output import Buffer, Found, byte_length, parse_header, trailer

# A driver call follows at most 4 MiB of output (driver.sh's READS); the daemon forwards up to the
# exec's output limit, so this one leaves room for the header and never cuts the data.
FOLLOW_OUTPUT_LIMIT = 8 << 20
# The daemon's longest exec. A wait without a timeout outlives it by following again.
MAX_EXEC = 24 * 3600.0


class Event(Protocol):
    """One event of ``exec_stream``: output ("stdout", "stderr" with ``data``), then the "result"."""

    @property
    def type(self) -> str: ...
    @property
    def data(self) -> str | None: ...
    @property
    def result(self) -> ExecResult | None: ...


class Execs(Protocol):
    """What a session needs of a sandbox: ``dsec.AsyncSandbox`` has it (and tests give a local stand-in)."""

    def exec_stream(
        self, cmd: str | list[str], *, timeout: float = ..., stdin: str | None = ..., output_limit: int | None = ...
    ) -> AsyncIterator[Event]: ...

    async def exec(self, cmd: str | list[str], *, timeout: float = ..., stdin: str | None = ...) -> ExecResult: ...


class ShellGone(Exception):
    """The session's shell has exited."""


class SyntaxRejected(Exception):
    """``bash -n`` refused the command: ``rc`` its exit status, ``message`` what it said."""

    def __init__(self, rc: int, message: str) -> None:
        super().__init__(message)
        self.rc = rc
        self.message = message


class DriverFailed(RuntimeError):
    """The driver did not do what it says it does (it could not start, or tail stopped by itself)."""


class Follow:
    """``async with Follow(sb, driver, argv, stdin) as f: found = await f.wait(patterns, timeout)``.

    ``f.output`` is the log from byte ``f.base`` on, as far as it has arrived; leaving the block closes
    the stream, which has the daemon end the driver call.
    """

    def __init__(self, sb: Execs, driver: list[str], argv: list[str], stdin: str | None = None) -> None:
        self._sb = sb
        self._driver = driver  # the driver's argv up to its mode: ["bash", PATH, DIR]
        self._argv = argv
        self._stdin = stdin
        self.output = Buffer()
        self.base = 0
        # set once the first call's header has come: from then on the log before ``base`` is no concern of
        # the session's (the driver may have emptied the log and started it over)
        self.started = asyncio.Event()
        self._arrived = asyncio.Event()
        self._ended: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Follow:
        self._task = asyncio.create_task(self._pump())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait(self, patterns: Sequence[re.Pattern[str]], timeout: float | None, pos: int = 0) -> Found | None:
        """The earliest match at or after ``pos``, waiting up to ``timeout`` seconds (None: no limit) for
        it; None when none came in time. Raises what ended the stream if it ended without one."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        searched = 0
        while True:
            self._arrived.clear()
            length = len(self.output)
            found = self.output.search(patterns, pos, searched)
            if found is not None:
                return found
            searched = length
            if self._ended is not None:
                raise self._ended
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)

    async def settled(self, seconds: float = 5.0) -> bool:
        """Whether the first call's header came (waiting up to ``seconds`` for it): ``base`` holds then."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.started.wait(), seconds)
        return self.started.is_set()

    async def drain(self, seconds: float) -> None:
        """Let output arrive for ``seconds`` more (what a shell prints right after an interrupt)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                while self._ended is None:
                    self._arrived.clear()
                    await self._arrived.wait()

    async def _pump(self) -> None:
        argv, stdin, first = self._argv, self._stdin, True
        try:
            while True:
                offset = await self._one(argv, stdin, first)
                argv, stdin, first = [*self._driver, "follow", str(offset)], None, False
        except Exception as e:  # ShellGone, SyntaxRejected, DriverFailed, or the daemon's (the sandbox went away)
            self._ended = e
        finally:
            if self._ended is None:
                self._ended = DriverFailed("the output stream ended")
            self._arrived.set()

    async def _one(self, argv: list[str], stdin: str | None, first: bool) -> int:
        """One driver call: its header, then its data into ``output``. Returns the log offset to follow
        on from; raises how it ended otherwise."""
        head: str | None = ""  # the header line, until it is complete (then None)
        syntax: int | None = None
        message = stderr = ""
        result: ExecResult | None = None
        stream = self._sb.exec_stream(argv, timeout=MAX_EXEC, stdin=stdin, output_limit=FOLLOW_OUTPUT_LIMIT)
        async for event in stream:
            if event.type == "stdout" and event.data:
                data = event.data
                if head is not None:
                    head += data
                    if "\n" not in head:
                        continue
                    line, _, data = head.partition("\n")
                    head = None
                    syntax = self._header(line, first)
                if syntax is not None:
                    message += data
                    continue
                self.output.append(data)
                self._arrived.set()
            elif event.type == "stderr" and event.data:
                stderr += event.data
            elif event.type == "result":
                result = event.result
        if syntax is not None:
            raise SyntaxRejected(syntax, message)
        if head is not None:
            raise DriverFailed(_failure("the session driver wrote no header", head, stderr, result))
        status, offset = trailer(stderr)
        if status == "gone":
            raise ShellGone()
        if status == "more":
            return offset
        if result is not None and result.timed_out:  # the daemon's longest exec: go on where the data ended
            return self.base + byte_length(self.output.slice())
        raise DriverFailed(_failure("the session's output could not be followed", "", stderr, result))

    def _header(self, line: str, first: bool) -> int | None:
        """Takes a call's header; returns bash -n's exit status if it is a syntax complaint."""
        header = parse_header(line)
        if header is None:
            raise DriverFailed(_failure("the session driver wrote an unknown header", line, "", None))
        if header.kind == "gone":
            raise ShellGone()
        if header.kind == "syntax":
            return header.value
        if first:
            self.base = header.value
            self.started.set()
        return None


def _failure(what: str, stdout: str, stderr: str, result: ExecResult | None) -> str:
    code = "" if result is None else f" (exit status {result.exit_code})"
    return f"{what}{code}: {(stdout + stderr).strip()[-2000:] or 'no output'}"
