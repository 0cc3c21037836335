"""The daemon's side of dsec-agent (agent.c): building it, starting channels, sending execs."""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import shutil
import socket
import stat
import struct
import subprocess
from collections import deque
from pathlib import Path
from typing import Any

from ...errors import BackendError, KindUnavailable, LimitExceeded, SandboxGone
from ...protocol.terminal import PtySize

log = logging.getLogger("dsec.container.agent")

SOURCE = Path(__file__).with_name("agent.c")
RENDEZVOUS_FD = 4
_REPLY = struct.Struct("<cIq")
# The agent's replies are _REPLY.size bytes; longer frames are skipped (a newer agent's), but one that
# claims more than this is no agent's: the channel is dropped rather than buffering what it claims. The
# agent runs inside the sandbox, where a process of the sandbox's root could speak in its place.
MAX_FRAME = 1 << 12
# Descriptors the agent sent that no 'M' frame has claimed yet: a frame's descriptor arrives with its
# first byte, so at most a few wait at once; past this the agent is not behaving, and they are closed.
MAX_WAITING_FDS = 8
_FD_SPACE = socket.CMSG_SPACE(MAX_WAITING_FDS * 4)
PTMX = (5, 2)  # the device number of every devpts instance's ptmx (TTYAUX_MAJOR, 2)
TIOCGPTN = 0x80045430  # _IOR('T', 0x30, unsigned int): a master's terminal number (Python's termios lacks it)
_SYS_PIDFD_GETFD = 438
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def build(dest_dir: Path) -> Path:
    """Compile the agent statically (once per source version). KindUnavailable without a C compiler;
    BackendError when the compiler fails (a bug, never a reason to run without the agent)."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()
    target = dest_dir / "agent"
    stamp = dest_dir / "agent.sha256"
    if target.exists() and stamp.exists() and stamp.read_text() == digest:
        return target
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KindUnavailable("no C compiler to build dsec's sandbox agent (apt-get install gcc libc6-dev)")
    tmp = dest_dir / "agent.tmp"
    res = subprocess.run(
        [cc, "-O2", "-static", "-Wall", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, check=False
    )
    if res.returncode != 0:
        raise BackendError(f"building the sandbox agent failed: {res.stderr[-1500:]}")
    os.chmod(tmp, 0o555)
    tmp.rename(target)
    stamp.write_text(digest)
    return target


def steal_parked_end(pid: int) -> socket.socket:
    """Take the socket end a daemon-less agent parks on fd 4 (pidfd_getfd needs ptrace rights: root)."""
    pidfd = os.pidfd_open(pid)
    try:
        fd = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, RENDEZVOUS_FD, 0)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
    finally:
        os.close(pidfd)
    return socket.socket(fileno=int(fd))


# A fork refused for the sandbox's pids limit (EAGAIN) is tried again for this long: the processes of a
# command that was just killed (a fork bomb at its timeout) are still being reaped when the next comes.
SPAWN_RETRY_S = 2.0


def terminal_master(fd: int) -> bool:
    """Whether ``fd`` (from the agent: the sandbox's word) is a pseudo-terminal's master, the only kind
    of descriptor the daemon takes from a sandbox: a character device that is ptmx and answers TIOCGPTN."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != PTMX:
            return False
        fcntl.ioctl(fd, TIOCGPTN, b"\0\0\0\0")
    except OSError:
        return False
    return True


class ProcessLimit(LimitExceeded):
    """The agent could not fork: the sandbox is at its process limit."""


def _spawn_error(value: int) -> Exception:
    if value == errno.EAGAIN:
        return ProcessLimit(
            "the command could not start: the sandbox is at its process limit (pids); its processes must "
            "exit before another can start"
        )
    # an errno; os.strerror raises OverflowError on a value past a C int
    why = os.strerror(value) if 0 < value < 4096 else f"error {value}"
    return BackendError(f"the agent could not start the command: {why}")


class AgentChannel:
    """One daemon ↔ agent connection. Frames are length-prefixed; execs carry their fds."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._ids = itertools.count(1)
        self._send_lock = asyncio.Lock()
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._started: dict[int, asyncio.Future[int]] = {}
        self._exited: dict[int, asyncio.Future[int]] = {}
        self._masters: dict[int, int] = {}  # exec id -> its terminal's master, between its 'M' and 'S'
        # execs asked for on a terminal and not started yet: only while there are some are descriptors
        # read from the socket (recvmsg costs ~1 us more per read; plain reads make the kernel drop them)
        self._terminals: set[int] = set()
        self._fds: deque[int] = deque()  # descriptors received and not yet claimed by an 'M' frame
        self._buf = bytearray()
        self.closed = False
        # replies are read by the event loop's reader callback, not a task: each reply then resolves its
        # exec's future in the same turn it arrives (a task would cost a loop turn per reply, two per exec)
        self._reading = True
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(asyncio.shield(self._ready), timeout)

    async def hello(self, timeout: float = 5.0) -> None:
        await self._send(struct.pack("<IcI", 5, b"H", 0), [])
        await self.wait_ready(timeout)

    async def spawn(
        self, argv: list[str], env: list[str], cwd: str, fds: list[int], user: tuple[int, int] | None = None
    ) -> tuple[int, asyncio.Future[int]]:
        """Start a command (as root, or as ``user`` = (uid, gid)) with ``fds`` = [stdin, stdout, stderr,
        cgroup.procs]; returns its pid in the sandbox and a future of its raw wait status. A fork the
        pids limit refuses is tried again for SPAWN_RETRY_S."""
        pid, exited, _ = await self._spawn(argv, env, cwd, fds, user, None)
        return pid, exited

    async def spawn_terminal(
        self, argv: list[str], env: list[str], cwd: str, procs_fd: int, size: PtySize, user: tuple[int, int] | None
    ) -> tuple[int, asyncio.Future[int], int]:
        """``spawn`` on a new pseudo-terminal the agent makes in the sandbox: returns also the terminal's
        master (the caller's to close), the command's stdin, stdout and stderr."""
        return await self._spawn(argv, env, cwd, [procs_fd], user, size)

    async def _spawn(
        self,
        argv: list[str],
        env: list[str],
        cwd: str,
        fds: list[int],
        user: tuple[int, int] | None,
        size: PtySize | None,
    ) -> tuple[int, asyncio.Future[int], int]:
        strings = b"".join(s.encode() + b"\0" for s in [cwd, *argv, *env])
        deadline = asyncio.get_running_loop().time() + SPAWN_RETRY_S
        pause = 0.01
        while True:
            try:
                return await self._spawn_once(len(argv), len(env), strings, fds, user, size)
            except ProcessLimit:
                if asyncio.get_running_loop().time() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.25)

    async def _spawn_once(
        self,
        argc: int,
        envc: int,
        strings: bytes,
        fds: list[int],
        user: tuple[int, int] | None,
        size: PtySize | None,
    ) -> tuple[int, asyncio.Future[int], int]:
        if self.closed:
            raise SandboxGone("the sandbox's agent is gone")
        exec_id = next(self._ids)
        if size is not None:
            uid, gid = user or (0, 0)
            body = struct.pack("<cIIIIIII", b"T", exec_id, argc, envc, uid, gid, size.rows, size.cols) + strings
        elif user is None or user == (0, 0):
            body = struct.pack("<cIII", b"E", exec_id, argc, envc) + strings
        else:
            body = struct.pack("<cIIIII", b"U", exec_id, argc, envc, *user) + strings
        loop = asyncio.get_running_loop()
        started: asyncio.Future[int] = loop.create_future()
        exited: asyncio.Future[int] = loop.create_future()
        self._started[exec_id] = started
        self._exited[exec_id] = exited
        if size is not None:
            self._terminals.add(exec_id)
        try:
            await self._send(struct.pack("<I", len(body)) + body, fds)
            pid = await started
            master = self._masters.pop(exec_id, -1)
        except BaseException:
            self._exited.pop(exec_id, None)
            raise
        finally:
            self._started.pop(exec_id, None)
            self._terminals.discard(exec_id)
            _close(self._masters.pop(exec_id, -1))
        if size is not None and master < 0:
            if self.closed:
                raise SandboxGone("the sandbox's agent went away (the sandbox stopped)")
            raise BackendError("the sandbox's agent started the command without sending its terminal")
        return pid, exited, master

    async def _send(self, data: bytes, fds: list[int]) -> None:
        loop = asyncio.get_running_loop()
        async with self._send_lock:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            while True:
                try:
                    sent = self._sock.sendmsg([data], ancillary)
                    break
                except BlockingIOError:
                    writable = loop.create_future()
                    loop.add_writer(self._sock, writable.set_result, None)
                    try:
                        await writable
                    finally:
                        loop.remove_writer(self._sock)
                except OSError as e:
                    raise SandboxGone(f"the sandbox's agent is gone: {e}") from None
            if sent < len(data):  # the fds went with the first byte; the rest is plain data
                await loop.sock_sendall(self._sock, data[sent:])

    def _readable(self) -> None:
        buf = self._buf
        try:
            while True:
                try:
                    if self._terminals:
                        data, ancillary, _, _ = self._sock.recvmsg(65536, _FD_SPACE, socket.MSG_CMSG_CLOEXEC)
                        self._take_fds(ancillary)
                    else:
                        data = self._sock.recv(65536)
                except BlockingIOError:
                    return
                if not data:
                    break
                buf += data
                while len(buf) >= 4:
                    (size,) = struct.unpack_from("<I", buf)
                    if size > MAX_FRAME:
                        log.warning("the sandbox's agent sent a frame of %d bytes; dropping the channel", size)
                        self._stop_reading()
                        self._fail_all()
                        return
                    if len(buf) < 4 + size:
                        break
                    self._dispatch(bytes(buf[4 : 4 + size]))
                    del buf[: 4 + size]
        except (OSError, struct.error) as e:
            log.debug("agent channel read failed: %s", e)
        self._stop_reading()
        self._fail_all()

    def _take_fds(self, ancillary: list[tuple[int, int, bytes]]) -> None:
        for level, kind, data in ancillary:
            if level != socket.SOL_SOCKET or kind != socket.SCM_RIGHTS:
                continue
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            for fd in fds:
                if len(self._fds) >= MAX_WAITING_FDS:
                    _close(fd)
                else:
                    self._fds.append(fd)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            asyncio.get_running_loop().remove_reader(self._sock.fileno())

    def _dispatch(self, frame: bytes) -> None:
        if len(frame) != _REPLY.size:
            return
        kind, exec_id, value = _REPLY.unpack(frame)
        if kind == b"R":
            if not self._ready.done():
                self._ready.set_result(None)
        elif kind == b"M":
            fd = self._fds.popleft() if self._fds else -1
            if exec_id in self._terminals and exec_id not in self._masters and terminal_master(fd):
                self._masters[exec_id] = fd
            else:
                _close(fd)
        elif kind == b"S":
            fut = self._started.get(exec_id)
            if fut and not fut.done():
                fut.set_result(value)
        elif kind == b"F":
            fut = self._started.get(exec_id)
            if fut and not fut.done():
                fut.set_exception(_spawn_error(value))
        elif kind == b"X":
            fut = self._exited.pop(exec_id, None)
            if fut and not fut.done():
                fut.set_result(value)

    def _fail_all(self) -> None:
        self.closed = True
        gone = SandboxGone("the sandbox's agent went away (the sandbox stopped)")
        futures: list[asyncio.Future[Any]] = [self._ready, *self._started.values(), *self._exited.values()]
        for fut in futures:
            if not fut.done():
                fut.set_exception(gone)
                fut.exception()  # consumed: nobody may be waiting any more
        self._started.clear()
        self._exited.clear()
        for fd in [*self._masters.values(), *self._fds]:
            _close(fd)
        self._masters.clear()
        self._fds.clear()

    async def aclose(self) -> None:
        # The reader must have unregistered the socket from the event loop before the fd is closed:
        # a closed number is reused at once (often by a pidfd), and a late remove_reader on the old
        # registration would silently drop the new fd's events.
        self._stop_reading()
        self._fail_all()  # an exec still waiting for its start or exit learns the sandbox is gone
        with contextlib.suppress(OSError):
            self._sock.close()


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
