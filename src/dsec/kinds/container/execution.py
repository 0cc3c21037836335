"""Running one command in a container sandbox: pipes, output capture, per-exec cgroup, timeout kill.

Two ways to start the command share everything else:
- through the sandbox's agent (its init; see agent.c): ~1 ms, the default;
- through the OCI runtime's ``exec`` (``crun exec``, ~10+ ms), used when a sandbox has no agent channel.
Either way the daemon owns the pipes and the command runs in its own cgroup, so a timeout kills
exactly its process tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import BackendError, KindUnavailable, LimitExceeded, SandboxGone
from ...isolation import cgroups
from ...proc import FdReader, empty_input, read_line, spawn, wait, write_all
from ...protocol.sandbox import ExecResult
from ...protocol.terminal import PtySize
from ..base import MAX_ARCHIVE, OutputCallback
from ..execio import ExecIO
from ..output import CappedBuffer, Deadlines, exec_result
from .agent import AgentChannel

log = logging.getLogger("dsec.container.exec")

# After the main process exits, how long to keep reading output that background children still write.
DRAIN_GRACE = 0.2
PIPE_SIZE = 1 << 20
HANDSHAKE_TIMEOUT = 30.0
# After a deadline kill: how long to wait for the exit, in rounds that each repeat the kill.
KILL_ROUNDS = 20
KILL_ROUND = 0.5
# The runtime path's launcher (run by the read-only /.dsec/busybox sh): report our pid on fd 4, wait
# for the go on fd 3 (the daemon moves us into the exec cgroup meanwhile), then become the command.
LAUNCH = 'echo $$ >&4; exec 4>&-; read -r _ <&3; exec 3<&-; exec "$@"'


@dataclass
class ExecPlan:
    argv: list[str]
    stdin: bytes | None
    timeout: float
    limit: int
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    on_output: OutputCallback | None = None
    raw: bytearray | None = None  # keep all of stdout (archives), bounded by MAX_ARCHIVE
    user: tuple[int, int] | None = None  # (uid, gid) in the sandbox; None: root
    idle_timeout: float | None = None  # seconds without output before the tree is killed
    # (RLIMIT_NOFILE, RLIMIT_FSIZE) for the runtime path; the agent path inherits the init's (spec.py)
    rlimits: tuple[int, int] | None = None
    io: ExecIO | None = None  # live stdin, pid and signals (then ``stdin`` is None)


class _Capture:
    """The pipes of one exec and the tasks that drain them."""

    def __init__(self, plan: ExecPlan) -> None:
        self.plan = plan
        self.caps = {"stdout": CappedBuffer(plan.limit), "stderr": CappedBuffer(plan.limit)}
        self.terminal = plan.io is not None and plan.io.pty is not None
        if self.terminal:  # the agent makes the terminal; its master comes with the start (use_terminal)
            self.out_r = self.out_w = self.err_r = self.err_w = self.in_r = self.in_w = -1
        else:
            self.out_r, self.out_w = _big_pipe()
            self.err_r, self.err_w = _big_pipe()
            if plan.stdin is not None or plan.io is not None:
                self.in_r, self.in_w = os.pipe()
            else:
                self.in_r, self.in_w = empty_input(), -1
        self.tasks: list[asyncio.Future[None]] = []  # the readers' ``done``, then a stdin feeder's task
        self.readers: list[FdReader] = []
        self.clock = Deadlines(time.monotonic(), plan.timeout, plan.idle_timeout)

    def use_terminal(self, master: int) -> None:
        """The command's terminal: its output is read from the master, and input written to a second
        descriptor of it (each is closed once, as the pipes are)."""
        self.out_r = master
        self.in_w = os.dup(master)

    def child_fds(self) -> list[int]:
        return [self.in_r, self.out_w, self.err_w]

    def close_child_ends(self) -> None:
        # Each fd is closed once and forgotten: closing a number twice could close an fd that another
        # exec has been handed in between.
        for name in ("in_r", "out_w", "err_w"):
            _close(getattr(self, name))
            setattr(self, name, -1)

    async def cleanup(self) -> None:
        """Stop the readers and tasks, wait until they let go of their fds, then close every fd exactly once."""
        for reader in self.readers:
            reader.close()
        pending = []
        for task in self.tasks:
            if not task.done():
                task.cancel()
                pending.append(task)
            elif not task.cancelled():
                task.exception()  # retrieved, as gathering it would (gathering done tasks costs a loop turn)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self.close_child_ends()
        for name in ("in_w", "out_r", "err_r"):
            _close(getattr(self, name))
            setattr(self, name, -1)

    def _feeder(self, stream: str) -> Callable[[bytes], None]:
        cap, plan = self.caps[stream], self.plan

        def feed(data: bytes) -> None:
            self.clock.touch()
            cap.feed(data)
            if plan.raw is not None and stream == "stdout":
                plan.raw += data
                if len(plan.raw) > MAX_ARCHIVE:
                    raise LimitExceeded(f"output exceeds {MAX_ARCHIVE} bytes")
            if plan.on_output is not None:
                plan.on_output(stream, data)

        return feed

    def start(self) -> None:
        # a terminal's master reads EIO once every descriptor of its slave is closed: its end of file
        self.readers = [FdReader(self.out_r, self._feeder("stdout"), PIPE_SIZE, eio_is_eof=self.terminal)]
        if self.err_r >= 0:
            self.readers.append(FdReader(self.err_r, self._feeder("stderr"), PIPE_SIZE))
        self.tasks = [reader.done for reader in self.readers]
        if self.plan.stdin is not None:
            self.tasks.append(asyncio.ensure_future(self._feed_stdin(self.plan.stdin)))
        elif self.plan.io is not None:
            self.tasks.append(asyncio.ensure_future(self._pump_stdin(self.plan.io)))

    async def _feed_stdin(self, data: bytes) -> None:
        await write_all(self.in_w, data)
        _close(self.in_w)  # EOF for the command
        self.in_w = -1

    async def _pump_stdin(self, io: ExecIO) -> None:
        try:
            while (chunk := await io.next_chunk()) is not None:
                await write_all(self.in_w, chunk)
        except OSError as e:  # a terminal whose slave side is all closed refuses input (EIO)
            if not self.terminal:
                raise
            log.debug("input for a terminal was dropped: %s", e)
        # for a terminal only this descriptor goes: the master stays open for the output
        _close(self.in_w)
        self.in_w = -1

    def attach(self, pid: int, group: Path) -> None:
        """Report the started command to a live caller: its pid, signals for its exec cgroup, and the
        size of its terminal (set on the master: the kernel signals the terminal's foreground group)."""
        if self.plan.io is None:
            return
        resize = None
        if self.terminal:
            master = self.out_r

            def resize(size: PtySize) -> None:
                fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", size.rows, size.cols, 0, 0))

        self.plan.io.attach(pid, lambda sig: cgroups.signal_group(group, sig), resize)

    async def finish(self) -> None:
        readers = self.tasks[: len(self.readers)]
        if not all(task.done() for task in readers):  # (waiting on done ones costs a loop turn)
            await asyncio.wait(readers, timeout=DRAIN_GRACE)
        for reader in self.readers:
            if not reader.done.done():
                reader.close()
        for task in self.tasks[len(self.readers) :]:
            task.cancel()
        for task in readers:
            if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                raise exc

    def result(self, status: int, started: float, expired: str | None, oom: bool) -> ExecResult:
        """``status`` is a raw wait status; ``expired`` the deadline that killed the command, if any."""
        return exec_result(status, self.caps["stdout"], self.caps["stderr"], started, expired=expired, oom=oom)


async def _supervise(group: Path, exited: Awaitable[int], clock: Deadlines) -> tuple[int, str | None]:
    """Wait for the command; when its wall clock or idle-output deadline passes, kill its cgroup.
    Returns (raw wait status, the deadline that expired or None)."""
    fut = asyncio.ensure_future(exited)
    try:
        while True:
            if fut.done():  # (a short command's exit is often in already: no timer, no loop turn)
                return fut.result(), None
            try:
                return await asyncio.wait_for(asyncio.shield(fut), clock.wait()), None
            except TimeoutError:
                expired = clock.expired()
                if expired is not None:
                    break
        # cgroup.kill reaches only the members of the moment: a process still on its way into the
        # group (the command's first step is to join it) arrives afterwards, so the kill is repeated.
        for _ in range(KILL_ROUNDS):
            cgroups.kill_group(group)
            try:
                return await asyncio.wait_for(asyncio.shield(fut), KILL_ROUND), expired
            except TimeoutError:
                continue
        left = cgroups.describe_members(group)
        raise BackendError(f"the command did not die after its cgroup was killed; left: {left}", detail={"left": left})
    except asyncio.CancelledError:  # the caller went away (a streaming client disconnected)
        cgroups.kill_group(group)
        raise


async def run_via_agent(
    chan: AgentChannel,
    layout: cgroups.CgroupLayout,
    cg_path: str,
    base_env: dict[str, str],
    default_cwd: str,
    plan: ExecPlan,
    name: str,
    reuse_group: bool = False,
) -> ExecResult:
    """``reuse_group``: the cgroup ``name`` exists and outlives the exec (a function worker's kept
    group: made once, emptied by its reset, no mkdir or rmdir per call)."""
    group = layout.unified_dir(cg_path) / name if reuse_group else _make_group(layout, cg_path, name)
    cap = _Capture(plan)
    procs_fd = -1
    try:
        procs_fd = os.open(group / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        env = [f"{k}={v}" for k, v in {**base_env, **plan.env}.items()]
        oom_before = layout.oom_kills(cg_path)
        started = time.monotonic()
        cap.clock = Deadlines(started, plan.timeout, plan.idle_timeout)
        cwd = plan.cwd or default_cwd
        if plan.io is not None and plan.io.pty is not None:
            pid, exited, master = await chan.spawn_terminal(plan.argv, env, cwd, procs_fd, plan.io.pty, plan.user)
            cap.use_terminal(master)
        else:
            pid, exited = await chan.spawn(plan.argv, env, cwd, [*cap.child_fds(), procs_fd], plan.user)
        _close(procs_fd)
        procs_fd = -1
        cap.close_child_ends()
        cap.start()
        cap.attach(pid, group)
        status, expired = await _supervise(group, exited, cap.clock)
        await cap.finish()
        return cap.result(status, started, expired, _oom_killed(layout, cg_path, oom_before, status))
    finally:
        _close(procs_fd)
        if plan.io is not None:
            plan.io.detach()
        await cap.cleanup()
        if not reuse_group:
            # after the answer has gone out: nothing else in this turn of the event loop waits on it
            asyncio.get_running_loop().call_soon(_remove_group, group)


async def run_via_runtime(
    runtime_argv: list[str],
    sandbox_id: str,
    layout: cgroups.CgroupLayout,
    cg_path: str,
    helper: str,
    plan: ExecPlan,
    name: str,
    alive: Callable[[], Awaitable[bool]],
) -> ExecResult:
    if plan.io is not None and plan.io.pty is not None:
        raise KindUnavailable(
            "a command on a terminal needs the sandbox's agent, and this sandbox runs its commands through "
            "the OCI runtime's exec (its agent could not be built or re-attached)"
        )
    group = _make_group(layout, cg_path, name)
    cap = _Capture(plan)
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    cmd = [*runtime_argv, "exec", "--preserve-fds=2", "--no-new-privs"]
    if plan.cwd:
        cmd += ["--cwd", plan.cwd]
    if plan.user is not None:
        cmd += ["--user", f"{plan.user[0]}:{plan.user[1]}"]
    for k, v in plan.env.items():
        cmd += ["-e", f"{k}={v}"]
    cmd += [sandbox_id, helper, "sh", "-c", LAUNCH, "dsec-exec", *plan.argv]
    try:
        oom_before = layout.oom_kills(cg_path)
        started = time.monotonic()
        cap.clock = Deadlines(started, plan.timeout, plan.idle_timeout)
        pid = spawn(cmd, {0: cap.in_r, 1: cap.out_w, 2: cap.err_w, 3: go_r, 4: ready_w})
        for fd in (go_r, ready_w):
            os.close(fd)
        go_r = ready_w = -1
        cap.close_child_ends()
        cap.start()
        try:
            line = await asyncio.wait_for(read_line(ready_r), min(plan.timeout, HANDSHAKE_TIMEOUT))
        except TimeoutError:
            line = b""
        if line.strip().isdigit():
            host_pid = cgroups.host_pid_for_nspid(layout.unified_dir(cg_path), int(line))
            if host_pid is not None:
                with contextlib.suppress(OSError):
                    cgroups.move_pid(group, host_pid)
                if plan.rlimits is not None:
                    # crun's exec gives the process crun's own limits, not the sandbox's: set them
                    # before the launcher becomes the command
                    _prlimit(host_pid, plan.rlimits)
        with contextlib.suppress(OSError):
            os.write(go_w, b"\n")
        if line.strip().isdigit():
            cap.attach(int(line), group)

        async def exited() -> int:
            code = await wait(pid)
            # crun reports a signalled process as 128+N; turn it back into a wait status
            if 128 < code <= 128 + 64:
                return code - 128
            return (code & 0xFF) << 8 if code >= 0 else -code

        status, expired = await _supervise(group, exited(), cap.clock)
        await cap.finish()
        if not line.strip() and status != 0 and not await alive():
            raise SandboxGone(f"sandbox {sandbox_id} is no longer running")
        return cap.result(status, started, expired, _oom_killed(layout, cg_path, oom_before, status))
    finally:
        if plan.io is not None:
            plan.io.detach()
        for fd in (go_r, go_w, ready_r, ready_w):
            _close(fd)
        await cap.cleanup()
        _remove_group(group)


def _big_pipe() -> tuple[int, int]:
    """An output pipe of PIPE_SIZE: a flooding command (``yes``, a 2 GB line) then costs the daemon's
    event loop one wake-up per MiB instead of one per 64 KiB, which is what kept a neighbour's exec
    waiting behind it. Falls back to the default size where the kernel refuses (pipe-max-size)."""
    r, w = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    return r, w


def _prlimit(pid: int, limits: tuple[int, int]) -> None:
    nofile, fsize = limits
    for which, value in ((resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_FSIZE, fsize)):
        with contextlib.suppress(OSError, ValueError):
            resource.prlimit(pid, which, (value, value))


def _oom_killed(layout: cgroups.CgroupLayout, cg_path: str, before: int, status: int) -> bool:
    """The OOM killer's signal is SIGKILL: only when the command died of it, or exited 137 as a shell
    does when the child it waited for died of it (``sh -c "python3 ..."``), is the sandbox's counter
    worth reading again (v2's memory.events or v1's memory.oom_control)."""
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
    shell_reported = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + 9
    return (killed or shell_reported) and layout.oom_kills(cg_path) > before


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def _remove_group(group: Path) -> None:
    # An exec's cgroup is normally empty and childless by now: one rmdir, no thread hop. Background
    # processes keep it busy; it is then removed with the sandbox.
    try:
        os.rmdir(group)
    except OSError:
        pass


def _make_group(layout: cgroups.CgroupLayout, cg_path: str, name: str) -> Path:
    try:
        return cgroups.make_exec_group(layout, cg_path, name)
    except FileNotFoundError:
        raise SandboxGone("the sandbox is no longer running") from None
