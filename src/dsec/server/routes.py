"""HTTP routes: parse into wire models, call the core, serialise the answer."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, MutableMapping
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, BeforeValidator, WithJsonSchema

from ..core.manager import SandboxManager
from ..errors import InvalidRequest
from ..images.canary import call_canaries
from ..kinds.output import StreamForwarder
from ..protocol import network as policy
from ..protocol.grade import GradeRequest, GradeResult
from ..protocol.names import ImageName
from ..protocol.network import NetworkAllow, NetworkDeny
from ..protocol.sandbox import (
    BuildRequest,
    BuildResult,
    CreateSandbox,
    DockerfileBuildRequest,
    ErrorResponse,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileList,
    ForkRequest,
    ForkResult,
    GcResult,
    Health,
    ImageInfo,
    ImageList,
    ImageStats,
    ImportRequest,
    NetworkStatus,
    SandboxInfo,
    SandboxList,
    SnapshotRequest,
)
from ..protocol.sandbox_query import SandboxQuery
from ..protocol.trajectory import REPLAYED_HEADER, SEQ_HEADER
from ..protocol.types import MAX_LABELS, AbsPath
from ..protocol.version import __version__
from ..tenancy import Caller
from ..web.audit import note
from ..web.disconnect import GONE, gone_response, unless_gone
from .auth import CallerDep, OperatorDep, authorize
from .streaming import event_stream

log = logging.getLogger("dsec.server")


async def manager(request: Request) -> SandboxManager:
    mgr: SandboxManager = request.app.state.manager
    return mgr


Mgr = Annotated[SandboxManager, Depends(manager)]
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why}
    for status, why in (
        (400, "invalid request"),
        (401, "missing, wrong or revoked token"),
        (403, "the token's tenant may not do this (operator only)"),
        (404, "no such sandbox, image, volume or file (or another tenant's)"),
        (409, "the sandbox's state does not allow this, an image or volume name is taken, or a volume is in use"),
        (410, "the sandbox is stopped, failed or lost"),
        (413, "a size limit was exceeded"),
        (422, "a build step failed, or a canary was found in an image being published"),
        (429, "no room now on the node or in the tenant's quota (Retry-After says when to try again)"),
        (500, "the runtime failed"),
        (504, "a sandbox's agent did not answer in time"),
    )
}
router = APIRouter(prefix="/v1", responses=_ERRORS)
# a trajectory call's position (the SDK sends it on every call of a sandbox bound to a trajectory); a
# header is there or not, so the schema says an integer, not "or null"
MAX_SEQ = 10**18 - 1


def _decimal_position(value: object) -> object:
    # pydantic would read "+1", "1_0" (ten) and "01" as numbers: a position is written one way only
    if isinstance(value, str) and not re.fullmatch(r"[1-9][0-9]{0,17}", value):
        raise ValueError(f"{SEQ_HEADER} must be a decimal position (1, 2, ...), not {value[:40]!r}")
    return value


Seq = Annotated[
    int | None,
    BeforeValidator(_decimal_position),
    Header(alias=SEQ_HEADER, ge=1, le=MAX_SEQ, description="Position of a trajectory call (0 is the create)."),
    WithJsonSchema({"type": "integer", "minimum": 1, "maximum": MAX_SEQ}),
]
api = APIRouter(dependencies=[Depends(authorize)])


@router.get("/health", response_model=Health)
async def health(mgr: Mgr) -> Health:
    """Liveness, version, and the kinds this node can run now."""
    return Health(ok=True, version=__version__, kinds=sorted(mgr.backends))


@api.post("/sandboxes", response_model=SandboxInfo, status_code=201)
async def create_sandbox(body: CreateSandbox, mgr: Mgr, caller: CallerDep, request: Request) -> SandboxInfo | Response:
    """Create a sandbox and answer once it runs. A caller that disconnects first cancels the creation
    (out of the queue, or the half-made sandbox destroyed)."""
    info = await unless_gone(request.receive, mgr.create(body, caller=caller), "POST /v1/sandboxes")
    if info is GONE:
        return gone_response()
    note(request.scope, sandbox=info.id)
    return info


@api.get("/sandboxes", response_model=SandboxList)
async def list_sandboxes(
    mgr: Mgr,
    caller: CallerDep,
    label: Annotated[
        list[str],
        Query(max_length=MAX_LABELS, description="key=value; repeat to require several"),
        WithJsonSchema(
            {
                "type": "array",
                "maxItems": MAX_LABELS,
                "items": {"type": "string", "pattern": "^[^=]+=", "maxLength": 1024},
            }
        ),
    ] = [],  # noqa: B006
    all: bool = False,
    q: Annotated[SandboxQuery, Query()] = SandboxQuery(),
) -> SandboxList:
    """The caller's sandboxes, oldest first; filtered by state, kind, image and owner as asked, and with
    ``limit`` a page of them, newest first, with the total."""
    labels: dict[str, str] = {}
    for item in label:
        key, sep, value = item.partition("=")
        if not sep or not key or len(item) > 1024:
            raise InvalidRequest(f"label filter {item!r} must look like key=value")
        labels[key] = value
    return mgr.list_page(q, labels, include_finished=all, caller=caller)


def _json(model: BaseModel, status: int = 200) -> Response:
    """Serialise once; returning a model makes FastAPI validate and serialise it again (~1 ms here)."""
    return Response(content=model.model_dump_json(), media_type="application/json", status_code=status)


@api.get("/sandboxes/{sandbox_id}", response_model=SandboxInfo)
async def get_sandbox(sandbox_id: str, mgr: Mgr, caller: CallerDep) -> Response:
    return _json(mgr.info(sandbox_id, caller=caller))


@api.delete("/sandboxes/{sandbox_id}", response_model=SandboxInfo)
async def kill_sandbox(sandbox_id: str, mgr: Mgr, caller: CallerDep, seq: Seq = None) -> Response:
    info, replayed = await mgr.actions.call(sandbox_id, "kill", {}, seq=seq, caller=caller)
    return _mark(_json(info), replayed)


@api.post("/sandboxes/{sandbox_id}/exec", response_model=ExecResult)
async def exec_command(
    sandbox_id: str, body: ExecRequest, mgr: Mgr, caller: CallerDep, request: Request, seq: Seq = None
) -> Response:
    return await run_exec(mgr, request.scope, sandbox_id, body, seq, caller)


async def run_exec(
    mgr: SandboxManager,
    scope: MutableMapping[str, Any],
    sandbox_id: str,
    body: ExecRequest,
    seq: int | None,
    caller: Caller,
) -> Response:
    """The exec route's work once its request is parsed (also done by fast_calls.FastCalls)."""
    note(scope, command=body.cmd)
    result, replayed = await mgr.actions.call(sandbox_id, "exec", body, seq=seq, caller=caller)
    return _mark(_json(result), replayed)


def _mark(resp: Response, replayed: bool) -> Response:
    if replayed:
        resp.headers[REPLAYED_HEADER] = "1"
    return resp


def _bytes(media_type: str, description: str) -> dict[str, Any]:
    """An answer (or a request body) of raw bytes, as OpenAPI states one."""
    return {"description": description, "content": {media_type: {"schema": {"type": "string", "format": "binary"}}}}


def _upload(media_type: str, description: str) -> dict[str, Any]:
    """A raw request body: any content type is read as bytes, so octet-stream is one too."""
    body = _bytes(media_type, description)
    body["content"]["application/octet-stream"] = body["content"][media_type]
    return {"requestBody": {"required": False, **body}}


@api.post(
    "/sandboxes/{sandbox_id}/exec/stream",
    response_class=StreamingResponse,
    responses={200: _bytes("application/x-ndjson", "ExecEvent lines: output as it comes, then a result or an error.")},
)
async def exec_stream(
    sandbox_id: str, body: ExecRequest, mgr: Mgr, caller: CallerDep, request: Request, seq: Seq = None
) -> StreamingResponse:
    """Newline-delimited ExecEvent JSON: output chunks as they come, then one ``result`` (or ``error``)."""
    note(request.scope, command=body.cmd)
    mgr.info(sandbox_id, caller=caller)  # a 404 before the stream starts, not inside it
    forwarders = {s: StreamForwarder(body.output_limit) for s in ("stdout", "stderr")}

    async def work(send: Callable[[ExecEvent], None]) -> None:
        def on_output(stream: str, data: bytes) -> None:
            text = forwarders[stream].take(data)
            if text:
                send(ExecEvent(type=stream, data=text))

        result, replayed = await mgr.actions.call(sandbox_id, "exec", body, seq=seq, caller=caller, on_output=on_output)
        if replayed:  # the recorded output, as one chunk per stream
            for stream in ("stdout", "stderr"):
                if text := getattr(result, stream):
                    send(ExecEvent(type=stream, data=text))
        send(ExecEvent(type="result", result=result))

    return event_stream(work, lambda error: ExecEvent(type="error", error=error), "streamed exec")


PathQ = Annotated[AbsPath, Query(description="Absolute path inside the sandbox")]


@api.get(
    "/sandboxes/{sandbox_id}/files",
    response_class=Response,
    responses={200: _bytes("application/octet-stream", "The file's bytes.")},
)
async def read_file(sandbox_id: str, path: PathQ, mgr: Mgr, caller: CallerDep, seq: Seq = None) -> Response:
    data, replayed = await mgr.actions.call(sandbox_id, "read", {"path": path}, seq=seq, caller=caller)
    return _mark(Response(content=data, media_type="application/octet-stream"), replayed)


@api.put(
    "/sandboxes/{sandbox_id}/files",
    status_code=204,
    openapi_extra=_upload("application/octet-stream", "The file's new content."),
)
async def write_file(
    sandbox_id: str,
    path: PathQ,
    request: Request,
    mgr: Mgr,
    caller: CallerDep,
    mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644,
    seq: Seq = None,
) -> Response:
    mgr.info(sandbox_id, caller=caller)
    data = await request.body()
    _, replayed = await mgr.actions.call(
        sandbox_id, "write", {"path": path, "mode": mode}, data, seq=seq, caller=caller
    )
    return _mark(Response(status_code=204), replayed)


@api.get("/sandboxes/{sandbox_id}/files/list", response_model=FileList)
async def list_files(sandbox_id: str, path: PathQ, mgr: Mgr, caller: CallerDep, seq: Seq = None) -> Response:
    entries, replayed = await mgr.actions.call(sandbox_id, "list", {"path": path}, seq=seq, caller=caller)
    return _mark(_json(FileList(entries=entries)), replayed)


@api.post("/sandboxes/{sandbox_id}/files/mkdir", status_code=204)
async def make_dir(sandbox_id: str, path: PathQ, mgr: Mgr, caller: CallerDep, seq: Seq = None) -> Response:
    _, replayed = await mgr.actions.call(sandbox_id, "mkdir", {"path": path}, seq=seq, caller=caller)
    return _mark(Response(status_code=204), replayed)


@api.delete("/sandboxes/{sandbox_id}/files", status_code=204)
async def remove_file(
    sandbox_id: str, path: PathQ, mgr: Mgr, caller: CallerDep, recursive: bool = False, seq: Seq = None
) -> Response:
    req = {"path": path, "recursive": recursive}
    _, replayed = await mgr.actions.call(sandbox_id, "remove", req, seq=seq, caller=caller)
    return _mark(Response(status_code=204), replayed)


@api.put(
    "/sandboxes/{sandbox_id}/archive",
    status_code=204,
    openapi_extra=_upload("application/x-tar", "A tar archive, unpacked under path."),
)
async def upload_archive(
    sandbox_id: str, path: PathQ, request: Request, mgr: Mgr, caller: CallerDep, seq: Seq = None
) -> Response:
    mgr.info(sandbox_id, caller=caller)
    data = await request.body()
    _, replayed = await mgr.actions.call(sandbox_id, "upload", {"path": path}, data, seq=seq, caller=caller)
    return _mark(Response(status_code=204), replayed)


@api.get(
    "/sandboxes/{sandbox_id}/archive",
    response_class=Response,
    responses={200: _bytes("application/x-tar", "A tar archive of path.")},
)
async def download_archive(sandbox_id: str, path: PathQ, mgr: Mgr, caller: CallerDep, seq: Seq = None) -> Response:
    data, replayed = await mgr.actions.call(sandbox_id, "download", {"path": path}, seq=seq, caller=caller)
    return _mark(Response(content=data, media_type="application/x-tar"), replayed)


@api.post("/sandboxes/{sandbox_id}/snapshot", response_model=ImageInfo, status_code=201)
async def snapshot(sandbox_id: str, body: SnapshotRequest, mgr: Mgr, caller: CallerDep, seq: Seq = None) -> Response:
    """pack_diff: the sandbox's changes become a new immutable image version on top of its image."""
    info, replayed = await mgr.actions.call(sandbox_id, "snapshot", body, seq=seq, caller=caller)
    return _mark(_json(info, 201), replayed)


@api.post("/sandboxes/{sandbox_id}/grade", response_model=GradeResult)
async def grade(sandbox_id: str, body: GradeRequest, mgr: Mgr, caller: CallerDep, seq: Seq = None) -> Response:
    """Run a grader in a fresh sibling of the candidate's pristine image, against a read-only copy of the
    candidate's paths, with pristine tests under /grade, as uid 65534 with a fixed environment."""
    result, replayed = await mgr.actions.call(sandbox_id, "grade", body, seq=seq, caller=caller)
    return _mark(_json(result), replayed)


@api.post("/sandboxes/{sandbox_id}/pause", response_model=SandboxInfo)
async def pause_sandbox(sandbox_id: str, mgr: Mgr, caller: CallerDep) -> SandboxInfo:
    """Stop every process of the sandbox where it stands (VM kinds: the vCPUs). Not while a command runs."""
    return await mgr.pause(sandbox_id, caller=caller)


@api.post("/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo)
async def resume_sandbox(sandbox_id: str, mgr: Mgr, caller: CallerDep) -> SandboxInfo:
    return await mgr.resume(sandbox_id, caller=caller)


@api.post("/sandboxes/{sandbox_id}/fork", response_model=ForkResult, status_code=201)
async def fork_sandbox(sandbox_id: str, body: ForkRequest, mgr: Mgr, caller: CallerDep) -> ForkResult:
    """N new sandboxes restored from one memory snapshot of this one (VM kinds), all or none."""
    return await mgr.fork(sandbox_id, body, caller=caller)


@api.get("/sandboxes/{sandbox_id}/network", response_model=NetworkStatus)
async def network_status(sandbox_id: str, mgr: Mgr, caller: CallerDep) -> NetworkStatus:
    """The network policy in force, the sandbox's address, what it was denied and what it may reach now."""
    return await mgr.network_status(sandbox_id, caller=caller)


@api.put("/sandboxes/{sandbox_id}/network", response_model=NetworkStatus)
async def set_network(
    sandbox_id: str,
    mgr: Mgr,
    caller: CallerDep,
    body: Annotated[Literal["full"] | NetworkAllow | NetworkDeny | None, Body()] = None,
    seq: Seq = None,
) -> Response:
    """Change the policy of a running sandbox (JSON null: loopback only, "full", {"allow": [...]}, or
    {"deny": [...], "allow": [...]})."""
    req = {"policy": policy.to_json(body)}
    status, replayed = await mgr.actions.call(sandbox_id, "set_network", req, seq=seq, caller=caller)
    return _mark(_json(status), replayed)


ImageNameQ = Annotated[ImageName, Query()]


@api.get("/images", response_model=ImageList)
async def list_images(mgr: Mgr, caller: CallerDep) -> ImageList:
    return ImageList(images=await mgr.images.list(caller))


@api.get("/image", response_model=ImageInfo)
async def image_info(mgr: Mgr, caller: CallerDep, name: ImageNameQ) -> ImageInfo:
    return await mgr.images.info(name, caller)


@api.get("/image/history", response_model=ImageList)
async def image_history(mgr: Mgr, caller: CallerDep, name: ImageNameQ) -> ImageList:
    """The version a name points at, then its ancestors (lineage), newest first."""
    return ImageList(images=await mgr.images.history(name, caller))


@api.get("/image/stats", response_model=ImageStats)
async def image_stats(mgr: Mgr, caller: CallerDep, name: ImageNameQ) -> ImageStats:
    return await mgr.images.stats(name, caller)


@api.delete("/image", status_code=204)
async def remove_image(mgr: Mgr, caller: CallerDep, name: ImageNameQ) -> Response:
    """Free the name; its layers go at the next gc unless another image shares them."""
    await mgr.remove_image(name, caller=caller)
    return Response(status_code=204)


@api.post("/images/gc", response_model=GcResult)
async def gc_images(mgr: Mgr, _: OperatorDep) -> GcResult:
    """Delete versions, layers and chunks no image references; never one in use (operator only)."""
    return await mgr.gc_images()


@api.post("/images/build", response_model=ImageInfo)
async def build_image(mgr: Mgr, caller: CallerDep, name: ImageNameQ) -> ImageInfo:
    """Build a built-in image if it is not built yet (minutes for dsec/debian:12 on first use)."""
    return await mgr.images.ensure(name, caller)


@api.post("/images/builds", response_model=BuildResult, status_code=201)
async def build(body: BuildRequest, mgr: Mgr, caller: CallerDep) -> BuildResult:
    """Build an image from a spec: each step a layer, cached by its inputs (minutes for apt steps)."""
    return await mgr.builds.build(body, caller=caller)


@api.post("/images/dockerfile-builds", response_model=BuildResult, status_code=201)
async def build_dockerfile(body: DockerfileBuildRequest, mgr: Mgr, caller: CallerDep) -> BuildResult:
    """Build an image from a Dockerfile and its uploaded context: each RUN, COPY and ADD a cached layer."""
    return await mgr.build_dockerfile(body, caller=caller)


class ContextRef(BaseModel):
    context: str


@api.put(
    "/build-contexts",
    response_model=ContextRef,
    openapi_extra=_upload("application/x-tar", "A tar archive of the files a copy step (or a Dockerfile) copies."),
)
async def put_context(request: Request, mgr: Mgr) -> ContextRef:
    """Upload a tar archive for a build's copy step; answered with its content digest."""
    return ContextRef(context=await mgr.builds.put_context(await request.body()))


@api.post("/images/import", response_model=ImageInfo, status_code=201)
async def import_image(mgr: Mgr, _: OperatorDep, body: ImportRequest) -> ImageInfo:
    """Import an OCI image layout directory or a `docker save` tarball that is on the daemon's node.

    Operator only: the path is read with the daemon's rights, which no tenant has."""
    with call_canaries(body.canaries):  # every layer of the imported image is searched for them
        return await mgr.images.import_image(body.path, body.name, body.reference)


router.include_router(api)
