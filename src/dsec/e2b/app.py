"""The E2B-compatible API as one ASGI app: E2B's control API (``E2B_API_URL``), its in-sandbox envd
API (``E2B_SANDBOX_URL``) and the sandboxes' ports (``get_host``, ports.py) on the same listener, all
served by the daemon's own core. The daemon
runs it on ``dsec serve --e2b-listen``; it starts and stops with the daemon (no lifespan of its own)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ..core.manager import SandboxManager
from ..errors import DsecError, environment_error, validation_message
from ..protocol.version import __version__
from ..web import telemetry
from ..web.audit import AuditMiddleware
from ..web.idempotency import Idempotency, Memory
from ..web.limits import BodyLimit

# the services register their routes on envd.router as they are imported
from . import (  # noqa: F401
    code_interpreter,
    control,
    envd,
    files,
    fs_service,
    process_service,
    templates,
    volume_content,
    volumes,
)
from .auth import EnvdTokens, VolumeTokens, load_key
from .code_interpreter_port import CodeInterpreterPort
from .connect import ResettableConnections
from .errors import control_error, plain_error
from .ports import E2BPorts
from .service import E2BOptions, E2BService

log = logging.getLogger("dsec.e2b")
STREAMED = re.compile(r"^/volumecontent/[^/]+/file$")
# /health, /process.Process/*, ...; /files; the control API; volumes and their contents; port 49999's API
# templates before control: its catch-all DELETE /templates/{id} must not take /templates/tags
ROUTERS = (
    envd.router,
    files.router,
    templates.router,
    control.router,
    volumes.router,
    volume_content.router,
    code_interpreter.router,
)


def allowed(request: Request) -> list[str]:
    """The methods of our routes at the request's path (none: it is none of ours)."""
    return sorted(
        {
            method
            for router in ROUTERS
            for route in router.routes
            if isinstance(route, APIRoute) and route.matches(request.scope)[0] != Match.NONE
            for method in route.methods or ()
        }
    )


def create_e2b_app(manager: SandboxManager, options: E2BOptions, state_dir: Path, operator_token: str) -> FastAPI:
    app = FastAPI(
        title="dsec E2B-compatible API",
        version=__version__,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        telemetry=telemetry.OFF,
    )
    app.state.manager = manager  # the audit log, and bearer tokens
    app.state.token = operator_token
    key = load_key(state_dir)
    tokens = EnvdTokens(key)
    options = code_interpreter.with_template(options)
    app.state.e2b = E2BService(manager, options, tokens, operator_token, VolumeTokens(key))
    app.state.e2b_templates = templates.E2BTemplates(app.state.e2b, state_dir, key)

    @app.exception_handler(DsecError)
    async def _dsec(_: Request, exc: DsecError) -> Response:
        if exc.http_status >= 500:
            log.error("%s: %.2000s", exc.code, exc.message)
        return control_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return plain_error(400, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method the path has, not only those of the route matched first
            headers["Allow"] = ", ".join(allowed(request)) or headers.get("Allow", "")
        return plain_error(exc.status_code, str(exc.detail), headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        if (known := environment_error(exc)) is not None:
            return await _dsec(request, known)
        log.exception("internal error in the E2B API")
        return plain_error(500, f"internal error: {type(exc).__name__}: {exc}")

    # /health, /process.Process/*, ...; /files; the control API; volumes and their contents
    for router in ROUTERS:
        app.include_router(router)

    async def other(request: Request) -> Response:
        """A method a path of ours does not have: a 405 that says which it has; any other path: E2B's
        endpoints dsec does not serve (control.unsupported)."""
        methods = allowed(request)
        if methods:
            return plain_error(405, "Method Not Allowed", {"Allow": ", ".join(methods)})
        return control.unsupported(request)

    app.add_api_route("/{rest:path}", other, methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    app.add_middleware(templates.RequestScope)  # whose template a sandbox is created from
    # a volume's file is written to the volume as it arrives, bounded by the volume's quota
    app.add_middleware(BodyLimit, streamed=STREAMED)
    remembered = manager.metrics.remembered["e2b"] = Memory()
    app.add_middleware(
        Idempotency, error=lambda status, _code, message: plain_error(status, message), memory=remembered
    )
    app.add_middleware(AuditMiddleware, prefix="", unaudited=("/health",), label="e2b ")
    # a sandbox's own traffic (get_host): none of the API's rules
    app.add_middleware(E2BPorts, manager=manager, tokens=tokens, domain=options.domain)
    # port 49999, the e2b-code-interpreter package's server: dsec's code contexts answer it
    app.add_middleware(CodeInterpreterPort, tokens=tokens, domain=options.domain)
    # outermost, where the server's own receive callable arrives: a stream cut for a sandbox that died
    app.add_middleware(ResettableConnections)
    return app
