"""The lifecycle core. It owns the state machine and the records; kinds do the work.

States: creating → running → stopping → stopped, and failed / lost with a reason. Each action says
which states allow it and rejects the rest with ``InvalidState`` (or ``SandboxGone`` once terminal).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ..errors import (
    BackendError,
    DsecError,
    InvalidRequest,
    InvalidState,
    KindUnavailable,
    SandboxGone,
    SandboxNotFound,
    environment_error,
)
from ..images.store import ImageRef, ImageStore
from ..isolation.network.host import NetworkHost
from ..isolation.network.options import NetworkOptions
from ..kinds import registry
from ..kinds.base import Backend, BackendContext, OutputCallback
from ..kinds.execio import ExecIO
from ..protocol.network import NetworkSpec
from ..protocol.sandbox import (
    MAX_TTL_S,
    TERMINAL_STATES,
    CreateSandbox,
    ExecRequest,
    ExecResult,
    ForkRequest,
    ForkResult,
    NetworkStatus,
    SandboxInfo,
    State,
)
from ..store.audit import AuditLog
from ..store.records import SandboxRecord, new_record
from ..store.sqlite import SandboxStore
from ..store.tenants import TenantStore
from ..tenancy import OPERATOR, Caller
from . import forks
from .admission import Admission, AdmissionOptions, Claim
from .builds import Builder
from .fileops import FileActions
from .grading import Grader
from .imageops import ImageActions
from .metrics import NodeMetrics
from .oneshot import Runner
from .processes import ProcessTable
from .record_writes import RecordWrites
from .trajectory.recorder import Trajectories, TrajectoryOptions
from .usage import DEFAULT_EVICT_AT, UsageMonitor

log = logging.getLogger("dsec.core")
T = TypeVar("T")

REAP_INTERVAL = 1.0
KEEP_FINISHED_S = 24 * 3600.0
MAX_CONCURRENT_CREATES = 32
LIVE_STATES = {State.creating, State.running, State.paused, State.stopping}


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class SandboxManager(FileActions, ImageActions):
    def __init__(
        self,
        state_dir: Path,
        images: ImageStore | None = None,
        kinds: Sequence[str] | None = None,
        audit: AuditLog | None = None,
        network: NetworkOptions | None = None,
        kind_options: dict[str, Any] | None = None,
        trajectory: TrajectoryOptions | None = None,
        admission: AdmissionOptions | None = None,
        evict_at: float = DEFAULT_EVICT_AT,
    ) -> None:
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self.store = SandboxStore(state_dir / "state.db")
        self.records = RecordWrites(self.store)
        self.tenants = TenantStore(state_dir / "state.db")
        self.audit = audit or AuditLog(state_dir / "audit.db")
        self.images = images or ImageStore(state_dir / "images")
        self.ctx = BackendContext(state_dir=state_dir, net=NetworkHost(state_dir, network), options=kind_options or {})
        self.backends: dict[str, Backend] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Records of live sandboxes, kept in memory (written through to the store): the hot path of
        # every exec and file call reads them without touching SQLite.
        self._live: dict[str, SandboxRecord] = {}
        # per kind: VMs queueing for their few boot slots must not hold up container creations
        self._create_slots: dict[str, asyncio.Semaphore] = {}
        self._reaper: asyncio.Task[None] | None = None
        self.notes: list[str] = []
        self.unavailable: dict[str, str] = {}  # kind -> why this node cannot run it
        self.kinds = list(kinds) if kinds is not None else registry.available()  # the kinds to start
        # Set while a sandbox's writable layer is being packed: host-side file writes wait for it.
        self._packing: dict[str, asyncio.Event] = {}
        self.builds = Builder(self)
        self.grader = Grader(self)
        self.runner = Runner(self)
        self.trajectories = Trajectories(self, trajectory)
        self.processes = ProcessTable(self)
        self.admission = Admission(admission or AdmissionOptions(), quota_of=self.tenants.quota)
        self.node_name = self.admission.options.node_name or os.uname().nodename
        self.usage = UsageMonitor(self, evict_at)
        self.metrics = NodeMetrics(self)
        self.usage.on_sample = self._cpu_sampled
        self._monitor: asyncio.Task[None] | None = None
        self.max_concurrent_creates = MAX_CONCURRENT_CREATES
        self._background: set[asyncio.Task[None]] = set()
        self._busy: dict[str, int] = {}  # sandbox id -> execs in flight (a VM is not paused under one)
        # one-shot runs' sandboxes: never written to the state database (a daemon that dies mid-run
        # fails the call; the worker it held is cleaned up as stale on the next start)
        self._ephemeral: set[str] = set()
        # where the node also serves the E2B-compatible API, for its status (set by `dsec serve`)
        self.e2b_url: str | None = None

    # ---- daemon lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await self.audit.start()
        self.notes += await self.images.start()
        if self.ctx.net is not None:
            await self.ctx.net.start()
            if self.ctx.net.error is not None:
                self.notes.append(f"no network policies on this node ({self.ctx.net.error}): loopback only")
        for kind in self.kinds:
            if kind in self.backends:  # injected (tests, embedding)
                continue
            try:
                backend = registry.load(kind, self.ctx)
                self.notes += await backend.start()
            except KindUnavailable as e:
                if kind == "container":
                    raise
                # a named prerequisite of an optional kind is missing (no QEMU, say): the others go on.
                # Anything else is a bug and stops the daemon: a kind quietly gone would hide it.
                self.unavailable[kind] = e.message
                self.notes.append(f"{kind} kind unavailable: {e.message}")
                continue
            self.backends[kind] = backend
        await self.readopt()
        await self.trajectories.start()
        for backend in self.backends.values():
            await backend.readopted()
            try:
                self.notes += await backend.prewarm(self.images.resolve)
            except DsecError as e:  # a pool that cannot be filled must not keep the node down
                self.notes.append(f"{backend.kind} kind: pre-warming failed: {e.message}")
        self._reaper = asyncio.create_task(self._reap_forever())
        self._monitor = asyncio.create_task(self.usage.run_forever())

    async def close(self) -> None:
        for task in (self._reaper, self._monitor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._background:  # dead sandboxes' releases, traces being saved: bounded, then left
            await asyncio.wait(set(self._background), timeout=30)
        await self.processes.close()
        for backend in self.backends.values():
            try:
                await backend.close()
            except Exception:
                log.exception("closing the %s kind failed", backend.kind)
        if self.ctx.net is not None:
            try:
                await self.ctx.net.close()
            except Exception:
                log.exception("closing the network side failed")
        survivors = sum(1 for r in self._live.values() if r.state not in TERMINAL_STATES)
        try:
            for note in await self.images.close(survivors):
                log.info("%s", note)
            if not survivors:  # what the kinds set up for their sandboxes (helpers, say) has no user left
                for backend in self.backends.values():
                    await backend.release()
        except (DsecError, OSError) as e:
            log.error("releasing the node's mounts: %s", e)
        await self.trajectories.close()
        await self.audit.close()
        self.tenants.close()
        self.records.flush()
        self.store.close()

    async def readopt(self) -> None:
        """After a restart: keep what still runs, mark the rest lost with a reason, free what they held."""
        for rec in self.store.all(LIVE_STATES):
            self._live[rec.id] = rec
            backend = self.backends.get(rec.kind)
            alive = False
            if backend is not None and rec.state in (State.running, State.paused):
                try:
                    alive = await backend.alive(rec)
                except DsecError:
                    alive = False
            if alive:
                log.info("re-adopted sandbox %s", rec.id)
                self.admission.force(rec.id, Claim(rec.owner, rec.limits.cpu, rec.limits.mem_request()))
                continue
            reason = {
                State.creating: "the daemon stopped while the sandbox was being created",
                State.stopping: "the daemon stopped while the sandbox was being stopped",
            }.get(rec.state, "the sandbox was not running when the daemon restarted")
            if backend is None:
                reason = f"kind {rec.kind!r} is not available in this daemon"
            self._set_state(rec, State.lost, reason)
            if backend is not None:
                with contextlib.suppress(Exception):
                    await backend.destroy(rec)
            log.warning("sandbox %s lost: %s", rec.id, reason)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            try:
                await self.reap_once()
            except Exception:  # the reaper must survive anything one sandbox does
                log.exception("reaper pass failed")

    async def reap_once(self) -> None:
        now = time.time()
        self.records.flush()
        for rec in list(self._live.values()):
            if rec.state in (State.running, State.paused) and rec.expires_at <= now:
                log.info("sandbox %s reached its time to live", rec.id)
                with contextlib.suppress(DsecError):
                    await self._stop(rec.id, "time to live expired")
        self.store.delete_older_than(now - KEEP_FINISHED_S, set(TERMINAL_STATES))

    # ---- records and states ------------------------------------------------------------------------

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _set_state(self, rec: SandboxRecord, state: State, reason: str | None = None) -> None:
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
        else:
            self._live[rec.id] = rec

    def _get(self, sandbox_id: str, caller: Caller = OPERATOR) -> SandboxRecord:
        """The record, if ``caller`` may act on it. Every action on a sandbox goes through here: another
        tenant's sandbox is answered exactly like one that does not exist, so ids cannot be probed."""
        if not isinstance(sandbox_id, str) or not sandbox_id or len(sandbox_id) > 64:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        rec = self._live.get(sandbox_id) or self.records.unsaved.get(sandbox_id) or self.store.get(sandbox_id)
        if rec is None or not caller.owns(rec.owner):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        return rec

    def _running(self, sandbox_id: str, caller: Caller = OPERATOR) -> tuple[SandboxRecord, Backend]:
        rec = self._get(sandbox_id, caller)
        if rec.state in TERMINAL_STATES:
            why = f": {rec.reason}" if rec.reason else ""
            raise SandboxGone(f"sandbox {rec.id} is {rec.state.value}{why}", detail={"state": rec.state.value})
        if rec.state != State.running:
            raise InvalidState(
                f"sandbox {rec.id} is {rec.state.value}; this needs a running sandbox",
                detail={"state": rec.state.value},
            )
        if rec.expires_at <= time.time():
            raise SandboxGone(f"sandbox {rec.id} reached its time to live")
        return rec, self.backends[rec.kind]

    # ---- actions -----------------------------------------------------------------------------------

    async def create(self, req: CreateSandbox, *, caller: Caller = OPERATOR, persist: bool = True) -> SandboxInfo:
        """A new sandbox; with ``req.trajectory``, the trajectory's sandbox (new, resumed or rebuilt)."""
        try:
            if req.trajectory:
                return await self.trajectories.create(req, caller)
            return await self.create_fresh(req, caller=caller, persist=persist)
        except DsecError as e:
            self.metrics.failed(req.kind, e.code)
            raise

    async def create_fresh(self, req: CreateSandbox, *, caller: Caller = OPERATOR, persist: bool = True) -> SandboxInfo:
        if req.kind not in self.backends:
            if req.kind in self.unavailable:
                raise InvalidRequest(f"kind {req.kind!r} is not available on this node: {self.unavailable[req.kind]}")
            registry.load(req.kind, self.ctx)  # raises the precise "not available" / "unknown" error
            raise InvalidRequest(f"kind {req.kind!r} is not enabled on this node")
        if req.limits.memory > _host_memory():
            raise InvalidRequest(f"memory limit {req.limits.memory} exceeds this node's {_host_memory()} bytes")
        # refused now (too big for the node or the tenant's quota) rather than after an image build
        self.admission.check(Claim(caller.tenant, req.limits.cpu, req.limits.mem_request()))
        image = await self.images.resolve(req.image, caller=caller)
        return (await self.create_on(req, image, owner=caller.tenant, persist=persist)).info()

    async def create_on(
        self, req: CreateSandbox, image: ImageRef, *, owner: str = OPERATOR.tenant, persist: bool = True
    ) -> SandboxRecord:
        """Create on a resolved image (builder sandboxes the daemon runs itself come here too).

        Admission comes first: a creation that waits for capacity, or is refused, has no record yet, so
        nothing half-made is left behind by a deadline or a caller that went away."""
        backend = self.backends[req.kind]
        backend.check_network(req.network)
        started = time.monotonic()
        claim = Claim(owner, req.limits.cpu, req.limits.mem_request())
        waited = await self.admission.admit(claim, req.queue_timeout)
        if waited:
            self.metrics.queue_wait.observe(waited)
        try:
            rec = new_record(req.kind, image.name, image.digest, req.timeout, req.limits, req.env, req.labels)
        except BaseException:
            self.admission.cancel(claim)
            raise
        self.admission.bind(rec.id, claim)
        rec.owner = owner
        rec.network = req.network
        rec.runtime["node"] = self.node_name
        if req.trajectory:
            rec.runtime["trajectory"] = req.trajectory
        if persist:
            try:
                self.records.write(rec)
            except BaseException:
                self.admission.release(rec.id)
                raise
        else:
            self._ephemeral.add(rec.id)
        self._live[rec.id] = rec
        # VM kinds bound their boots (and restores) themselves, by the accelerator a first use finds
        slots = self._create_slots.setdefault(req.kind, asyncio.Semaphore(self.max_concurrent_creates))
        try:
            async with slots, self._lock(rec.id):
                if rec.state != State.creating:  # killed while it waited for a create slot
                    raise SandboxGone(f"sandbox {rec.id} was {rec.state.value} before it was created: {rec.reason}")
                timings = rec.runtime["timings"] = {"queue": round(time.monotonic() - started, 6)}
                try:
                    await backend.create(rec, image)
                    total = time.monotonic() - started
                    timings["runtime"] = round(total - timings["queue"] - timings.get("rootfs", 0.0), 6)
                    timings["total"] = round(total, 6)
                    self._set_state(rec, State.running)  # not recorded (a full disk): the creation failed
                except BaseException as e:
                    self._set_state(rec, State.failed, f"creation failed: {_failure(e)}")
                    with contextlib.suppress(Exception):
                        await backend.destroy(rec)
                    if isinstance(e, DsecError) or not isinstance(e, Exception):
                        raise
                    raise environment_error(e) or BackendError(f"creating sandbox failed: {_failure(e)}") from e
        except BaseException as e:
            if rec.state == State.creating:  # cancelled before its backend was asked (waiting for a slot)
                self._set_state(rec, State.failed, f"creation failed: {_failure(e)}")
            self._locks.pop(rec.id, None)  # a failed sandbox takes no more actions that need it
            raise
        self.metrics.created(rec.kind, timings)
        return rec

    def info(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        return self._get(sandbox_id, caller).info()

    def record(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxRecord:
        """The sandbox's record, if ``caller`` may act on it (for layers that translate calls into the
        core's, like the E2B API: they need its owner and trajectory, not only its info)."""
        return self._get(sandbox_id, caller)

    def is_live(self, sandbox_id: str) -> bool:
        return sandbox_id in self._live

    async def kill(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        rec = self._get(sandbox_id, caller)
        if rec.state in TERMINAL_STATES:
            return rec.info()  # killing twice is not an error
        return await self._stop(sandbox_id, "killed by request")

    def set_timeout(self, sandbox_id: str, seconds: float, *, caller: Caller = OPERATOR) -> SandboxInfo:
        """A new time to live, counted from now (shorter or longer than the old one). Allowed in: creating,
        running, paused."""
        if not 0 < seconds <= MAX_TTL_S:
            raise InvalidRequest(f"timeout must be more than 0 and at most {MAX_TTL_S:g} seconds, not {seconds:g}")
        rec = self._get(sandbox_id, caller)
        if rec.state in TERMINAL_STATES:
            why = f": {rec.reason}" if rec.reason else ""
            raise SandboxGone(f"sandbox {rec.id} is {rec.state.value}{why}", detail={"state": rec.state.value})
        if rec.state == State.stopping:
            raise InvalidState(f"sandbox {rec.id} is stopping", detail={"state": rec.state.value})
        rec.expires_at = time.time() + seconds
        if rec.id not in self._ephemeral:
            self.store.put(rec)
        return rec.info()

    async def evict(self, sandbox_id: str, reason: str) -> None:
        """End a sandbox the node cannot keep (memory pressure): ``failed``, with why."""
        with contextlib.suppress(DsecError):
            await self._stop(sandbox_id, reason, final=State.failed)
        self.metrics.evictions.inc()

    def _cpu_sampled(self, sandbox_id: str, ratio: float) -> None:
        rec = self._live.get(sandbox_id)
        if rec is not None:
            self.metrics.cpu_use.labels(rec.kind).observe(ratio)

    async def _stop(self, sandbox_id: str, reason: str, final: State = State.stopped) -> SandboxInfo:
        async with self._lock(sandbox_id):
            rec = self._get(sandbox_id)
            if rec.state in TERMINAL_STATES:
                return rec.info()
            self._set_state(rec, State.stopping, reason)
            try:
                await self.backends[rec.kind].destroy(rec)
            except Exception as e:
                self._set_state(rec, State.failed, f"{reason}; cleanup failed: {e}")
                if isinstance(e, DsecError):
                    raise
                raise BackendError(f"stopping sandbox {rec.id} failed: {e}") from e
            self._set_state(rec, final, reason)
        self._locks.pop(sandbox_id, None)
        self._in_background(self.images.save_traces(rec.image_digest))
        return rec.info()

    async def exec(
        self,
        sandbox_id: str,
        req: ExecRequest,
        on_output: OutputCallback | None = None,
        *,
        caller: Caller = OPERATOR,
        io: ExecIO | None = None,
    ) -> ExecResult:
        """Run a command. With ``io`` the caller drives it live: standard input fed while it runs (the
        request then has no ``stdin``), its pid once started, signals to its tree."""
        if io is not None and req.stdin is not None:
            raise InvalidRequest("a command fed standard input while it runs cannot also be given stdin up front")
        rec, backend = self._running(sandbox_id, caller)
        env = {**rec.env, **req.env}
        req = req.model_copy(update={"env": env})
        self._busy[rec.id] = self._busy.get(rec.id, 0) + 1
        first = "first_exec" not in rec.runtime.get("timings", {"first_exec": 0})
        started = time.monotonic()
        try:
            result = await self._checked(rec, backend.exec(rec, req, on_output, io))
            if first:
                seconds = time.monotonic() - started
                rec.runtime["timings"]["first_exec"] = round(seconds, 6)
                self.metrics.phase.labels(rec.kind, "first_exec").observe(seconds)
            return result
        finally:
            left = self._busy[rec.id] - 1
            if left:
                self._busy[rec.id] = left
            else:
                del self._busy[rec.id]

    # ---- pause, resume, fork -----------------------------------------------------------------------

    async def pause(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        """Stop the sandbox's processes where they stand; pausing a paused sandbox is not an error.

        Refused while a command runs: its timeout keeps counting on the host, and a guest that cannot
        answer its kill is a guest the host must destroy. Allowed in: running, paused.
        """
        self._get(sandbox_id, caller)
        async with self._lock(sandbox_id):
            rec = self._get(sandbox_id)
            if rec.state == State.paused:
                return rec.info()
            rec, backend = self._running(sandbox_id)
            if busy := self._busy.get(rec.id):
                raise InvalidState(
                    f"sandbox {rec.id} has {busy} command(s) running; pause it between commands",
                    detail={"state": rec.state.value},
                )
            # paused before the backend is asked, so no exec can start in between
            self._set_state(rec, State.paused)
            try:
                await backend.pause(rec)
            except SandboxGone as e:
                self._died(rec, str(e))
                raise
            except BaseException:
                self._set_state(rec, State.running)
                raise
        return rec.info()

    async def resume(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        """Let a paused sandbox run on; resuming a running one is not an error. Allowed in: paused, running."""
        self._get(sandbox_id, caller)
        async with self._lock(sandbox_id):
            rec = self._get(sandbox_id)
            if rec.state == State.running:
                return rec.info()
            if rec.state != State.paused:
                self._running(sandbox_id)  # raises the precise error
            try:
                await self.backends[rec.kind].resume(rec)
            except SandboxGone as e:
                self._died(rec, str(e))
                raise
            self._set_state(rec, State.running)
        return rec.info()

    async def fork(self, sandbox_id: str, req: ForkRequest, *, caller: Caller = OPERATOR) -> ForkResult:
        """``req.n`` new sandboxes restored from one memory snapshot of this one (see forks.fork)."""
        return await forks.fork(self, sandbox_id, req, caller)

    async def _checked(self, rec: SandboxRecord, op: Awaitable[T]) -> T:
        """Run an operation; if the sandbox died under it, report that rather than a runtime error."""
        try:
            return await op
        except SandboxGone as e:
            current = self._live.get(rec.id)
            if current is not None and current.state == State.running:
                self._died(current, str(e))
            raise

    def _died(self, rec: SandboxRecord, why: str) -> None:
        """A sandbox found dead under an operation: ``failed`` at once; what the backend still holds for it
        (cgroups, bundle, network, leases) released once that operation has let go of the lock."""
        self._set_state(rec, State.failed, why)

        async def release() -> None:
            try:
                async with self._lock(rec.id):
                    await self.backends[rec.kind].destroy(rec)
            except Exception:
                log.exception("releasing what dead sandbox %s held failed", rec.id)
            finally:
                self._locks.pop(rec.id, None)

        self._in_background(release())

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def set_network(self, sandbox_id: str, policy: NetworkSpec, *, caller: Caller = OPERATOR) -> NetworkStatus:
        """Change the network policy of a running sandbox; new and open connections follow it at once."""
        async with self._lock(sandbox_id):
            rec, backend = self._running(sandbox_id, caller)
            await self._checked(rec, backend.set_network(rec, policy))
            self.store.put(rec)
            return await backend.network_status(rec)

    async def network_status(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> NetworkStatus:
        rec, backend = self._running(sandbox_id, caller)
        return await backend.network_status(rec)

    def list(
        self, labels: dict[str, str] | None = None, include_finished: bool = False, *, caller: Caller = OPERATOR
    ) -> list[SandboxInfo]:
        recs = self.store.all() if include_finished else sorted(self._live.values(), key=lambda r: r.created_at)
        wanted = labels or {}
        return [r.info() for r in recs if caller.owns(r.owner) and all(r.labels.get(k) == v for k, v in wanted.items())]

    # ---- tenants -----------------------------------------------------------------------------------
    # (trajectories, issue 7, will be owned like sandboxes: check them with the caller through _get)

    def live_count(self, tenant: str) -> int:
        return sum(1 for r in self._live.values() if r.owner == tenant)

    async def remove_tenant(self, name: str) -> tuple[float, builtins.list[str]]:
        """Revoke the tenant's token at once, then kill its live sandboxes; its images stay, owned."""
        revoked = self.tenants.revoke(name)
        killed = []
        for rec in [r for r in self._live.values() if r.owner == name]:
            with contextlib.suppress(DsecError):
                await self._stop(rec.id, f"tenant {name} was removed")
                killed.append(rec.id)
        assert revoked.revoked_at is not None
        return revoked.revoked_at, killed


def _failure(e: BaseException) -> str:
    if isinstance(e, DsecError):
        return str(e)
    if isinstance(e, asyncio.CancelledError):
        return "cancelled (its caller went away, or the daemon is stopping)"
    return f"{type(e).__name__}: {e}"
