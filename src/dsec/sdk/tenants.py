"""Tenants and the audit log from the SDK (a mixin of AsyncClient, so the blocking ``Client`` has it too)."""

from __future__ import annotations

import builtins
from datetime import datetime
from urllib.parse import quote

from ..protocol.sandbox import AuditList, AuditRecord, TenantCreated, TenantInfo, TenantList, TenantRemoved
from .transport import Transport


class TenantClient:
    _transport: Transport

    async def create_tenant(self, name: str) -> TenantCreated:
        """Operator only: a new tenant and its bearer token, which is shown this once."""
        reply = await self._transport.request("POST", "/v1/tenants", json={"name": name})
        return TenantCreated.model_validate_json(reply.content)

    async def tenants(self) -> builtins.list[TenantInfo]:
        """Operator only: every tenant, removed ones included."""
        reply = await self._transport.request("GET", "/v1/tenants")
        return TenantList.model_validate_json(reply.content).tenants

    async def remove_tenant(self, name: str) -> TenantRemoved:
        """Operator only: revoke the tenant's token and kill its live sandboxes."""
        reply = await self._transport.request("DELETE", f"/v1/tenants/{quote(name, safe='')}")
        return TenantRemoved.model_validate_json(reply.content)

    async def audit(
        self,
        *,
        sandbox: str | None = None,
        tenant: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 100,
    ) -> builtins.list[AuditRecord]:
        """The newest ``limit`` audited API calls, oldest first: the caller's own (the operator: everyone's,
        or ``tenant``'s); ``until``: only those before it (page back with the oldest ``time`` received)."""
        params: dict[str, str | int] = {"limit": limit}
        if sandbox is not None:
            params["sandbox"] = sandbox
        if tenant is not None:
            params["tenant"] = tenant
        if since is not None:
            params["since"] = since.isoformat()
        if until is not None:
            params["until"] = until.isoformat()
        reply = await self._transport.request("GET", "/v1/audit", params=params)
        return AuditList.model_validate_json(reply.content).records
