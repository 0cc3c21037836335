"""The cluster gateway: the node daemon's HTTP API in front of many nodes (``DSEC_URL`` points here).

Creations are placed on a node with free capacity (``placement.py``) and passed on; a node that refuses
(429) or cannot be reached is skipped for the next candidate, and only when every node refuses is the
caller answered 429 with Retry-After. Every call on a sandbox goes to the node that holds it, its body
and answer streamed through untouched. Lists, the node status and metrics are the nodes' own, merged.
Node-level calls (images, builds, trajectory reads) go to one healthy node: the layer repository and
the trajectory log are shared by all of them.

It is a plain ASGI application (no framework): an exec pays for one dictionary lookup and one
pass-through on top of the node's own work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlencode

from pydantic import ValidationError

from ..errors import (
    DaemonUnreachable,
    DsecError,
    InvalidRequest,
    InvalidState,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    SandboxGone,
    SandboxNotFound,
    Unauthorized,
    validation_message,
)
from ..protocol.node import MAX_TOP, NodeHistory, NodeStatus
from ..protocol.run import PoolList, RunRequest
from ..protocol.sandbox import CreateSandbox, ForkResult, Health, SandboxInfo, SandboxList
from ..protocol.sandbox_query import SandboxQuery, select
from ..protocol.trajectory import TrajectoryList
from ..protocol.version import __version__
from ..server.allow import allowed_methods, routed
from ..tenancy import OPERATOR, Caller
from ..web.disconnect import CLIENT_GONE, GONE, unless_gone
from . import aggregate
from .directory import Directory, labels_of
from .models import ClusterNode, ClusterStatus
from .nodes import Health as NodeHealth
from .nodes import Node, NodeSet
from .placement import Demand
from .proxy import (
    Failure,
    Message,
    Receive,
    Scope,
    Send,
    answer,
    answer_json,
    bearer,
    body_of,
    control_headers,
    fail,
    forward,
    query,
    read_body,
)
from .wire import Broken, NodeClient, Reply

log = logging.getLogger("dsec.cluster")

PRUNE_EVERY = 60.0
NUDGE_SPACING = 0.3  # seconds between health checks a failing call triggers on one node
AUDIT_DEFAULT_LIMIT = 100
TRAJECTORY_LIST_DEFAULT = 1000


def unreachable(node: Node, sent: bool) -> Failure:
    if node.lost:
        return Failure(SandboxGone, node.lost_reason())
    maybe = "; the call may or may not have taken effect" if sent else ""
    return Failure(DaemonUnreachable, f"node {node.name} ({node.url}) does not answer{maybe}")


def sandbox_gone(node: Node) -> Failure:
    return Failure(SandboxGone, node.lost_reason())


class Gateway:
    def __init__(self, nodes: NodeSet, token: str, *, name: str = "cluster") -> None:
        self.nodes = nodes
        self.token = token.encode()
        self.name = name
        self.directory = Directory(nodes)
        self._pruned = time.monotonic()
        self._checks: dict[int, asyncio.Task[None]] = {}
        self._nudged: dict[int, float] = {}

    def verify(self, token: str) -> Caller | None:
        """Who a token is (the console's login): the cluster has one token, its operator's."""
        return OPERATOR if secrets.compare_digest(token.encode(), self.token) else None

    # ---- ASGI ----------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._dispatch(scope, receive, tracked)
        except Failure as f:
            if not started:
                await fail(send, f)
        except Exception as e:  # the answer is always the API's JSON error, never a bare 500 page
            log.exception("gateway error on %s %s", scope["method"], scope["path"])
            if not started:
                await fail(send, Failure(DsecError, f"gateway error: {type(e).__name__}: {e}"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.nodes.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.nodes.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if routed(path, method) is False:  # routed before authenticated, as on a node
            allow = ", ".join(sorted(allowed_methods(path) or ()))
            raise Failure(MethodNotAllowed, f"{method} {path}", allow=allow)
        if path == "/v1/health":
            await self._health(send)
            return
        if not secrets.compare_digest(bearer(scope), self.token):
            raise Failure(Unauthorized, "missing or wrong bearer token (the cluster's operator token)")
        parts = path.strip("/").split("/")
        if len(parts) < 2 or parts[0] != "v1":
            if path == "/metrics" and method == "GET":
                await self._metrics(scope, send)
                return
            raise Failure(NotFound, f"no route {method} {path}")
        route = parts[1]
        if route == "sandboxes":
            await self._sandboxes(scope, receive, send, method, parts[2:])
        elif route == "node" and method == "GET" and parts[2:] == ["history"]:
            await self._history(send)
        elif route == "node" and method == "GET":
            await self._node(scope, send)
        elif route == "cluster" and method == "GET":
            await answer_json(send, 200, self.cluster_status())
        elif route == "run" and len(parts) == 2 and method == "POST":
            await self._run(scope, receive, send)
        elif route == "run" and parts[2:] == ["batch"] and method == "POST":
            from .batch import run_batch

            await run_batch(self, scope, receive, send)
        elif route == "pools" and method == "GET":
            await self._pools(scope, send)
        elif route == "metrics" and method == "GET":
            await self._metrics(scope, send)
        elif route == "audit" and method == "GET":
            await self._audit(scope, send)
        elif route == "tenants":
            raise Failure(
                InvalidRequest,
                "tenants are kept per node and cannot be managed through the cluster gateway: "
                "use the cluster's operator token",
            )
        elif route == "volumes":
            raise Failure(
                InvalidRequest,
                "named volumes are kept on one node's disk and cannot be managed through the cluster gateway: "
                "use the node's own API (docs/volumes.md)",
            )
        elif route == "images" and parts[2:] == ["gc"]:
            raise Failure(
                InvalidState,
                "image gc is refused through the gateway: each node knows only the images its own sandboxes "
                "use, so a gc on one node could delete layers another node runs on",
            )
        elif route == "trajectories":
            await self._trajectories(scope, receive, send, method, parts[2:])
        else:  # images, image builds and their contexts, imports: one node, the repository is shared
            await self._to_primary(scope, receive, send)

    # ---- sandboxes -----------------------------------------------------------------------------------

    async def _sandboxes(self, scope: Scope, receive: Receive, send: Send, method: str, rest: list[str]) -> None:
        if not rest:
            if method == "POST":
                await self._create(scope, receive, send)
            elif method == "GET":
                await self._list(scope, send)
            else:
                raise Failure(MethodNotAllowed, f"{method} /v1/sandboxes")
            return
        if rest == ["batch"] and method == "POST":
            from .batch import create_batch

            await create_batch(self, scope, receive, send)
            return
        sandbox_id = rest[0]
        node = await self.directory.locate(sandbox_id)
        if node is None:
            lost = [n.name for n in self.nodes.nodes if n.lost]
            where = f" (lost nodes may have held it: {', '.join(lost)})" if lost else ""
            raise Failure(SandboxNotFound, f"no sandbox {sandbox_id} on any reachable node{where}")
        if len(rest) == 1 and method in ("GET", "DELETE"):
            await self._info_or_kill(scope, send, node, sandbox_id)
        elif node.lost:
            raise sandbox_gone(node)
        elif rest[1:] == ["fork"] and method == "POST":
            body = await read_body(receive)
            reply = await self._call(node, scope, body)
            if reply.status < 300:
                with contextlib.suppress(ValidationError):
                    for info in ForkResult.model_validate_json(reply.content).sandboxes:
                        self.directory.record(node, info)
            await answer(send, reply.status, reply.content, reply.response_headers())
        else:  # the hot path: exec, streamed exec, files, archives, snapshot, grade, network, pause, resume
            if node.health is not NodeHealth.healthy:
                self.nudge(node)
            content = await body_of(receive)
            await forward(node.http, scope, send, content, lambda sent: self._broken(node, sent))

    def _broken(self, node: Node, sent: bool) -> Failure:
        self.nudge(node)
        return unreachable(node, sent)

    async def _call(self, node: Node, scope: Scope, body: bytes | None = None) -> Reply:
        """The caller's request passed to ``node`` and its answer read whole (control-plane calls)."""
        url = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if qs := query(scope):
            url += "?" + qs
        try:
            return await node.http.request(scope["method"], url, body=body or b"", headers=control_headers(scope))
        except Broken as e:
            raise self._broken(node, e.sent) from e

    async def _info_or_kill(self, scope: Scope, send: Send, node: Node, sandbox_id: str) -> None:
        entry = self.directory.entries.get(sandbox_id)
        if node.lost and entry is not None:  # a kill of a lost sandbox is a no-op, as for any finished one
            await answer_json(send, 200, self.directory.as_lost(entry))
            return
        if node.lost:
            raise sandbox_gone(node)
        try:
            reply = await self._call(node, scope)
        except Failure:
            if node.lost and entry is not None:
                await answer_json(send, 200, self.directory.as_lost(entry))
                return
            raise
        if reply.status == 200:
            self.directory.record_json(node, reply.content)
        elif reply.status == 404:
            self.directory.forget(sandbox_id)
        await answer(send, reply.status, reply.content, reply.response_headers())

    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        try:
            req = CreateSandbox.model_validate_json(body)
        except ValidationError as e:
            raise Failure(InvalidRequest, validation_message(e)) from None
        pinned: Node | None = None
        if req.trajectory:
            pinned, _ = await self.directory.trajectory(req.trajectory)
        placed = await self.place_for(receive, send, scope, "/v1/sandboxes", body, Demand.of(req.limits), pinned=pinned)
        if placed is None:
            return
        reply, node = placed
        if reply.status < 300:
            self.directory.record_json(node, reply.content)
        await answer(send, reply.status, reply.content, reply.response_headers())
        self.maybe_prune()

    async def place_for(
        self, receive: Receive, send: Send, scope: Scope, path: str, body: bytes, demand: Demand, **how: Any
    ) -> tuple[Reply, Node] | None:
        """``place``, cancelled if the caller goes away first: its connection to the node then closes, and
        the node cancels the creation in turn. None: the caller is gone (answered 499, for the audit)."""
        placed = await unless_gone(receive, self.place(scope, path, body, demand, **how), f"gateway {path}")
        if placed is GONE:
            await answer(send, CLIENT_GONE, b"", [])
            return None
        return placed

    async def place(
        self,
        scope: Scope,
        path: str,
        body: bytes,
        demand: Demand,
        *,
        pinned: Node | None = None,
        resend: bool = True,
        via: Callable[[Node], NodeClient | None] | None = None,
    ) -> tuple[Reply, Node]:
        """Send a creation to the best node for it, then to the next ones while they refuse (429) or
        cannot be reached; ``resend`` False: only a node that was never reached is skipped (the call
        may have run). ``pinned``: only that node (a trajectory's sandbox lives there). ``via``: the
        connection to send on (another API of the node, such as its E2B listener; None skips the node),
        instead of the node's own API.

        Every node the demand fits (by the last statuses) is tried; of those it does not fit, only
        until one has refused: such a node keeps the creation in its queue up to the queue timeout
        before refusing, and making the caller wait that long once is enough (it retries later)."""
        if pinned is None:
            await self.nodes.first_answers()
        order = [pinned] if pinned is not None else self.nodes.candidates(demand)
        if not order:
            raise Failure(DaemonUnreachable, "no node of the cluster is healthy now")
        refusals: list[tuple[Node, Reply]] = []
        failures: list[str] = []
        headers = control_headers(scope)
        for node in order:
            view = node.placement_view()
            if refusals and view is not None and not view.fits(demand):
                break
            http = node.http if via is None else via(node)
            if http is None:
                continue
            hold = node.hold(demand)
            try:
                reply = await http.request("POST", path, body=body, headers=headers)
            except Broken as e:
                node.release(hold)
                node.unreachable += 1
                self.nudge(node)
                failures.append(f"node {node.name}: {e}")
                if resend or not e.sent:
                    continue
                raise unreachable(node, True) from e
            if reply.status == 429:
                node.release(hold)
                node.refused()
                node.refused_count += 1
                refusals.append((node, reply))
                continue
            node.settle(hold, 1 if reply.status < 300 else 0)
            node.placed += reply.status < 300
            return reply, node
        if refusals:
            raise self._overloaded(refusals, failures)
        raise Failure(DaemonUnreachable, "no node of the cluster could be reached: " + "; ".join(failures))

    @staticmethod
    def _overloaded(refusals: list[tuple[Node, Reply]], failures: list[str]) -> Failure:
        waits: list[float] = []
        reasons = []
        for node, reply in refusals:
            _, message, detail = reply.error()
            wait = detail.get("retry_after")
            if isinstance(wait, int | float):
                waits.append(float(wait))
            else:
                header = reply.header(b"retry-after")
                with contextlib.suppress(ValueError, TypeError):
                    waits.append(float(header or b""))
            reasons.append(f"node {node.name}: {message}")
        retry_after = min(waits) if waits else 1.0
        message = "every node of the cluster refused the creation for capacity: " + "; ".join(reasons + failures)
        return Failure(Overloaded, message, {"retry_after": retry_after})

    async def _list(self, scope: Scope, send: Send) -> None:
        params = parse_qs(query(scope))
        try:  # the nodes filter; the page is cut here, from all of them
            page = SandboxQuery.model_validate({k: v[-1] for k, v in params.items() if k in SandboxQuery.model_fields})
        except ValidationError as e:
            raise Failure(InvalidRequest, validation_message(e)) from None
        qs = urlencode([(k, v) for k, vs in params.items() if k not in ("limit", "offset") for v in vs])
        url = "/v1/sandboxes" + (f"?{qs}" if qs else "")
        replies = await self.fan_out(self.nodes.routable(), url)
        infos: dict[str, SandboxInfo] = {}
        for node, reply in replies:
            if reply.status != 200:
                code, message, detail = reply.error()
                raise Failure.relay(reply.status, code, message, detail)  # e.g. a malformed label filter
            for info in SandboxList.model_validate_json(reply.content).sandboxes:
                self.directory.record(node, info)
                infos[info.id] = info
        include_all = params.get("all", ["false"])[-1].lower() in ("1", "true", "yes")
        for info in self.directory.lost_infos(include_all, labels_of(params)):
            infos.setdefault(info.id, info)
        await answer_json(send, 200, select(aggregate.by_creation(infos.values()), page, lambda info: info))
        self.maybe_prune()

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        try:
            req = RunRequest.model_validate_json(body)
        except ValidationError as e:
            raise Failure(InvalidRequest, validation_message(e)) from None
        # a one-shot run is not resent after it may have started: it would run twice
        reply, _ = await self.place(scope, "/v1/run", body, Demand.of(req.limits), resend=False)
        await answer(send, reply.status, reply.content, reply.response_headers())

    # ---- node-level calls ----------------------------------------------------------------------------

    async def fan_out(self, nodes: list[Node], url: str, timeout: float = 30.0) -> list[tuple[Node, Reply]]:
        """``GET url`` on every node at once; the nodes that cannot be reached are left out."""

        async def one(node: Node) -> tuple[Node, Reply] | None:
            try:
                return node, await node.http.request("GET", url, timeout=timeout)
            except Broken:
                self.nudge(node)
                return None

        return [r for r in await asyncio.gather(*(one(n) for n in nodes)) if r is not None]

    async def _health(self, send: Send) -> None:
        live = self.nodes.routable()
        kinds = sorted({k for n in live if n.status is not None for k in n.status.kinds})
        await answer_json(send, 200, Health(ok=bool(live), version=__version__, kinds=kinds))

    async def _node(self, scope: Scope, send: Send) -> None:
        text = parse_qs(query(scope), keep_blank_values=True).get("top", ["0"])[-1]
        if not (text.isascii() and text.isdigit() and int(text) <= MAX_TOP):  # the node's own bound
            raise Failure(InvalidRequest, f"top must be a whole number from 0 to {MAX_TOP}, not {text[:40]!r}")
        top = int(text)
        if top > 0:
            replies = await self.fan_out(self.nodes.healthy(), f"/v1/node?top={top}")
            statuses = [NodeStatus.model_validate_json(r.content) for _, r in replies if r.status == 200]
        else:
            statuses = [n.status for n in self.nodes.healthy() if n.status is not None]
        await answer_json(send, 200, aggregate.node_total(self.name, statuses, top))

    async def _history(self, send: Send) -> None:
        replies = await self.fan_out(self.nodes.healthy(), "/v1/node/history")
        histories = [NodeHistory.model_validate_json(r.content) for _, r in replies if r.status == 200]
        await answer_json(send, 200, aggregate.history_total(histories))

    def cluster_status(self) -> ClusterStatus:
        def ts(t: float | None) -> datetime | None:
            return None if t is None else datetime.fromtimestamp(t, UTC)

        nodes = [
            ClusterNode(
                name=n.name,
                url=n.url,
                health=n.health.value,
                reason=n.reason,
                since=datetime.fromtimestamp(n.changed_at, UTC),
                last_seen=ts(n.last_seen),
                routed=self.directory.count(n),
                meta=n.meta,
                placed=n.placed,
                refused=n.refused_count,
                unreachable=n.unreachable,
                status=n.status,
            )
            for n in self.nodes.nodes
        ]
        healthy = [n.status for n in self.nodes.healthy() if n.status is not None]
        total = aggregate.node_total(self.name, healthy) if healthy else None
        return ClusterStatus(gateway=__version__, nodes=nodes, total=total)

    async def _pools(self, scope: Scope, send: Send) -> None:
        replies = await self.fan_out(self.nodes.routable(), "/v1/pools")
        pools = [p for _, r in replies if r.status == 200 for p in PoolList.model_validate_json(r.content).pools]
        await answer_json(send, 200, PoolList(pools=pools))

    async def _metrics(self, scope: Scope, send: Send) -> None:
        replies = await self.fan_out(self.nodes.routable(), scope["path"])
        texts = [(n.name, r.content.decode(errors="replace")) for n, r in replies if r.status == 200]
        body = aggregate.merge_metrics(texts).encode()
        await answer(send, 200, body, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])

    async def _audit(self, scope: Scope, send: Send) -> None:
        qs = query(scope)
        params = parse_qs(qs)
        limit = AUDIT_DEFAULT_LIMIT
        with contextlib.suppress(ValueError):
            limit = int(params.get("limit", [str(limit)])[-1])
        replies = await self.fan_out(self.nodes.routable(), "/v1/audit" + (f"?{qs}" if qs else ""))
        records: list[dict[str, Any]] = []
        for _, reply in replies:
            if reply.status != 200:
                code, message, detail = reply.error()
                raise Failure.relay(reply.status, code, message, detail)
            records += json.loads(reply.content)["records"]

        # parsed, not sorted as text: "…:05Z" (no fraction) would sort after "…:05.25Z"
        def at(r: dict[str, Any]) -> datetime:
            return datetime.fromisoformat(str(r["time"]))

        records.sort(key=at)  # stable: a node's records of one microsecond keep their order
        cut = max(len(records) - limit, 0) if limit > 0 else 0
        # every node passed ``until`` on and answered whole microseconds: keep the oldest one whole too,
        # so that a client paging back with the oldest time it got skips nothing
        while 0 < cut < len(records) and at(records[cut - 1]) == at(records[cut]):
            cut -= 1
        await answer_json(send, 200, {"records": records[cut:]})

    async def _trajectories(self, scope: Scope, receive: Receive, send: Send, method: str, rest: list[str]) -> None:
        params = parse_qs(query(scope))
        if not rest and method == "GET":  # the list: every node's (with a shared log, the same ones)
            qs = query(scope)
            replies = await self.fan_out(self.nodes.routable(), "/v1/trajectories" + (f"?{qs}" if qs else ""))
            merged: dict[str, Any] = {}
            for _, reply in replies:
                if reply.status == 400:  # every node judges the query alike: refused by one, by all
                    code, message, detail = reply.error()
                    raise Failure.relay(400, code, message, detail)
                if reply.status == 200:
                    for t in TrajectoryList.model_validate_json(reply.content).trajectories:
                        if t.id not in merged or t.updated_at > merged[t.id].updated_at:
                            merged[t.id] = t
            limit = TRAJECTORY_LIST_DEFAULT
            with contextlib.suppress(ValueError):
                limit = int(params.get("limit", [str(limit)])[-1])
            ordered = sorted(merged.values(), key=lambda t: t.updated_at, reverse=True)[:limit]
            await answer_json(send, 200, TrajectoryList(trajectories=ordered))
            return
        tid = params.get("id", [""])[-1]
        node: Node | None = None
        if tid:
            home, knows = await self.directory.trajectory(tid)
            node = home or knows  # a removal must meet the node running its sandbox, which refuses it
        if node is None:
            await self.nodes.first_answers()
            node = self.nodes.primary()
        if node is None:
            raise Failure(DaemonUnreachable, "no node of the cluster is healthy now")
        content = await body_of(receive)
        await forward(node.http, scope, send, content, lambda sent: unreachable(node, sent))

    async def _to_primary(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.nodes.first_answers()
        node = self.nodes.primary()
        if node is None:
            raise Failure(DaemonUnreachable, "no node of the cluster is healthy now")
        content = await body_of(receive)
        await forward(node.http, scope, send, content, lambda sent: unreachable(node, sent))

    # ---- upkeep --------------------------------------------------------------------------------------

    def nudge(self, node: Node) -> None:
        """Check a node's health now (one check at a time per node): a refused connection is news that
        should not wait for the next poll."""
        now = time.monotonic()
        if node.retired or id(node) in self._checks or now - self._nudged.get(id(node), 0.0) < NUDGE_SPACING:
            return
        self._nudged[id(node)] = now
        task = asyncio.get_running_loop().create_task(self.nodes.check(node))
        self._checks[id(node)] = task
        task.add_done_callback(lambda _: self._checks.pop(id(node), None))

    def maybe_prune(self) -> None:
        if time.monotonic() - self._pruned > PRUNE_EVERY:
            self._pruned = time.monotonic()
            self.directory.prune()
