"""Child processes without asyncio's child watcher: posix_spawn (vfork speed, exact fd placement) plus pidfd waits.

crun's ``--preserve-fds`` passes descriptors by number (3, 4, ...), which ``subprocess`` cannot place;
``posix_spawn`` file actions can. Waiting on a pidfd keeps one event-loop reader per child instead of
a thread per child.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence


def spawn(argv: Sequence[str], fds: Mapping[int, int], env: Mapping[str, str] | None = None) -> int:
    """Start ``argv`` with child fd N = our fd ``fds[N]``; every other fd is closed (all ours are CLOEXEC)."""
    actions: list[tuple[int, int, int]] = [(os.POSIX_SPAWN_DUP2, src, dst) for dst, src in fds.items()]
    return os.posix_spawn(argv[0], list(argv), dict(env if env is not None else os.environ), file_actions=actions)


async def wait(pid: int) -> int:
    """Wait for a child; returns its status the way ``subprocess`` does (-N for signal N)."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        pidfd = -1
    if pidfd >= 0:
        fut: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(pidfd, ready)
        try:
            await fut
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
    # the pidfd said the child exited, so this does not block
    _, status = os.waitpid(pid, 0)  # noqa: ASYNC222
    return os.waitstatus_to_exitcode(status)


async def read_fd(fd: int, on_data: Callable[[bytes], None], chunk: int = 1 << 16) -> None:
    """Read a fd until EOF, handing each chunk to ``on_data``. The caller owns (and closes) the fd."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    readable = asyncio.Event()
    loop.add_reader(fd, readable.set)
    try:
        while True:
            try:
                data = os.read(fd, chunk)
            except BlockingIOError:
                readable.clear()
                await readable.wait()
                continue
            if not data:
                return
            on_data(data)
    finally:
        loop.remove_reader(fd)


class FdReader:
    """``read_fd`` without a task: the event loop's reader callback reads and hands over each chunk, so
    a command's output and its EOF cost no task switches (two per stream per exec otherwise, a fair
    part of a short command's round trip). ``done`` resolves at EOF, or fails with what ``on_data``
    raised; ``close`` unregisters the fd (before the caller closes it) and cancels ``done`` if pending."""

    def __init__(self, fd: int, on_data: Callable[[bytes], None], chunk: int = 1 << 16) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = fd
        self._on_data = on_data
        self._chunk = chunk
        self.done: asyncio.Future[None] = self._loop.create_future()
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            while True:  # until the pipe is empty, as read_fd does
                try:
                    data = os.read(self._fd, self._chunk)
                except BlockingIOError:
                    return
                if not data:
                    self._end(None)
                    return
                self._on_data(data)
        except Exception as e:
            self._end(e)

    def _end(self, error: Exception | None) -> None:
        self._loop.remove_reader(self._fd)
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        self.done.cancel()


async def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a fd; a reader that went away is not an error. The caller owns the fd."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    view = memoryview(data)
    writable = asyncio.Event()
    loop.add_writer(fd, writable.set)
    try:
        while view:
            try:
                n = os.write(fd, view[: 1 << 16])
                view = view[n:]
            except BlockingIOError:
                writable.clear()
                await writable.wait()
            except (BrokenPipeError, ConnectionResetError):
                return
    finally:
        loop.remove_writer(fd)


def empty_input() -> int:
    """A read end that is at EOF at once: standard input for helpers and commands that get none.

    Never the host's /dev/null: an OCI runtime hands its stdio to the container and chowns it to the
    container's root (crun does, for ``run`` and ``exec``), which made the host's /dev/null the property
    of a sandbox that could then chmod it for the whole host.
    """
    r, w = os.pipe2(os.O_CLOEXEC)
    os.close(w)
    return r


async def run(
    argv: Sequence[str],
    *,
    timeout: float = 60.0,
    log_file: str | None = None,
    extra_fds: Mapping[int, int] | None = None,
) -> tuple[int, bytes]:
    """Run a host helper to completion; returns (status, stdout+stderr). Kills it on timeout.

    Output goes through a file, not a pipe: an OCI runtime hands its own stdio to the container it
    starts, and a pipe would then stay open for the container's whole life.
    """
    with contextlib.ExitStack() as stack:
        if log_file is None:
            out = stack.enter_context(tempfile.TemporaryFile())
            out_fd = out.fileno()
        else:
            out_fd = os.open(log_file, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            stack.callback(os.close, out_fd)
        empty = empty_input()
        try:
            pid = spawn(argv, {0: empty, 1: out_fd, 2: out_fd, **(extra_fds or {})})
        finally:
            os.close(empty)
        try:
            status = await asyncio.wait_for(wait(pid), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            status = await wait(pid)
        os.lseek(out_fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(out_fd, 1 << 16):
            chunks.append(chunk)
        return status, b"".join(chunks)


async def read_line(fd: int, limit: int = 64) -> bytes:
    """Read up to a newline (or EOF, or ``limit`` bytes) from a non-blocking fd; does not close it."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    buf = bytearray()
    readable = asyncio.Event()
    loop.add_reader(fd, readable.set)
    try:
        while b"\n" not in buf and len(buf) < limit:
            try:
                data = os.read(fd, limit - len(buf))
            except BlockingIOError:
                readable.clear()
                await readable.wait()
                continue
            if not data:
                break
            buf += data
    finally:
        loop.remove_reader(fd)
    return bytes(buf)
