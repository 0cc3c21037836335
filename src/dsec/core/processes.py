"""Processes started through the process API (the E2B layer's ``commands`` and ``pty``): commands that
outlive the request that started them, can be listed, re-attached to, fed standard input and signalled,
and may run on a pseudo-terminal that can be resized while they run.

Each one is an ordinary exec of the manager (or a trajectory call, for a bound sandbox), so limits,
output caps, timeouts, logging and the host-side exit status are those of every exec. The table only
keeps what a live caller needs: the pid, the ``ExecIO`` to feed and signal it, and the subscribers its
output is fanned out to. Output forwarded to subscribers is bounded per stream (like a streamed exec);
the final result keeps its head and tail as every exec's does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..errors import BackendError, DsecError, InvalidState, LimitExceeded, NotFound
from ..kinds.execio import ExecIO
from ..protocol.sandbox import ExecRequest, ExecResult
from ..protocol.terminal import PtySize
from ..tenancy import Caller
from .actions import Actions
from .sandboxes import Sandboxes

log = logging.getLogger("dsec.core.processes")

MAX_PER_SANDBOX = 100  # live API processes of one sandbox
MAX_SUBSCRIBERS = 16  # streams attached to one process at once
DEFAULT_STREAM_LIMIT = 16 << 20  # bytes of each stream forwarded to subscribers


@dataclass(frozen=True)
class Output:
    stream: str  # "stdout" | "stderr"; a terminal's one stream is "stdout"
    data: bytes


@dataclass(frozen=True)
class Ended:
    """The process ended: its result, or the error that ended the call (the sandbox went away, say)."""

    result: ExecResult | None
    error: DsecError | None = None


Event = Output | Ended


class Subscription:
    """One stream of a process's events, from the moment it subscribed."""

    def __init__(self, proc: Process) -> None:
        self.proc = proc
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        self._queue.put_nowait(event)

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event; None when ``timeout`` seconds pass without one (time for a keepalive)."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, Ended):
                return

    def close(self) -> None:
        self.proc.subscribers.discard(self)


@dataclass(eq=False)
class Process:
    sandbox_id: str
    owner: str
    req: ExecRequest
    tag: str | None
    io: ExecIO
    stream_limit: int
    pid: int = 0
    subscribers: set[Subscription] = field(default_factory=set)
    ended: Ended | None = None
    replayed: bool = False
    _sent: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    task: asyncio.Task[None] | None = None

    @property
    def terminal(self) -> bool:
        return self.io.pty is not None

    def resize(self, size: PtySize) -> None:
        """A new size for the process's terminal."""
        self.io.resize(size)

    def subscribe(self) -> Subscription:
        if len(self.subscribers) >= MAX_SUBSCRIBERS:
            raise LimitExceeded(f"process {self.pid} already has {MAX_SUBSCRIBERS} streams attached")
        sub = Subscription(self)
        if self.ended is not None:
            sub.put(self.ended)
        else:
            self.subscribers.add(sub)
        return sub

    def output(self, stream: str, data: bytes) -> None:
        """Called by the kind for every chunk, on the event loop: fanned out within the stream's budget."""
        sent = self._sent[stream]
        if sent >= self.stream_limit:
            return
        chunk = data[: self.stream_limit - sent]
        self._sent[stream] = sent + len(chunk)
        if self._sent[stream] >= self.stream_limit:
            chunk += f"\n[dsec: {stream} beyond {self.stream_limit} bytes is not streamed]\n".encode()
        for sub in self.subscribers:
            sub.put(Output(stream, chunk))

    def finish(self, ended: Ended) -> None:
        self.ended = ended
        for sub in self.subscribers:
            sub.put(ended)
        self.subscribers.clear()


class ProcessTable:
    def __init__(self, sandboxes: Sandboxes, actions: Actions, stream_limit: int = DEFAULT_STREAM_LIMIT) -> None:
        self.sandboxes = sandboxes
        self.actions = actions
        self.stream_limit = stream_limit
        self._live: dict[str, dict[int, Process]] = {}  # sandbox id -> pid -> running process

    async def start(
        self,
        sandbox_id: str,
        req: ExecRequest,
        *,
        caller: Caller,
        stdin: bool = False,
        tag: str | None = None,
        seq: int | None = None,
        pty: PtySize | None = None,
    ) -> tuple[Process, Subscription]:
        """Start a command and return it once it runs, with a subscription that sees all its output.

        ``stdin``: the command's standard input stays open for ``send_input`` until ``close_stdin``
        (else it reads EOF at once). ``pty``: the command runs on a pseudo-terminal of that size, which
        is its standard input (always open: what is fed is typed on it) and its one output stream.
        ``seq``: the call's position, for a sandbox bound to a trajectory. A replayed trajectory call
        never starts: the process comes back already ended (pid 0), its subscription holding the
        recorded output and result.
        """
        rec = self.sandboxes.get(sandbox_id, caller)
        live = self._live.setdefault(rec.id, {})
        if len(live) >= MAX_PER_SANDBOX:
            raise LimitExceeded(f"sandbox {rec.id} already runs {MAX_PER_SANDBOX} processes started by the API")
        if rec.trajectory and (stdin or pty is not None):
            what = "a terminal's input" if pty is not None else "standard input fed while a command runs"
            raise InvalidState(
                f"sandbox {rec.id} is bound to a trajectory: {what} is not recorded in the log, so such "
                "commands are refused; pass the input in the command instead"
            )
        io = ExecIO(pty=pty)
        if not stdin and pty is None:
            io.close_stdin()
        proc = Process(rec.id, rec.owner or "", req, tag, io, self.stream_limit)
        sub = proc.subscribe()
        proc.task = asyncio.create_task(self._run(proc, caller, seq))
        started = asyncio.ensure_future(io.started.wait())
        try:
            await asyncio.wait({started, proc.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if io.started.is_set() and io.pid is not None:
            proc.pid = io.pid
            if proc.ended is None:  # a command that ended at once is never listed
                live[proc.pid] = proc
            return proc, sub
        # the call ended without starting a command: an error (no such user, sandbox gone), or a replay
        if proc.ended is not None and proc.ended.error is not None:
            raise proc.ended.error
        if proc.ended is not None and proc.replayed and proc.ended.result is not None:
            return proc, sub
        raise BackendError("the command ended before it started")  # a kind that never called attach

    async def _run(self, proc: Process, caller: Caller, seq: int | None) -> None:
        try:
            result, replayed = await self.actions.call(
                proc.sandbox_id, "exec", proc.req, seq=seq, caller=caller, on_output=proc.output, io=proc.io
            )
            proc.replayed = replayed
            if replayed:
                for stream in ("stdout", "stderr"):
                    if text := getattr(result, stream):
                        proc.output(stream, text.encode())
            ended = Ended(result)
        except DsecError as e:
            ended = Ended(None, e)
        except asyncio.CancelledError:
            ended = Ended(None, InvalidState("the daemon is stopping"))
            raise
        except Exception as e:  # the subscribers must always see an end
            log.exception("process of sandbox %s failed", proc.sandbox_id)
            ended = Ended(None, BackendError(f"internal error: {type(e).__name__}: {e}"))
        finally:
            live = self._live.get(proc.sandbox_id)
            if live is not None and live.get(proc.pid) is proc:
                del live[proc.pid]
                if not live:
                    del self._live[proc.sandbox_id]
            proc.finish(ended)

    def list(self, sandbox_id: str, *, caller: Caller) -> list[Process]:
        rec = self.sandboxes.get(sandbox_id, caller)
        return sorted(self._live.get(rec.id, {}).values(), key=lambda p: p.pid)

    def find(self, sandbox_id: str, *, caller: Caller, pid: int | None = None, tag: str | None = None) -> Process:
        """A running process by pid or by tag."""
        for proc in self.list(sandbox_id, caller=caller):
            if (pid is not None and proc.pid == pid) or (tag is not None and proc.tag == tag):
                return proc
        what = f"pid {pid}" if pid is not None else f"tag {tag!r}"
        raise NotFound(f"no running process with {what} in sandbox {sandbox_id}")

    async def close(self) -> None:
        """The daemon stops: the processes' calls are cancelled (the kinds kill what they started)."""
        tasks = [p.task for live in self._live.values() for p in live.values() if p.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._live.clear()
