"""The node API as an ASGI app (``create_app``) and its OpenAPI document."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from ..core.manager import SandboxManager
from ..protocol.version import __version__
from ..web import errors as errors
from ..web.audit import AuditMiddleware
from ..web.errors import error_response
from ..web.idempotency import Idempotency, Memory
from ..web.limits import BodyLimit
from . import node_routes, routes, run_routes, tenant_routes, trajectory_routes
from .allow import allowed_methods

if TYPE_CHECKING:
    pass

log = logging.getLogger("dsec.server")


def create_app(manager: SandboxManager, token: str) -> FastAPI:
    remembered = Memory()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        manager.metrics.remembered["node"] = remembered
        manager.tenants.set_operator_token(token)
        for note in manager.notes:
            log.info("%s", note)
        try:
            yield
        finally:
            await manager.close()

    app = FastAPI(title="dsec", version=__version__, lifespan=lifespan)
    app.state.manager = manager
    app.state.token = token
    errors.install(app, allowed_methods)
    app.include_router(node_routes.router)  # before routes: /sandboxes/batch is not a sandbox id
    app.include_router(node_routes.metrics_router)
    app.include_router(routes.router)
    app.include_router(tenant_routes.router)
    app.include_router(run_routes.router)
    app.include_router(trajectory_routes.router)
    app.add_middleware(BodyLimit)
    # outside the body limit: its 413s are answers too
    app.add_middleware(Idempotency, error=error_response, memory=remembered)
    app.add_middleware(AuditMiddleware)  # added last: outside the others, so their answers are audited too
    return app


def openapi_spec() -> dict[str, Any]:
    """The OpenAPI document, generated from the routes and wire models (no daemon needed)."""
    app = FastAPI(title="dsec", version=__version__)
    app.include_router(node_routes.router)  # before routes: /sandboxes/batch is not a sandbox id
    app.include_router(node_routes.metrics_router)
    app.include_router(routes.router)
    app.include_router(tenant_routes.router)
    app.include_router(run_routes.router)
    app.include_router(trajectory_routes.router)
    return app.openapi()
