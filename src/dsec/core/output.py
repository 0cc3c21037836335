"""Bounded capture of a process's output: the head and the tail are kept, the middle is counted."""

from __future__ import annotations

import codecs
import os
import time

from ..models import ExecResult


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
    timed_out: bool,
    oom: bool = False,
) -> ExecResult:
    """An exec's result from its raw wait status (None: unknown) and its captured streams; a signal N is
    reported as exit code 128 + N, as a shell would."""
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
        timed_out=timed_out,
        oom_killed=oom,
        duration=time.monotonic() - started,
    )
