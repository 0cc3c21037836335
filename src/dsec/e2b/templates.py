"""E2B's template build API (``Template.build``, ``build_in_background``, ``get_build_status``, ``exists``,
tags) on dsec's image builds.

An E2B template is a name of the API key's tenant whose builds are dsec images (template_store.py);
a build's steps become a Dockerfile that dsec's Dockerfile builder runs (template_plan.py,
template_builds.py). ``Sandbox.create("name")``, ``"name:tag"`` or the template's id then creates from
the image the tag names.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from contextvars import ContextVar
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path, Query, Request, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import ImageExists, ImageInUse, InvalidRequest
from ..tenancy import Caller
from ..web.auth import CALLER
from . import template_models as tm
from .control_common import Svc, Who, json_answer, parse
from .control_doc import doc
from .control_snapshots import delete_snapshot
from .errors import control_error
from .service import DEFAULT_TEMPLATE, E2BService
from .template_builds import TemplateBuilds
from .template_store import Template, TemplateStore, check_name, check_tag, split_name

LEVELS = ("debug", "info", "warn", "error")
TemplateId = Annotated[str, Path(max_length=512)]
BuildId = Annotated[str, Path(pattern=r"^[0-9a-f-]{36}$")]
FilesHash = Annotated[str, Path(pattern=tm.HASH)]


class E2BTemplates:
    """The templates of one E2B listener: their store and their builds."""

    def __init__(self, svc: E2BService, state_dir: FsPath, key: bytes) -> None:
        root = state_dir / "e2b-templates"
        self.store = TemplateStore(root / "templates.json")
        self.builds = TemplateBuilds(svc, self.store, root, key)
        self.svc = svc
        svc.built = self.image_for  # Sandbox.create of a template's name, name:tag or id

    def image_for(self, ref: str) -> str | None:
        """The image of the template ``ref`` names, for the request being answered: a template the caller
        may not use is none, so that no tenant's name changes what another tenant's name means."""
        scope = REQUEST.get()
        caller = scope.get("state", {}).get(CALLER) if scope is not None else None
        found = self.store.find(ref)
        if not isinstance(caller, Caller) or found is None or not caller.sees(found[0].owner):
            return None
        return self.store.image_for(ref)

    def reserved(self, name: str) -> bool:
        return name == DEFAULT_TEMPLATE or name in self.svc.options.templates


REQUEST: ContextVar[MutableMapping[str, Any] | None] = ContextVar("dsec_e2b_request", default=None)


class RequestScope:
    """Keeps the request's ASGI scope where E2BTemplates.image_for finds its caller (named in the scope
    by the routes' API key check) when a sandbox is created from a template."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = REQUEST.set(scope)
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST.reset(token)


def templates(request: Request) -> E2BTemplates:
    found: E2BTemplates = request.app.state.e2b_templates
    return found


Tpl = Annotated[E2BTemplates, Depends(templates)]
router = APIRouter()


def _tags(template: Template | None, name: str, tags: list[str]) -> list[str]:
    """Tags as E2B's SDK sends them: ``tag`` or ``name:tag`` of the same template."""
    out = []
    for raw in tags:
        tag_name, tag = split_name(raw)
        if tag is None:
            tag, tag_name = raw, name
        if tag_name != name:
            raise InvalidRequest(f"tag {raw[:80]!r} names another template than {name!r}")
        out.append(check_tag(tag))
    return list(dict.fromkeys(out))


@router.post("/v3/templates", **doc(202, tm.TemplateRequested, tm.NewTemplate, body_required=True))
async def request_build(tpl: Tpl, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    req: tm.NewTemplate = parse(tm.NewTemplate, body)
    ref = req.name or req.alias
    if not ref:
        raise InvalidRequest("a template build needs a name")
    name, tag = split_name(ref)
    check_name(name)
    if tpl.reserved(name):
        raise InvalidRequest(f"template name {name!r} is one of the node's own templates (base, --e2b-template)")
    tags = _tags(None, name, [*([tag] if tag else []), *(req.tags or [])]) or [tm.DEFAULT_TAG]
    try:
        template, build = tpl.store.new_build(name, tags, caller)
    except ImageExists as e:
        return control_error(e, 409)
    answer = tm.TemplateRequested(
        template_id=template.id, build_id=build.id, names=[name], tags=tags, aliases=[name], public=False
    )
    return json_answer(answer, 202)


@router.get("/templates/{template_id}/files/{files_hash}", **doc(201, tm.FileUpload))
async def file_upload_link(
    template_id: TemplateId, files_hash: FilesHash, request: Request, tpl: Tpl, caller: Who
) -> Response:
    template, _ = tpl.store.own(template_id, caller)
    if tpl.builds.has_upload(template.owner, files_hash):
        return json_answer(tm.FileUpload(present=True), 201)
    url = tpl.builds.upload_link(str(request.base_url), template.id, files_hash)
    return json_answer(tm.FileUpload(present=False, url=url), 201)


@router.put("/e2b-template-files/{template_id}/{files_hash}/{expires}/{sig}/build-contexts", **doc(200))
async def upload_files(
    template_id: Annotated[str, Path(pattern=r"^[a-z0-9]{20}$")],
    files_hash: FilesHash,
    expires: int,
    sig: Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")],
    request: Request,
    tpl: Tpl,
) -> Response:
    """A step's files (a tar, gzipped or not), PUT by the SDK to the link it was given; the link is the
    only credential, as E2B's presigned storage links are."""
    template = tpl.builds.check_link(template_id, files_hash, expires, sig)
    await tpl.builds.put_upload(template.owner, files_hash, await request.body())
    return Response(status_code=200)


@router.post("/v2/templates/{template_id}/builds/{build_id}", **doc(202, None, tm.BuildStart, body_required=True))
async def start_build(
    template_id: TemplateId, build_id: BuildId, tpl: Tpl, caller: Who, body: Annotated[Any, Body()] = None
) -> Response:
    req: tm.BuildStart = parse(tm.BuildStart, body)
    template, _ = tpl.store.own(template_id, caller)
    build = template.builds.get(build_id)
    if build is None:
        return control_error(InvalidRequest(f"template {template.name!r} has no build {build_id}"), 404)
    tpl.builds.start(template, build, req, caller)
    return Response(status_code=202)


@router.get("/templates/{template_id}/builds/{build_id}/status", **doc(200, tm.BuildInfo))
async def build_status(
    template_id: TemplateId,
    build_id: BuildId,
    tpl: Tpl,
    caller: Who,
    logs_offset: Annotated[int, Query(alias="logsOffset", ge=0)] = 0,
    limit: Annotated[int, Query(ge=0, le=100)] = 100,
    level: Annotated[str | None, Query(pattern=r"^(debug|info|warn|error)$")] = None,
) -> Response:
    template, _ = tpl.store.own(template_id, caller)  # a build's log is its owner's, even of a shared template
    build = template.builds.get(build_id)
    if build is None:
        return control_error(InvalidRequest(f"template {template.name!r} has no build {build_id}"), 404)
    entries = tpl.builds.log_of(build.id).entries
    if level is not None:
        entries = [e for e in entries if LEVELS.index(e.level) >= LEVELS.index(level)]
    reason = None
    if build.status == "error":
        tail = [e for e in entries if e.level == "error"][-10:]
        reason = tm.StatusReason(message=build.reason or "the build failed", step=build.step, log_entries=tail)
    info = tm.BuildInfo(
        log_entries=entries[logs_offset : logs_offset + limit],
        template_id=template.id,
        build_id=build.id,
        status=build.status,
        reason=reason,
    )
    return json_answer(info)


@router.get("/templates/aliases/{alias}", **doc(200, tm.AliasFound))
async def alias(alias: TemplateId, tpl: Tpl, caller: Who) -> Response:
    """Whether a name is a template the caller may use (``Template.exists``): the node's own (``base``,
    ``--e2b-template``), or one of the caller's or the operator's. Another tenant's is not found."""
    if tpl.reserved(alias):
        return json_answer(tm.AliasFound(template_id=alias, public=True))
    template, _ = tpl.store.visible(alias, caller)
    return json_answer(tm.AliasFound(template_id=template.id, public=template.owner is None))


@router.post("/templates/tags", **doc(201, tm.AssignedTags, tm.AssignTags, body_required=True))
async def assign_tags(tpl: Tpl, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    req: tm.AssignTags = parse(tm.AssignTags, body)
    template, tag = tpl.store.own(req.target, caller)
    build = tpl.store.build_of(template, tag)
    tags = _tags(template, template.name, req.tags)
    tpl.store.assign(template, build, tags)
    return json_answer(tm.AssignedTags(tags=tags, build_id=build.id), 201)


@router.delete("/templates/tags", **doc(204, None, tm.RemoveTags, body_required=True))
async def remove_tags(tpl: Tpl, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    req: tm.RemoveTags = parse(tm.RemoveTags, body)
    template, _ = tpl.store.own(req.name, caller)
    tpl.store.remove_tags(template, _tags(template, template.name, req.tags))
    return Response(status_code=204)


@router.delete("/templates/{template_id}", **doc(204))
async def delete_template(template_id: TemplateId, tpl: Tpl, svc: Svc, caller: Who) -> Response:
    """A template and its builds' images (refused while a sandbox or another template's build uses one);
    any other name is a snapshot's, deleted as control.py deletes them."""
    if tpl.store.find(template_id) is None:
        return await delete_snapshot(template_id, svc, caller)
    template, _ = tpl.store.own(template_id, caller)
    if any(b.id in tpl.builds.tasks for b in template.builds.values()):
        raise InvalidRequest(f"template {template.name!r} is being built; delete it when the build ends")
    images = {template.image(b.id): b.id for b in template.builds.values() if b.status == "ready"}
    if await tpl.builds.in_use(list(images)):
        raise ImageInUse(f"template {template.name!r} is used by a live sandbox; kill it first")
    kept = await tpl.builds.remove_images(list(images), caller)
    if kept:
        tpl.store.forget(template, [build for image, build in images.items() if image not in kept])
        raise ImageInUse(f"template {template.name!r} is another template's base; delete that one first")
    tpl.store.delete(template)
    return Response(status_code=204)


@router.get("/templates/{template_id}/tags", **doc(200, list[tm.TagInfo]))
async def list_tags(template_id: TemplateId, tpl: Tpl, caller: Who) -> Response:
    template, _ = tpl.store.visible(template_id, caller)
    items = [
        tm.TagInfo(tag=tag, build_id=tagged.build, created_at=tagged.at).wire().decode()
        for tag, tagged in sorted(template.tags.items())
    ]
    return Response("[" + ",".join(items) + "]", media_type="application/json")
