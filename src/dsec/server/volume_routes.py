"""Named volumes: made, listed, inspected and removed by their owners (a tenant: its own, and the
operator's read-only ones in lists; the operator: all)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..protocol.volumes import VolumeCreate, VolumeInfo, VolumeList, VolumeName
from .auth import CallerDep
from .routes import _ERRORS, Mgr

router = APIRouter(prefix="/v1", responses=_ERRORS)


@router.post("/volumes", response_model=VolumeInfo, status_code=201)
async def create_volume(body: VolumeCreate, mgr: Mgr, caller: CallerDep) -> VolumeInfo:
    """A new, empty volume of ``size`` bytes on this node (409 volume_exists if the name is taken)."""
    return await mgr.create_volume(body, caller=caller)


@router.get("/volumes", response_model=VolumeList)
async def list_volumes(mgr: Mgr, caller: CallerDep) -> VolumeList:
    """The volumes the caller may mount: its own and the operator's (every one, for the operator)."""
    return VolumeList(volumes=mgr.list_volumes(caller=caller))


@router.get("/volumes/{name}", response_model=VolumeInfo)
async def volume_info(name: VolumeName, mgr: Mgr, caller: CallerDep) -> VolumeInfo:
    """Its size, the bytes it takes on the node's disk, and the live sandboxes that mount it."""
    return mgr.volume(name, caller=caller)


@router.delete("/volumes/{name}", status_code=204)
async def remove_volume(name: VolumeName, mgr: Mgr, caller: CallerDep) -> Response:
    """Delete the volume and everything on it; refused (409 volume_in_use) while a live sandbox mounts it."""
    await mgr.remove_volume(name, caller=caller)
    return Response(status_code=204)
