"""The one place where dsec's errors become the E2B wires' errors: the control API's ``{code, message}``
with an HTTP status, the envd API's Connect codes, envd's plain-HTTP answers (``/files``, and the
proxy's 502 for a sandbox that cannot be reached), and the volume content API's answers — chosen so
that the SDK raises the exception an E2B user expects (``SandboxNotFoundException``,
``NotFoundException``, ``TimeoutException``, ``RateLimitException``, ``InvalidArgumentException``,
``VolumePathNotFoundException``, ``AuthenticationException``, ...)."""

from __future__ import annotations

import math

from fastapi.responses import Response

from ..errors import (
    DsecError,
    FileNotFoundInSandbox,
    Forbidden,
    InvalidRequest,
    InvalidState,
    LimitExceeded,
    NotFound,
    QuotaExceeded,
    SandboxGone,
    SandboxTimeout,
    StorageFull,
    Unauthorized,
    VolumeExists,
)
from .connect import RpcError
from .control_models import Error
from .volume_models import ContentError

# E2B's proxy answers 502 with this wording for a sandbox it cannot find; the SDK turns a message
# containing "was not found" into SandboxNotRunningException ("killed or reached its timeout")
GONE_TEMPLATE = "The sandbox {id} was not found"


def control_status(e: DsecError) -> int:
    if isinstance(e, NotFound | SandboxGone):  # a stopped sandbox is one E2B no longer knows
        return 404
    if isinstance(e, Unauthorized):
        return 401
    if isinstance(e, Forbidden):
        return 403
    if isinstance(e, QuotaExceeded):
        return 429
    if isinstance(e, InvalidState | VolumeExists):
        return 409
    if isinstance(e, InvalidRequest | LimitExceeded):
        return 400
    if isinstance(e, SandboxTimeout):
        return 504
    if isinstance(e, StorageFull):
        return 507
    return 500


def control_error(e: DsecError, status: int | None = None) -> Response:
    status = status or control_status(e)
    headers = {}
    retry_after = e.detail.get("retry_after")
    if isinstance(retry_after, int | float):
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    body = Error(code=status, message=e.message).wire()
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def plain_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An answer before (or instead of) the Connect protocol: what E2B's proxy or envd's HTTP API send."""
    return Response(
        Error(code=status, message=message).wire(), status_code=status, media_type="application/json", headers=headers
    )


def gone(sandbox_id: str) -> Response:
    # the id comes from a header: quoted back bounded, as a valid id is
    return plain_error(502, GONE_TEMPLATE.format(id=sandbox_id[:64]))


def rpc_error(e: DsecError) -> RpcError:
    if isinstance(e, FileNotFoundInSandbox | NotFound):
        return RpcError("not_found", e.message)
    if isinstance(e, SandboxGone):
        return RpcError("unavailable", f"{e.message} (the sandbox was not found)")
    if isinstance(e, Unauthorized):
        return RpcError("unauthenticated", e.message)
    if isinstance(e, Forbidden):
        return RpcError("permission_denied", e.message)
    if isinstance(e, QuotaExceeded | LimitExceeded | StorageFull):
        return RpcError("resource_exhausted", e.message)
    if isinstance(e, InvalidState):
        return RpcError("failed_precondition", e.message)
    if isinstance(e, InvalidRequest):
        return RpcError("invalid_argument", e.message)
    if isinstance(e, SandboxTimeout):
        return RpcError("deadline_exceeded", e.message)
    return RpcError("internal", e.message)


def files_status(e: DsecError) -> int:
    """envd's /files answers: 404 missing, 400 bad path, 507 disk full (NotEnoughSpaceException)."""
    if isinstance(e, FileNotFoundInSandbox | NotFound):
        return 404
    if isinstance(e, LimitExceeded) and "disk is full" in e.message:
        return 507
    if isinstance(e, SandboxGone):
        return 502
    return control_status(e)


def content_status(e: DsecError) -> int:
    """The volume content API's answers: 404 a missing path (``VolumePathNotFoundException``), 409 a
    volume a sandbox writes, 507 a volume full to its quota; else as the control API answers."""
    if isinstance(e, NotFound):
        return 404
    if isinstance(e, LimitExceeded | StorageFull):
        return 507
    return control_status(e)


def content_error(e: DsecError) -> Response:
    status = content_status(e)
    body = ContentError(code=e.code, message=e.message).wire()
    return Response(body, status_code=status, media_type="application/json")
