"""The sandbox state machine: the live table, lookups on behalf of a caller, state changes and the
per-sandbox locks. Every other part of the core receives one of these (with the backends) and acts
on sandboxes only through it.

States: creating → running → stopping → stopped, and failed / lost with a reason. Each action says
which states allow it and rejects the rest with ``InvalidState`` (or ``SandboxGone`` once terminal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from ..errors import DsecError, InvalidState, SandboxGone, SandboxNotFound
from ..kinds.base import Backend
from ..protocol.sandbox import TERMINAL_STATES, ExecResult, State
from ..store.records import SandboxRecord
from ..store.sqlite import SandboxStore
from ..tenancy import OPERATOR, Caller
from .admission import Admission
from .record_writes import RecordWrites
from .volumes import Volumes

log = logging.getLogger("dsec.core")
T = TypeVar("T")

LIVE_STATES = {State.creating, State.running, State.paused, State.stopping}
MAX_ID = 64


class Sandboxes:
    def __init__(
        self,
        store: SandboxStore,
        records: RecordWrites,
        admission: Admission,
        backends: dict[str, Backend],
        volumes: Volumes | None = None,
    ) -> None:
        self.store = store
        self.records = records
        self.admission = admission
        self.volumes = volumes  # named volumes the sandboxes hold: given back as each one ends
        self.backends = backends  # kind -> backend, filled as the kinds start
        # Records of live sandboxes, kept in memory (written through to the store): the hot path of
        # every exec and file call reads them without touching SQLite.
        self._live: dict[str, SandboxRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._busy: dict[str, int] = {}  # sandbox id -> execs in flight (a VM is not paused under one)
        # one-shot runs' sandboxes: never written to the state database (a daemon that dies mid-run
        # fails the call; the worker it held is cleaned up as stale on the next start)
        self._ephemeral: set[str] = set()
        # set while a sandbox's writable layer is being packed: host-side file writes wait for it
        self._packing: dict[str, asyncio.Event] = {}
        # sandboxes being rolled back (their processes ended, their root made again): calls wait
        self._resetting: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        self.on_end: list[Callable[[str], None]] = []  # told of each sandbox that ends, after its state

    # ---- the live table ----------------------------------------------------------------------------

    def live(self) -> list[SandboxRecord]:
        """The live sandboxes' records (a copy: callers may await while they walk it)."""
        return list(self._live.values())

    def find_live(self, sandbox_id: str) -> SandboxRecord | None:
        return self._live.get(sandbox_id)

    def is_live(self, sandbox_id: str) -> bool:
        return sandbox_id in self._live

    def adopt(self, rec: SandboxRecord, *, persist: bool = True) -> None:
        """A new (or re-adopted) sandbox enters the table; unless ``persist``, it is never recorded."""
        if persist:
            self.records.write(rec)
        else:
            self._ephemeral.add(rec.id)
        self._live[rec.id] = rec

    def readopt(self, rec: SandboxRecord) -> None:
        """A recorded sandbox found live after a restart enters the table as the store holds it, with
        the volumes it holds."""
        self._live[rec.id] = rec
        if self.volumes is not None:
            self.volumes.readopt(rec)

    def save(self, rec: SandboxRecord) -> None:
        """Write a changed record through (an ephemeral sandbox's stays in memory)."""
        if rec.id not in self._ephemeral:
            self.store.put(rec)

    def get(self, sandbox_id: str, caller: Caller = OPERATOR) -> SandboxRecord:
        """The record, if ``caller`` may act on it. Every action on a sandbox goes through here: another
        tenant's sandbox is answered exactly like one that does not exist, so ids cannot be probed."""
        if not isinstance(sandbox_id, str) or not sandbox_id or len(sandbox_id) > MAX_ID:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        rec = self._live.get(sandbox_id) or self.records.unsaved.get(sandbox_id) or self.store.get(sandbox_id)
        # an idle warm-pool member is nobody's until claimed: only the operator reaches it, by its id
        if rec is None or not caller.owns(rec.owner) or (rec.pool is not None and not caller.operator):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        return rec

    def running(self, sandbox_id: str, caller: Caller = OPERATOR) -> tuple[SandboxRecord, Backend]:
        """The record and its backend, if the sandbox is running; else the precise error."""
        rec = self.get(sandbox_id, caller)
        if rec.state in TERMINAL_STATES:
            raise gone(rec)
        if rec.state != State.running:
            raise InvalidState(
                f"sandbox {rec.id} is {rec.state.value}; this needs a running sandbox",
                detail={"state": rec.state.value},
            )
        if rec.id in self._resetting:
            raise InvalidState(f"sandbox {rec.id} is being rolled back; call again once the rollback answered")
        if rec.expires_at <= time.time():
            raise SandboxGone(f"sandbox {rec.id} reached its time to live")
        return rec, self.backends[rec.kind]

    def drop(self, sandbox_id: str) -> None:
        """An unrecorded sandbox leaves the table as if it had never been (a creation whose image could
        not be had: nothing was made for it)."""
        if sandbox_id in self._ephemeral:
            self._ephemeral.discard(sandbox_id)
            self._live.pop(sandbox_id, None)
            self._locks.pop(sandbox_id, None)

    def set_state(self, rec: SandboxRecord, state: State, reason: str | None = None) -> None:
        before = rec.state, rec.reason
        rec.state = state
        rec.reason = reason
        if rec.id not in self._ephemeral:
            try:
                self.records.write(rec)  # a state that starts something is refused if it cannot be recorded
            except BaseException:
                rec.state, rec.reason = before
                raise
        if state in TERMINAL_STATES:
            self._ephemeral.discard(rec.id)
            self._live.pop(rec.id, None)
            self.admission.release(rec.id)
            if self.volumes is not None:
                self.volumes.release(rec.id)
            for ended in self.on_end:
                ended(rec.id)
        else:
            self._live[rec.id] = rec

    # ---- locks, commands in flight, packing ----------------------------------------------------------

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def forget_lock(self, sandbox_id: str) -> None:
        """A sandbox that takes no more actions needing its lock (ended, or failed to start)."""
        self._locks.pop(sandbox_id, None)

    def held_locks(self) -> int:
        return len(self._locks)

    @contextlib.contextmanager
    def busy(self, sandbox_id: str) -> Iterator[None]:
        """A command in flight in the sandbox for the duration."""
        self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        try:
            yield
        finally:
            left = self._busy[sandbox_id] - 1
            if left:
                self._busy[sandbox_id] = left
            else:
                del self._busy[sandbox_id]

    def commands_running(self, sandbox_id: str) -> int:
        return self._busy.get(sandbox_id, 0)

    @contextlib.asynccontextmanager
    async def packing(self, sandbox_id: str) -> AsyncIterator[None]:
        """The sandbox's writable layer is being packed: host-side writes wait until it is done."""
        done = self._packing[sandbox_id] = asyncio.Event()
        try:
            yield
        finally:
            done.set()
            self._packing.pop(sandbox_id, None)

    @contextlib.contextmanager
    def resetting(self, sandbox_id: str) -> Iterator[None]:
        """The sandbox is rolled back for the duration: new calls are refused, and a call it ends is
        answered as ended by the rollback, not taken for the sandbox's death."""
        self._resetting.add(sandbox_id)
        try:
            yield
        finally:
            self._resetting.discard(sandbox_id)

    async def not_packing(self, sandbox_id: str) -> None:
        packing = self._packing.get(sandbox_id)
        if packing is not None:
            await packing.wait()

    # ---- sandboxes found dead, and work left to the background --------------------------------------

    async def checked(self, rec: SandboxRecord, op: Awaitable[T]) -> T:
        """Run an operation; if the sandbox died under it, report that rather than a runtime error."""
        ended = f"the call was ended by a rollback of sandbox {rec.id}"
        try:
            result = await op
        except DsecError as e:
            if rec.id in self._resetting:  # its processes were ended by the rollback, on purpose
                raise InvalidState(ended) from e
            if not isinstance(e, SandboxGone):
                raise
            current = self._live.get(rec.id)
            if current is not None and current.state == State.running:
                self.died(current, str(e))
            raise
        if rec.id in self._resetting and isinstance(result, ExecResult) and result.signal == signal.SIGKILL:
            raise InvalidState(ended)  # a rollback in place kills the command, the sandbox stays
        return result

    def died(self, rec: SandboxRecord, why: str) -> None:
        """A sandbox found dead under an operation: ``failed`` at once; what the backend still holds for it
        (cgroups, bundle, network, leases) released once that operation has let go of the lock."""
        self.set_state(rec, State.failed, why)

        async def release() -> None:
            try:
                async with self.lock(rec.id):
                    await self.backends[rec.kind].destroy(rec)
            except Exception:
                log.exception("releasing what dead sandbox %s held failed", rec.id)
            finally:
                self.forget_lock(rec.id)

        self.in_background(release())

    def in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def settle(self, timeout: float) -> None:
        """Wait (bounded) for the background work: dead sandboxes' releases, traces being saved."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)


def gone(rec: SandboxRecord) -> SandboxGone:
    why = f": {rec.reason}" if rec.reason else ""
    return SandboxGone(f"sandbox {rec.id} is {rec.state.value}{why}", detail={"state": rec.state.value})
