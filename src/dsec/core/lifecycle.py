"""A sandbox's life: create, run commands, pause and resume, change its network, stop; the reaper
that ends sandboxes past their time to live; and, after a restart, re-adopting what still runs."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import BackendError, DsecError, InvalidRequest, InvalidState, SandboxGone, environment_error
from ..images.store import ImageRef, ImageStore
from ..kinds.base import Backend, OutputCallback
from ..kinds.execio import ExecIO
from ..protocol.network import NetworkSpec
from ..protocol.sandbox import (
    MAX_TTL_S,
    TERMINAL_STATES,
    CreateSandbox,
    ExecRequest,
    ExecResult,
    NetworkStatus,
    SandboxInfo,
    State,
)
from ..store.records import SandboxRecord, new_record
from ..store.tenants import TenantStore
from ..tenancy import OPERATOR, Caller
from .admission import Claim
from .exec_feed import ExecFeed
from .metrics import NodeMetrics
from .sandboxes import LIVE_STATES, Sandboxes, gone
from .volumes import Volumes

RESOLVE_SHOWN_AFTER = 0.25  # s: an image not ready by then is being pulled (or built): the sandbox is listed
WAITING_EVERY = 1.0  # s between updates of what it waits for
log = logging.getLogger("dsec.core")

KEEP_FINISHED_S = 24 * 3600.0
# a sandbox that pauses at its time to live but runs a command then is paused at a later pass; past
# this grace it is stopped instead (the time to live bounds what it holds)
PAUSE_GRACE_S = 30.0
MAX_CONCURRENT_CREATES = 32


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class Kinds:
    """What the node can run: the kinds that failed to start say why; ``check`` names the precise
    error for a kind that is not enabled."""

    unavailable: dict[str, str] = field(default_factory=dict)  # kind -> why this node cannot run it
    check: Callable[[str], object] = lambda kind: None


class Lifecycle:
    def __init__(
        self,
        sandboxes: Sandboxes,
        images: ImageStore,
        metrics: NodeMetrics,
        tenants: TenantStore,
        kinds: Kinds,
        node_name: str,
    ) -> None:
        self.sandboxes = sandboxes
        self.images = images
        self.metrics = metrics
        self.tenants = tenants
        self.kinds = kinds
        self.node_name = node_name
        self.max_concurrent_creates = MAX_CONCURRENT_CREATES
        # per kind: VMs queueing for their few boot slots must not hold up container creations
        self._create_slots: dict[str, asyncio.Semaphore] = {}
        # an idle warm-pool sandbox handed over to a creation that matches one (core/warm.py); None: none
        self.claim: Callable[[CreateSandbox, ImageRef, Caller], SandboxRecord | None] = lambda *_: None
        self.feed = ExecFeed()  # commands as they run, for a console watching a sandbox

    # ---- create --------------------------------------------------------------------------------------

    async def create(self, req: CreateSandbox, *, caller: Caller = OPERATOR, persist: bool = True) -> SandboxInfo:
        """A new sandbox (not a trajectory's), its failure counted by reason."""
        try:
            return await self.create_fresh(req, caller=caller, persist=persist)
        except DsecError as e:
            self.metrics.failed(req.kind, e.code, caller.owner)
            raise

    async def create_fresh(self, req: CreateSandbox, *, caller: Caller = OPERATOR, persist: bool = True) -> SandboxInfo:
        backends = self.sandboxes.backends
        if req.kind not in backends:
            if req.kind in self.kinds.unavailable:
                why = self.kinds.unavailable[req.kind]
                raise InvalidRequest(f"kind {req.kind!r} is not available on this node: {why}")
            self.kinds.check(req.kind)  # raises the precise "not available" / "unknown" error
            raise InvalidRequest(f"kind {req.kind!r} is not enabled on this node")
        if req.on_timeout == "pause" and not backends[req.kind].can_pause():
            raise InvalidRequest(f"on_timeout 'pause': sandboxes of kind {req.kind!r} cannot be paused")
        if req.limits.memory > host_memory():
            raise InvalidRequest(f"memory limit {req.limits.memory} exceeds this node's {host_memory()} bytes")
        # refused now (too big for the node or the tenant's quota) rather than after an image build
        self.sandboxes.admission.check(Claim(caller.tenant, req.limits.cpu, req.limits.mem_request()))
        image, pending = await self._resolve(req, caller)
        if pending is None and persist and (warm := self.claim(req, image, caller)) is not None:
            return warm.info()
        try:
            rec = await self.create_on(req, image, owner=caller.tenant, persist=persist, pending=pending)
        except BaseException:
            if pending is not None and pending.state == State.creating:
                self.sandboxes.drop(pending.id)  # refused before it was taken up: it was never recorded
            raise
        return rec.info()

    async def _resolve(self, req: CreateSandbox, caller: Caller) -> tuple[ImageRef, SandboxRecord | None]:
        """The image, and the sandbox's record if one was shown while the caller waited for a pull (or a
        build): listed as creating, its ``waiting`` saying what the pull is doing, so a pull of minutes is
        seen, not a silence. The record is kept in memory only until the creation takes it up (a pull that
        fails leaves nothing); admission follows the pull; a kill meanwhile ends the creation after it."""
        resolving = asyncio.ensure_future(self.images.resolve(req.image, caller=caller, pull=req.pull))
        rec: SandboxRecord | None = None
        try:
            done, _ = await asyncio.wait({resolving}, timeout=RESOLVE_SHOWN_AFTER)
            if not done:
                rec = self._record(req, req.image, "", caller.tenant)
                rec.waiting = self._waiting_for(req.image)
                self.sandboxes.adopt(rec, persist=False)
                while not (await asyncio.wait({resolving}, timeout=WAITING_EVERY))[0]:
                    rec.waiting = self._waiting_for(req.image)
            return resolving.result(), rec
        except BaseException:
            resolving.cancel()
            if rec is not None:
                self.sandboxes.drop(rec.id)
            raise

    def _waiting_for(self, image: str) -> str:
        pull = self.images.pulling(image)
        return pull.waiting_for() if pull is not None else f"image {image} (being built or resolved)"

    def _record(self, req: CreateSandbox, image: str, digest: str, owner: str) -> SandboxRecord:
        rec = new_record(req.kind, image, digest, req.timeout, req.limits, req.env, req.labels)
        rec.owner = owner
        rec.network = req.network
        rec.node = self.node_name
        rec.trajectory = req.trajectory or None
        rec.on_timeout = req.on_timeout
        return rec

    async def create_on(
        self,
        req: CreateSandbox,
        image: ImageRef,
        *,
        owner: str = OPERATOR.tenant,
        persist: bool = True,
        pending: SandboxRecord | None = None,
    ) -> SandboxRecord:
        """Create on a resolved image (builder sandboxes the daemon runs itself come here too).

        Admission comes first: a creation that waits for capacity, or is refused, has no record yet, so
        nothing half-made is left behind by a deadline or a caller that went away. ``pending``: the
        record made while the image was pulled (``_resolve``), which the creation goes on with."""
        sandboxes, admission = self.sandboxes, self.sandboxes.admission
        backend = sandboxes.backends[req.kind]
        backend.check_network(req.network)
        caller = OPERATOR if owner == OPERATOR.tenant else Caller(owner)
        if req.volumes:
            backend.check_volumes(req.volumes)
            self._volumes().check(req.volumes, caller)  # refused now, not after a wait in the queue
        started = time.monotonic()
        claim = Claim(owner, req.limits.cpu, req.limits.mem_request())
        waited = await admission.admit(claim, req.queue_timeout)
        if waited:
            self.metrics.queue_wait.observe(waited)
        try:
            rec = (
                self._record(req, image.name, image.digest, owner) if pending is None else _went_on(pending, image, req)
            )
        except BaseException:
            admission.cancel(claim)
            raise
        admission.bind(rec.id, claim)
        try:
            if req.volumes:  # taken again: the queue may have let another writer in meanwhile
                rec.volumes = self._volumes().claim(rec.id, req.volumes, caller)
            sandboxes.drop(rec.id)  # a record shown during a pull is taken up: recorded from now on
            sandboxes.adopt(rec, persist=persist)
        except BaseException:
            if sandboxes.volumes is not None:
                sandboxes.volumes.release(rec.id)
            admission.release(rec.id)
            raise
        # VM kinds bound their boots (and restores) themselves, by the accelerator a first use finds
        slots = self._create_slots.setdefault(req.kind, asyncio.Semaphore(self.max_concurrent_creates))
        try:
            async with slots, sandboxes.lock(rec.id):
                timings = await self._start(rec, image, started)
        except BaseException as e:
            if rec.state == State.creating:  # cancelled before its backend was asked (waiting for a slot)
                sandboxes.set_state(rec, State.failed, f"creation failed: {failure(e)}")
            sandboxes.forget_lock(rec.id)  # a failed sandbox takes no more actions that need it
            raise
        self.metrics.created(rec.kind, timings, rec.owner)
        return rec

    async def _start(self, rec: SandboxRecord, image: ImageRef, started: float) -> dict[str, float]:
        """The backend's part of a creation, under the sandbox's lock and a create slot."""
        sandboxes, backend = self.sandboxes, self.sandboxes.backends[rec.kind]
        if rec.state != State.creating:  # killed while it waited for a create slot
            raise SandboxGone(f"sandbox {rec.id} was {rec.state.value} before it was created: {rec.reason}")
        timings = rec.timings = {"queue": round(time.monotonic() - started, 6)}
        try:
            if rec.volumes:
                await self._volumes().mount(rec.volumes)
            await backend.create(rec, image)
            total = time.monotonic() - started
            timings["runtime"] = round(total - timings["queue"] - timings.get("rootfs", 0.0), 6)
            timings["total"] = round(total, 6)
            sandboxes.set_state(rec, State.running)  # not recorded (a full disk): the creation failed
        except BaseException as e:
            sandboxes.set_state(rec, State.failed, f"creation failed: {failure(e)}")
            with contextlib.suppress(Exception):
                await backend.destroy(rec)
            if isinstance(e, DsecError) or not isinstance(e, Exception):
                raise
            raise environment_error(e) or BackendError(f"creating sandbox failed: {failure(e)}") from e
        return timings

    def _volumes(self) -> Volumes:
        if self.sandboxes.volumes is None:
            raise InvalidRequest("this node keeps no named volumes")
        return self.sandboxes.volumes

    # ---- end -----------------------------------------------------------------------------------------

    async def kill(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        rec = self.sandboxes.get(sandbox_id, caller)
        if rec.state in TERMINAL_STATES:
            return rec.info()  # killing twice is not an error
        return await self.stop(sandbox_id, "killed by request")

    async def evict(self, sandbox_id: str, reason: str) -> None:
        """End a sandbox the node cannot keep (memory pressure): ``failed``, with why."""
        with contextlib.suppress(DsecError):
            await self.stop(sandbox_id, reason, final=State.failed)
        self.metrics.evictions.inc()

    async def stop(self, sandbox_id: str, reason: str, final: State = State.stopped) -> SandboxInfo:
        sandboxes = self.sandboxes
        async with sandboxes.lock(sandbox_id):
            rec = sandboxes.get(sandbox_id)
            if rec.state in TERMINAL_STATES:
                return rec.info()
            sandboxes.set_state(rec, State.stopping, reason)
            try:
                await sandboxes.backends[rec.kind].destroy(rec)
            except Exception as e:
                sandboxes.set_state(rec, State.failed, f"{reason}; cleanup failed: {e}")
                if isinstance(e, DsecError):
                    raise
                raise BackendError(f"stopping sandbox {rec.id} failed: {e}") from e
            sandboxes.set_state(rec, final, reason)
        sandboxes.forget_lock(sandbox_id)
        sandboxes.in_background(self.images.save_traces(rec.image_digest))
        return rec.info()

    def set_timeout(self, sandbox_id: str, seconds: float, *, caller: Caller = OPERATOR) -> SandboxInfo:
        """A new time to live, counted from now (shorter or longer than the old one). Allowed in: creating,
        running, paused."""
        if not 0 < seconds <= MAX_TTL_S:
            raise InvalidRequest(f"timeout must be more than 0 and at most {MAX_TTL_S:g} seconds, not {seconds:g}")
        rec = self.sandboxes.get(sandbox_id, caller)
        if rec.state in TERMINAL_STATES:
            raise gone(rec)
        if rec.state == State.stopping:
            raise InvalidState(f"sandbox {rec.id} is stopping", detail={"state": rec.state.value})
        rec.expires_at = time.time() + seconds
        self.sandboxes.save(rec)
        return rec.info()

    async def reap_once(self) -> None:
        now = time.time()
        self.sandboxes.records.flush()
        for rec in self.sandboxes.live():
            if rec.state in (State.running, State.paused) and rec.expires_at <= now:
                with contextlib.suppress(DsecError):
                    await self._expired(rec, now)
        self.sandboxes.store.delete_older_than(now - KEEP_FINISHED_S, set(TERMINAL_STATES))

    async def expire(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        """Reach the time to live now: what the reaper does at its end (stop, or pause). Allowed in:
        running, paused."""
        rec = self.sandboxes.get(sandbox_id, caller)
        if rec.state in TERMINAL_STATES:
            raise gone(rec)
        if rec.state not in (State.running, State.paused):
            raise InvalidState(f"sandbox {rec.id} is {rec.state.value}", detail={"state": rec.state.value})
        now = time.time()
        rec.expires_at = min(rec.expires_at, now)
        self.sandboxes.save(rec)
        await self._expired(rec, now)
        return rec.info()

    async def _expired(self, rec: SandboxRecord, now: float) -> None:
        """A sandbox past its time to live: stopped; or, if it pauses at its time to live and runs, paused
        and kept paused for up to the longest time to live (stopped if it cannot be paused in time)."""
        if rec.on_timeout != "pause" or rec.state != State.running:
            log.info("sandbox %s reached its time to live", rec.id)
            await self.stop(rec.id, "time to live expired")
            return
        busy = self.sandboxes.commands_running(rec.id)
        if busy and now - rec.expires_at < PAUSE_GRACE_S:
            return  # paused at a later pass, once its commands are done
        if busy:
            why = f"time to live expired; not paused: {busy} command(s) still ran {PAUSE_GRACE_S:g} s after it"
            await self.stop(rec.id, why)
            return
        expired_at, rec.expires_at = rec.expires_at, time.time() + MAX_TTL_S  # a running one is paused, not gone
        try:
            await self.pause(rec.id)
        except InvalidState:
            rec.expires_at = expired_at  # a command started meanwhile: a later pass
            return
        except DsecError as e:
            rec.expires_at = expired_at
            if rec.state == State.running:
                await self.stop(rec.id, f"time to live expired; it could not be paused: {e}")
            return
        except BaseException:
            rec.expires_at = expired_at
            raise
        self.sandboxes.save(rec)
        log.info("sandbox %s reached its time to live: paused", rec.id)

    async def remove_tenant(self, name: str) -> tuple[float, builtins.list[str]]:
        """Revoke the tenant's token at once, then kill its live sandboxes; its images stay, owned."""
        revoked = self.tenants.revoke(name)
        killed = []
        for rec in [r for r in self.sandboxes.live() if r.owner == name]:
            with contextlib.suppress(DsecError):
                await self.stop(rec.id, f"tenant {name} was removed")
                killed.append(rec.id)
        assert revoked.revoked_at is not None
        return revoked.revoked_at, killed

    # ---- run -----------------------------------------------------------------------------------------

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
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        req = req.model_copy(update={"env": {**rec.env, **req.env}})
        first = bool(rec.timings) and "first_exec" not in rec.timings  # (a fork's copies have no phases)
        started = time.monotonic()
        with self.sandboxes.busy(rec.id):
            if self.feed.watching(rec.id):
                result = await self._exec_watched(rec, backend, req, on_output, io)
            else:
                result = await self.sandboxes.checked(rec, backend.exec(rec, req, on_output, io))
        if first:
            seconds = time.monotonic() - started
            rec.timings["first_exec"] = round(seconds, 6)
            self.metrics.phase.labels(rec.kind, "first_exec").observe(seconds)
        return result

    async def _exec_watched(
        self,
        rec: SandboxRecord,
        backend: Backend,
        req: ExecRequest,
        on_output: OutputCallback | None,
        io: ExecIO | None,
    ) -> ExecResult:
        """An exec someone watches (the console): its start, output and end go to the feed as well."""
        feed, sid = self.feed, rec.id
        number = feed.started(sid, req.cmd)

        def tap(stream: str, data: bytes) -> None:
            feed.output(sid, number, stream, data)
            if on_output is not None:
                on_output(stream, data)

        try:
            result = await self.sandboxes.checked(rec, backend.exec(rec, req, tap, io))
        except BaseException as e:
            feed.ended(sid, number, None, str(e) or type(e).__name__)
            raise
        feed.ended(sid, number, result.exit_code, "timed out" if result.timed_out else None)
        return result

    async def pause(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        """Stop the sandbox's processes where they stand; pausing a paused sandbox is not an error.

        Refused while a command runs: its timeout keeps counting on the host, and a guest that cannot
        answer its kill is a guest the host must destroy. Allowed in: running, paused.
        """
        sandboxes = self.sandboxes
        sandboxes.get(sandbox_id, caller)
        async with sandboxes.lock(sandbox_id):
            rec = sandboxes.get(sandbox_id)
            if rec.state == State.paused:
                return rec.info()
            rec, backend = sandboxes.running(sandbox_id)
            if busy := sandboxes.commands_running(rec.id):
                raise InvalidState(
                    f"sandbox {rec.id} has {busy} command(s) running; pause it between commands",
                    detail={"state": rec.state.value},
                )
            # paused before the backend is asked, so no exec can start in between
            sandboxes.set_state(rec, State.paused)
            try:
                await backend.pause(rec)
            except SandboxGone as e:
                sandboxes.died(rec, str(e))
                raise
            except BaseException:
                sandboxes.set_state(rec, State.running)
                raise
        return rec.info()

    async def resume(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> SandboxInfo:
        """Let a paused sandbox run on; resuming a running one is not an error. Allowed in: paused, running."""
        sandboxes = self.sandboxes
        sandboxes.get(sandbox_id, caller)
        async with sandboxes.lock(sandbox_id):
            rec = sandboxes.get(sandbox_id)
            if rec.state == State.running:
                return rec.info()
            if rec.state != State.paused:
                sandboxes.running(sandbox_id)  # raises the precise error
            try:
                await sandboxes.backends[rec.kind].resume(rec)
            except SandboxGone as e:
                sandboxes.died(rec, str(e))
                raise
            sandboxes.set_state(rec, State.running)
        return rec.info()

    async def set_network(self, sandbox_id: str, policy: NetworkSpec, *, caller: Caller = OPERATOR) -> NetworkStatus:
        """Change the network policy of a running sandbox; new and open connections follow it at once."""
        async with self.sandboxes.lock(sandbox_id):
            rec, backend = self.sandboxes.running(sandbox_id, caller)
            await self.sandboxes.checked(rec, backend.set_network(rec, policy))
            self.sandboxes.store.put(rec)
            return await backend.network_status(rec)

    async def network_status(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> NetworkStatus:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        return await backend.network_status(rec)

    # ---- after a restart -----------------------------------------------------------------------------

    async def readopt(self) -> None:
        """After a restart: keep what still runs, mark the rest lost with a reason, free what they held."""
        sandboxes = self.sandboxes
        for rec in sandboxes.store.all(LIVE_STATES):
            sandboxes.readopt(rec)
            backend = sandboxes.backends.get(rec.kind)
            if rec.pool is not None and backend is not None:
                await self._retire_pooled(rec)
                continue
            alive = False
            if backend is not None and rec.state in (State.running, State.paused):
                try:
                    alive = await backend.alive(rec)
                except DsecError:
                    alive = False
            if alive:
                log.info("re-adopted sandbox %s", rec.id)
                sandboxes.admission.force(rec.id, Claim(rec.owner, rec.limits.cpu, rec.limits.mem_request()))
                continue
            reason = {
                State.creating: "the daemon stopped while the sandbox was being created",
                State.stopping: "the daemon stopped while the sandbox was being stopped",
            }.get(rec.state, "the sandbox was not running when the daemon restarted")
            if backend is None:
                reason = f"kind {rec.kind!r} is not available in this daemon"
            sandboxes.set_state(rec, State.lost, reason)
            if backend is not None:
                with contextlib.suppress(Exception):
                    await backend.destroy(rec)
            log.warning("sandbox %s lost: %s", rec.id, reason)

    async def _retire_pooled(self, rec: SandboxRecord) -> None:
        """An idle warm-pool sandbox a stopped daemon left: killed, never re-adopted (docs/pools.md)."""
        with contextlib.suppress(Exception):
            await self.sandboxes.backends[rec.kind].destroy(rec)
        self.sandboxes.set_state(rec, State.stopped, "idle warm-pool sandbox: not re-adopted after a restart")
        log.info("killed idle warm-pool sandbox %s of pool %s", rec.id, rec.pool)


def _went_on(rec: SandboxRecord, image: ImageRef, req: CreateSandbox) -> SandboxRecord:
    """A record made during a pull, now that the image is there (SandboxGone if it was killed meanwhile)."""
    if rec.state != State.creating:
        raise SandboxGone(f"sandbox {rec.id} was {rec.state.value} while its image was pulled: {rec.reason}")
    rec.image, rec.image_digest, rec.waiting = image.name, image.digest, None
    rec.expires_at = time.time() + req.timeout  # its time to live counts from its start, not from the pull's
    return rec


def failure(e: BaseException) -> str:
    if isinstance(e, DsecError):
        return str(e)
    if isinstance(e, asyncio.CancelledError):
        return "cancelled (its caller went away, or the daemon is stopping)"
    return f"{type(e).__name__}: {e}"
