"""Batches across nodes: a batch creation split by free capacity, its nodes' NDJSON streams merged as
they come (indexes the batch's own, one summary line at the end); one-shot run batches likewise.

A share a node refuses (429, or its items answered ``overloaded``) or cannot take (the node broke) is
placed again on the nodes not yet tried, round after round, until it is placed or no node is left; what
is left then fails with the last refusal. Items bound to a trajectory whose sandbox lives on a
reachable node go to that node only (elsewhere they would rebuild a sandbox that still runs).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from pydantic import ValidationError

from ..errors import DaemonUnreachable, InvalidRequest, validation_message
from ..protocol.node import BatchCreate, BatchEvent
from ..protocol.run import RunBatch, RunBatchResult, RunOutcome
from ..protocol.sandbox import ErrorBody
from .directory import Directory
from .nodes import Node, NodeSet
from .placement import Demand, chunks, split
from .proxy import NDJSON_TYPE, Failure, Receive, Scope, Send, answer_json, control_headers, read_body
from .wire import Broken, Reply


class Gateway(Protocol):
    """What a batch needs of the gateway that runs it."""

    nodes: NodeSet
    directory: Directory

    def nudge(self, node: Node) -> None:
        """Check the node's health now: it refused a connection."""


RETRYABLE = frozenset({"overloaded", "daemon_unreachable"})
LOOKUPS_AT_ONCE = 16  # trajectory lookups of one batch in flight


class _Merge:
    """The merged answer of one batch: lines written as they come, counts for the summary."""

    def __init__(self, gw: Gateway, send: Send) -> None:
        self.gw = gw
        self.send = send
        self.lock = asyncio.Lock()
        self.created = 0
        self.failed = 0
        self.last_error: dict[int, ErrorBody] = {}

    async def start(self) -> None:
        headers = [(b"content-type", NDJSON_TYPE)]
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})

    async def line(self, event: BatchEvent) -> None:
        data = event.model_dump_json(exclude_none=True).encode() + b"\n"
        async with self.lock:
            await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def ok(self, node: Node, event: BatchEvent, index: int) -> None:
        assert event.sandbox is not None
        self.gw.directory.record(node, event.sandbox)
        self.created += 1
        node.placed += 1
        await self.line(event.model_copy(update={"index": index}))

    async def error(self, index: int, error: ErrorBody) -> None:
        self.failed += 1
        await self.line(BatchEvent(index=index, error=error))

    async def finish(self) -> None:
        summary = BatchEvent(done=True, created=self.created, failed=self.failed)
        data = summary.model_dump_json(exclude_none=True).encode() + b"\n"
        async with self.lock:
            await self.send({"type": "http.response.body", "body": data, "more_body": False})


async def create_batch(gw: Gateway, scope: Scope, receive: Receive, send: Send) -> None:

    try:
        req = BatchCreate.model_validate_json(await read_body(receive))
    except ValidationError as e:
        raise Failure(InvalidRequest, validation_message(e)) from None
    if req.trajectories is not None and len(req.trajectories) != req.count:
        raise Failure(InvalidRequest, f"trajectories: {len(req.trajectories)} given for {req.count} sandboxes")
    demand = Demand.of(req.sandbox.limits)
    headers = control_headers(scope)
    pinned = await _homes(gw, req.trajectories or [])
    merge = _Merge(gw, send)
    await merge.start()
    await _Creation(gw, req, demand, headers, merge).place(pinned)
    await merge.finish()


class _Creation:
    """One batch creation spread over the nodes, share by share."""

    def __init__(
        self, gw: Gateway, req: BatchCreate, demand: Demand, headers: list[tuple[bytes, bytes]], merge: _Merge
    ) -> None:
        self.gw = gw
        self.req = req
        self.demand = demand
        self.headers = headers
        self.merge = merge

    async def place(self, pinned: dict[int, Node]) -> None:
        """Rounds of shares until every item is answered: what a node refuses or drops goes to the nodes
        not tried yet; a pinned item (its trajectory's sandbox lives on its node) fails instead."""
        merge = self.merge
        refused: set[Node] = set()
        groups: dict[Node, list[int]] = {}
        for i, node in pinned.items():
            groups.setdefault(node, []).append(i)
        pending = [i for i in range(self.req.count) if i not in pinned]
        while groups or pending:
            if pending:
                await self._spread(pending, refused, groups)
            if not groups:
                break
            work = list(groups.items())
            groups = {}
            again = await asyncio.gather(*(self.share(node, idx) for node, idx in work))
            pending = []
            for (node, _), retry in zip(work, again, strict=True):
                if retry:  # it refused or broke: the rest goes to the others
                    refused.add(node)
                    node.refused()
                for i in retry:
                    if i in pinned:  # its sandbox's node broke: resent elsewhere it would rebuild a live one
                        await merge.error(i, merge.last_error[i])
                    else:
                        pending.append(i)

    async def _spread(self, pending: list[int], refused: set[Node], groups: dict[Node, list[int]]) -> None:
        """Add the pending items to ``groups`` by the free capacity of the nodes not refused yet."""
        nodes = [n for n in self.gw.nodes.candidates(self.demand) if n not in refused]
        views = [v for n in nodes if (v := n.placement_view()) is not None]
        by_name = {n.name: n for n in nodes}
        for name, idx in chunks(pending, split(views, self.demand, len(pending))).items():
            groups.setdefault(by_name[name], []).extend(idx)
        placed = {i for idx in groups.values() for i in idx}
        for i in pending:
            if i not in placed:  # no node left to try
                await self.merge.error(i, self.merge.last_error.get(i) or _no_node())

    async def share(self, node: Node, idx: list[int]) -> list[int]:
        """One node's part; returns the items to place again elsewhere."""
        hold = node.hold(self.demand, len(idx))
        before = self.merge.created
        try:
            return await self._send(node, idx)
        finally:  # not exact when shares run at once, but only a forecast until the next status
            node.settle(hold, max(0, self.merge.created - before))

    async def _send(self, node: Node, idx: list[int]) -> list[int]:
        req = self.req
        trajectories = [req.trajectories[i] for i in idx] if req.trajectories else None
        part = BatchCreate(count=len(idx), sandbox=req.sandbox, trajectories=trajectories)
        answered: set[int] = set()
        again: list[int] = []
        try:
            body = part.model_dump_json().encode()
            async with await node.http.send("POST", "/v1/sandboxes/batch", self.headers, body) as resp:
                if resp.status >= 300:
                    return await self._refused(node, idx, Reply(resp.status, [], await resp.read()))
                async for raw in resp.lines():
                    if raw.strip():
                        await self._event(node, idx, BatchEvent.model_validate_json(raw), answered, again)
        except (Broken, ValidationError) as e:
            self.gw.nudge(node)
            err = ErrorBody(
                code="daemon_unreachable",
                message=f"node {node.name} broke off the batch ({type(e).__name__}: {e}); "
                "a creation it had started may have been lost with it",
            )
            for j, i in enumerate(idx):
                if j not in answered:
                    node.unreachable += 1
                    self.merge.last_error[i] = err
                    again.append(i)
        return again

    async def _refused(self, node: Node, idx: list[int], reply: Reply) -> list[int]:
        """A node's answer to the whole share: 429 puts every item up for another node, others fail them."""
        code, message, detail = reply.error()
        err = ErrorBody(code=code, message=f"node {node.name}: {message}", detail=detail)
        if reply.status == 429:
            node.refused_count += len(idx)
            for i in idx:
                self.merge.last_error[i] = err
            return idx
        for i in idx:
            await self.merge.error(i, err)
        return []

    async def _event(self, node: Node, idx: list[int], event: BatchEvent, answered: set[int], again: list[int]) -> None:
        """One line of a node's stream: a creation (or its failure) of one of the share's items."""
        if event.done or event.index is None or not 0 <= event.index < len(idx):
            return
        answered.add(event.index)
        index = idx[event.index]
        if event.sandbox is not None:
            await self.merge.ok(node, event, index)
        elif event.error is not None and event.error.code in RETRYABLE:
            node.refused_count += 1
            self.merge.last_error[index] = event.error
            again.append(index)
        else:
            await self.merge.error(index, event.error or ErrorBody(code="internal", message="no outcome"))


def _no_node() -> ErrorBody:
    return ErrorBody(code="daemon_unreachable", message="no node of the cluster is healthy now")


async def _homes(gw: Gateway, trajectories: list[str]) -> dict[int, Node]:
    """The items whose trajectory's sandbox lives on a reachable node, and that node."""
    gate = asyncio.Semaphore(LOOKUPS_AT_ONCE)
    out: dict[int, Node] = {}

    async def one(i: int, tid: str) -> None:
        async with gate:
            home, _ = await gw.directory.trajectory(tid)
        if home is not None:
            out[i] = home

    await asyncio.gather(*(one(i, t) for i, t in enumerate(trajectories)))
    return out


async def run_batch(gw: Gateway, scope: Scope, receive: Receive, send: Send) -> None:
    """One-shot runs split over the nodes; outcomes in the order given. A share is sent to the next
    node only when the previous one refused it or was never reached (a run is not run twice)."""

    try:
        req = RunBatch.model_validate_json(await read_body(receive))
    except ValidationError as e:
        raise Failure(InvalidRequest, validation_message(e)) from None
    started = time.monotonic()
    demand = Demand.of(req.runs[0].limits)
    await gw.nodes.first_answers()
    nodes = gw.nodes.candidates(demand)
    if not nodes:
        raise Failure(DaemonUnreachable, "no node of the cluster is healthy now")
    views = [v for n in nodes if (v := n.placement_view()) is not None]
    by_name = {n.name: n for n in nodes}
    groups = chunks(list(range(len(req.runs))), split(views, demand, len(req.runs)))
    outcomes: list[RunOutcome | None] = [None] * len(req.runs)
    headers = control_headers(scope)

    async def share(first: Node, idx: list[int]) -> None:
        concurrency = max(1, round(req.concurrency * len(idx) / len(req.runs)))
        part = RunBatch(runs=[req.runs[i] for i in idx], concurrency=concurrency).model_dump_json().encode()
        err = ErrorBody(code="daemon_unreachable", message="no node of the cluster took these runs")
        for node in [first, *(n for n in nodes if n is not first)]:
            try:
                reply = await node.http.request("POST", "/v1/run/batch", body=part, headers=headers)
            except Broken as e:
                gw.nudge(node)
                if not e.sent:
                    err = ErrorBody(code="daemon_unreachable", message=f"node {node.name}: {e}")
                    continue
                err = ErrorBody(
                    code="daemon_unreachable",
                    message=f"node {node.name} broke off the runs ({e}); they may or may not have run",
                )
                break
            if reply.status == 429:
                code, message, detail = reply.error()
                err = ErrorBody(code=code, message=f"node {node.name}: {message}", detail=detail)
                continue
            if reply.status >= 300:
                code, message, detail = reply.error()
                err = ErrorBody(code=code, message=f"node {node.name}: {message}", detail=detail)
                break
            for i, outcome in zip(idx, RunBatchResult.model_validate_json(reply.content).outcomes, strict=True):
                outcomes[i] = outcome
            return
        for i in idx:
            outcomes[i] = RunOutcome(error=err)

    await asyncio.gather(*(share(by_name[name], idx) for name, idx in groups.items()))
    seconds = round(time.monotonic() - started, 6)
    await answer_json(
        send, 200, RunBatchResult(outcomes=[o or RunOutcome(error=_no_node()) for o in outcomes], seconds=seconds)
    )
