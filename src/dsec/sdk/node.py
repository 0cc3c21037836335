"""The node's capacity and tenant quotas from the SDK (a mixin of AsyncClient, so ``Client`` has it too)."""

from __future__ import annotations

from urllib.parse import quote

from ..protocol.node import NodeStatus, TenantQuota
from .transport import Transport


class NodeClient:
    _transport: Transport

    async def node(self, top: int = 0) -> NodeStatus:
        """The node's capacity, oversubscription, admitted requests, queue and measured use; with ``top``,
        the caller's sandboxes using the most CPU."""
        reply = await self._transport.request("GET", "/v1/node", params={"top": top}, timeout=30)
        return NodeStatus.model_validate_json(reply.content)

    async def metrics(self) -> str:
        """The node's Prometheus metrics, as text (a tenant's token: its own sandboxes and pools only)."""
        reply = await self._transport.request("GET", "/metrics", timeout=30)
        return reply.text

    async def quota(self, tenant: str) -> TenantQuota:
        """Operator only: what ``tenant`` may hold on the node at once."""
        reply = await self._transport.request("GET", f"/v1/tenants/{quote(tenant, safe='')}/quota")
        return TenantQuota.model_validate_json(reply.content)

    async def set_quota(
        self, tenant: str, *, sandboxes: int | None = None, cpu: float | None = None, memory: int | str | None = None
    ) -> TenantQuota:
        """Operator only: bound what ``tenant`` may hold at once (None: no bound of its own). Creations
        past it wait in the tenant's queue, then get 429, like creations past the node's capacity."""
        body = TenantQuota.model_validate({"sandboxes": sandboxes, "cpu": cpu, "memory": memory})
        reply = await self._transport.request(
            "PUT", f"/v1/tenants/{quote(tenant, safe='')}/quota", json=body.model_dump(exclude_none=True)
        )
        return TenantQuota.model_validate_json(reply.content)
