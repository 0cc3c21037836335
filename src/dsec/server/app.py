"""The node API as an ASGI app."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI

from ..console import Console
from ..core.manager import SandboxManager
from ..protocol.version import __version__
from ..web import errors as errors
from ..web import telemetry
from ..web.audit import AuditMiddleware
from ..web.auth import identify_token
from ..web.errors import error_response
from ..web.idempotency import Idempotency, Memory
from ..web.limits import BodyLimit
from .allow import allowed_methods
from .fast_calls import FastCalls
from .openapi import include_routes
from .port_proxy import PortProxy

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

    app = FastAPI(title="dsec", version=__version__, lifespan=lifespan, telemetry=telemetry.OFF)
    app.state.manager = manager
    app.state.token = token
    errors.install(app, allowed_methods)
    include_routes(app)
    app.add_middleware(FastCalls)  # innermost: everything outside sees it as the route it serves
    app.add_middleware(BodyLimit)
    # outside the body limit: its 413s are answers too
    app.add_middleware(Idempotency, error=error_response, memory=remembered)
    app.add_middleware(AuditMiddleware)  # outside the others, so their answers are audited too
    # outside the audit: a browser's call is audited as its session's token, like any client's
    app.add_middleware(Console, verify=lambda token: identify_token(app, token.encode()))
    app.add_middleware(PortProxy, manager=manager)  # a sandbox's own traffic: none of the API's rules
    return app
