"""envd's HTTP file API (``GET``/``POST /files``: the SDK's ``files.read`` and ``files.write``) on the
core's read and write, so the same size limits, confinement and trajectory logging apply."""

from __future__ import annotations

import json
import posixpath
import zlib
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.datastructures import UploadFile

from ..errors import DsecError, InvalidRequest, LimitExceeded
from ..isolation.rootpath_meta import check_metadata
from ..kinds.base import MAX_FILE_READ
from ..protocol.sandbox import TERMINAL_STATES
from ..web.limits import MAX_UPLOAD_BODY
from . import file_urls
from .envd import Call, Refused, route
from .errors import files_status, plain_error
from .file_urls import Signed
from .hosts import envd_sandbox
from .service import E2BService

METADATA_PREFIX = "x-metadata-"
router = APIRouter()
PathQ = Annotated[str | None, Query(max_length=4096)]
UserQ = Annotated[str | None, Query(max_length=64)]


def _call(request: Request, path: str | None, operation: str, username: str | None) -> Call:
    """The call's sandbox: by its header and access token, or by a signed URL (file_urls.py)."""
    q = request.query_params
    signature, expiration = q.get("signature"), q.get("signature_expiration")
    if not signature or path is None or request.headers.get("x-access-token"):
        return route(request)
    svc: E2BService = request.app.state.e2b
    user = username or ""
    named = request.headers.get("e2b-sandbox-id", "").strip() or envd_sandbox(
        request.scope.get("headers", []), svc.options.domain
    )
    if named:
        result = file_urls.check(svc.tokens.token(named), path, operation, user, signature, expiration)
        found: str | None = named if result is not Signed.INVALID else None
    else:
        live = (r.id for r in svc.mgr.sandboxes.live() if r.state not in TERMINAL_STATES)
        found, result = file_urls.signer(live, svc.tokens.token, path, operation, user, signature, expiration)
    if result is Signed.EXPIRED:
        raise Refused(plain_error(401, "signature is already expired"))
    if found is None and not named:
        raise Refused(plain_error(401, "invalid signature: it was not made for this path, operation and user"))
    return route(request, signature=lambda sandbox_id: sandbox_id == found, sandbox_id=found)


async def _home(call: Call, username: str | None) -> str:
    return (await call.svc.account(call.rec, username or call.basic_user(), call.caller)).home


def _gunzip(data: bytes, limit: int) -> bytes:
    """A gzip body (one member or several), inflated to at most ``limit`` bytes: a small bomb must not
    fill the daemon's memory."""
    out = bytearray()
    rest = data
    while rest:
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out += inflate.decompress(rest, limit + 1 - len(out))
        except zlib.error as e:
            raise InvalidRequest(f"the body is not valid gzip: {e}") from None
        if len(out) > limit or inflate.unconsumed_tail:
            raise LimitExceeded(f"the uncompressed upload exceeds {limit} bytes")
        if not inflate.eof:
            raise InvalidRequest("the gzip body is truncated")
        rest = inflate.unused_data
    return bytes(out)


@router.get("/files")
async def download(request: Request, path: PathQ = None, username: UserQ = None) -> Response:
    try:
        call = _call(request, path, "read", username)
        if not path:
            raise InvalidRequest("the path query parameter is required")
        target = call.svc.absolute(path, await _home(call, username))
        data: bytes = await call.svc.call(call.rec, "read", {"path": target}, caller=call.caller)
    except Refused as e:
        return e.response
    except DsecError as e:
        return plain_error(files_status(e), e.message)
    return Response(data, media_type="application/octet-stream")


@router.post("/files")
async def upload(request: Request, path: PathQ = None, username: UserQ = None) -> Response:
    try:
        call = _call(request, path, "write", username)
        metadata = check_metadata(
            {k[len(METADATA_PREFIX) :]: v for k, v in request.headers.items() if k.lower().startswith(METADATA_PREFIX)}
        )
        backend = call.svc.mgr.backends.get(call.rec.kind)
        keeps = backend is not None and backend.keeps_metadata
        if metadata and not keeps:
            raise InvalidRequest(f"sandboxes of kind {call.rec.kind!r} keep no file metadata (X-Metadata-* headers)")
        home = await _home(call, username)
        files: list[tuple[str, bytes]] = []
        content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if content_type == "multipart/form-data":
            form = await request.form(max_files=1000, max_fields=1000)
            parts = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            if not parts:
                raise InvalidRequest("the multipart upload holds no file")
            for part in parts:
                name = path if path and len(parts) == 1 else part.filename
                if not name:
                    raise InvalidRequest("a multipart file has no name: give its path as the part's filename")
                files.append((call.svc.absolute(name, home), await part.read()))
        else:
            if not path:
                raise InvalidRequest("the path query parameter is required")
            body = await request.body()
            encoding = request.headers.get("content-encoding", "identity").strip().lower()
            if encoding == "gzip":
                body = _gunzip(body, min(MAX_UPLOAD_BODY, MAX_FILE_READ))
            elif encoding not in ("", "identity"):
                raise InvalidRequest(f"content-encoding {encoding!r} is not supported (gzip or identity)")
            files.append((call.svc.absolute(path, home), body))
        written = []
        for target, data in files:
            await call.svc.call(call.rec, "write", {"path": target, "mode": 0o644}, data, caller=call.caller)
            if metadata:  # the write dropped what the file had: an upload replaces it, as envd's does
                meta = {"path": target, "metadata": metadata}
                await call.svc.call(call.rec, "set_metadata", meta, caller=call.caller)
            info: dict[str, object] = {"name": posixpath.basename(target), "type": "file", "path": target}
            if metadata:
                info["metadata"] = metadata
            written.append(info)
    except Refused as e:
        return e.response
    except DsecError as e:
        return plain_error(files_status(e), e.message)
    return Response(json.dumps(written), media_type="application/json")
