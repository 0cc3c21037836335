"""Application factory and the ``serve`` entry point."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from fastapi import FastAPI

from .. import __version__
from ..core.admission import AdmissionOptions
from ..core.manager import SandboxManager
from ..core.trajectory.recorder import TrajectoryOptions
from ..core.usage import DEFAULT_EVICT_AT
from ..errors import InvalidRequest
from ..images.scrub import ScrubRules
from ..images.store import ImageStore
from ..isolation.network.options import NetworkOptions
from ..store.audit import DEFAULT_KEEP_DAYS, DEFAULT_MAX_RECORDS, AuditLog
from . import errors, node_routes, routes, run_routes, tenant_routes, trajectory_routes
from .audit import AuditMiddleware
from .limits import BodyLimit

log = logging.getLogger("dsec.server")

DEFAULT_STATE_DIR = Path("/var/lib/dsec")
KEEP_ALIVE_S = 120


def default_listen(state_dir: Path) -> str:
    return f"unix://{state_dir / 'dsec.sock'}"


def ensure_token(state_dir: Path) -> str:
    """The operator's bearer token, created with mode 0600 at first start (tenants get theirs from it)."""
    path = state_dir / "token"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def create_app(manager: SandboxManager, token: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await manager.start()
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
    errors.install(app)
    app.include_router(node_routes.router)  # before routes: /sandboxes/batch is not a sandbox id
    app.include_router(node_routes.metrics_router)
    app.include_router(routes.router)
    app.include_router(tenant_routes.router)
    app.include_router(run_routes.router)
    app.include_router(trajectory_routes.router)
    app.add_middleware(BodyLimit)
    app.add_middleware(AuditMiddleware)  # added last: outside the body limit, so its 413s are audited too
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


def parse_listen(listen: str) -> dict[str, Any]:
    """uvicorn arguments for ``unix:///path`` or ``http://HOST:PORT``."""
    url = urlparse(listen)
    if url.scheme == "unix":
        if not url.path:
            raise InvalidRequest(f"--listen {listen!r}: expected unix:///absolute/path")
        return {"uds": url.path}
    if url.scheme == "http":
        if not url.hostname or url.port is None:
            raise InvalidRequest(f"--listen {listen!r}: expected http://HOST:PORT")
        return {"host": url.hostname, "port": url.port}
    raise InvalidRequest(f"--listen {listen!r}: use unix:///path or http://HOST:PORT")


@dataclass(frozen=True)
class ImageOptions:
    repository: str | None = None  # default: STATE_DIR/images/repository
    cache_max: int = 20 << 30
    lazy: bool = True
    scrub: tuple[str, ...] = ()  # residue rules on top of the defaults, for every layer this node packs
    canaries: tuple[str, ...] = ()  # strings no image this node publishes may contain, in any layer


@dataclass(frozen=True)
class AuditOptions:
    keep_days: float = DEFAULT_KEEP_DAYS
    max_records: int = DEFAULT_MAX_RECORDS


def serve(
    state_dir: Path,
    listen: str | None,
    images: ImageOptions | None = None,
    log_level: str = "info",
    audit: AuditOptions | None = None,
    network: NetworkOptions | None = None,
    function: Any = None,
    trajectory: TrajectoryOptions | None = None,
    admission: AdmissionOptions | None = None,
    evict_at: float = DEFAULT_EVICT_AT,
) -> None:
    """``function``: the function kind's FunctionOptions (kept opaque here: the server knows no kind)."""
    import uvicorn

    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    # traversable but not listable: crun, inside a sandbox's user namespace, must reach the bundle paths
    # under it before it pivots; the token and the state database are 0600 themselves
    os.chmod(state_dir, 0o711)
    listen = listen or default_listen(state_dir)
    where = parse_listen(listen)
    uds = where.get("uds")
    if isinstance(uds, str) and os.path.exists(uds):
        os.unlink(uds)  # a stale socket from a killed daemon
    token = ensure_token(state_dir)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    images = images or ImageOptions()
    store = ImageStore(
        state_dir / "images",
        images.repository,
        lazy=images.lazy,
        cache_max=images.cache_max,
        scrub=ScrubRules.of(images.scrub),
        canaries=images.canaries,
    )
    audit = audit or AuditOptions()
    audit_log = AuditLog(state_dir / "audit.db", keep_days=audit.keep_days, max_records=audit.max_records)
    kind_options = {"function": function} if function is not None else None
    manager = SandboxManager(
        state_dir,
        store,
        audit=audit_log,
        network=network,
        kind_options=kind_options,
        trajectory=trajectory,
        admission=admission,
        evict_at=evict_at,
    )
    app = create_app(manager, token)
    # Keep idle connections well past the SDK's own keep-alive expiry: a server that closes first races
    # with a request sent on the same connection, which the client then sees as a dropped read.
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
        **where,
    )
    server = uvicorn.Server(config)
    log.info("dsec %s listening on %s (state in %s)", __version__, listen, state_dir)
    server.run()
