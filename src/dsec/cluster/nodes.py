"""The node daemons behind a gateway: one pooled HTTP client each, their health, their last status.

Health is polled with ``GET /v1/node`` (every ``interval`` seconds): an answer makes a node healthy and
refreshes the figures placement works from; a miss makes it suspect (routed to, never placed on);
``misses`` misses in a row make it lost. Losing a node closes its client, which fails every request
still waiting on it at once instead of leaving callers hanging on a dead peer. A lost node that answers
again is healthy again: what its sandboxes are is then the node's word, as for any node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from ..protocol.node import NodeStatus
from .placement import Demand, NodeView, candidates
from .wire import NodeClient

log = logging.getLogger("dsec.cluster")


class Health(StrEnum):
    starting = "starting"  # not answered yet
    healthy = "healthy"
    suspect = "suspect"  # missed a health check: still routed to, not placed on
    lost = "lost"


@dataclass(eq=False)
class Node:
    url: str
    token: str
    name: str = ""  # given, else learned from the node's status
    http: NodeClient = field(init=False)
    health: Health = Health.starting
    status: NodeStatus | None = None
    misses: int = 0
    reason: str | None = None  # why it was lost
    changed_at: float = field(default_factory=time.time)
    last_seen: float | None = None
    retired: bool = False  # no longer polled (Ray says the node is gone)
    meta: dict[str, str] = field(default_factory=dict)  # e.g. the Ray node id
    placed: int = 0  # creations it took
    refused_count: int = 0  # creations it answered 429 (sent on to another node)
    unreachable: int = 0  # creations that could not reach it or broke off (sent on when safe)
    # Creations sent here that its last status may not count yet: (demand, count, when the node
    # answered or None while in flight). A status asked for after that answer counts them.
    _holds: dict[int, tuple[Demand, int, float | None]] = field(default_factory=dict)
    _next_hold: int = 0
    _full: bool = False  # refused a creation since its last status

    def __post_init__(self) -> None:
        self.name = self.name or self.url
        self.http = NodeClient(self.url, self.token)

    @property
    def lost(self) -> bool:
        return self.health is Health.lost

    @property
    def routable(self) -> bool:
        return self.health in (Health.healthy, Health.suspect)

    def placement_view(self) -> NodeView | None:
        """The node as placement sees it: its last status, less the creations it may not count yet."""
        if self.status is None:
            return None
        view = NodeView.of(self.status, healthy=self.health is Health.healthy, name=self.name)
        for demand, count, _ in self._holds.values():
            view.reserve(demand, count)
        if self._full:
            view.refused()
        return view

    def hold(self, demand: Demand, count: int = 1) -> int:
        self._next_hold += 1
        self._holds[self._next_hold] = (demand, count, None)
        return self._next_hold

    def settle(self, key: int, admitted: int | None = None) -> None:
        """The node answered the creations of hold ``key``: ``admitted`` of them (default all) were."""
        demand, count, _ = self._holds.pop(key, (None, 0, None))
        n = count if admitted is None else admitted
        if demand is not None and n > 0:
            self._holds[key] = (demand, n, time.monotonic())

    def release(self, key: int) -> None:
        self._holds.pop(key, None)

    def refused(self) -> None:
        self._full = True

    def lost_reason(self) -> str:
        return f"node {self.name} was lost: {self.reason or 'it stopped answering'}"

    def _set(self, health: Health) -> None:
        if health is not self.health:
            self.health = health
            self.changed_at = time.time()

    def seen(self, status: NodeStatus, asked_at: float | None = None) -> None:
        if self.health is Health.lost:
            log.warning("node %s answers again; placing on it again", self.name)
        elif self.health is Health.starting:
            log.info("node %s (%s) is up", status.node, self.url)
        self.status = status
        self.name = status.node or self.name
        self._full = False
        if asked_at is not None:  # what the node had answered before it was asked, it counts now
            self._holds = {k: h for k, h in self._holds.items() if h[2] is None or h[2] > asked_at}
        self.misses = 0
        self.reason = None
        self.last_seen = time.time()
        self._set(Health.healthy)

    def missed(self, why: str, threshold: int) -> bool:
        """Count a failed health check; True when it makes the node lost."""
        self.misses += 1
        if self.health is Health.lost:
            return False
        if self.misses >= threshold:
            self.lose(f"no answer to {self.misses} health checks in a row ({why})")
            return True
        if self.health is Health.healthy:
            log.warning("node %s missed a health check: %s", self.name, why)
            self._set(Health.suspect)
        return False

    def lose(self, reason: str) -> None:
        if self.health is Health.lost:
            return
        log.error("node %s (%s) is lost: %s", self.name, self.url, reason)
        self.reason = reason
        self._set(Health.lost)
        old, self.http = self.http, NodeClient(self.url, self.token)
        # closing the pool fails the requests still waiting on the node now (ReadError), not at a timeout
        task = asyncio.get_running_loop().create_task(old.aclose())
        _background.add(task)
        task.add_done_callback(_background.discard)


_background: set[asyncio.Task[None]] = set()


class NodeSet:
    """Every node a gateway knows, lost ones included (their sandboxes still answer ``lost``)."""

    def __init__(self, token: str, *, interval: float = 1.0, misses: int = 3) -> None:
        self.token = token
        self.interval = interval
        self.threshold = misses
        self.nodes: list[Node] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def add(self, url: str, name: str = "", **meta: str) -> Node:
        for n in self.nodes:
            if n.url == url and not n.retired:
                return n
        node = Node(url=url, token=self.token, name=name, meta=dict(meta))
        self.nodes.append(node)
        return node

    def by_name(self, name: str) -> Node | None:
        return next((n for n in self.nodes if n.name == name), None)

    def routable(self) -> list[Node]:
        return [n for n in self.nodes if n.routable]

    def healthy(self) -> list[Node]:
        return [n for n in self.nodes if n.health is Health.healthy]

    def primary(self) -> Node | None:
        """Where node-level calls go (image builds, reads of shared state): the first healthy node by
        name, so that an upload and the build that uses it meet on the same node."""
        nodes = sorted(self.healthy(), key=lambda n: n.name) or sorted(self.routable(), key=lambda n: n.name)
        return nodes[0] if nodes else None

    async def first_answers(self) -> None:
        """Wait (at most one health check's time) for the nodes not heard from yet: a gateway just started
        has asked them but may not have their answers, and a creation sent then must not be refused for
        that. Returns at once when every node has answered or been lost."""
        deadline = time.monotonic() + self.check_timeout + self.interval
        while any(n.health is Health.starting and not n.retired for n in self.nodes):
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.02)

    @property
    def check_timeout(self) -> float:
        return max(self.interval * 2, 1.0)

    def candidates(self, demand: Demand) -> list[Node]:
        views = [v for n in self.nodes if (v := n.placement_view()) is not None]
        by_name = {n.name: n for n in self.nodes if n.health is Health.healthy}
        return [by_name[name] for name in candidates(views, demand) if name in by_name]

    def retire(self, node: Node, reason: str) -> None:
        """The node is gone for good (its Ray node died): lost, and no longer polled."""
        node.lose(reason)
        node.retired = True

    # ---- health --------------------------------------------------------------------------------------

    async def check(self, node: Node) -> None:
        try:
            asked_at = time.monotonic()
            reply = await node.http.request("GET", "/v1/node", timeout=self.check_timeout)
            if reply.status != 200:
                raise RuntimeError(f"GET /v1/node answered HTTP {reply.status}")
            node.seen(NodeStatus.model_validate_json(reply.content), asked_at)
            if any(n is not node and n.name == node.name for n in self.nodes):
                # two daemons with one name (the default is the host name): placement and the lost
                # reasons need them apart
                node.name = f"{node.name}@{node.url}"
        except Exception as e:  # any failure is a miss: the node's word is all that counts
            first = str(e).splitlines()[0] if str(e) else ""
            node.missed(f"{type(e).__name__}: {first}" if first else type(e).__name__, self.threshold)

    async def check_all(self, nodes: Iterable[Node] | None = None) -> None:
        todo = [n for n in (self.nodes if nodes is None else nodes) if not n.retired]
        await asyncio.gather(*(self.check(n) for n in todo))

    async def _poll(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            await self.check_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), max(0.0, self.interval - (time.monotonic() - started)))

    def start(self) -> None:
        if self._task is None:
            self._stopping.clear()
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def close(self) -> None:
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
            self._task = None
        await asyncio.gather(*(n.http.aclose() for n in self.nodes), return_exceptions=True)
