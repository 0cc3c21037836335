"""The node API's routes, and its OpenAPI document generated from them and the wire models (no daemon
needed)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from ..protocol.version import __version__
from ..web import telemetry
from . import (
    checkpoint_routes,
    code_routes,
    image_routes,
    node_routes,
    pool_routes,
    port_routes,
    routes,
    run_routes,
    tenant_routes,
    trajectory_routes,
    volume_routes,
    watch_routes,
)


def include_routes(app: FastAPI) -> None:
    app.include_router(node_routes.router)  # before routes: /sandboxes/batch is not a sandbox id
    app.include_router(watch_routes.router)
    app.include_router(node_routes.metrics_router)
    app.include_router(routes.router)
    app.include_router(image_routes.router)
    app.include_router(tenant_routes.router)
    app.include_router(run_routes.router)
    app.include_router(trajectory_routes.router)
    app.include_router(volume_routes.router)
    app.include_router(port_routes.router)
    app.include_router(code_routes.router)
    app.include_router(pool_routes.router)
    app.include_router(checkpoint_routes.router)


def openapi_spec() -> dict[str, Any]:
    """The OpenAPI document of the node API."""
    app = FastAPI(title="dsec", version=__version__, telemetry=telemetry.OFF)
    include_routes(app)
    return app.openapi()
