"""Bounded capture of a process's output: the head and the tail are kept, the middle is counted."""

from __future__ import annotations

import codecs
import os
import time

from ..protocol.sandbox import ExecResult


class CappedBuffer:
    """Keeps the first ``limit // 2`` and the last ``limit - limit // 2`` bytes of a stream."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        self.limit = limit
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_limit:
            if len(data) >= self.tail_limit:
                self.tail = bytearray(data[-self.tail_limit :])
            else:
                self.tail += data
                excess = len(self.tail) - self.tail_limit
                if excess > 0:
                    del self.tail[:excess]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def getvalue(self) -> bytes:
        if not self.truncated:
            return bytes(self.head + self.tail)
        dropped = self.total - len(self.head) - len(self.tail)
        marker = f"\n[... {dropped} bytes truncated by dsec ...]\n".encode()
        return bytes(self.head) + marker + bytes(self.tail)

    def text(self) -> str:
        return self.getvalue().decode("utf-8", errors="replace")


class Deadlines:
    """The two ways an exec runs out of time: its wall clock, and (optionally) too long without output.

    ``touch`` is called for every chunk of stdout or stderr; ``wait`` says how long the supervisor may
    sleep before one of the deadlines can have passed, and ``expired`` which one has.
    """

    def __init__(self, started: float, timeout: float, idle_timeout: float | None) -> None:
        self.started = started
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.last_output = started

    def touch(self) -> None:
        self.last_output = time.monotonic()

    def wait(self) -> float:
        now = time.monotonic()
        left = self.started + self.timeout - now
        if self.idle_timeout is not None:
            left = min(left, self.last_output + self.idle_timeout - now)
        return max(0.001, left)

    def expired(self) -> str | None:
        """ "timeout", "idle", or None while both deadlines are ahead."""
        now = time.monotonic()
        if now >= self.started + self.timeout:
            return "timeout"
        if self.idle_timeout is not None and now >= self.last_output + self.idle_timeout:
            return "idle"
        return None


class StreamForwarder:
    """Decodes chunks incrementally (multi-byte characters may straddle chunks) up to a byte budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.sent = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, data: bytes) -> str | None:
        if self.sent >= self.budget:
            return None
        data = data[: self.budget - self.sent]
        self.sent += len(data)
        text = self._decoder.decode(data)
        return text or None


def exec_result(
    status: int | None,
    stdout: CappedBuffer,
    stderr: CappedBuffer,
    started: float,
    *,
    expired: str | None,
    oom: bool = False,
) -> ExecResult:
    """An exec's result from its raw wait status (None: unknown) and its captured streams; a signal N is
    reported as exit code 128 + N, as a shell would. ``expired``: the deadline that killed it, if any
    ("timeout" or "idle", as ``Deadlines`` names them)."""
    signal: int | None = None
    code: int | None = None
    if status is not None and os.WIFSIGNALED(status):
        signal = os.WTERMSIG(status)
        code = 128 + signal
    elif status is not None:
        code = os.WEXITSTATUS(status)
    return ExecResult(
        exit_code=code,
        signal=signal,
        stdout=stdout.text(),
        stderr=stderr.text(),
        truncated=stdout.truncated or stderr.truncated,
        stdout_bytes=stdout.total,
        stderr_bytes=stderr.total,
        timed_out=expired is not None,
        idle_timed_out=expired == "idle",
        oom_killed=oom,
        duration=time.monotonic() - started,
    )
