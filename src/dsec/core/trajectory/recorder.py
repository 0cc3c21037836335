"""Trajectories: every call on a bound sandbox is logged before it runs and again with its result,
before the reply; a call at a position the log already holds is answered from the log; a lost sandbox
is rebuilt by re-applying the log.

Positions are the client's: the SDK numbers its calls (the create is 0) and sends the number with each
one, so a resumed trainer, which issues the same calls from the start, is recognised call by call.
Calls of one trajectory run one at a time, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import (
    BackendError,
    CallInterrupted,
    DsecError,
    InvalidRequest,
    InvalidState,
    NotFound,
    SandboxGone,
    TrajectoryDiverged,
)
from ...protocol.sandbox import TERMINAL_STATES, CreateSandbox, ImageInfo, SandboxInfo, State
from ...protocol.trajectory import MUTATING_OPS, RECORDED_AT, SEQ_HEADER, call_digest, canonical
from ...store.trajectories import CallRow, SequenceConflict, TrajectoryRow, TrajectoryStore
from ...tenancy import Caller
from ..actions import ACTIONS, Action, Call, Target
from ..lifecycle import Lifecycle
from .results import decode_error, encode_error, outcome
from .writer import InlineWriter, LogWriter

log = logging.getLogger("dsec.trajectory")

PAGE = 500
TOUCH_EVERY = 60.0  # seconds: how often a busy trajectory's last-written time is refreshed (retention)
PRUNE_INTERVAL = 600.0


@dataclass
class TrajectoryOptions:
    url: str | None = None  # None: sqlite in the state directory
    durable: bool = False  # SQLite synchronous=FULL: commits survive a power loss too
    keep_days: float = 30.0


@dataclass(frozen=True)
class _Live:
    call: Call
    seq: int
    params: str  # canonical JSON
    digest: str


@dataclass
class _Bound:
    owner: str
    tid: str
    length: int
    sandbox_id: str  # the sandbox bound now: a rebuild binds a new one
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    touched: float = 0.0


def _create_params(req: CreateSandbox) -> dict[str, object]:
    """What a create is, for its digest: how long it may queue for capacity and how its image is fetched
    are not part of the sandbox (the log pins the image's version itself). No volumes is left out, so a
    create logged before volumes existed digests the same."""
    skip = {"queue_timeout", "pull"} | ({"volumes"} if not req.volumes else set())
    return req.model_dump(mode="json", exclude=skip)


class Trajectories:
    """The trajectory log, and the recorder of the calls on sandboxes bound to a trajectory."""

    def __init__(
        self, lifecycle: Lifecycle, target: Target, state_dir: Path, options: TrajectoryOptions | None = None
    ) -> None:
        self.lifecycle = lifecycle
        self.sandboxes = lifecycle.sandboxes
        self.target = target  # what a rebuild re-applies the recorded calls on
        self.state_dir = state_dir
        self.options = options or TrajectoryOptions()
        if self.options.keep_days <= 0:
            raise ValueError("trajectory retention must be positive")
        self._store: TrajectoryStore | None = None
        self._writer: LogWriter | InlineWriter | None = None
        self._bound: dict[tuple[str, str], _Bound] = {}
        self._binding: dict[tuple[str, str], asyncio.Lock] = {}
        self._pruner: asyncio.Task[None] | None = None

    @property
    def store(self) -> TrajectoryStore:
        if self._store is None:
            raise BackendError("the trajectory log is not open")
        return self._store

    @property
    def writer(self) -> LogWriter | InlineWriter:
        if self._writer is None:
            raise BackendError("the trajectory log is not open")
        return self._writer

    async def start(self) -> None:
        url = self.options.url or f"sqlite:///{self.state_dir / 'trajectories.db'}"
        try:
            self._store = await asyncio.to_thread(TrajectoryStore, url, durable=self.options.durable)
        except Exception as e:  # a server that is down, a bad URL, a file that cannot be opened
            raise BackendError(f"cannot open the trajectory log at {_safe(url)}: {type(e).__name__}: {e}") from e
        inline = self._store.path is not None and not self.options.durable
        self._writer = InlineWriter(self._store) if inline else LogWriter(self._store)
        ours = {r.id for r in self.sandboxes.store.all()}
        n = await asyncio.to_thread(self._store.interrupt_running, ours)
        if n:
            log.warning("%d trajectory call(s) were running when the daemon stopped: recorded as interrupted", n)
        self._pruner = asyncio.create_task(self._prune_forever())

    async def close(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pruner
        if isinstance(self._writer, InlineWriter):
            self._writer.close()
        elif self._writer is not None:
            await asyncio.to_thread(self._writer.close)
        if self._store is not None:
            self._store.close()

    # ---- create: new, resumed or rebuilt --------------------------------------------------------------

    async def create(self, req: CreateSandbox, caller: Caller) -> SandboxInfo:
        tid = req.trajectory
        if not tid:
            raise InvalidRequest("no trajectory given")
        key = (caller.tenant, tid)
        digest = call_digest("create", _create_params(req))
        async with self._binding.setdefault(key, asyncio.Lock()):
            row = await asyncio.to_thread(self.store.get, *key)
            if row is None:
                return await self._begin(req, caller, digest)
            first = await asyncio.to_thread(self.store.call, *key, 0)
            if first is None or first.digest != digest:
                raise _diverged(tid, 0, first.digest if first else "", digest, first.op if first else "", "create")
            rec = self.sandboxes.find_live(row.sandbox_id) or self.sandboxes.store.get(row.sandbox_id)
            alive = rec is not None and rec.state not in TERMINAL_STATES and rec.expires_at > time.time()
            if alive and rec is not None:
                info = rec.info()
            elif row.closed:  # the trajectory ended by killing its sandbox: there is nothing to rebuild
                info = rec.info() if rec is not None else await self._closed_info(row, first)
            else:
                info = await self._rebuild(row, req, caller)
            # the create at position 0, answered for the trajectory the log holds: a resume
            self.writer.post(TrajectoryStore.replayed(*key, 0, time.time()))
            length = self._bound[key].length if key in self._bound else row.length
            return info.model_copy(update={"trajectory_length": length})

    async def _begin(self, req: CreateSandbox, caller: Caller, digest: str) -> SandboxInfo:
        tid = req.trajectory or ""
        info = await self.lifecycle.create_fresh(req, caller=caller)
        rec = self.sandboxes.get(info.id)
        now = time.time()
        row = TrajectoryRow(
            caller.tenant, tid, info.id, req.kind, req.image, now, now, 1, image_version=rec.image_digest
        )
        first = CallRow(
            caller.tenant, tid, 0, "create", digest, canonical(_create_params(req)), "done", now,
            result=info.model_dump_json(), duration_ms=0.0,
        )  # fmt: skip
        try:
            await self.writer.write(TrajectoryStore.begin(row, first))
        except BaseException as e:  # cancelled too (its caller went away): no sandbox the log may not know
            with contextlib.suppress(Exception):
                await self.lifecycle.kill(info.id)
            if not isinstance(e, Exception):
                raise
            raise BackendError(f"the trajectory log could not record trajectory {tid!r}: {e}") from e
        self._bound[(caller.tenant, tid)] = _Bound(caller.tenant, tid, 1, info.id)
        return info.model_copy(update={"trajectory_length": 1})

    async def _closed_info(self, row: TrajectoryRow, first: CallRow) -> SandboxInfo:
        """A closed trajectory's sandbox after its record was reaped: as its logged kill answered."""
        last = await asyncio.to_thread(self.store.call, row.owner, row.id, row.length - 1)
        if last is not None and last.op == "kill" and last.status == "done" and last.result:
            return SandboxInfo.model_validate_json(last.result)
        created = SandboxInfo.model_validate_json(first.result or "{}")
        return created.model_copy(update={"state": State.stopped, "reason": "killed by a call of its trajectory"})

    async def _rebuild(self, row: TrajectoryRow, req: CreateSandbox, caller: Caller) -> SandboxInfo:
        """A new sandbox from the trajectory's image (or its latest snapshot), then every recorded
        state-changing call re-applied in order; where a re-run answers differently, the call says so."""
        started = time.monotonic()
        calls = await self._all_calls(row.owner, row.id)
        image, version, after = req.image, row.image_version or None, 0
        for c in reversed(calls):
            if c.op == "snapshot" and c.status == "done" and c.result:
                snap = ImageInfo.model_validate_json(c.result)
                image, version, after = snap.name, snap.digest, c.seq
                break
        ref = await self.lifecycle.images.resolve(image, caller=caller, version=version)
        rec = await self.lifecycle.create_on(req.model_copy(update={"image": image}), ref, owner=caller.tenant)
        n = row.rebuilds + 1
        notes: list[tuple[int, str]] = []
        try:
            for c in calls:
                if c.seq <= after or c.op not in MUTATING_OPS:
                    continue
                if c.status not in ("done", "error"):
                    notes.append((c.seq, f"rebuild {n}: not re-applied (the call was {c.status})"))
                    continue
                op = ACTIONS[c.op]
                want = outcome(op, op.decode(c.result, c.result_blob)) if c.status == "done" else _error_key(c.result)
                try:
                    value = await op.run(self.target, rec.id, op.parse(json.loads(c.request)), c.payload, caller, None)
                    got = outcome(op, value)
                except DsecError as e:
                    got = f"error:{e.code}"
                if got != want:
                    notes.append((c.seq, f"rebuild {n}: the re-run's result differs from the recorded one"))
        except BaseException:
            with contextlib.suppress(Exception):
                await self.lifecycle.kill(rec.id)
            raise
        now = time.time()
        writes = [TrajectoryStore.bind(row.owner, row.id, rec.id, rebuilt=True, now=now)]
        writes += [TrajectoryStore.annotate(row.owner, row.id, seq, note) for seq, note in notes]
        for w in writes:
            await self.writer.write(w)
        if (row.owner, row.id) in self._bound:
            self._bound[(row.owner, row.id)].sandbox_id = rec.id
        log.info(
            "trajectory %s rebuilt as %s: %d calls re-applied in %.1f s, %d differed",
            row.id, rec.id, sum(1 for c in calls if c.op in MUTATING_OPS and c.seq > after),
            time.monotonic() - started, len(notes),
        )  # fmt: skip
        return rec.info()

    # ---- calls ----------------------------------------------------------------------------------------

    async def record(self, call: Call) -> tuple[Any, bool]:
        """Run a call, logging it if the sandbox is bound to a trajectory. Returns (result, replayed).

        A call at a position the log already holds is answered from it, and never runs."""
        sandbox_id, op, seq = call.sandbox_id, call.action, call.seq
        rec = self.sandboxes.get(sandbox_id, call.caller)
        tid = rec.trajectory
        if tid is None or seq is None:
            if seq is not None:  # a sound request the sandbox's state refuses: the same goes to a bound one
                raise InvalidState(f"sandbox {sandbox_id} is not bound to a trajectory: {SEQ_HEADER} does not apply")
            # a kill from outside the trajectory (an operator, `dsec kill`) is allowed: the sandbox is
            # then lost to the trajectory, which rebuilds it when resumed
            if tid is not None and op.name in MUTATING_OPS and op.name != "kill":
                raise InvalidState(
                    f"sandbox {sandbox_id} belongs to trajectory {tid!r}: a call that changes it must carry "
                    f"its position ({SEQ_HEADER}); use the SDK with trajectory={tid!r}"
                )
            return await call.go(), False
        if seq < 1:
            raise InvalidRequest(f"{SEQ_HEADER} must be 1 or more (0 is the create)")
        st = await self._state(rec.owner, tid)
        if st.sandbox_id != sandbox_id:  # a late call through a sandbox a rebuild replaced: not the log's
            raise SandboxGone(f"sandbox {sandbox_id} was replaced by {st.sandbox_id} in trajectory {tid!r}")
        params = canonical(op.params(call.req))
        digest = call_digest(op.name, params, call.payload)
        async with st.lock:
            if seq < st.length:
                return await self._replay(st, seq, op, digest), True
            if seq > st.length:
                raise TrajectoryDiverged(
                    f"trajectory {tid!r}: call {seq} skips ahead of the log, which has {st.length} calls",
                    detail={"position": seq, "length": st.length},
                )
            return await self._live(st, _Live(call, seq, params, digest)), False

    async def length(self, owner: str, tid: str) -> int:
        """How many calls the trajectory's log holds (the position of the next live call)."""
        return (await self._state(owner, tid)).length

    async def _state(self, owner: str, tid: str) -> _Bound:
        st = self._bound.get((owner, tid))
        if st is None:
            row = await asyncio.to_thread(self.store.get, owner, tid)
            if row is None:
                raise InvalidState(f"trajectory {tid!r} is no longer in the log (removed or past its retention)")
            st = self._bound.setdefault((owner, tid), _Bound(owner, tid, row.length, row.sandbox_id))
        return st

    async def _replay(self, st: _Bound, seq: int, op: Action, digest: str) -> Any:
        row = await asyncio.to_thread(self.store.call, st.owner, st.tid, seq)
        if row is None:
            raise BackendError(f"trajectory {st.tid!r}: call {seq} is missing from the log")
        if row.digest != digest:
            raise _diverged(st.tid, seq, row.digest, digest, row.op, op.name)
        if row.status in ("interrupted", "running"):
            raise CallInterrupted(
                f"trajectory {st.tid!r}: call {seq} ({row.op}) was interrupted while it ran; whether it took "
                "effect is unknown",
                detail={"position": seq, RECORDED_AT: seq},
            )
        # counted without waiting for the commit: an answer from the log costs no commit of its own
        self.writer.post(TrajectoryStore.replayed(st.owner, st.tid, seq, time.time()))
        if row.status == "error":
            err = decode_error(row.result)
            err.detail[RECORDED_AT] = seq
            raise err
        return op.decode(row.result, row.result_blob)

    async def _live(self, st: _Bound, c: _Live) -> Any:
        seq, op, payload = c.seq, c.call.action, c.call.payload
        started = time.time()
        t0 = time.perf_counter()
        call = CallRow(st.owner, st.tid, seq, op.name, c.digest, c.params, "running", started, payload)
        try:
            touch = started - st.touched > TOUCH_EVERY
            await self.writer.write(TrajectoryStore.start(call, touch=touch))
            if touch:
                st.touched = started
        except SequenceConflict:
            row = await asyncio.to_thread(self.store.get, st.owner, st.tid)
            st.length = row.length if row else st.length
            raise TrajectoryDiverged(
                f"trajectory {st.tid!r}: call {seq} was recorded meanwhile by another client",
                detail={"position": seq},
            ) from None
        except Exception as e:
            raise BackendError(f"the trajectory log could not record call {seq}: {e}") from e
        st.length = seq + 1

        def finish(status: str, result: str | None = None, blob: bytes | None = None) -> Any:
            ms = (time.perf_counter() - t0) * 1000
            closes = op.name == "kill" and status == "done"
            return TrajectoryStore.finish(
                st.owner, st.tid, seq, status=status, result=result, result_blob=blob, duration_ms=ms, closes=closes
            )

        try:
            value = await c.call.go()
        except DsecError as e:
            await self.writer.write(finish("error", encode_error(e)))
            e.detail[RECORDED_AT] = seq  # the answer's, not the log's: a replay adds it again
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                await self.writer.write(finish("interrupted"))
            raise
        text, blob = op.encode(value)
        try:
            await self.writer.write(finish("done", text, blob))
        except Exception as e:
            raise BackendError(f"the trajectory log could not record the result of call {seq}: {e}") from e
        return value

    # ---- reading the log ------------------------------------------------------------------------------

    async def info(self, tid: str, caller: Caller) -> TrajectoryRow:
        row = await asyncio.to_thread(self.store.get, caller.tenant, tid)
        if row is None:
            raise NotFound(f"no trajectory {tid!r}")
        return row

    async def find(self, caller: Caller, prefix: str = "", limit: int = 1000) -> list[TrajectoryRow]:
        return await asyncio.to_thread(self.store.find, caller.tenant, limit=limit, prefix=prefix)

    async def calls(self, tid: str, caller: Caller, start: int = 0, limit: int = PAGE) -> list[CallRow]:
        await self.info(tid, caller)
        return await asyncio.to_thread(self.store.calls, caller.tenant, tid, start, limit)

    async def replayed_by_client(self, tid: str, caller: Caller, start: int, end: int) -> None:
        """Count one replay for each of the calls ``start``..``end - 1``, which a client answered itself."""
        row = await self.info(tid, caller)
        if end > row.length:
            raise InvalidRequest(f"trajectory {tid!r} holds {row.length} calls: it has no call {end - 1} to replay")
        self.writer.post(TrajectoryStore.replayed(caller.tenant, tid, start, time.time(), end=end))

    async def remove(self, tid: str, caller: Caller) -> None:
        key = (caller.tenant, tid)
        async with self._binding.setdefault(key, asyncio.Lock()):
            row = await self.info(tid, caller)
            rec = self.sandboxes.find_live(row.sandbox_id)
            if rec is not None and rec.state not in TERMINAL_STATES:
                raise InvalidState(f"trajectory {tid!r} is bound to running sandbox {row.sandbox_id}: kill it first")
            await asyncio.to_thread(self.store.delete, *key)
            self._bound.pop(key, None)

    async def _all_calls(self, owner: str, tid: str) -> list[CallRow]:
        out: list[CallRow] = []
        while True:
            page = await asyncio.to_thread(self.store.calls, owner, tid, len(out), PAGE)
            out += page
            if len(page) < PAGE:
                return out

    async def _prune_forever(self) -> None:
        while True:
            try:
                live = {
                    (r.owner, r.trajectory)
                    for r in self.sandboxes.live()
                    if r.trajectory and r.state not in TERMINAL_STATES
                }
                cutoff = time.time() - self.options.keep_days * 86400
                gone = await asyncio.to_thread(self.store.prune, cutoff, live)
                if gone:
                    log.info(
                        "trajectory retention: removed %d trajectories older than %g days", gone, self.options.keep_days
                    )
            except Exception as e:
                log.warning("trajectory retention pass failed: %s", e)
            await asyncio.sleep(PRUNE_INTERVAL)


def _diverged(tid: str, seq: int, recorded: str, given: str, recorded_op: str, given_op: str) -> TrajectoryDiverged:
    return TrajectoryDiverged(
        f"trajectory {tid!r} diverged at call {seq}: the log holds {recorded_op} {recorded[:16]}, "
        f"this call is {given_op} {given[:16]}; nothing was run",
        detail={"position": seq, "recorded": recorded, "given": given, "recorded_op": recorded_op},
    )


def _safe(url: str) -> str:
    """A database URL without its password."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if at and ":" in creds:
        return f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}"
    return url


def _error_key(result: str | None) -> str:
    return f"error:{decode_error(result).code}"
