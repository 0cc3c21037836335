"""E2B's volume control API (``Volume.create/list/get_info/connect/destroy``) on dsec's named volumes.

An E2B volume *is* a dsec volume of the API key's tenant: its id is its name (what ``volumeMounts``
names too), it is made at dsec's default size, and the core's rules hold (names, ownership, removal
refused while a sandbox mounts it). Each answer for one volume carries the token that opens its
content API (auth.py, volume_content.py) to the caller.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Response

from ..protocol.volumes import VolumeCreate, VolumeInfo
from ..tenancy import Caller
from . import control_models as m
from .control_common import Svc, Who, json_answer, parse
from .control_doc import doc
from .service import E2BService

router = APIRouter()
VolumeId = Annotated[str, Path(max_length=255)]


def _with_token(svc: E2BService, caller: Caller, info: VolumeInfo) -> m.VolumeAndToken:
    token = svc.volume_tokens.token(caller, info.name, info.created_at)
    return m.VolumeAndToken(volume_id=info.name, name=info.name, token=token)


@router.post("/volumes", **doc(201, m.VolumeAndToken, m.NewVolume, body_required=True))
async def create_volume(svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    req: m.NewVolume = parse(m.NewVolume, body)
    info = await svc.mgr.create_volume(VolumeCreate(name=req.name), caller=caller)
    return json_answer(_with_token(svc, caller, info), 201)


@router.get("/volumes", **doc(200, list[m.Volume]))
async def list_volumes(svc: Svc, caller: Who) -> Response:
    """The caller's volumes, and the operator's (which a tenant may read and mount read-only)."""
    items = [m.Volume(volume_id=v.name, name=v.name).wire().decode() for v in svc.mgr.list_volumes(caller=caller)]
    return Response("[" + ",".join(items) + "]", media_type="application/json")


@router.get("/volumes/{volume_id}", **doc(200, m.VolumeAndToken))
async def get_volume(volume_id: VolumeId, svc: Svc, caller: Who) -> Response:
    return json_answer(_with_token(svc, caller, svc.mgr.volume(volume_id, caller=caller)))


@router.delete("/volumes/{volume_id}", **doc(204))
async def delete_volume(volume_id: VolumeId, svc: Svc, caller: Who) -> Response:
    await svc.mgr.remove_volume(volume_id, caller=caller)
    return Response(status_code=204)
