"""E2B's snapshots: a sandbox's filesystem as a new image (dsec's pack_diff snapshot), listed, deleted and
named as a template by later creations; and forks (VM kinds).

A snapshot is any image the caller may change that was taken of a sandbox (its ``source_sandbox``).
E2B's snapshots also keep memory; dsec's keep the filesystem, which is what a sandbox created from one
starts with.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import Body, Query, Response

from ..errors import ERRORS_BY_CODE, DsecError, NotFound
from ..protocol.names import ImageName
from ..protocol.sandbox import ForkRequest, ImageInfo, SnapshotRequest
from . import control_models as m
from .control_common import (
    MAX_PAGE,
    Svc,
    Who,
    json_answer,
    live_info,
    page_after,
    page_token,
    parse,
    router,
    sandbox_model,
)
from .control_doc import doc
from .errors import plain_error


@router.post("/sandboxes/{sandbox_id}/snapshots", **doc(201, m.SnapshotInfo, m.SnapshotRequest))
async def snapshot(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    """pack_diff: the sandbox's changes become a new image, which a create can name as its template."""
    req: m.SnapshotRequest = parse(m.SnapshotRequest, body)
    live_info(svc, sandbox_id, caller)
    name = req.name or f"e2b-snapshots/{sandbox_id}:{int(time.time() * 1000)}"
    rec = svc.mgr.record(sandbox_id, caller=caller)
    image = await svc.call(rec, "snapshot", SnapshotRequest(name=name), caller=caller)
    return json_answer(m.SnapshotInfo(snapshot_id=image.name, names=[image.name]), 201)


def _named(image: ImageInfo, name: str) -> bool:
    """E2B's name filter: the snapshot's name or id, with or without its tag."""
    repo = image.name.rsplit(":", 1)[0] if ":" in image.name.rsplit("/", 1)[-1] else image.name
    return name in (image.name, repo)


def _key(image: ImageInfo) -> tuple[float, str]:
    return (image.created_at.timestamp() if image.created_at else 0.0, image.name)


@router.get("/snapshots", **doc(200, list[m.SnapshotInfo]))
async def list_snapshots(
    svc: Svc,
    caller: Who,
    sandbox_id: Annotated[str | None, Query(alias="sandboxID", max_length=64)] = None,
    name: Annotated[str | None, Query(max_length=256)] = None,
    next_token: Annotated[str | None, Query(alias="nextToken", max_length=1024)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
) -> Response:
    """The caller's snapshots, newest first, by the sandbox they were taken of and by name."""
    found = [
        i
        for i in await svc.mgr.images.list(caller)
        if i.source_sandbox is not None
        and caller.owns(i.owner)
        and (sandbox_id is None or i.source_sandbox == sandbox_id)
        and (not name or _named(i, name))
    ]
    found.sort(key=_key, reverse=True)
    if next_token:
        after = page_after(next_token)
        found = [i for i in found if _key(i) < after]
    page = found[:limit]
    body = "[" + ",".join(m.SnapshotInfo(snapshot_id=i.name, names=[i.name]).wire().decode() for i in page) + "]"
    headers = {"x-next-token": page_token(*_key(page[-1]))} if len(found) > limit else {}
    return Response(body, media_type="application/json", headers=headers)


@router.delete("/templates/{template_id:path}", **doc(204))
async def delete_snapshot(template_id: ImageName, svc: Svc, caller: Who) -> Response:
    """Delete a snapshot (or any image of the caller's): its name is freed."""
    try:
        await svc.mgr.remove_image(template_id, caller=caller)
    except NotFound:
        return plain_error(404, f"no snapshot or template {template_id!r}")
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/fork", **doc(201, list[m.ForkResult], m.ForkRequest))
async def fork(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    """One entry per copy asked, a sandbox or its error. VM kinds: restored from one memory snapshot (all or
    none in dsec); containers: copies of the files, each made or failed on its own."""
    req: m.ForkRequest = parse(m.ForkRequest, body)
    live_info(svc, sandbox_id, caller)
    result = await svc.mgr.fork(
        sandbox_id, ForkRequest(n=req.count, timeout=float(req.timeout) if req.timeout else None), caller=caller
    )
    failed = {f.index: f.error for f in result.failed}
    made = iter(result.sandboxes)
    items = []
    for i in range(req.count):
        if i in failed:
            status = ERRORS_BY_CODE.get(failed[i].code, DsecError).http_status
            item = m.ForkResult(error=m.ForkError(code=status, message=failed[i].message))
        else:
            item = m.ForkResult(sandbox=sandbox_model(svc, next(made)))
        items.append(item.wire().decode())
    return Response("[" + ",".join(items) + "]", status_code=201, media_type="application/json")
