"""Named volumes from the SDK (a mixin of AsyncClient, so the blocking ``Client`` has it too)."""

from __future__ import annotations

import builtins
from urllib.parse import quote

from ..errors import InvalidRequest, validation_message
from ..protocol.volumes import DEFAULT_VOLUME_SIZE, VolumeCreate, VolumeInfo, VolumeList
from .transport import Transport

MKFS_TIMEOUT = 600.0


class VolumeClient:
    _transport: Transport

    async def create_volume(self, name: str, size: int | str = DEFAULT_VOLUME_SIZE) -> VolumeInfo:
        """A new, empty volume on the node, ``size`` bytes (or '10Gi') at most: mount it with
        ``Sandbox.create(volumes={"/data": name})``, or ``{"/data": (name, "ro")}`` read-only. It outlives
        the sandboxes that mount it until ``remove_volume``."""
        try:
            body = VolumeCreate.model_validate({"name": name, "size": size})
        except ValueError as e:
            raise InvalidRequest(validation_message(e)) from None
        reply = await self._transport.request("POST", "/v1/volumes", json=body.model_dump(), timeout=MKFS_TIMEOUT)
        return VolumeInfo.model_validate_json(reply.content)

    async def volumes(self) -> builtins.list[VolumeInfo]:
        """The volumes the caller may mount: its own, and the operator's (read-only for a tenant)."""
        reply = await self._transport.request("GET", "/v1/volumes")
        return VolumeList.model_validate_json(reply.content).volumes

    async def volume(self, name: str) -> VolumeInfo:
        """Its size, the bytes it takes on the node's disk, and the live sandboxes that mount it."""
        reply = await self._transport.request("GET", f"/v1/volumes/{quote(name, safe='')}")
        return VolumeInfo.model_validate_json(reply.content)

    async def remove_volume(self, name: str) -> None:
        """Delete the volume and its contents (``VolumeInUse`` while a live sandbox mounts it)."""
        await self._transport.request("DELETE", f"/v1/volumes/{quote(name, safe='')}", timeout=MKFS_TIMEOUT)
