"""The client side of a trajectory: number the calls, fast-forward through the recorded ones locally,
go live at the end of the log, and retry a call whose connection broke (the log makes that safe).

A trainer does nothing special to resume: it creates the sandbox with the same trajectory id and
issues the same calls. While they match the log (same digest at the same position), each is answered
from a page of recorded calls fetched in bulk, without a round trip per call.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from ..errors import CallInterrupted, DaemonUnreachable, DsecError, TrajectoryDiverged, error_from_wire
from ..protocol.sandbox import ExecResult
from ..protocol.trajectory import (
    RECORDED_AT,
    SEQ_HEADER,
    RecordedCall,
    RecordedCalls,
    TrajectoryInfo,
    TrajectoryList,
    call_digest,
)
from .transport import Transport

log = logging.getLogger("dsec.trajectory")

T = TypeVar("T")
# a call's parameters as the daemon digests them, or a function making them (only a replay needs them)
Params = dict[str, Any] | Callable[[], dict[str, Any]]
M = TypeVar("M", bound=BaseModel)
PAGE = 1000
RETRY_FOR = 120.0  # how long a call whose connection broke is retried (a daemon restarting)


class Trajectory:
    """Where a sandbox's trajectory stands, as this client sees it (``sb.trajectory``)."""

    def __init__(self, transport: Transport, trajectory_id: str, recorded: int) -> None:
        self.id = trajectory_id
        self.position = 1  # the next call's; 0 is the create
        self.recorded = recorded  # calls the log held when this client attached
        self.replayed = 0  # calls answered from the log
        self.live = 0  # calls that ran
        self.last_replayed = False
        self._t = transport
        self._lock = asyncio.Lock()
        self._page: dict[int, RecordedCall] = {}
        self._unreported: int | None = None  # the first call answered here that the daemon was not told of

    def __repr__(self) -> str:
        return f"<Trajectory {self.id} at {self.position}: {self.replayed} replayed, {self.live} live>"

    @property
    def replaying(self) -> bool:
        """True while calls are still answered from the log."""
        return self.position < self.recorded

    @asynccontextmanager
    async def step(self, op: str, params: Params, payload: bytes | None = None) -> AsyncIterator[Step]:
        """Hold the trajectory's next position for one call. ``step.recorded`` is its recorded call when
        the log has it (checked against this call's digest; a mismatch raises ``TrajectoryDiverged``);
        otherwise send the call with ``step.headers``. The position advances when the block ends, or
        raises an error that the log holds as this call's outcome."""
        async with self._lock:
            seq = self.position
            step = Step(seq, {SEQ_HEADER: str(seq)})
            if seq < self.recorded:
                rec = await self._recorded(seq)
                if rec is not None and rec.status != "running":  # a running one: the daemon waits for it
                    # made only to compare with the log: a live call is digested by the daemon
                    digest = call_digest(op, params() if callable(params) else params, payload)
                    if rec.digest != digest:
                        await self._report_replays()
                        raise TrajectoryDiverged(
                            f"trajectory {self.id!r} diverged at call {seq}: the log holds {rec.op} "
                            f"{rec.digest[:16]}, this call is {op} {digest[:16]}; nothing was run",
                            detail={"position": seq, "recorded": rec.digest, "given": digest, "recorded_op": rec.op},
                        )
                    step.recorded = rec
            if step.recorded is None:
                await self._report_replays()  # the replay ends here: this call is sent
            try:
                yield step
            except DsecError as e:
                if e.detail.get(RECORDED_AT) == seq:  # the failure is the call's outcome in the log
                    self._advance(seq, op, replayed=step.recorded is not None)
                    await self._replay_ended()
                raise
            self._advance(seq, op, replayed=step.recorded is not None)
            await self._replay_ended()

    async def call(
        self,
        op: str,
        params: Params,
        payload: bytes | None,
        live: Callable[[dict[str, str]], Awaitable[T]],
        decode: Callable[[RecordedCall], T],
    ) -> T:
        """One call: from the log while it matches, else sent with its position (and sent again if the
        connection broke: the daemon answers a call it already logged from the log)."""
        async with self.step(op, params, payload) as step:
            if step.recorded is not None:
                return replay(step.recorded, decode)
            return await self._send(step, live)

    def _advance(self, seq: int, op: str, *, replayed: bool) -> None:
        self.position = seq + 1
        self.last_replayed = replayed
        if replayed:
            self.replayed += 1
            if self._unreported is None:
                self._unreported = seq
        else:
            self.live += 1
        log.debug("trajectory %s call %d %s: %s", self.id, seq, op, "replayed" if replayed else "live")

    async def _replay_ended(self) -> None:
        if self.position >= self.recorded:  # the log is replayed to its end
            await self._report_replays()

    async def _report_replays(self) -> None:
        """Tell the daemon which calls were answered here (one request per replay, not per call), so the
        log shows them replayed. Best effort: a failure to tell never fails the trainer's call."""
        start, self._unreported = self._unreported, None
        if start is None or self.position <= start:
            return
        body = {"start": start, "end": self.position}
        try:
            await self._t.request("POST", "/v1/trajectories/replayed", params={"id": self.id}, json=body, timeout=30)
        except (DsecError, httpx.HTTPError) as e:
            log.warning(
                "trajectory %s: could not report calls %d-%d as replayed: %s", self.id, start, self.position - 1, e
            )

    async def _recorded(self, seq: int) -> RecordedCall | None:
        if seq not in self._page:
            self._page.clear()
            reply = await self._t.request(
                "GET", "/v1/trajectories/calls", params={"id": self.id, "start": seq, "limit": PAGE}
            )
            for rec in RecordedCalls.model_validate_json(reply.content).calls:
                if rec.seq < self.recorded:
                    self._page[rec.seq] = rec
        return self._page.get(seq)

    async def _send(self, step: Step, live: Callable[[dict[str, str]], Awaitable[T]]) -> T:
        deadline = time.monotonic() + RETRY_FOR
        delay = 0.2
        while True:
            try:
                return await live(step.headers)
            except DaemonUnreachable as e:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("trajectory %s call %d: %s; retrying in %.1f s", self.id, step.seq, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


@dataclass
class Step:
    seq: int
    headers: dict[str, str]
    recorded: RecordedCall | None = None


def replay(rec: RecordedCall, decode: Callable[[RecordedCall], T]) -> T:
    """A recorded call's outcome: its result, or the error it raised."""
    if rec.status == "interrupted":
        raise CallInterrupted(
            f"call {rec.seq} ({rec.op}) was interrupted while it ran; whether it took effect is unknown",
            detail={"position": rec.seq, RECORDED_AT: rec.seq},
        )
    if rec.status == "error":
        err = (rec.result or {}).get("error") or {}
        e = error_from_wire(str(err.get("code", "internal")), str(err.get("message", "")), err.get("detail"))
        e.detail[RECORDED_AT] = rec.seq
        raise e
    return decode(rec)


def recorded_bytes(rec: RecordedCall) -> bytes:
    return base64.b64decode(rec.result_bytes or "")


def canonical_params(model: type[BaseModel], body: dict[str, Any]) -> dict[str, Any]:
    """A request's parameters as the daemon digests them (after its own parsing, defaults included)."""
    return model.model_validate(body).model_dump(mode="json")


def exec_result(rec: RecordedCall) -> ExecResult:
    return ExecResult.model_validate({**(rec.result or {}), "replayed": True})


def model_result(model: type[M]) -> Callable[[RecordedCall], M]:
    return lambda rec: model.model_validate(rec.result or {})


def no_result(_: RecordedCall) -> None:
    """A call that answers nothing (a write, a removal), read back from the log."""
    return None


class TrajectoryClient:
    """Reading the trajectory log back (a mixin of AsyncClient, so the blocking ``Client`` has it too)."""

    _transport: Transport

    async def trajectories(self, prefix: str = "", limit: int = 1000) -> builtins.list[TrajectoryInfo]:
        """The caller's trajectories, most recently written first; ``prefix`` filters ids (e.g. "job-17/")."""
        reply = await self._transport.request("GET", "/v1/trajectories", params={"prefix": prefix, "limit": limit})
        return TrajectoryList.model_validate_json(reply.content).trajectories

    async def trajectory(self, trajectory_id: str) -> TrajectoryInfo:
        reply = await self._transport.request("GET", "/v1/trajectories/info", params={"id": trajectory_id})
        return TrajectoryInfo.model_validate_json(reply.content)

    async def trajectory_calls(self, trajectory_id: str, start: int = 0) -> AsyncIterator[RecordedCall]:
        """The recorded calls from position ``start`` on, in order (fetched a page at a time)."""
        at: int | None = start
        while at is not None:
            params = {"id": trajectory_id, "start": at, "limit": PAGE}
            reply = await self._transport.request("GET", "/v1/trajectories/calls", params=params)
            page = RecordedCalls.model_validate_json(reply.content)
            for rec in page.calls:
                yield rec
            at = page.next

    async def remove_trajectory(self, trajectory_id: str) -> None:
        """Forget a trajectory and its calls (refused while its sandbox runs)."""
        await self._transport.request("DELETE", "/v1/trajectories", params={"id": trajectory_id})
