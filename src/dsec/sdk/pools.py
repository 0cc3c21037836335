"""Warm pools from the SDK (a mixin of AsyncClient, so the blocking ``Client`` has it too). Operator only."""

from __future__ import annotations

import builtins
from typing import Any
from urllib.parse import quote

from ..errors import InvalidRequest, validation_message
from ..protocol.network import NetworkSpec
from ..protocol.pools import WarmPoolInfo, WarmPoolList, WarmPoolSpec
from ..protocol.sandbox import Limits
from .transport import Transport


class PoolClient:
    _transport: Transport

    async def warm_pools(self) -> builtins.list[WarmPoolInfo]:
        """Operator only: every warm pool, its idle sandboxes and its counters."""
        reply = await self._transport.request("GET", "/v1/warm-pools")
        return WarmPoolList.model_validate_json(reply.content).pools

    async def set_warm_pool(
        self,
        name: str,
        image: str,
        size: int,
        *,
        kind: str = "container",
        limits: Limits | dict[str, Any] | None = None,
        network: NetworkSpec = None,
        tenant: str | None = None,
    ) -> WarmPoolInfo:
        """Operator only: keep ``size`` idle sandboxes of this image, kind, limits and network policy for
        ``tenant``'s creations (default: the operator's); a creation asking for exactly that is handed one."""
        body = {
            "image": image,
            "kind": kind,
            "limits": limits if limits is not None else Limits(),
            "network": network,
            "tenant": tenant,
        }
        try:  # a clear error before the round trip
            spec = WarmPoolSpec.model_validate({**body, "size": size})
        except ValueError as e:
            raise InvalidRequest(validation_message(e)) from None
        reply = await self._transport.request(
            "PUT", f"/v1/warm-pools/{quote(name, safe='')}", json=spec.model_dump(mode="json", exclude_none=True)
        )
        return WarmPoolInfo.model_validate_json(reply.content)

    async def remove_warm_pool(self, name: str) -> None:
        """Operator only: remove the pool and kill its idle sandboxes."""
        await self._transport.request("DELETE", f"/v1/warm-pools/{quote(name, safe='')}")
