"""The one place where errors become the SandboxFusion API's answers.

SandboxFusion answers a call it could not run with HTTP 200 and ``status: SandboxError`` plus a message;
the ``sandbox-fusion`` client raises on it, and verl scores it as a sandbox error. A node with no room
for another sandbox (its queue waited out, or its quotas) answers 504 instead: verl retries a call only
on 504 (a gateway's timeout), and the client retries on anything. A request the models refuse is a 422,
as FastAPI answers it in SandboxFusion's own server, with a one-line ``detail``.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from ..errors import DsecError, QuotaExceeded, SandboxTimeout, environment_error
from .models import RunCodeResponse

log = logging.getLogger("dsec.fusion")


def detail(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": message})


def sandbox_error(message: str) -> JSONResponse:
    return JSONResponse(status_code=200, content=RunCodeResponse.sandbox_error(message).model_dump(mode="json"))


def answer_for(exc: Exception) -> JSONResponse:
    known = exc if isinstance(exc, DsecError) else environment_error(exc)
    if known is None:
        log.exception("internal error in the SandboxFusion API", exc_info=exc)
        return sandbox_error(f"internal error: {type(exc).__name__}: {exc}")
    if isinstance(known, QuotaExceeded | SandboxTimeout):
        return detail(504, f"{known.code}: {known.message}")
    if known.http_status >= 500:
        log.error("%s: %.2000s", known.code, known.message)
    return sandbox_error(f"{known.code}: {known.message}")
