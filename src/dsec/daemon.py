"""The node daemon as a process: its core, the node API and, when asked, the E2B-compatible API and the
SandboxFusion-compatible API, each on a listener of its own, served by uvicorn. It sits above the APIs
(server/, e2b/, fusion/), which know nothing of each other.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from starlette.types import ASGIApp

from .core.admission import AdmissionOptions
from .core.manager import SandboxManager
from .core.trajectory.recorder import TrajectoryOptions
from .core.usage import DEFAULT_EVICT_AT
from .errors import InvalidRequest
from .images.registry import RegistryOptions
from .images.scrub import ScrubRules
from .images.store import ImageStore
from .isolation.network.options import NetworkOptions
from .protocol.pools import WarmPoolSpec
from .protocol.version import __version__
from .server.app import create_app
from .store.audit import DEFAULT_KEEP_DAYS, DEFAULT_MAX_RECORDS, AuditLog
from .web import tokens
from .web.listeners import ByListener

if TYPE_CHECKING:
    from .e2b.service import E2BOptions
    from .fusion.service import FusionOptions

log = logging.getLogger("dsec.server")

DEFAULT_STATE_DIR = Path("/var/lib/dsec")


def default_listen(state_dir: Path) -> str:
    return f"unix://{state_dir / 'dsec.sock'}"


def ensure_token(state_dir: Path) -> str:
    """The operator's bearer token, created with mode 0600 at first start (tenants get theirs from it)."""
    return tokens.ensure_token(state_dir / "token")


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
    registry: RegistryOptions | None = None  # how registries are reached (default: anonymous, ~/.docker)


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
    e2b: E2BOptions | None = None,
    fusion: FusionOptions | None = None,
    *,
    warm: dict[str, WarmPoolSpec] | None = None,
) -> None:
    """``function``: the function kind's FunctionOptions (kept opaque here: the server knows no kind).
    ``e2b``: also serve the E2B-compatible API on its own listener (docs/e2b.md); ``fusion``: the
    SandboxFusion-compatible API on its own (docs/sandbox-fusion.md)."""
    import uvicorn

    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    # traversable but not listable: crun, inside a sandbox's user namespace, must reach the bundle paths
    # under it before it pivots; the token and the state database are 0600 themselves
    os.chmod(state_dir, 0o711)
    listen = listen or default_listen(state_dir)
    where = parse_listen(listen)
    e2b_where = parse_listen(e2b.listen) if e2b is not None else None
    fusion_where = parse_listen(fusion.listen) if fusion is not None else None
    _distinct({"--listen": where, "--e2b-listen": e2b_where, "--sandbox-fusion-listen": fusion_where})
    uds = where.get("uds")
    if isinstance(uds, str) and os.path.exists(uds):
        os.unlink(uds)  # a stale socket from a killed daemon
    token = ensure_token(state_dir)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    manager = _manager(
        state_dir, images or ImageOptions(), audit or AuditOptions(), network, function, trajectory, admission, evict_at
    )
    manager.warm_at_start(warm or {})
    app: ASGIApp = create_app(manager, token)
    # Keep idle connections well past the SDK's own keep-alive expiry: a server that closes first races
    # with a request sent on the same connection, which the client then sees as a dropped read.
    settings: dict[str, Any] = {
        "log_level": log_level,
        "access_log": False,
        "timeout_graceful_shutdown": 5,
        "timeout_keep_alive": tokens.KEEP_ALIVE_S,
        # WebSockets (exposed ports, E2B) by the pinned wsproto, whatever else is installed beside dsec
        # (uvicorn prefers the websockets package when it is there; openenv-core brings it)
        "ws": "wsproto",
    }
    others: list[tuple[dict[str, Any], Callable[[int], ASGIApp]]] = []
    if e2b is not None and e2b_where is not None:
        others.append((e2b_where, lambda port: _e2b_app(manager, e2b, state_dir, token, e2b_where, port)))
    if fusion is not None and fusion_where is not None:
        others.append((fusion_where, lambda port: _fusion_app(manager, fusion, token, fusion_where, port)))
    sockets = None
    if others:
        app, sockets = _with_listeners(app, settings, where, others)
    server = uvicorn.Server(uvicorn.Config(app, **settings, **where))
    log.info("dsec %s listening on %s (state in %s)", __version__, listen, state_dir)
    tune_gc()
    server.run(sockets=sockets)


def tune_gc() -> None:
    """Python's cyclic garbage collector traverses what it tracks, and a node holding thousands of
    sandboxes tracks half a million objects: with the default thresholds the collections took 2 s of a
    burst of 200 creations at 2,000 held (full ones 240 ms each, the event loop stopped meanwhile). What
    was made to start the daemon (modules, the app, its models) is frozen out of the collector's sight,
    and collections run less often; garbage without cycles is freed at once as ever."""
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)


def _manager(
    state_dir: Path,
    images: ImageOptions,
    audit: AuditOptions,
    network: NetworkOptions | None,
    function: Any,
    trajectory: TrajectoryOptions | None,
    admission: AdmissionOptions | None,
    evict_at: float,
) -> SandboxManager:
    store = ImageStore(
        state_dir / "images",
        images.repository,
        lazy=images.lazy,
        cache_max=images.cache_max,
        scrub=ScrubRules.of(images.scrub),
        canaries=images.canaries,
        registry=images.registry,
    )
    audit_log = AuditLog(state_dir / "audit.db", keep_days=audit.keep_days, max_records=audit.max_records)
    kind_options = {"function": function} if function is not None else None
    return SandboxManager(
        state_dir,
        store,
        audit=audit_log,
        network=network,
        kind_options=kind_options,
        trajectory=trajectory,
        admission=admission,
        evict_at=evict_at,
    )


def _distinct(listeners: dict[str, dict[str, Any] | None]) -> None:
    seen: dict[str, str] = {}
    for flag, where in listeners.items():
        if where is None:
            continue
        key = repr(sorted(where.items()))
        if key in seen:
            raise InvalidRequest(f"{flag} must differ from {seen[key]}")
        seen[key] = flag


def _with_listeners(
    app: ASGIApp,
    settings: dict[str, Any],
    where: dict[str, Any],
    others: list[tuple[dict[str, Any], Callable[[int], ASGIApp]]],
) -> tuple[ASGIApp, list[Any]]:
    """The app that also answers each other listener (its app made for the port it got), and every
    listener's socket, bound now."""
    import uvicorn

    bound = []
    for other_where, make in others:
        sock = uvicorn.Config(app, **settings, **other_where).bind_socket()
        bound.append((sock, make))
    main_socket = uvicorn.Config(app, **settings, **where).bind_socket()
    for sock in (main_socket, *(s for s, _ in bound)):
        # uvicorn makes them inheritable (for its worker processes): the layer fetcher the daemon
        # starts, which outlives it, would otherwise hold the listeners and swallow connections
        sock.set_inheritable(False)
    for sock, make in bound:
        port = sock.getsockname()[1]
        app = ByListener(app, make(port), port)  # nested: each picks out its own port, the rest goes on
    return app, [main_socket, *(s for s, _ in bound)]


def _e2b_app(
    manager: SandboxManager, e2b: E2BOptions, state_dir: Path, token: str, e2b_where: dict[str, Any], port: int
) -> ASGIApp:
    from .e2b.app import create_e2b_app

    # E2B's get_host(port) names PORT-ID.DOMAIN: by default a name of this machine's loopback that
    # browsers and curl resolve (*.localhost), with the listener's port
    e2b = dataclasses.replace(e2b, domain=e2b.domain or f"localhost:{port}")
    manager.e2b_url = f"http://{e2b_where['host']}:{port}"
    log.info("E2B-compatible API on http://%s:%d (E2B_API_URL and E2B_SANDBOX_URL)", e2b_where["host"], port)
    return create_e2b_app(manager, e2b, state_dir, token)


def _fusion_app(
    manager: SandboxManager, fusion: FusionOptions, token: str, fusion_where: dict[str, Any], port: int
) -> ASGIApp:
    from .fusion.app import create_fusion_app

    log.info("SandboxFusion-compatible API on http://%s:%d/run_code", fusion_where["host"], port)
    return create_fusion_app(manager, fusion, token)
