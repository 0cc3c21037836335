"""HTTP routes: parse into wire models, call the core, serialise the answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from .. import __version__
from ..core.manager import SandboxManager
from ..core.output import StreamForwarder
from ..errors import DsecError, InvalidRequest, Unauthorized
from ..models import (
    BuildRequest,
    BuildResult,
    CreateSandbox,
    ErrorBody,
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
    SandboxInfo,
    SandboxList,
    SnapshotRequest,
)

log = logging.getLogger("dsec.server")


async def manager(request: Request) -> SandboxManager:
    mgr: SandboxManager = request.app.state.manager
    return mgr


async def authorize(request: Request) -> None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    # compared as bytes: compare_digest refuses non-ASCII str, and a header may carry anything
    expected = str(request.app.state.token).encode()
    if scheme.lower() != "bearer" or not secrets.compare_digest(value.strip().encode(errors="replace"), expected):
        raise Unauthorized("missing or wrong bearer token (see DSEC_TOKEN and the daemon's STATE_DIR/token)")


Mgr = Annotated[SandboxManager, Depends(manager)]
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why}
    for status, why in (
        (400, "invalid request"),
        (401, "missing or wrong token"),
        (404, "no such sandbox, image or file"),
        (409, "the sandbox's state does not allow this, or the image name is taken"),
        (410, "the sandbox is stopped, failed or lost"),
        (413, "a size limit was exceeded"),
        (500, "the runtime failed"),
    )
}
router = APIRouter(prefix="/v1", responses=_ERRORS)
api = APIRouter(dependencies=[Depends(authorize)])


@router.get("/health", response_model=Health)
async def health(mgr: Mgr) -> Health:
    """Liveness, version, and the kinds this node can run now."""
    return Health(ok=True, version=__version__, kinds=sorted(mgr.backends))


@api.post("/sandboxes", response_model=SandboxInfo, status_code=201)
async def create_sandbox(body: CreateSandbox, mgr: Mgr) -> SandboxInfo:
    return await mgr.create(body)


@api.get("/sandboxes", response_model=SandboxList)
async def list_sandboxes(
    mgr: Mgr,
    label: Annotated[list[str], Query(description="key=value; repeat to require several")] = [],  # noqa: B006
    all: bool = False,
) -> SandboxList:
    labels: dict[str, str] = {}
    for item in label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"label filter {item!r} must look like key=value")
        labels[key] = value
    return SandboxList(sandboxes=mgr.list(labels, include_finished=all))


def _json(model: BaseModel, status: int = 200) -> Response:
    """Serialise once; returning a model makes FastAPI validate and serialise it again (~1 ms here)."""
    return Response(content=model.model_dump_json(), media_type="application/json", status_code=status)


@api.get("/sandboxes/{sandbox_id}", response_model=SandboxInfo)
async def get_sandbox(sandbox_id: str, mgr: Mgr) -> Response:
    return _json(mgr.info(sandbox_id))


@api.delete("/sandboxes/{sandbox_id}", response_model=SandboxInfo)
async def kill_sandbox(sandbox_id: str, mgr: Mgr) -> SandboxInfo:
    return await mgr.kill(sandbox_id)


@api.post("/sandboxes/{sandbox_id}/exec", response_model=ExecResult)
async def exec_command(sandbox_id: str, body: ExecRequest, mgr: Mgr) -> Response:
    return _json(await mgr.exec(sandbox_id, body))


@api.post("/sandboxes/{sandbox_id}/exec/stream", response_class=StreamingResponse)
async def exec_stream(sandbox_id: str, body: ExecRequest, mgr: Mgr) -> StreamingResponse:
    """Newline-delimited ExecEvent JSON: output chunks as they come, then one ``result`` (or ``error``)."""
    mgr.info(sandbox_id)  # a 404 before the stream starts, not inside it
    queue: asyncio.Queue[ExecEvent | None] = asyncio.Queue()
    forwarders = {s: StreamForwarder(body.output_limit) for s in ("stdout", "stderr")}

    def on_output(stream: str, data: bytes) -> None:
        text = forwarders[stream].take(data)
        if text:
            queue.put_nowait(ExecEvent(type=stream, data=text))

    async def run() -> None:
        try:
            result = await mgr.exec(sandbox_id, body, on_output)
            queue.put_nowait(ExecEvent(type="result", result=result))
        except DsecError as e:
            queue.put_nowait(ExecEvent(type="error", error=ErrorBody(code=e.code, message=e.message)))
        except Exception as e:  # the stream must always end with a result or an error
            log.exception("streamed exec failed")
            queue.put_nowait(ExecEvent(type="error", error=ErrorBody(code="internal", message=f"internal error: {e}")))
        finally:
            queue.put_nowait(None)

    async def events() -> AsyncIterator[bytes]:
        task = asyncio.create_task(run())
        try:
            while (event := await queue.get()) is not None:
                yield event.model_dump_json(exclude_none=True).encode() + b"\n"
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    return StreamingResponse(events(), media_type="application/x-ndjson")


PathQ = Annotated[str, Query(min_length=1, max_length=4096, description="Absolute path inside the sandbox")]


@api.get("/sandboxes/{sandbox_id}/files")
async def read_file(sandbox_id: str, path: PathQ, mgr: Mgr) -> Response:
    data = await mgr.read_file(sandbox_id, path)
    return Response(content=data, media_type="application/octet-stream")


@api.put("/sandboxes/{sandbox_id}/files", status_code=204)
async def write_file(
    sandbox_id: str,
    path: PathQ,
    request: Request,
    mgr: Mgr,
    mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644,
) -> Response:
    mgr.info(sandbox_id)
    await mgr.write_file(sandbox_id, path, await request.body(), mode)
    return Response(status_code=204)


@api.get("/sandboxes/{sandbox_id}/files/list", response_model=FileList)
async def list_files(sandbox_id: str, path: PathQ, mgr: Mgr) -> FileList:
    return FileList(entries=await mgr.list_dir(sandbox_id, path))


@api.post("/sandboxes/{sandbox_id}/files/mkdir", status_code=204)
async def make_dir(sandbox_id: str, path: PathQ, mgr: Mgr) -> Response:
    await mgr.mkdir(sandbox_id, path)
    return Response(status_code=204)


@api.delete("/sandboxes/{sandbox_id}/files", status_code=204)
async def remove_file(sandbox_id: str, path: PathQ, mgr: Mgr, recursive: bool = False) -> Response:
    await mgr.remove(sandbox_id, path, recursive)
    return Response(status_code=204)


@api.put("/sandboxes/{sandbox_id}/archive", status_code=204)
async def upload_archive(sandbox_id: str, path: PathQ, request: Request, mgr: Mgr) -> Response:
    mgr.info(sandbox_id)
    await mgr.upload_tar(sandbox_id, path, await request.body())
    return Response(status_code=204)


@api.get("/sandboxes/{sandbox_id}/archive")
async def download_archive(sandbox_id: str, path: PathQ, mgr: Mgr) -> Response:
    data = await mgr.download_tar(sandbox_id, path)
    return Response(content=data, media_type="application/x-tar")


@api.post("/sandboxes/{sandbox_id}/snapshot", response_model=ImageInfo, status_code=201)
async def snapshot(sandbox_id: str, body: SnapshotRequest, mgr: Mgr) -> ImageInfo:
    """pack_diff: the sandbox's changes become a new immutable image version on top of its image."""
    return await mgr.snapshot(sandbox_id, body)


@api.post("/sandboxes/{sandbox_id}/pause", response_model=SandboxInfo)
async def pause_sandbox(sandbox_id: str, mgr: Mgr) -> SandboxInfo:
    """Stop every process of the sandbox where it stands (VM kinds: the vCPUs). Not while a command runs."""
    return await mgr.pause(sandbox_id)


@api.post("/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo)
async def resume_sandbox(sandbox_id: str, mgr: Mgr) -> SandboxInfo:
    return await mgr.resume(sandbox_id)


@api.post("/sandboxes/{sandbox_id}/fork", response_model=ForkResult, status_code=201)
async def fork_sandbox(sandbox_id: str, body: ForkRequest, mgr: Mgr) -> ForkResult:
    """N new sandboxes restored from one memory snapshot of this one (VM kinds), all or none."""
    return await mgr.fork(sandbox_id, body)


ImageName = Annotated[str, Query(min_length=1, max_length=256, description="repo:tag")]


@api.get("/images", response_model=ImageList)
async def list_images(mgr: Mgr) -> ImageList:
    return ImageList(images=await mgr.images.list())


@api.get("/image", response_model=ImageInfo)
async def image_info(mgr: Mgr, name: ImageName) -> ImageInfo:
    return await mgr.images.info(name)


@api.get("/image/history", response_model=ImageList)
async def image_history(mgr: Mgr, name: ImageName) -> ImageList:
    """The version a name points at, then its ancestors (lineage), newest first."""
    return ImageList(images=await mgr.images.history(name))


@api.get("/image/stats", response_model=ImageStats)
async def image_stats(mgr: Mgr, name: ImageName) -> ImageStats:
    return await mgr.images.stats(name)


@api.delete("/image", status_code=204)
async def remove_image(mgr: Mgr, name: ImageName) -> Response:
    """Free the name; its layers go at the next gc unless another image shares them."""
    await mgr.remove_image(name)
    return Response(status_code=204)


@api.post("/images/gc", response_model=GcResult)
async def gc_images(mgr: Mgr) -> GcResult:
    """Delete versions, layers and chunks no image references; never one in use."""
    return await mgr.gc_images()


@api.post("/images/build", response_model=ImageInfo)
async def build_image(mgr: Mgr, name: ImageName) -> ImageInfo:
    """Build a built-in image if it is not built yet (minutes for dsec/debian:12 on first use)."""
    return await mgr.images.ensure(name)


@api.post("/images/builds", response_model=BuildResult, status_code=201)
async def build(body: BuildRequest, mgr: Mgr) -> BuildResult:
    """Build an image from a spec: each step a layer, cached by its inputs (minutes for apt steps)."""
    return await mgr.builds.build(body)


class ContextRef(BaseModel):
    context: str


@api.put("/build-contexts", response_model=ContextRef)
async def put_context(request: Request, mgr: Mgr) -> ContextRef:
    """Upload a tar archive for a build's copy step; answered with its content digest."""
    return ContextRef(context=await mgr.builds.put_context(await request.body()))


@api.post("/images/import", response_model=ImageInfo, status_code=201)
async def import_image(mgr: Mgr, body: ImportRequest) -> ImageInfo:
    """Import an OCI image layout directory or a `docker save` tarball that is on the daemon's node."""
    return await mgr.images.import_image(body.path, body.name, body.reference)


router.include_router(api)
