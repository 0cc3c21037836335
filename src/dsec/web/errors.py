"""The one place where errors become HTTP responses."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import DsecError, MethodNotAllowed, NotFound, Unauthorized, environment_error, validation_message
from ..protocol.sandbox import ErrorBody, ErrorResponse

log = logging.getLogger("dsec.server")


def error_response(
    status: int,
    code: str,
    message: str,
    detail: dict[str, object] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(code=code, message=message, detail=detail or {}))
    out = dict(headers or {})
    retry_after = (detail or {}).get("retry_after")
    if isinstance(retry_after, int | float):
        out["Retry-After"] = str(max(1, math.ceil(retry_after)))  # whole seconds, as HTTP says
    return JSONResponse(status_code=status, content=body.model_dump(mode="json"), headers=out or None)


def dsec_error_response(exc: DsecError) -> JSONResponse:
    """The answer to a DsecError (for the handler below, and a route served outside FastAPI's routing)."""
    if exc.http_status >= 500:
        # messages may quote sandbox output (bounded on the wire, not meant to fill the log)
        log.error("%s: %.2000s", exc.code, exc.message)
    return error_response(exc.http_status, exc.code, exc.message, exc.detail)


def install(app: FastAPI, allowed_methods: Callable[[str], frozenset[str] | None]) -> None:
    """The handlers of an API's errors; ``allowed_methods``: a path's methods, for a 405's Allow header."""

    @app.exception_handler(DsecError)
    async def _dsec(_: Request, exc: DsecError) -> JSONResponse:
        return dsec_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, "invalid_request", validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        known = {401: Unauthorized, 404: NotFound, 405: MethodNotAllowed}.get(exc.status_code)
        code = known.code if known is not None else "http_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method the path has, not only those of the route matched first
            allowed = allowed_methods(request.url.path)
            if allowed:
                headers["Allow"] = ", ".join(sorted(allowed))
        return error_response(exc.status_code, code, str(exc.detail), headers=headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        if (known := environment_error(exc)) is not None:
            return await _dsec(request, known)
        log.exception("internal error")
        return error_response(500, "internal", f"internal error: {type(exc).__name__}: {exc}")
