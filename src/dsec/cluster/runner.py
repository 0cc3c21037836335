"""Running a gateway: over a fixed list of node daemons, or over the node daemons of a Ray cluster.

``serve_static`` needs nothing but the node URLs (``dsec cluster gateway --node URL ...``).
``run_ray`` starts a node daemon on every Ray node (``ray_nodes.py``), serves the gateway over them,
follows the cluster (a node that joins gets a daemon, a node Ray declares dead is lost at once, without
waiting for missed health checks), and stops the daemons when it is told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any
from urllib.parse import urlparse

from ..errors import InvalidRequest
from ..web.tokens import KEEP_ALIVE_S
from .gateway import Gateway
from .nodes import NodeSet
from .options import RayOptions
from .ports import E2BGatewayPorts, GatewayPorts, PortTraffic

log = logging.getLogger("dsec.cluster")


def listen_address(listen: str) -> tuple[str, int]:
    url = urlparse(listen)
    if url.scheme != "http" or not url.hostname or url.port is None:
        raise InvalidRequest(f"--listen {listen!r}: expected http://HOST:PORT")
    return url.hostname, url.port


def server(app: Any, host: str, port: int, log_level: str = "warning") -> Any:
    """A uvicorn server for the gateway's app (uvloop and httptools when installed, as the daemon)."""
    import uvicorn

    return uvicorn.Server(_config(app, host, port, log_level))


def _config(app: Any, host: str, port: int, log_level: str) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=5,
        ws="wsproto",  # as the node daemon's: the pinned library, not whichever is installed
    )


def node_api(gateway: Gateway, traffic: PortTraffic | None = None) -> Any:
    """The gateway as served: sandboxes' ports outermost (their traffic is the sandboxes', not calls),
    the web console (/ui and its sessions), then Idempotency-Keys remembered by the gateway itself, so
    a repeated creation whose answer was lost is answered again instead of being placed a second time
    (perhaps on another node)."""
    from ..console import Console
    from ..web.errors import error_response
    from ..web.idempotency import Idempotency

    # the console inside the ports (a sandbox's own /ui is the sandbox's), outside the API it logs in to
    api = Console(Idempotency(gateway, error=error_response), verify=gateway.verify, cluster=True)
    return GatewayPorts(api, gateway, traffic or PortTraffic(gateway))


def servers(
    gateway: Gateway, listen: str, e2b_listen: str | None, log_level: str = "warning", e2b_domain: str | None = None
) -> tuple[Any, list[Any] | None]:
    """The gateway's uvicorn server and, with ``e2b_listen``, the sockets to serve it on: the gateway's
    own and the E2B API's (cluster/e2b.py), one server for both as in the daemon. ``e2b_domain``: E2B's
    sandbox domain (get_host's ``PORT-ID.DOMAIN``), by default ``localhost:PORT`` of the E2B listener."""
    import uvicorn

    from ..e2b.errors import plain_error
    from ..e2b.hosts import check_domain
    from ..web.idempotency import Idempotency
    from ..web.listeners import ByListener
    from .e2b import E2BGateway

    host, port = listen_address(listen)
    traffic = PortTraffic(gateway)  # one bound per sandbox, whichever listener its traffic comes in on
    api = node_api(gateway, traffic)
    if e2b_listen is None:
        return server(api, host, port, log_level), None
    domain = check_domain(e2b_domain)
    e2b_host, e2b_port = listen_address(e2b_listen)
    sockets = [_config(gateway, host, port, log_level).bind_socket()]
    sockets.append(_config(gateway, e2b_host, e2b_port, log_level).bind_socket())
    for sock in sockets:
        sock.set_inheritable(False)  # uvicorn makes them inheritable for its workers; none here
    actual = sockets[1].getsockname()[1]
    domain = domain or f"localhost:{actual}"
    e2b = E2BGateway(gateway, domain)
    e2b_api = Idempotency(e2b, error=lambda status, _code, message: plain_error(status, message))
    app = ByListener(api, E2BGatewayPorts(e2b_api, e2b, traffic, domain), actual)
    log.info("E2B-compatible API of the cluster on http://%s:%d (sandbox domain %s)", e2b_host, actual, domain)
    return uvicorn.Server(_config(app, host, port, log_level)), sockets


def serve_static(
    urls: list[str],
    token: str,
    listen: str,
    *,
    interval: float = 1.0,
    misses: int = 3,
    e2b_listen: str | None = None,
    e2b_domain: str | None = None,
) -> None:
    """A gateway over node daemons that run already (started by hand, by systemd, ...); ``e2b_listen``:
    also the E2B API over the nodes' own E2B listeners."""
    nodes = NodeSet(token, interval=interval, misses=misses)
    for url in urls:
        nodes.add(url)
    srv, sockets = servers(Gateway(nodes, token), listen, e2b_listen, log_level="info", e2b_domain=e2b_domain)
    srv.run(sockets=sockets)


async def follow(gateway: Gateway, fleet: Any, stop: asyncio.Event, every: float = 2.0) -> None:
    """Keep the gateway's nodes in step with Ray: new Ray nodes get a daemon, dead ones are lost."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
        if stop.is_set():
            return
        try:
            added, dead = await asyncio.to_thread(fleet.sync)
        except Exception as e:  # Ray hiccups must not take the gateway down
            log.warning("could not follow the Ray cluster: %s", e)
            continue
        for daemon in added:
            gateway.nodes.add(daemon.url, daemon.name, ray_node=daemon.ray_node)
        for daemon, why in dead:
            node = gateway.nodes.by_name(daemon.name)
            if node is not None:
                gateway.nodes.retire(node, why)


async def run_ray(opts: RayOptions, stop: asyncio.Event | None = None) -> None:
    """Start (or join) the Ray cluster, a node daemon per Ray node, and the gateway; serve until
    ``stop`` is set (default: SIGINT or SIGTERM); then stop the daemons (their sandboxes killed unless
    ``keep_sandboxes``) and leave Ray if it was joined here."""
    from .ray_nodes import Fleet  # Ray is needed from here on only

    host, port = listen_address(opts.listen)
    fleet = Fleet(opts)
    fleet.connect()  # in this thread: Ray installs signal handlers when it is the main one
    loop = asyncio.get_running_loop()
    signals = stop is None
    stop = stop or asyncio.Event()
    if signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    try:
        daemons = await asyncio.to_thread(fleet.start_all)
        if not daemons:
            raise InvalidRequest("no Ray node to run a node daemon on (check --label and the dsec_node resource)")
        nodes = NodeSet(opts.token, interval=opts.interval, misses=opts.misses)
        for d in daemons:
            nodes.add(d.url, d.name, ray_node=d.ray_node)
        gateway = Gateway(nodes, opts.token)
        srv, sockets = servers(gateway, opts.listen, opts.e2b_listen, log_level="info", e2b_domain=opts.e2b_domain)
        srv.install_signal_handlers = lambda: None  # ours: stop following Ray first, then the server
        serving = asyncio.create_task(srv.serve(sockets=sockets))
        watcher = asyncio.create_task(follow(gateway, fleet, stop))
        while not srv.started and not serving.done():  # noqa: ASYNC110 (uvicorn sets a flag, no event)
            await asyncio.sleep(0.05)
        if srv.started and opts.ready is not None:
            opts.ready(f"http://{host}:{port}")
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([serving, stopped], return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        srv.should_exit = True
        await asyncio.gather(serving, watcher, stopped, return_exceptions=True)
    finally:
        if signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        await asyncio.to_thread(fleet.stop_daemons)
        fleet.leave()
