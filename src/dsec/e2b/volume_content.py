"""E2B's volume content API (``E2B_VOLUME_API_URL``: the SDK's ``Volume.read_file``, ``write_file``,
``list``, ``get_info``, ``make_dir``, ``update_metadata``, ``remove``) on the core's volume files, with no
sandbox.

A call is opened by the volume's token (auth.py's VolumeTokens) as ``Authorization: Bearer`` and acts as
the tenant the token was given to. A token that does not open the volume named, whether or not a volume
of that name exists, is answered 401 alike, so names cannot be probed with a token of another volume.
Files stream both ways: an upload is written to the volume as it arrives (its bound is the volume's
quota, not the daemon's memory), a download is read as it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from ..core.volume_files import MAX_DEPTH, MAX_ID, VolumeEntry
from ..errors import DsecError, InvalidRequest, Unauthorized, VolumeNotFound, validation_message
from ..protocol.types import PATH_MAX
from ..tenancy import Caller
from ..web.auth import name_caller
from .auth import header
from .control_common import service
from .errors import content_error
from .volume_models import MetadataUpdate, VolumeEntryStat

router = APIRouter()
VolumeId = Annotated[str, Path(max_length=255)]
PathQ = Annotated[str, Query(min_length=1, max_length=PATH_MAX)]
IdQ = Annotated[int | None, Query(ge=0, le=MAX_ID)]
ModeQ = Annotated[int | None, Query(ge=0, le=0o7777)]
ForceQ = Annotated[bool | None, Query()]
Work = Callable[[Caller], Awaitable[Response]]
MAX_DRAINED = 64 << 20  # what is read of a refused upload's body, so that its client reads the refusal


def _caller(request: Request, volume_id: str) -> Caller:
    svc = service(request)
    scheme, _, raw = header(request.scope.get("headers", []), b"authorization").partition(b" ")
    token = raw.strip().decode(errors="replace") if scheme.lower() == b"bearer" else ""
    caller = svc.volume_tokens.holder(token, svc.mgr.tenants) if token else None
    if caller is not None:
        with contextlib.suppress(VolumeNotFound):
            info = svc.mgr.volume(volume_id, caller=caller)
            if svc.volume_tokens.opens(token, caller, info.name, info.created_at):
                name_caller(request.scope, caller)
                return caller
    raise Unauthorized(
        f"this token does not open volume {volume_id[:64]!r}: use the token Volume.create or Volume.connect gives"
    )


async def _answer(request: Request, volume_id: str, work: Work) -> Response:
    """``work`` as the token's caller; dsec's errors as the content API's."""
    try:
        return await work(_caller(request, volume_id))
    except DsecError as e:
        return content_error(e)


def _stat(e: VolumeEntry, status: int = 200) -> Response:
    return Response(VolumeEntryStat.of(e).wire(), status_code=status, media_type="application/json")


@router.get("/volumecontent/{volume_id}/path")
async def get_path(request: Request, volume_id: VolumeId, path: PathQ) -> Response:
    async def work(caller: Caller) -> Response:
        return _stat(await service(request).mgr.volume_files.stat(volume_id, path, caller=caller))

    return await _answer(request, volume_id, work)


@router.patch("/volumecontent/{volume_id}/path")
async def update_path(request: Request, volume_id: VolumeId, path: PathQ) -> Response:
    async def work(caller: Caller) -> Response:
        try:
            req = MetadataUpdate.model_validate_json(await request.body() or b"{}")
        except ValidationError as e:
            raise InvalidRequest(validation_message(e)) from None
        files = service(request).mgr.volume_files
        return _stat(
            await files.set_attributes(volume_id, path, uid=req.uid, gid=req.gid, mode=req.mode, caller=caller)
        )

    return await _answer(request, volume_id, work)


@router.delete("/volumecontent/{volume_id}/path")
async def delete_path(request: Request, volume_id: VolumeId, path: PathQ) -> Response:
    async def work(caller: Caller) -> Response:
        await service(request).mgr.volume_files.remove(volume_id, path, caller=caller)
        return Response(status_code=204)

    return await _answer(request, volume_id, work)


@router.get("/volumecontent/{volume_id}/dir")
async def list_dir(
    request: Request, volume_id: VolumeId, path: PathQ, depth: Annotated[int, Query(ge=1, le=MAX_DEPTH)] = 1
) -> Response:
    async def work(caller: Caller) -> Response:
        entries = await service(request).mgr.volume_files.list(volume_id, path, depth, caller=caller)
        return Response(
            "[" + ",".join(VolumeEntryStat.of(e).wire().decode() for e in entries) + "]", media_type="application/json"
        )

    return await _answer(request, volume_id, work)


@router.post("/volumecontent/{volume_id}/dir")
async def make_dir(
    request: Request,
    volume_id: VolumeId,
    path: PathQ,
    uid: IdQ = None,
    gid: IdQ = None,
    mode: ModeQ = None,
    force: ForceQ = None,
) -> Response:
    """``force``: the parents are made as needed, and a directory already there is no error."""

    async def work(caller: Caller) -> Response:
        files = service(request).mgr.volume_files
        made = await files.mkdir(volume_id, path, parents=bool(force), uid=uid, gid=gid, mode=mode, caller=caller)
        return _stat(made, 201)

    return await _answer(request, volume_id, work)


@router.put("/volumecontent/{volume_id}/file")
async def write_file(
    request: Request,
    volume_id: VolumeId,
    path: PathQ,
    uid: IdQ = None,
    gid: IdQ = None,
    mode: ModeQ = None,
    force: ForceQ = None,
) -> Response:
    """The body becomes the file, made or replaced whole (its parents made as needed); ``force`` changes
    nothing: a write replaces a file either way, as the SDK documents."""

    body = _body(request)

    async def work(caller: Caller) -> Response:
        files = service(request).mgr.volume_files
        return _stat(await files.write(volume_id, path, body, uid=uid, gid=gid, mode=mode, caller=caller), 201)

    answer = await _answer(request, volume_id, work)
    if answer.status_code >= 400:
        # a client still sending reads no answer: take in (and drop) a bounded rest of its body first
        await _drain(body, MAX_DRAINED)
    return answer


async def _body(request: Request) -> AsyncIterator[bytes]:
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect:
        raise InvalidRequest("the client went away before the whole file was sent: nothing was written") from None


async def _drain(body: AsyncIterator[bytes], limit: int) -> None:
    with contextlib.suppress(DsecError):
        async for chunk in body:
            limit -= len(chunk)
            if limit < 0:
                return


@router.get("/volumecontent/{volume_id}/file")
async def read_file(request: Request, volume_id: VolumeId, path: PathQ) -> Response:
    async def work(caller: Caller) -> Response:
        stack = contextlib.AsyncExitStack()
        try:
            chunks = await stack.enter_async_context(
                service(request).mgr.volume_files.reading(volume_id, path, caller=caller)
            )
        except BaseException:
            await stack.aclose()
            raise
        return Download(stack, chunks)

    return await _answer(request, volume_id, work)


class Download(StreamingResponse):
    """A file's contents as they are read. What the read holds (the open file, the borrowed volume) is
    let go when the answer ends, however it ends: sent whole, the client gone, or the task cancelled."""

    def __init__(self, held: contextlib.AsyncExitStack, chunks: AsyncIterator[bytes]) -> None:
        super().__init__(chunks, media_type="application/octet-stream")
        self._held = held

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with self._held:
            gone = asyncio.Event()

            async def watch() -> None:  # a client that leaves stops the reading, not only the sending
                with contextlib.suppress(Exception):
                    while (await receive())["type"] != "http.disconnect":
                        pass
                gone.set()

            watcher = asyncio.create_task(watch())
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    if gone.is_set():
                        return
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                watcher.cancel()
