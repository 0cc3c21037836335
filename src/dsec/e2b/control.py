"""E2B's control API (the sandbox lifecycle, ``E2B_API_URL``), translated to the core's actions.

A sandbox is an ordinary dsec sandbox: the E2B template names its image (and kind), the E2B metadata
is its labels, the E2B timeout its time to live. What E2B offers and dsec cannot honour is refused
with a 400 that says so (see docs/e2b.md), never silently dropped.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
import urllib.parse
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Header, Query, Request, Response
from pydantic import ValidationError, WithJsonSchema

from ..errors import InvalidRequest, InvalidState, NotFound, SandboxNotFound, Unauthorized, validation_message
from ..protocol import network as policy
from ..protocol.names import ImageName
from ..protocol.network import NetworkAllow, NetworkSpec
from ..protocol.sandbox import TERMINAL_STATES, CreateSandbox, ForkRequest, Limits, SandboxInfo, SnapshotRequest, State
from ..protocol.types import TIME_SCHEMA
from ..protocol.volumes import Mode
from ..tenancy import Caller
from ..web import telemetry
from ..web.audit import note
from ..web.auth import name_caller
from ..web.disconnect import GONE, gone_response, unless_gone
from . import control_models as m
from .auth import api_token, identify
from .control_doc import add_bodies, doc
from .errors import plain_error
from .service import (
    META_CPU,
    META_DISK,
    META_MEMORY,
    META_TEMPLATE,
    META_TRAJECTORY,
    E2BService,
)

MAX_PAGE = 100
STATES = r"^ *(running|paused)? *(, *(running|paused)? *)*$"  # as E2B's SDK sends them: 'running,paused'
UNSUPPORTED = "is not supported by dsec's E2B API (see docs/e2b.md)"


def service(request: Request) -> E2BService:
    svc: E2BService = request.app.state.e2b
    return svc


async def api_caller(request: Request) -> Caller:
    svc = service(request)
    caller = identify(api_token(request.scope.get("headers", [])), svc.operator_token, svc.mgr.tenants)
    if caller is None:
        raise Unauthorized("missing or wrong API key: E2B_API_KEY must be a dsec token (the operator's or a tenant's)")
    name_caller(request.scope, caller)
    return caller


Svc = Annotated[E2BService, Depends(service)]
Who = Annotated[Caller, Depends(api_caller)]
router = APIRouter()


# ---- translation -------------------------------------------------------------------------------------


def parse(model: type[Any], raw: Any) -> Any:
    try:
        return model.model_validate(raw if raw is not None else {})
    except ValidationError as e:
        raise InvalidRequest(validation_message(e)) from None


def _limits(metadata: dict[str, str]) -> Limits:
    fields: dict[str, Any] = {}
    for key, field in ((META_CPU, "cpu"), (META_MEMORY, "memory"), (META_DISK, "disk")):
        if key in metadata:
            fields[field] = metadata[key]
    try:
        return Limits.model_validate(fields)
    except ValidationError as e:
        raise InvalidRequest(f"sandbox limits from metadata: {validation_message(e)}") from None


def network_spec(allow_internet: bool | None, net: m.NetworkConfig | None, default: NetworkSpec) -> NetworkSpec:
    """E2B's egress rules as a dsec policy. dsec enforces allowlists: "deny everything" (denyOut
    0.0.0.0/0, or allowInternetAccess=false) with allowOut exceptions maps exactly; denying only some
    ranges does not."""
    allow: list[str] = []
    deny: list[str] = []
    if net is not None:
        for name in ("mask_request_host", "rules", "egress_proxy", "dns_servers", "https_ports"):
            if getattr(net, name) not in (None, [], {}):
                alias = m.NetworkConfig.model_fields[name].alias or name
                raise InvalidRequest(f"network.{alias} {UNSUPPORTED}")
        allow, deny = list(net.allow_out or []), list(net.deny_out or [])
    deny_all = allow_internet is False or any(d.strip() in ("0.0.0.0/0", "::/0") for d in deny)
    if deny and not deny_all:
        raise InvalidRequest(
            "network.denyOut of some ranges only "
            + UNSUPPORTED
            + ": dsec enforces allowlists; deny 0.0.0.0/0 and list what is allowed in allowOut"
        )
    if deny_all:
        if not allow:
            return None
        try:
            # E2B's entries have no port: each allows every port of its address, range or name
            return NetworkAllow(allow=[f"{a.strip()}:*" for a in allow])
        except ValidationError as e:
            raise InvalidRequest(f"network.allowOut: {validation_message(e)}") from None
    if net is None and allow_internet is None:
        return default
    return "full"


def _refuse_unsupported(body: m.NewSandbox) -> None:
    if body.auto_pause:
        raise InvalidRequest(f"autoPause (pausing instead of killing at the timeout) {UNSUPPORTED}")
    if body.lifecycle is not None and body.lifecycle.on_timeout not in (None, "kill", {"action": "kill"}):
        raise InvalidRequest(f"lifecycle.onTimeout other than kill {UNSUPPORTED}")
    for value, what in ((body.mcp, "mcp"), (body.iam, "iam")):
        if value:
            raise InvalidRequest(f"{what} {UNSUPPORTED}")
    if body.network is not None and body.network.allow_public_traffic:
        raise InvalidRequest(
            f"network.allowPublicTraffic=true {UNSUPPORTED}: a sandbox's ports are reached with its "
            "trafficAccessToken in the e2b-traffic-access-token header"
        )


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


def _state(info: SandboxInfo) -> str:
    return "paused" if info.state == State.paused else "running"


def _listed(info: SandboxInfo, cls: type[m.ListedSandbox] = m.ListedSandbox, **extra: Any) -> Any:
    labels = dict(info.labels)
    template = labels.pop(META_TEMPLATE, info.image)
    return cls(
        template_id=template,
        sandbox_id=info.id,
        started_at=info.created_at,
        end_at=info.expires_at,
        cpu_count=max(1, math.ceil(info.limits.cpu_limit or info.limits.cpu)),
        memory_mb=info.limits.memory >> 20,
        disk_size_mb=info.limits.disk >> 20,
        state=_state(info),
        metadata=labels,
        **extra,
    )


def _sandbox(svc: E2BService, info: SandboxInfo) -> m.Sandbox:
    return m.Sandbox(
        template_id=info.labels.get(META_TEMPLATE, info.image),
        sandbox_id=info.id,
        envd_access_token=svc.tokens.token(info.id),
        traffic_access_token=svc.tokens.traffic_token(info.id),
        domain=svc.options.domain,
    )


def _live(svc: E2BService, sandbox_id: str, caller: Caller) -> SandboxInfo:
    """A sandbox E2B still knows: a stopped one is not found, as it is for E2B."""
    info = svc.mgr.info(sandbox_id, caller=caller)
    if info.state in TERMINAL_STATES:
        raise SandboxNotFound(
            f"sandbox {sandbox_id} is {info.state.value}" + (f": {info.reason}" if info.reason else "")
        )
    return info


def json_answer(model: m._Out, status: int = 200) -> Response:
    return Response(model.wire(), status_code=status, media_type="application/json")


# ---- create, list, get -------------------------------------------------------------------------------


async def _create(svc: E2BService, caller: Caller, raw: Any, idempotency_key: str | None, request: Request) -> Response:
    body: m.NewSandbox = parse(m.NewSandbox, raw)
    _refuse_unsupported(body)
    image, kind = svc.template(body.template_id, body.metadata)
    labels = {**body.metadata, META_TEMPLATE: body.template_id}
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
                return json_answer(_sandbox(svc, svc.mgr.info(earlier, caller=caller)), 201)
            info = await unless_gone(request.receive, svc.mgr.create(req, caller=caller), what)
            if info is not GONE:
                svc.remember(caller.tenant, idempotency_key, info.id)
    if info is GONE:
        return gone_response()
    if req.trajectory:
        svc.begin(info.id)
    note(request.scope, sandbox=info.id)
    svc.sweep()
    return json_answer(_sandbox(svc, info), 201)


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


def _token(info: SandboxInfo) -> str:
    return base64.urlsafe_b64encode(json.dumps([info.created_at.timestamp(), info.id]).encode()).decode()


def _after(token: str) -> tuple[float, str]:
    try:
        at, sid = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(at), str(sid)
    except (ValueError, TypeError, binascii.Error):
        raise InvalidRequest(f"invalid nextToken {token[:40]!r}") from None


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
    infos = [i for i in svc.mgr.list(_metadata_filter(metadata), caller=caller) if _state(i) in states]
    if started_after is not None:
        after = started_after if started_after.tzinfo else started_after.replace(tzinfo=UTC)
        infos = [i for i in infos if i.created_at >= after]
    if template:
        infos = [i for i in infos if i.labels.get(META_TEMPLATE, i.image) == template]
    infos.sort(key=lambda i: (i.created_at.timestamp(), i.id), reverse=order == "desc")
    if next_token:
        key = _after(next_token)
        if order == "desc":
            infos = [i for i in infos if (i.created_at.timestamp(), i.id) < key]
        else:
            infos = [i for i in infos if (i.created_at.timestamp(), i.id) > key]
    page = infos[:limit]
    body = "[" + ",".join(_listed(i).wire().decode() for i in page) + "]"
    headers = {"x-next-token": _token(page[-1])} if len(infos) > limit else {}
    return Response(body, media_type="application/json", headers=headers)


@router.get("/sandboxes", **doc(200, list[m.ListedSandbox]))
async def list_sandboxes_v1(svc: Svc, caller: Who, metadata: str | None = None) -> Response:
    infos = [i for i in svc.mgr.list(_metadata_filter(metadata), caller=caller) if i.state == State.running]
    return Response("[" + ",".join(_listed(i).wire().decode() for i in infos) + "]", media_type="application/json")


@router.get("/sandboxes/{sandbox_id}", **doc(200, m.SandboxDetail))
async def get_sandbox(sandbox_id: str, svc: Svc, caller: Who) -> Response:
    info = _live(svc, sandbox_id, caller)
    network = info.network
    detail = _listed(
        info,
        m.SandboxDetail,
        envd_access_token=svc.tokens.token(info.id),
        allow_internet_access=network is not None,
        domain=svc.options.domain,
        volume_mounts=[m.MountedVolume(name=v.name, path=v.path) for v in info.volumes],
    )
    return json_answer(detail)


# ---- lifecycle ---------------------------------------------------------------------------------------


@router.delete("/sandboxes/{sandbox_id}", **doc(204))
async def kill_sandbox(sandbox_id: str, svc: Svc, caller: Who) -> Response:
    _live(svc, sandbox_id, caller)
    rec = svc.mgr.record(sandbox_id, caller=caller)
    await svc.call(rec, "kill", {}, caller=caller)
    svc.forget(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", **doc(204, None, m.TimeoutRequest, body_required=True))
async def set_timeout(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    req: m.TimeoutRequest = parse(m.TimeoutRequest, body)
    _live(svc, sandbox_id, caller)
    svc.mgr.set_timeout(sandbox_id, float(req.timeout), caller=caller)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", **doc(204, None, m.RefreshRequest))
async def refresh(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    """Keep-alive: the time to live becomes at least ``duration`` seconds from now (a body that is no
    object is no duration: the default)."""
    duration = parse(m.RefreshRequest, body if isinstance(body, dict) else None).duration
    info = _live(svc, sandbox_id, caller)
    if info.expires_at.timestamp() - time.time() < duration:
        svc.mgr.set_timeout(sandbox_id, float(duration), caller=caller)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause", **doc(204, None, m.PauseRequest))
async def pause_sandbox(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    parse(m.PauseRequest, body)
    info = _live(svc, sandbox_id, caller)
    if info.state == State.paused:
        return plain_error(409, f"sandbox {sandbox_id} is already paused")
    try:
        await svc.mgr.pause(sandbox_id, caller=caller)
    except InvalidState as e:
        # 409 tells the SDK "already paused", which a busy sandbox is not
        raise InvalidRequest(e.message) from None
    return Response(status_code=204)


async def _connect(sandbox_id: str, svc: E2BService, caller: Caller, body: Any) -> Response:
    req: m.ConnectRequest = parse(m.ConnectRequest, body)
    info = _live(svc, sandbox_id, caller)
    resumed = info.state == State.paused
    if resumed:
        info = await svc.mgr.resume(sandbox_id, caller=caller)
        svc.mgr.set_timeout(sandbox_id, float(req.timeout), caller=caller)
    elif info.expires_at.timestamp() - time.time() < req.timeout:  # a running one only gets longer
        svc.mgr.set_timeout(sandbox_id, float(req.timeout), caller=caller)
    return json_answer(_sandbox(svc, info), 201 if resumed else 200)


_CONNECT = doc(200, m.Sandbox, m.ConnectRequest, also={201: m.Sandbox})  # 201: it was paused and is resumed


@router.post("/sandboxes/{sandbox_id}/connect", **_CONNECT)
@router.post("/v2/sandboxes/{sandbox_id}/connect", **_CONNECT)
@router.post("/sandboxes/{sandbox_id}/resume", **_CONNECT)
async def connect_sandbox(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    return await _connect(sandbox_id, svc, caller, body)


@router.get("/sandboxes/{sandbox_id}/metrics", **doc(200, list[m.SandboxMetric]))
async def metrics(sandbox_id: str, svc: Svc, caller: Who) -> Response:
    """The latest usage sample the node took of the sandbox (every 2 s), as E2B's one-item series."""
    info = _live(svc, sandbox_id, caller)
    usage = svc.mgr.usage.usage.get(sandbox_id)
    now = datetime.now(UTC)
    cpus = max(1, math.ceil(info.limits.cpu_limit or info.limits.cpu))
    sample = m.SandboxMetric(
        timestamp=now,
        timestamp_unix=int(now.timestamp()),
        cpu_count=cpus,
        cpu_used_pct=round(100.0 * (usage.cpu_used if usage else 0.0) / cpus, 2),
        mem_used=usage.memory if usage else 0,
        mem_total=info.limits.memory,
        disk_total=info.limits.disk,
    )
    return Response(b"[" + sample.wire() + b"]", media_type="application/json")


@router.post("/sandboxes/{sandbox_id}/snapshots", **doc(201, m.SnapshotInfo, m.SnapshotRequest))
async def snapshot(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    """pack_diff: the sandbox's changes become a new image, which a create can name as its template."""
    req: m.SnapshotRequest = parse(m.SnapshotRequest, body)
    _live(svc, sandbox_id, caller)
    name = req.name or f"e2b-snapshots/{sandbox_id}:{int(time.time() * 1000)}"
    rec = svc.mgr.record(sandbox_id, caller=caller)
    image = await svc.call(rec, "snapshot", SnapshotRequest(name=name), caller=caller)
    return json_answer(m.SnapshotInfo(snapshot_id=image.name, names=[image.name]), 201)


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
    """VM kinds: copies restored from one memory snapshot (all or none in dsec)."""
    req: m.ForkRequest = parse(m.ForkRequest, body)
    _live(svc, sandbox_id, caller)
    result = await svc.mgr.fork(
        sandbox_id, ForkRequest(n=req.count, timeout=float(req.timeout) if req.timeout else None), caller=caller
    )
    items = [m.ForkResult(sandbox=_sandbox(svc, info)).wire().decode() for info in result.sandboxes]
    return Response("[" + ",".join(items) + "]", status_code=201, media_type="application/json")


@router.put("/sandboxes/{sandbox_id}/network", **doc(204, None, m.NetworkUpdate))
async def update_network(sandbox_id: str, svc: Svc, caller: Who, body: Annotated[Any, Body()] = None) -> Response:
    req: m.NetworkUpdate = parse(m.NetworkUpdate, body)
    if req.rules:
        raise InvalidRequest(f"network rules {UNSUPPORTED}")
    net = m.NetworkConfig(allowOut=req.allow_out, denyOut=req.deny_out)
    spec = network_spec(req.allow_internet_access, net, "full")
    _live(svc, sandbox_id, caller)
    rec = svc.mgr.record(sandbox_id, caller=caller)
    await svc.call(rec, "set_network", {"policy": policy.to_json(spec)}, caller=caller)
    return Response(status_code=204)


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
