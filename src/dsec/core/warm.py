"""Warm pools for every kind: sandboxes made ahead within admission and handed out to creations that
match them (docs/pools.md; the match itself is warm_match.py).

A pool's members are ordinary sandboxes of its kind, made through the same creation path as any other
(a microVM's from its memory-snapshot template), counted against the node's capacity and the pool
tenant's quota, recorded with the pool's name and owned by nobody a tenant can reach or list. A claim
hands one over: from then on it is the claimant's sandbox, with the claimant's creation time, time to
live, labels and environment, and it is never returned to a pool (a member serves one claimant only).

Capacity: refills take only what is free with nobody queued; a real creation that does not fit takes
what idle members hold (Admission.reclaim), so sandboxes made ahead never push a real one out.
Versions: each pass resolves every pool's image; when its tag moved, idle members of the old version
are killed and the pool refills on the new one. Restart: members are killed when the daemon stops,
and any a crash left are killed on the next start (Lifecycle.readopt), never re-adopted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ..errors import BackendError, DsecError, ImageNotFound, InvalidRequest, NotFound
from ..images.store import ImageRef
from ..protocol.pools import WarmPoolInfo, WarmPoolSpec
from ..protocol.sandbox import MAX_TTL_S, CreateSandbox, ExecRequest, State
from ..store.records import SandboxRecord, new_record
from ..tenancy import OPERATOR, Caller
from .admission import Claim
from .lifecycle import Lifecycle
from .warm_match import Shape, WarmPool, backoff, servable, shape_of

log = logging.getLogger("dsec.core")

PASS_EVERY = 1.0  # s between passes (a claim, a miss or a change wakes the keeper sooner)
# s after a claim before its replacement is started: a claimant's first commands come right after its
# creation, and on a small node they would share the CPUs with the replacement's creation
REFILL_AFTER_CLAIM = 0.25
WARM_UP_TIMEOUT = 60.0  # s (a microVM under TCG is slow)
CLOSE_WITHIN = 30.0  # s the daemon's stop waits for idle members to be killed


class WarmPools:
    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle
        self.sandboxes = lifecycle.sandboxes
        self.pools: dict[str, WarmPool] = {}
        self._shapes: dict[Shape, list[WarmPool]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._fills: set[asyncio.Task[None]] = set()
        lifecycle.claim = self.claim
        self.sandboxes.admission.reclaim = self.reclaim

    # ---- configuration -----------------------------------------------------------------------------

    def set(self, name: str, spec: WarmPoolSpec) -> WarmPoolInfo:
        """Add the pool, or change it: members that no longer fit what it now says are killed."""
        self._check(spec)
        old = self.pools.get(name)
        pool = WarmPool(name, spec)
        if old is not None:
            if old.spec.model_dump() == {**spec.model_dump(), "size": old.spec.size}:
                pool = old  # only its size changed: its members stay
                pool.spec = spec
            else:
                self._retire(old, "its warm pool was changed")
        self.pools[name] = pool
        self._index()
        self._trim(pool)
        self._wake.set()
        return pool.info()

    def _check(self, spec: WarmPoolSpec) -> None:
        """Refuse now what could never fill: a kind the node does not run, a tenant it does not know,
        sandboxes larger than the node or the tenant's quota admit."""
        if spec.kind not in self.sandboxes.backends:
            why = self.lifecycle.kinds.unavailable.get(spec.kind, "not enabled")
            raise InvalidRequest(f"kind {spec.kind!r} is not available on this node: {why}")
        if spec.tenant is not None:
            self.lifecycle.tenants.get(spec.tenant)
        tenant = spec.tenant or OPERATOR.tenant
        self.sandboxes.admission.check(Claim(tenant, spec.limits.cpu, spec.limits.mem_request()))
        self.sandboxes.backends[spec.kind].check_network(spec.network)

    def remove(self, name: str) -> None:
        pool = self.pools.pop(name, None)
        if pool is None:
            raise NotFound(f"no warm pool {name!r}")
        self._index()
        self._retire(pool, "its warm pool was removed")

    def list(self, caller: Caller = OPERATOR) -> list[WarmPoolInfo]:
        return [p.info() for _, p in sorted(self.pools.items()) if caller.owns(p.tenant)]

    def _index(self) -> None:
        shapes: dict[Shape, list[WarmPool]] = {}
        for pool in self.pools.values():
            shapes.setdefault(pool.shape, []).append(pool)
        self._shapes = shapes

    # ---- claims ------------------------------------------------------------------------------------

    def claim(self, req: CreateSandbox, image: ImageRef, caller: Caller) -> SandboxRecord | None:
        """An idle member that is what ``req`` asks for, handed over to ``caller``; None: make one."""
        if not servable(req):
            return None
        started = time.monotonic()
        pools = self._shapes.get(shape_of(caller.tenant, req.kind, req.limits, req.network))
        for pool in pools or ():
            if not pool.serves(image):
                continue
            if pool.image is not None and pool.image.digest == image.digest:
                while pool.idle:
                    rec = self.sandboxes.find_live(pool.idle.popleft())
                    if rec is not None and rec.state == State.running and rec.pool == pool.name:
                        self._hand_over(rec, req, image, caller, started)
                        pool.stats.claims += 1
                        asyncio.get_running_loop().call_later(REFILL_AFTER_CLAIM, self._wake.set)
                        return rec
            pool.stats.misses += 1
            self._wake.set()  # empty, or on another version than the tag names now: look again
        return None

    def _hand_over(
        self, rec: SandboxRecord, req: CreateSandbox, image: ImageRef, caller: Caller, started: float
    ) -> None:
        now = time.time()
        before = (rec.pool, rec.created_at, rec.expires_at, rec.labels, rec.env, rec.image, rec.timings)
        rec.pool, rec.owner, rec.image = None, caller.tenant, image.name
        rec.created_at, rec.expires_at = now, now + req.timeout
        rec.labels, rec.env, rec.on_timeout = dict(req.labels), dict(req.env), req.on_timeout
        seconds = round(time.monotonic() - started, 6)
        rec.timings = {"queue": 0.0, "claim": seconds, "total": seconds}
        try:
            self.sandboxes.records.write(rec)
        except BaseException:
            rec.pool, rec.created_at, rec.expires_at, rec.labels, rec.env, rec.image, rec.timings = before
            self._kill(rec, "its claim could not be recorded")
            raise

    def reclaim(self, claim: Claim) -> None:
        """Free what idle members hold so that ``claim`` fits: the claimant tenant's own first (its quota
        may be what is full), then the fullest pools'; the fewest that make it fit, and none at all if
        every idle member would not (another tenant's members do nothing for a tenant's full quota)."""
        admission = self.sandboxes.admission
        candidates: list[tuple[WarmPool, SandboxRecord, Claim]] = []
        for pool in sorted(self.pools.values(), key=lambda p: (p.tenant != claim.tenant, -len(p.idle))):
            for member in reversed(pool.idle):  # the newest first: the oldest are claimed first
                rec, held = self.sandboxes.find_live(member), admission.held.get(member)
                if rec is not None and held is not None:
                    candidates.append((pool, rec, held))
        for n in range(1, len(candidates) + 1):
            if admission.fits_after(claim, [held for _, _, held in candidates[:n]]):
                break
        else:
            return
        for pool, rec, _ in candidates[:n]:
            pool.idle.remove(rec.id)
            admission.release(rec.id)  # the claim's now; the member's teardown follows
            pool.stats.reclaimed += 1
            self._kill(rec, "its capacity went to a creation")

    # ---- the keeper --------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Stop refilling and kill the idle members: nothing made ahead outlives the daemon."""
        tasks = [t for t in (self._task, *self._fills) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        idle = [i for pool in self.pools.values() for i in pool.idle]
        for pool in self.pools.values():
            pool.idle.clear()
        if idle:
            await asyncio.wait(
                [asyncio.create_task(self._stop(i, "the daemon stopped")) for i in idle], timeout=CLOSE_WITHIN
            )

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for can turn the daemon's cancel into a timeout
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PASS_EVERY):
                    await self._wake.wait()
            self._wake.clear()
            for pool in list(self.pools.values()):
                try:
                    await self._keep(pool)
                except Exception:  # one pool's trouble must not stop the others'
                    log.exception("warm pool %s: pass failed", pool.name)

    async def _keep(self, pool: WarmPool) -> None:
        self._prune(pool)
        if time.monotonic() < pool.retry_at:
            return
        if pool.spec.tenant is not None and self._revoked(pool.spec.tenant):
            pool.waiting = f"tenant {pool.spec.tenant} was removed: nothing is made for it"
            return
        owner = OPERATOR if pool.spec.tenant is None else Caller(pool.tenant)
        try:
            image = await self.lifecycle.images.resolve(pool.spec.image, caller=owner)
        except DsecError as e:
            if isinstance(e, ImageNotFound) and pool.image is not None:
                pool.image = None  # the name was removed: what it named is not what a creation gets now
                self._drain(pool)
            self._failed(pool, f"image {pool.spec.image}: {e.message}")
            return
        if self.pools.get(pool.name) is not pool:
            return  # removed or replaced while its image was resolved
        if pool.image is None or pool.image.digest != image.digest:
            if pool.image is not None:
                log.info("warm pool %s: %s moved to %s, draining", pool.name, pool.spec.image, image.digest[:19])
            pool.image = image
            self._drain(pool)
        self._trim(pool)
        for _ in range(pool.wanted()):
            pool.filling += 1
            task = asyncio.create_task(self._fill(pool, image))
            self._fills.add(task)
            task.add_done_callback(self._fills.discard)

    def _revoked(self, tenant: str) -> bool:
        try:
            return self.lifecycle.tenants.get(tenant).revoked_at is not None
        except NotFound:
            return True

    async def _fill(self, pool: WarmPool, image: ImageRef) -> None:
        spec = pool.spec
        rec = new_record(spec.kind, image.name, image.digest, MAX_TTL_S, spec.limits, {}, {})
        rec.owner, rec.network, rec.node, rec.pool = pool.tenant, spec.network, self.lifecycle.node_name, pool.name
        req = CreateSandbox(
            image=image.name, kind=spec.kind, limits=spec.limits, network=spec.network, timeout=MAX_TTL_S
        )
        try:
            claim = Claim(pool.tenant, spec.limits.cpu, spec.limits.mem_request())
            # checked and taken with no await between (create_on admits before it first waits): a refill
            # fills only what is free with nobody queued, and never reclaims another pool's members
            if not self.sandboxes.admission.room_now(claim):
                pool.waiting = "no capacity free: refills wait for it (real creations go first)"
                return
            await self.lifecycle.create_on(
                req.model_copy(update={"queue_timeout": 0.0}), image, owner=pool.tenant, pending=rec
            )
            await self._warm_up(rec)
        except BaseException as e:
            if rec.state == State.running:  # made, then its warm-up failed (or the daemon is stopping)
                self._kill(rec, "it was not ready")
            if not isinstance(e, Exception):
                raise
            if not isinstance(e, DsecError):
                log.exception("warm pool %s: refill failed", pool.name)
            self._failed(pool, f"refill failed: {e.message if isinstance(e, DsecError) else e}")
            return
        finally:
            pool.filling -= 1
            self._wake.set()
        current = self.pools.get(pool.name) is pool and pool.image is not None and pool.image.digest == image.digest
        if not current or rec.state != State.running:
            self._kill(rec, "its warm pool changed while it was made")
            return
        pool.idle.append(rec.id)
        pool.stats.refills += 1
        pool.failed_in_row, pool.waiting = 0, None
        self._trim(pool)

    async def _warm_up(self, rec: SandboxRecord) -> None:
        """Run `true` once in a new member, straight through its kind: what a sandbox's first command
        pays once (its exec cgroup's first setup, cold code paths in the agent) is paid before a
        claimant's first command, which then costs what any later one does. Nothing of it stays: the
        command exits, and the core records no phase or call for it."""
        backend = self.sandboxes.backends[rec.kind]
        async with self.sandboxes.lock(rec.id):
            if rec.state != State.running:
                return
            with self.sandboxes.busy(rec.id):
                result = await backend.exec(rec, ExecRequest(cmd=["true"], timeout=WARM_UP_TIMEOUT))
        if result.exit_code != 0:
            raise BackendError(f"warm-up command in {rec.id} exited {result.exit_code}: {result.stderr[-200:]}")

    def _failed(self, pool: WarmPool, why: str) -> None:
        pool.stats.failures += 1
        pool.failed_in_row += 1
        pool.waiting = why
        pool.retry_at = time.monotonic() + backoff(pool.failed_in_row)
        log.warning("warm pool %s: %s", pool.name, why)

    def _prune(self, pool: WarmPool) -> None:
        """Forget members that ended on their own (killed by id, evicted, failed)."""
        live = self.sandboxes.find_live
        kept = [i for i in pool.idle if (r := live(i)) is not None and r.state == State.running and r.pool == pool.name]
        if len(kept) != len(pool.idle):
            pool.idle.clear()
            pool.idle.extend(kept)

    def _drain(self, pool: WarmPool) -> None:
        """Kill the idle members not on the version the pool's image names now (all, if none)."""
        now = pool.image.digest if pool.image is not None else None
        stale = [i for i in pool.idle if (r := self.sandboxes.find_live(i)) is None or r.image_digest != now]
        for member in stale:
            pool.idle.remove(member)
            pool.stats.drained += 1
            self._kill_id(member, f"{pool.spec.image} names another version now")

    def _trim(self, pool: WarmPool) -> None:
        while len(pool.idle) > pool.spec.size:
            self._kill_id(pool.idle.pop(), "its warm pool was made smaller")

    def _retire(self, pool: WarmPool, why: str) -> None:
        for member in list(pool.idle):
            self._kill_id(member, why)
        pool.idle.clear()

    def _kill_id(self, sandbox_id: str, why: str) -> None:
        rec = self.sandboxes.find_live(sandbox_id)
        if rec is not None:
            self._kill(rec, why)

    def _kill(self, rec: SandboxRecord, why: str) -> None:
        self.sandboxes.in_background(self._stop(rec.id, f"idle warm-pool sandbox: {why}"))

    async def _stop(self, sandbox_id: str, why: str) -> None:
        with contextlib.suppress(DsecError):
            await self.lifecycle.stop(sandbox_id, why)
