"""Which node holds which sandbox, and what each sandbox last looked like.

The map lives in the gateway's memory: it learns from every answer that names a sandbox (creates,
lists, forks, lookups) and, for an id it does not know (a gateway restarted, a sandbox made on a node
directly), asks every reachable node once. What a sandbox last looked like is kept so that the
sandboxes of a lost node can still answer ``lost``, with the reason, when their node cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

from pydantic import ValidationError

from ..protocol.sandbox import TERMINAL_STATES, SandboxInfo, State
from ..protocol.trajectory import TrajectoryInfo
from .nodes import Node, NodeSet
from .wire import Broken, Reply

LOOKUP_TIMEOUT = 10.0
FORGET_AFTER = timedelta(hours=1)  # a finished (or expired) sandbox's entry is dropped this long after


@dataclass
class Entry:
    node: Node
    info: SandboxInfo


async def first_ok(nodes: list[Node], url: str, timeout: float = LOOKUP_TIMEOUT) -> tuple[Node, Reply] | None:
    """The first node answering ``GET url`` with 200 (the others are not waited for)."""

    async def one(node: Node) -> tuple[Node, Reply] | None:
        with contextlib.suppress(Broken):
            reply = await node.http.request("GET", url, timeout=timeout)
            if reply.status == 200:
                return node, reply
        return None

    tasks = [asyncio.ensure_future(one(n)) for n in nodes]
    try:
        for done in asyncio.as_completed(tasks):
            found = await done
            if found is not None:
                return found
        return None
    finally:
        for t in tasks:
            t.cancel()


class Directory:
    def __init__(self, nodes: NodeSet) -> None:
        self.nodes = nodes
        self.entries: dict[str, Entry] = {}

    def record(self, node: Node, info: SandboxInfo) -> None:
        self.entries[info.id] = Entry(node, info)

    def record_json(self, node: Node, content: bytes) -> SandboxInfo | None:
        try:
            info = SandboxInfo.model_validate_json(content)
        except ValidationError:
            return None
        self.record(node, info)
        return info

    def forget(self, sandbox_id: str) -> None:
        self.entries.pop(sandbox_id, None)

    def node_of(self, sandbox_id: str) -> Node | None:
        entry = self.entries.get(sandbox_id)
        return entry.node if entry else None

    def count(self, node: Node) -> int:
        return sum(1 for e in self.entries.values() if e.node is node and e.info.state not in TERMINAL_STATES)

    async def locate(self, sandbox_id: str) -> Node | None:
        """The node holding the sandbox: known, or found by asking every reachable node."""
        node = self.node_of(sandbox_id)
        if node is not None:
            return node
        # the id as the client's path had it (percent-encoded): a decoded one may hold '/', '?' or what
        # a request line cannot carry
        found = await first_ok(self.nodes.routable(), f"/v1/sandboxes/{quote(sandbox_id, safe='')}")
        if found is None:
            return None
        node, reply = found
        self.record_json(node, reply.content)
        return node

    @staticmethod
    def as_lost(entry: Entry) -> SandboxInfo:
        """What a sandbox of a lost node is: lost with its node's reason, unless it had finished before."""
        info = entry.info
        if info.state in TERMINAL_STATES:
            return info
        return info.model_copy(update={"state": State.lost, "reason": entry.node.lost_reason(), "waiting": None})

    def lost_infos(self, include_finished: bool, labels: dict[str, str]) -> list[SandboxInfo]:
        """The sandboxes of lost nodes, for lists (a lost sandbox is finished: only ``all`` lists show it)."""
        if not include_finished:
            return []
        out = []
        for entry in self.entries.values():
            if entry.node.lost and all(entry.info.labels.get(k) == v for k, v in labels.items()):
                out.append(self.as_lost(entry))
        return out

    def prune(self, now: float | None = None) -> int:
        """Forget sandboxes long finished or long expired: the map must not grow without bound."""
        cutoff = datetime.fromtimestamp(now if now is not None else time.time(), UTC) - FORGET_AFTER
        stale = [
            sid
            for sid, e in self.entries.items()
            if e.info.expires_at < cutoff or (e.info.state in TERMINAL_STATES and e.info.created_at < cutoff)
        ]
        for sid in stale:
            del self.entries[sid]
        return len(stale)

    async def trajectory(self, trajectory_id: str) -> tuple[Node | None, Node | None]:
        """(the node whose live sandbox the trajectory is bound to, if reachable; a node that knows the
        trajectory). With a shared trajectory log every node knows every trajectory; without one only
        the node that recorded it does, so every reachable node is asked."""
        found = await first_ok(self.nodes.routable(), f"/v1/trajectories/info?id={quote(trajectory_id, safe='')}")
        if found is None:
            return None, None
        knows, reply = found
        try:
            sandbox_id = TrajectoryInfo.model_validate_json(reply.content).sandbox_id
        except ValidationError:
            return None, knows
        home = await self.locate(sandbox_id)
        return (home if home is not None and home.routable else None), knows


def labels_of(query: dict[str, list[str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in query.get("label", []):
        key, _, value = item.partition("=")
        out[key] = value
    return out
