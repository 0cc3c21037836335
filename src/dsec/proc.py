"""Child processes without asyncio's child watcher: posix_spawn (vfork speed, exact fd placement) plus pidfd waits.

crun's ``--preserve-fds`` passes descriptors by number (3, 4, ...), which ``subprocess`` cannot place;
``posix_spawn`` file actions can. Waiting on a pidfd keeps one event-loop reader per child instead of
a thread per child.

``posix_spawn`` is libc's, called through ctypes, not ``os.posix_spawn``: CPython holds the GIL for the
whole call, which lasts until the child has exec'd (a few milliseconds for crun on a busy machine), and
converts ``os.environ`` into a new block each time. In a burst of creations that stalled every other
request of the daemon; ctypes lets the GIL go, and the child gets libc's ``environ`` as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence

_libc = ctypes.CDLL(None, use_errno=True)
_libc.posix_spawn.argtypes = [
    ctypes.POINTER(ctypes.c_int),
    ctypes.c_char_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
]
_libc.posix_spawn_file_actions_init.argtypes = [ctypes.c_void_p]
_libc.posix_spawn_file_actions_destroy.argtypes = [ctypes.c_void_p]
_libc.posix_spawn_file_actions_adddup2.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
_FILE_ACTIONS_SIZE = 256  # posix_spawn_file_actions_t is 80 bytes in glibc; room to spare


def _strings(items: Sequence[str | bytes]) -> ctypes.Array[ctypes.c_char_p]:
    """A NULL-terminated ``char *[]``."""
    return (ctypes.c_char_p * (len(items) + 1))(*(os.fsencode(i) for i in items), None)


def spawn(argv: Sequence[str], fds: Mapping[int, int], env: Mapping[str, str] | None = None) -> int:
    """Start ``argv`` with child fd N = our fd ``fds[N]``; every other fd is closed (all ours are CLOEXEC).
    ``argv[0]`` is a path (no PATH search); ``env`` None: this process's environment."""
    actions = ctypes.create_string_buffer(_FILE_ACTIONS_SIZE)
    if _libc.posix_spawn_file_actions_init(actions) != 0:
        raise OSError(ctypes.get_errno(), "posix_spawn_file_actions_init")
    try:
        for dst, src in fds.items():
            rc = _libc.posix_spawn_file_actions_adddup2(actions, src, dst)
            if rc != 0:
                raise OSError(rc, os.strerror(rc))
        args = _strings(list(argv))
        envp = _strings([f"{k}={v}" for k, v in env.items()]) if env is not None else _environ()
        pid = ctypes.c_int()
        rc = _libc.posix_spawn(ctypes.byref(pid), os.fsencode(argv[0]), actions, None, args, envp)
        if rc != 0:
            raise OSError(rc, os.strerror(rc), argv[0])
        return pid.value
    finally:
        _libc.posix_spawn_file_actions_destroy(actions)


def _environ() -> int | None:
    # read at each call: os.environ's changes go through setenv, which may move the array
    return ctypes.c_void_p.in_dll(_libc, "environ").value


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
    raised; ``close`` unregisters the fd (before the caller closes it) and cancels ``done`` if pending.
    ``eio_is_eof``: EIO ends the stream as EOF does (a pseudo-terminal's master once its slave is closed)."""

    def __init__(
        self, fd: int, on_data: Callable[[bytes], None], chunk: int = 1 << 16, *, eio_is_eof: bool = False
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = fd
        self._on_data = on_data
        self._chunk = chunk
        self._eio_is_eof = eio_is_eof
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
                except OSError as e:
                    if not (self._eio_is_eof and e.errno == errno.EIO):
                        raise
                    data = b""
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
    start: Callable[[Sequence[str], Mapping[int, int]], Awaitable[int]] | None = None,
) -> tuple[int, bytes]:
    """Run a host helper to completion; returns (status, stdout+stderr). Kills it on timeout.
    ``start``: how to start it (``spawn``'s arguments; e.g. from inside another mount namespace).

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
        fds = {0: empty, 1: out_fd, 2: out_fd, **(extra_fds or {})}
        try:
            pid = spawn(argv, fds) if start is None else await start(argv, fds)
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
