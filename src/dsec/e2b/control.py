"""E2B's control API (the sandbox lifecycle, ``E2B_API_URL``), translated to the core's actions.

A sandbox is an ordinary dsec sandbox: the E2B template names its image (and kind), the E2B metadata
is its labels, the E2B timeout its time to live. What E2B offers and dsec cannot honour is refused
with a 400 that says so (see docs/e2b.md), never silently dropped.
"""

from __future__ import annotations

import math
import time
import urllib.parse
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import Body, Header, Query, Request, Response
from pydantic import ValidationError, WithJsonSchema

from ..errors import InvalidRequest, validation_message
from ..protocol.sandbox import CreateSandbox, Limits, SandboxInfo, State
from ..protocol.types import MAX_LABELS, TIME_SCHEMA
from ..protocol.volumes import Mode
from ..tenancy import Caller
from ..web import telemetry
from ..web.audit import note
from ..web.disconnect import GONE, gone_response, unless_gone
from . import control_models as m
from .control_common import (
    MAX_PAGE,
    UNSUPPORTED,
    Svc,
    Who,
    live_info,
    page_after,
    page_token,
    parse,
    sandbox_model,
)
from .control_common import json_answer as json_answer
from .control_common import router as router
from .control_common import service as service
from .control_doc import add_bodies, doc
from .control_lifecycle import META_AUTO_RESUME, lifecycle_of, on_timeout
from .control_network import network_spec as network_spec
from .control_snapshots import list_snapshots as list_snapshots  # its routes register on the router
from .errors import plain_error
from .hosts import META_MASK_HOST, META_PUBLIC_TRAFFIC, check_mask
from .service import (
    META_CPU,
    META_DISK,
    META_MEMORY,
    META_TEMPLATE,
    META_TRAJECTORY,
    E2BService,
)

META_E2B = "dsec.e2b."  # labels of this layer's own (the template, auto-resume): not the sandbox's metadata

STATES = r"^ *(running|paused)? *(, *(running|paused)? *)*$"  # as E2B's SDK sends them: 'running,paused'


# ---- translation -------------------------------------------------------------------------------------


def _limits(metadata: dict[str, str]) -> Limits:
    fields: dict[str, Any] = {}
    for key, field in ((META_CPU, "cpu"), (META_MEMORY, "memory"), (META_DISK, "disk")):
        if key in metadata:
            fields[field] = metadata[key]
    try:
        return Limits.model_validate(fields)
    except ValidationError as e:
        raise InvalidRequest(f"sandbox limits from metadata: {validation_message(e)}") from None


def _refuse_unsupported(body: m.NewSandbox) -> None:
    if reserved := [k for k in body.metadata if k.startswith(META_E2B)]:
        raise InvalidRequest(f"metadata key {reserved[0][:80]!r}: keys {META_E2B}* are dsec's own")
    if len(body.metadata) > MAX_LABELS - 4:
        raise InvalidRequest(f"metadata: at most {MAX_LABELS - 4} keys")
    if body.iam:
        raise InvalidRequest(f"iam {UNSUPPORTED}")


def volumes_of(mounts: list[m.VolumeMount] | None) -> dict[str, str | tuple[str, Mode]]:
    """E2B's volume mounts as a dsec creation's: read-write, or read-only for 'NAME:ro' (E2B's mounts
    have no flag for it). The creation checks the paths and names themselves."""
    volumes: dict[str, str | tuple[str, Mode]] = {}
    for mount in mounts or []:
        name, colon, mode = mount.name.partition(":")
        if colon and mode not in ("ro", "rw"):
            raise InvalidRequest(
                f"volumeMounts: {mount.name[:80]!r}: a volume's name, or NAME:ro to mount it read-only"
            )
        if mount.path in volumes:
            raise InvalidRequest(f"volumeMounts: {mount.path[:80]!r} is named twice")
        volumes[mount.path] = (name, "ro") if mode == "ro" else name
    return volumes


def e2b_state(info: SandboxInfo) -> str:
    return "paused" if info.state == State.paused else "running"


def _listed(info: SandboxInfo, cls: type[m.ListedSandbox] = m.ListedSandbox, **extra: Any) -> Any:
    labels = {k: v for k, v in info.labels.items() if not k.startswith(META_E2B)}
    template = info.labels.get(META_TEMPLATE, info.image)
    return cls(
        template_id=template,
        sandbox_id=info.id,
        started_at=info.created_at,
        end_at=info.expires_at,
        cpu_count=max(1, math.ceil(info.limits.cpu_limit or info.limits.cpu)),
        memory_mb=info.limits.memory >> 20,
        disk_size_mb=info.limits.disk >> 20,
        state=e2b_state(info),
        metadata=labels,
        **extra,
    )


# ---- create, list, get -------------------------------------------------------------------------------


async def _create(svc: E2BService, caller: Caller, raw: Any, idempotency_key: str | None, request: Request) -> Response:
    body: m.NewSandbox = parse(m.NewSandbox, raw)
    _refuse_unsupported(body)
    timeout_action, auto_resume = on_timeout(body)
    image, kind = svc.template(body.template_id, body.metadata)
    labels = {**body.metadata, META_TEMPLATE: body.template_id}
    if auto_resume:
        labels[META_AUTO_RESUME] = "true"
    if body.network is not None and body.network.mask_request_host:
        labels[META_MASK_HOST] = check_mask(body.network.mask_request_host)
    if body.network is not None and body.network.allow_public_traffic:
        labels[META_PUBLIC_TRAFFIC] = "true"  # the caller asked for ports open to whoever knows the id, as on E2B
    try:
        req = CreateSandbox(
            image=image,
            kind=kind,
            limits=_limits(body.metadata),
            timeout=float(body.timeout),
            env=body.env_vars,
            labels=labels,
            network=network_spec(body.allow_internet_access, body.network, svc.options.network),
            trajectory=body.metadata.get(META_TRAJECTORY),
            volumes=volumes_of(body.volume_mounts),
            on_timeout=timeout_action,
        )
    except ValidationError as e:
        raise InvalidRequest(validation_message(e)) from None
    what = "E2B create"
    if idempotency_key is None:
        info = await unless_gone(request.receive, svc.mgr.create(req, caller=caller), what)
    else:
        async with svc.idempotency_lock(caller.tenant, idempotency_key):
            earlier = svc.idempotent(caller.tenant, idempotency_key)
            if earlier is not None:
                return json_answer(sandbox_model(svc, svc.mgr.info(earlier, caller=caller)), 201)
            info = await unless_gone(request.receive, svc.mgr.create(req, caller=caller), what)
            if info is not GONE:
                svc.remember(caller.tenant, idempotency_key, info.id)
    if info is GONE:
        return gone_response()
    if req.trajectory:
        svc.begin(info.id)
    note(request.scope, sandbox=info.id)
    svc.sweep()
    return json_answer(sandbox_model(svc, info), 201)


@router.post("/sandboxes", **doc(201, m.Sandbox, m.NewSandbox, body_required=True))
@router.post("/v2/sandboxes", **doc(201, m.Sandbox, m.NewSandbox, body_required=True))
async def create_sandbox(
    request: Request,
    svc: Svc,
    caller: Who,
    body: Annotated[Any, Body()] = None,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=255)] = None,
) -> Response:
    return await _create(svc, caller, body, idempotency_key, request)


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """The SDK's ``metadata`` query: ``urlencode`` of percent-quoted keys and values."""
    if not raw:
        return {}
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in urllib.parse.parse_qsl(raw)}


@router.get("/v2/sandboxes", **doc(200, list[m.ListedSandbox]))
async def list_sandboxes(
    svc: Svc,
    caller: Who,
    metadata: str | None = None,
    state: Annotated[str | None, Query(pattern=STATES, description="running and/or paused, comma-separated")] = None,
    order: Literal["asc", "desc"] | None = None,
    started_after: Annotated[
        datetime | None,
        Query(alias="startedAfter"),
        WithJsonSchema(TIME_SCHEMA),
    ] = None,
    template: str | None = None,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
) -> Response:
    states = {s.strip() for s in (state or "running,paused").split(",") if s.strip()}
    if not states <= {"running", "paused"}:
        raise InvalidRequest(f"state must be running and/or paused, not {state!r}")
    infos = [i for i in svc.mgr.list(_metadata_filter(metadata), caller=caller) if e2b_state(i) in states]
    if started_after is not None:
        after = started_after if started_after.tzinfo else started_after.replace(tzinfo=UTC)
        infos = [i for i in infos if i.created_at >= after]
    if template:
        infos = [i for i in infos if i.labels.get(META_TEMPLATE, i.image) == template]
    newest_first = order != "asc"  # E2B's default order is newest first
    infos.sort(key=lambda i: (i.created_at.timestamp(), i.id), reverse=newest_first)
    if next_token:
        key = page_after(next_token)
        if newest_first:
            infos = [i for i in infos if (i.created_at.timestamp(), i.id) < key]
        else:
            infos = [i for i in infos if (i.created_at.timestamp(), i.id) > key]
    page = infos[:limit]
    body = "[" + ",".join(_listed(i).wire().decode() for i in page) + "]"
    headers = {"x-next-token": page_token(page[-1].created_at.timestamp(), page[-1].id)} if len(infos) > limit else {}
    return Response(body, media_type="application/json", headers=headers)


@router.get("/sandboxes", **doc(200, list[m.ListedSandbox]))
async def list_sandboxes_v1(svc: Svc, caller: Who, metadata: str | None = None) -> Response:
    infos = [i for i in svc.mgr.list(_metadata_filter(metadata), caller=caller) if i.state == State.running]
    return Response("[" + ",".join(_listed(i).wire().decode() for i in infos) + "]", media_type="application/json")


@router.get("/sandboxes/{sandbox_id}", **doc(200, m.SandboxDetail))
async def get_sandbox(sandbox_id: str, svc: Svc, caller: Who) -> Response:
    info = live_info(svc, sandbox_id, caller)
    network = info.network
    detail = _listed(
        info,
        m.SandboxDetail,
        envd_access_token=svc.tokens.token(info.id),
        allow_internet_access=network is not None,
        domain=svc.options.domain,
        volume_mounts=[m.MountedVolume(name=v.name, path=v.path) for v in info.volumes],
        lifecycle=lifecycle_of(info),
    )
    return json_answer(detail)


# ---- lifecycle ---------------------------------------------------------------------------------------


@router.delete("/sandboxes/{sandbox_id}", **doc(204))
async def kill_sandbox(sandbox_id: str, svc: Svc, caller: Who) -> Response:
    live_info(svc, sandbox_id, caller)
    rec = svc.mgr.record(sandbox_id, caller=caller)
    await svc.call(rec, "kill", {}, caller=caller)
    svc.forget(sandbox_id)
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}/metrics", **doc(200, list[m.SandboxMetric]))
async def metrics(
    sandbox_id: str,
    svc: Svc,
    caller: Who,
    start: Annotated[int | None, Query(ge=0, description="Unix seconds: samples taken at or after it")] = None,
    end: Annotated[int | None, Query(ge=0, description="Unix seconds: samples taken before its next second")] = None,
) -> Response:
    """The usage samples the node took of the sandbox (every 2 s, the last 10 minutes kept), within
    [start, end] when given; without a range and before the first sample, one sample of now."""
    info = live_info(svc, sandbox_id, caller)
    cpus = max(1, math.ceil(info.limits.cpu_limit or info.limits.cpu))

    def metric(at: float, cpu_used: float, memory: int) -> bytes:
        when = datetime.fromtimestamp(at, UTC)
        return m.SandboxMetric(
            timestamp=when,
            timestamp_unix=int(at),
            cpu_count=cpus,
            cpu_used_pct=round(100.0 * cpu_used / cpus, 2),
            mem_used=memory,
            mem_total=info.limits.memory,
            disk_total=info.limits.disk,
        ).wire()

    # the query is in whole seconds: a sample within the end's second is within the range
    series = svc.mgr.usage.series(sandbox_id, start, None if end is None else end + 1)
    items = [metric(s.at, s.cpu_used, s.memory) for s in series]
    if not items and start is None and end is None:
        items = [metric(time.time(), 0.0, 0)]
    return Response(b"[" + b",".join(items) + b"]", media_type="application/json")


def unsupported(request: Request) -> Response:
    """Every other E2B endpoint (templates, secrets, logs, ...): a 501 that says so."""
    return plain_error(501, f"{request.method} {request.url.path} {UNSUPPORTED}")


def openapi_document() -> dict[str, Any]:
    """The control routes' OpenAPI document (volumes' too), from their models (control_doc.py)."""
    from fastapi import FastAPI

    from ..protocol.version import __version__
    from . import volumes  # its routes take this module's caller and service

    app = FastAPI(title="dsec E2B-compatible control API", version=__version__, telemetry=telemetry.OFF)
    app.include_router(router)
    app.include_router(volumes.router)
    return add_bodies(app.openapi())
