"""The SandboxFusion-compatible API as one ASGI app, served by the daemon's own core on a listener of
its own (``dsec serve --sandbox-fusion-listen``); it starts and stops with the daemon (no lifespan of its
own). Routes live in their modules, each with its router, listed in ROUTERS."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.manager import SandboxManager
from ..errors import validation_message
from ..protocol.version import __version__
from ..web import telemetry
from ..web.audit import AuditMiddleware
from ..web.limits import BodyLimit
from . import routes
from .errors import answer_for, detail
from .service import FusionOptions, FusionService

ROUTERS: tuple[APIRouter, ...] = (routes.router,)


def create_fusion_app(manager: SandboxManager, options: FusionOptions, operator_token: str) -> FastAPI:
    app = FastAPI(
        telemetry=telemetry.OFF,
        title="dsec SandboxFusion-compatible API",
        version=__version__,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.manager = manager  # the audit log
    app.state.token = operator_token  # the audit resolves a bearer token if a client sends one
    app.state.fusion = FusionService(manager, options)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return detail(422, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return detail(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        return answer_for(exc)

    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(BodyLimit)
    app.add_middleware(AuditMiddleware, prefix="", unaudited=("/v1/ping",), label="fusion ")
    return app
