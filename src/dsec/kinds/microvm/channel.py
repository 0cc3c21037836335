"""The host's side of the guest agent (guest_agent.c): frames over one stream, commands multiplexed on it.

Every frame is ``u32 len | u8 type | u32 id | payload`` (little endian, ``len`` counts type, id and
payload). The agent announces itself with ``'R'`` on every new connection; nothing is sent before that,
because the agent drops whatever the port held before it announced itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import BackendError, InvalidRequest, KindUnavailable, LimitExceeded, SandboxGone, SandboxTimeout
from ...protocol.sandbox import ExecResult
from ...protocol.terminal import PtySize
from ..base import MAX_ARCHIVE, OutputCallback
from ..execio import ExecIO
from ..output import CappedBuffer, Deadlines, exec_result

log = logging.getLogger("dsec.microvm.channel")

MAX_FRAME = 8 << 20
STDIN_CHUNK = 1 << 20
# After a timeout's SIGKILL, how long the exit status may take to come back before we stop waiting.
KILL_GRACE = 2.0
# A command sent before the agent announced itself waits this long for it (boot is normally done).
READY_TIMEOUT = 30.0
SIGKILL = 9
# run_bytes: the environment of the daemon's own helper commands, and how much of their stderr is kept
HELPER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
HELPER_STDERR = 64 << 10
FLAG_STDIN = 1
FLAG_RLIMITS = 2  # u64 RLIMIT_NOFILE, u64 RLIMIT_FSIZE follow the header, set by the agent before exec
FLAG_PTY = 4  # u32 rows, u32 cols follow (after the limits): the agent runs the command on a new terminal
PTY_PROTOCOL = 2  # the agent's protocol number since which it runs commands on terminals

_HEADER = struct.Struct("<IcI")
_EXEC = struct.Struct("<IIIII")
_RLIMITS = struct.Struct("<QQ")
_WINSIZE = struct.Struct("<II")
_STREAMS = {b"O": "stdout", b"e": "stderr"}


def _protocol(version: str | None) -> int:
    """The protocol number of an agent's version ("dsec-guest-agent/2"); 0 when it says none."""
    number = (version or "").rpartition("/")[2]
    return int(number) if number.isdigit() else 0


def _frame(kind: bytes, ident: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(5 + len(payload), kind, ident) + payload


@dataclass
class _Exec:
    caps: dict[str, CappedBuffer]
    on_output: OutputCallback | None
    # the raw wait status; None when the agent could not start the command (see ``failure``)
    exited: asyncio.Future[int | None]
    clock: Deadlines
    pid: int | None = None
    failure: tuple[int, str] | None = None
    oom: bool = False  # the guest OOM-killed a process while the command ran
    callback_error: Exception | None = None
    stdin_task: asyncio.Task[None] | None = field(default=None, repr=False)
    io: ExecIO | None = None


class GuestChannel:
    """One connection to a guest agent. Any number of commands may run on it at once."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[str] = loop.create_future()
        self._execs: dict[int, _Exec] = {}
        self._pings: dict[int, asyncio.Future[bytes]] = {}
        self._ids = itertools.count(1)  # 0 is the agent's own id ('R')
        self.closed = False
        self.version: str | None = None
        self._task = asyncio.create_task(self._read_loop())

    @classmethod
    async def connect_unix(cls, path: str | os.PathLike[str], timeout: float) -> GuestChannel:
        """Connect to the unix socket QEMU exposes for the port; retries while QEMU has not made it yet."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), max(remaining, 0.001))
                return cls(reader, writer)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if remaining <= 0:
                    raise BackendError(f"cannot connect to the guest agent at {path}: {e}") from None
                await asyncio.sleep(min(0.05, remaining))
            except TimeoutError:
                raise BackendError(f"cannot connect to the guest agent at {path}: timed out") from None
            except OSError as e:
                raise BackendError(f"cannot connect to the guest agent at {path}: {e}") from None

    async def hello(self) -> None:
        """Ask for a fresh 'R': a restored guest's agent may still think it talks to its old host."""
        await self._send(_frame(b"H", 0))

    async def wait_ready(self, timeout: float) -> str:
        """Wait for the agent's ``'R'``; returns its version string."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            raise SandboxTimeout(f"the guest agent did not report ready within {timeout:g}s") from None

    async def ping(self, timeout: float) -> float:
        """Round-trip time to the agent, in seconds."""
        ping_id = next(self._ids)
        token = struct.pack("<Q", time.monotonic_ns())
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pings[ping_id] = fut
        started = time.monotonic()
        try:
            await self._send(_frame(b"P", ping_id, token))
            echoed = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise SandboxTimeout(f"the guest agent did not answer a ping within {timeout:g}s") from None
        finally:
            self._pings.pop(ping_id, None)
        if echoed != token:
            raise BackendError("the guest agent echoed a different ping")
        return time.monotonic() - started

    async def refresh(self, timeout: float) -> tuple[bool, bool]:
        """After a memory-snapshot restore: set the guest's clock from the host's and reseed its CRNG
        with fresh host entropy. Returns (clock set, CRNG reseeded)."""
        ident = next(self._ids)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pings[ident] = fut
        now = time.time_ns()
        payload = struct.pack("<qq", now // 1_000_000_000, now % 1_000_000_000) + os.urandom(64)
        try:
            await self._send(_frame(b"T", ident, payload))
            reply = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise SandboxTimeout(f"the guest agent did not answer a refresh within {timeout:g}s") from None
        finally:
            self._pings.pop(ident, None)
        return bool(reply[:1] == b"\x01"), bool(reply[1:2] == b"\x01")

    async def run(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        stdin: bytes | None,
        timeout: float,
        output_limit: int,
        on_output: OutputCallback | None = None,
        user: tuple[int, int] | None = None,
        idle_timeout: float | None = None,
        rlimits: tuple[int, int] | None = None,
        io: ExecIO | None = None,
    ) -> ExecResult:
        """Run a command in the guest; ``env`` is its whole environment, ``user`` (uid, gid), None: root.

        ``idle_timeout``: seconds without output before the command's tree is killed, as on a timeout.
        ``rlimits``: (RLIMIT_NOFILE, RLIMIT_FSIZE) the command starts with; None: the agent's own.
        ``io``: standard input fed while the command runs (``stdin`` is then None), its pid and signals;
        with ``io.pty`` the command runs on a terminal the agent makes in the guest, its one output
        stream reported as stdout."""
        if not argv:
            raise InvalidRequest("the command is empty")
        if self.closed:
            raise SandboxGone("the guest agent's channel is closed")
        if not self._ready.done():
            await self.wait_ready(READY_TIMEOUT)
        exec_id = next(self._ids)
        live_stdin = stdin is not None or io is not None
        payload = self._exec_payload(argv, env, cwd, user, live_stdin, rlimits, io.pty if io is not None else None)
        if 5 + len(payload) > MAX_FRAME:
            raise InvalidRequest(f"the command line and environment exceed {MAX_FRAME} bytes")
        ex = _Exec(
            caps={"stdout": CappedBuffer(output_limit), "stderr": CappedBuffer(output_limit)},
            on_output=on_output,
            exited=asyncio.get_running_loop().create_future(),
            clock=Deadlines(time.monotonic(), timeout, idle_timeout),
            io=io,
        )
        self._execs[exec_id] = ex
        started = ex.clock.started
        try:
            await self._send(_frame(b"E", exec_id, payload))
            if stdin is not None:
                ex.stdin_task = asyncio.create_task(self._feed_stdin(exec_id, stdin))
            elif io is not None:
                ex.stdin_task = asyncio.create_task(self._pump_stdin(exec_id, io))
            expired: str | None = None
            status: int | None = None
            while expired is None:
                try:
                    status = await asyncio.wait_for(asyncio.shield(ex.exited), ex.clock.wait())
                    break
                except TimeoutError:
                    expired = ex.clock.expired()
            if expired is not None:
                self._kill_nowait(exec_id)
                try:
                    status = await asyncio.wait_for(asyncio.shield(ex.exited), KILL_GRACE)
                except TimeoutError:
                    log.warning("exec %d did not report its exit within %gs of SIGKILL", exec_id, KILL_GRACE)
                    status = None
            if ex.callback_error is not None:
                raise ex.callback_error
            return _result(ex, status, started, expired)
        except asyncio.CancelledError:  # the caller went away (a streaming client disconnected)
            if not ex.exited.done():
                self._kill_nowait(exec_id)
            raise
        finally:
            self._execs.pop(exec_id, None)
            if io is not None:
                io.detach()
            if ex.stdin_task is not None:
                ex.stdin_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, SandboxGone):
                    await ex.stdin_task

    def _exec_payload(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        user: tuple[int, int] | None,
        live_stdin: bool,
        rlimits: tuple[int, int] | None,
        pty: PtySize | None,
    ) -> bytes:
        """An 'E' frame's payload: the header, the limits and the terminal's size if any, the strings."""
        envs = [f"{k}={v}" for k, v in env.items()]
        strings = b"".join(s.encode() + b"\0" for s in [cwd, *argv, *envs])
        uid, gid = user if user is not None else (0, 0)
        flags = (FLAG_STDIN if live_stdin else 0) | (FLAG_RLIMITS if rlimits is not None else 0)
        extra = _RLIMITS.pack(*rlimits) if rlimits is not None else b""
        if pty is not None:
            if _protocol(self.version) < PTY_PROTOCOL:
                # an agent restored from an older memory snapshot would run it on pipes without a word
                raise KindUnavailable(
                    f"the guest agent ({self.version}) predates terminals; a sandbox made afresh has one that runs them"
                )
            flags |= FLAG_PTY
            extra += _WINSIZE.pack(pty.rows, pty.cols)
        return _EXEC.pack(len(argv), len(envs), flags, uid, gid) + extra + strings

    async def run_bytes(
        self, argv: list[str], stdin: bytes | None, timeout: float, user: tuple[int, int] | None = None
    ) -> tuple[int, bytes, str]:
        """Run a helper command of the daemon's (file API): (exit code, all of stdout, stderr text).

        stdout is kept whole up to MAX_ARCHIVE bytes; beyond that the command is killed and
        LimitExceeded raised. A timeout raises SandboxTimeout.
        """
        out = bytearray()

        def collect(stream: str, data: bytes) -> None:
            if stream == "stdout":
                out.extend(data)
                if len(out) > MAX_ARCHIVE:
                    raise LimitExceeded(f"output exceeds {MAX_ARCHIVE} bytes")

        res = await self.run(argv, HELPER_ENV, "/", stdin, timeout, HELPER_STDERR, collect, user)
        if res.timed_out or res.exit_code is None:
            raise SandboxTimeout(f"{argv[0]} did not finish within {timeout:g}s")
        return res.exit_code, bytes(out), res.stderr

    async def aclose(self) -> None:
        self.closed = True
        self._writer.close()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    # ---- sending ---------------------------------------------------------------------------------

    async def _send(self, frame: bytes) -> None:
        # One write per frame: the transport never interleaves two writes, so no lock is needed.
        if self.closed or self._writer.is_closing():
            raise SandboxGone("the guest agent's channel is closed")
        try:
            self._writer.write(frame)
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            raise SandboxGone(f"the guest agent's channel broke: {e}") from None

    def _resize_nowait(self, exec_id: int, size: PtySize) -> None:
        """The agent sets the exec's terminal's size (the guest kernel sends SIGWINCH)."""
        if self.closed or self._writer.is_closing():
            return
        with contextlib.suppress(ConnectionError, OSError):
            self._writer.write(_frame(b"W", exec_id, _WINSIZE.pack(size.rows, size.cols)))

    def _kill_nowait(self, exec_id: int) -> None:
        self._signal_nowait(exec_id, SIGKILL)

    def _signal_nowait(self, exec_id: int, sig: int) -> None:
        """The agent sends ``sig`` to the exec's tree (SIGKILL: its cgroup, else its process group)."""
        if self.closed or self._writer.is_closing():
            return
        with contextlib.suppress(ConnectionError, OSError):
            self._writer.write(_frame(b"K", exec_id, struct.pack("<I", sig)))

    async def _feed_stdin(self, exec_id: int, data: bytes) -> None:
        view = memoryview(data)
        for off in range(0, len(view), STDIN_CHUNK):
            await self._send(_frame(b"I", exec_id, bytes(view[off : off + STDIN_CHUNK])))
        await self._send(_frame(b"I", exec_id))  # EOF

    async def _pump_stdin(self, exec_id: int, io: ExecIO) -> None:
        while (chunk := await io.next_chunk()) is not None:
            view = memoryview(chunk)
            for off in range(0, len(view), STDIN_CHUNK):
                await self._send(_frame(b"I", exec_id, bytes(view[off : off + STDIN_CHUNK])))
        await self._send(_frame(b"I", exec_id))  # EOF

    # ---- receiving -------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                size, kind, ident = _HEADER.unpack(await self._reader.readexactly(_HEADER.size))
                if size < 5 or size > MAX_FRAME:
                    log.warning("the guest agent sent a frame of length %d; dropping the channel", size)
                    break
                payload = await self._reader.readexactly(size - 5) if size > 5 else b""
                self._dispatch(kind, ident, payload)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            log.debug("guest agent channel closed: %r", e)
        finally:
            self._fail_all()

    def _dispatch(self, kind: bytes, ident: int, payload: bytes) -> None:
        if kind == b"R":
            if not self._ready.done():
                self.version = payload.decode(errors="replace")
                self._ready.set_result(self.version)
            return
        if kind in (b"p", b"t"):
            ping = self._pings.get(ident)
            if ping is not None and not ping.done():
                ping.set_result(payload)
            return
        ex = self._execs.get(ident)
        if ex is None:  # a command whose caller already gave up on it
            return
        if kind in _STREAMS:
            self._output(ident, ex, _STREAMS[kind], payload)
        elif kind == b"S" and len(payload) >= 8:
            (ex.pid,) = struct.unpack_from("<q", payload)
            if ex.io is not None:
                resize = None if ex.io.pty is None else lambda size: self._resize_nowait(ident, size)
                ex.io.attach(ex.pid, lambda sig: self._signal_nowait(ident, sig), resize)
        elif kind == b"X" and len(payload) >= 4:
            ex.oom = len(payload) >= 5 and bool(payload[4] & 1)  # agents before the flag sent 4 bytes
            if not ex.exited.done():
                ex.exited.set_result(struct.unpack_from("<i", payload)[0])
        elif kind == b"F" and len(payload) >= 4:
            (err,) = struct.unpack_from("<I", payload)
            ex.failure = (err, payload[4:].decode(errors="replace"))
            if not ex.exited.done():
                ex.exited.set_result(None)

    def _output(self, ident: int, ex: _Exec, stream: str, data: bytes) -> None:
        ex.clock.touch()
        ex.caps[stream].feed(data)
        if ex.on_output is None or ex.callback_error is not None:
            return
        try:
            ex.on_output(stream, data)
        except Exception as e:  # the consumer is gone: stop the command, report the error from run()
            ex.callback_error = e
            self._kill_nowait(ident)

    def _fail_all(self) -> None:
        self.closed = True
        gone = SandboxGone("the guest agent went away (the sandbox stopped)")
        futures: list[asyncio.Future[Any]] = [
            self._ready,
            *(ex.exited for ex in self._execs.values()),
            *self._pings.values(),
        ]
        for fut in futures:
            if not fut.done():
                fut.set_exception(gone)
                fut.exception()  # consumed: nobody may be waiting any more


def _result(ex: _Exec, status: int | None, started: float, expired: str | None) -> ExecResult:
    """``status`` is a raw wait status, or None if unknown (a start failure, or an unconfirmed kill)."""
    if ex.failure is not None:
        err, message = ex.failure
        # the same codes a shell (and the container kind) gives a command that cannot be run
        status = (127 if err == errno.ENOENT else 126) << 8
        ex.caps["stderr"].feed(f"dsec: {message}\n".encode())
    return exec_result(status, ex.caps["stdout"], ex.caps["stderr"], started, expired=expired, oom=ex.oom)


async def connect_agent(sock: Path, timeout: float, gone: Callable[[], str | None], kick: bool = False) -> GuestChannel:
    """A channel to a guest agent that has said 'R', retrying while the guest boots or restores.

    An agent that does not greet within a second is asked to (``hello``): one restored from a memory
    snapshot, or one whose greeting crossed the host's connection, may believe it already did. With
    ``kick`` (a restored guest) it is asked at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        if (why := gone()) is not None:
            raise SandboxGone(why)
        try:
            chan = await GuestChannel.connect_unix(sock, timeout=2.0)
            try:
                if kick:
                    await chan.hello()
                while True:
                    try:
                        await chan.wait_ready(min(1.0, max(0.1, deadline - time.monotonic())))
                        return chan
                    except TimeoutError:
                        if time.monotonic() >= deadline or (why := gone()) is not None:
                            raise
                        await chan.hello()
            except BaseException:
                await chan.aclose()
                raise
        except (OSError, TimeoutError, BackendError):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from the guest agent within {timeout:g}s") from None
            await asyncio.sleep(0.1)
