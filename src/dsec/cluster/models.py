"""Wire models of the gateway's own routes (``GET /v1/cluster``)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from ..protocol.node import NodeStatus


class ClusterNode(BaseModel):
    name: str
    url: str
    health: str = Field(description="starting, healthy, suspect (missed a health check: not placed on) or lost.")
    reason: str | None = Field(None, description="Why the node was lost.")
    since: datetime = Field(description="When the health last changed.")
    last_seen: datetime | None = Field(None, description="The last answered health check.")
    routed: int = Field(description="Sandboxes the gateway knows to be on this node.")
    meta: dict[str, str] = Field(default_factory=dict, description="E.g. the Ray node id.")
    placed: int = Field(0, description="Creations (single and batched) this node took.")
    refused: int = Field(0, description="Creations it refused for capacity (429), sent on to other nodes.")
    unreachable: int = Field(0, description="Creations that could not reach it or broke off on the way.")
    status: NodeStatus | None = Field(None, description="The node's last GET /v1/node answer.")


class ClusterStatus(BaseModel):
    gateway: str = Field(description="The gateway's version.")
    nodes: list[ClusterNode]
    total: NodeStatus | None = Field(None, description="The healthy nodes' figures summed.")
