"""``dsec cluster``: node daemons on a Ray cluster behind one gateway (``up``), a gateway over daemons
started some other way (``gateway``), and what a gateway sees (``status``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..errors import DsecError
from .common import TokenOpt, UrlOpt, console, err, ident, show
from .common import fail as _fail

cluster_app = typer.Typer(help="Scale out: a node daemon per Ray node behind one gateway.", no_args_is_help=True)

DEFAULT_STATE_ROOT = Path("/var/lib/dsec-cluster")
ListenOpt = Annotated[str, typer.Option(help="Where the gateway listens: http://HOST:PORT.")]
IntervalOpt = Annotated[float, typer.Option(min=0.05, help="Seconds between health checks of each node.")]
MissesOpt = Annotated[int, typer.Option(min=1, help="Health checks missed in a row before a node is lost.")]
E2BListenOpt = Annotated[
    str | None,
    typer.Option(
        help="Also serve the E2B-compatible API of the cluster on http://HOST:PORT (E2B_API_URL and "
        "E2B_SANDBOX_URL; E2B_API_KEY is the cluster's token). Every node must serve it too (dsec serve "
        "--e2b-listen; `up` starts them so)."
    ),
]
E2BDomainOpt = Annotated[
    str | None,
    typer.Option(
        help="E2B's sandbox domain at the gateway: get_host(port) answers PORT-ID.DOMAIN, which must reach "
        "--e2b-listen (wildcard DNS, or a Host header). Default: localhost:PORT of --e2b-listen."
    ),
]


@cluster_app.command()
def up(
    listen: ListenOpt = "http://127.0.0.1:7070",
    address: Annotated[
        str | None,
        typer.Option(help="Ray cluster to join (e.g. auto, or HEAD_IP:6379). Default: start a local Ray node."),
    ] = None,
    local_nodes: Annotated[
        int,
        typer.Option(min=0, max=64, help="Start a local N-node Ray test cluster on this machine instead."),
    ] = 0,
    state_root: Annotated[
        Path, typer.Option(help="On every node, each daemon's state directory is STATE_ROOT/NODE_NAME.")
    ] = DEFAULT_STATE_ROOT,
    token_file: Annotated[
        Path | None,
        typer.Option(help="The cluster's operator token (made 0600 at first use). Default: STATE_ROOT/token."),
    ] = None,
    repository: Annotated[
        str | None,
        typer.Option(help="Layer repository every node shares: a shared directory mount or s3://bucket/prefix?..."),
    ] = None,
    trajectory_db: Annotated[
        str | None,
        typer.Option(help="Trajectory log every node shares (postgresql://...): trajectories resume on any node."),
    ] = None,
    label: Annotated[
        str | None, typer.Option(help="KEY=VALUE: only Ray nodes with this node label run a daemon.")
    ] = None,
    node_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--node-arg", help="An argument for every `dsec serve` (repeatable), e.g. --node-arg=--cpu-ratio=4."
        ),
    ] = None,
    interval: IntervalOpt = 1.0,
    misses: MissesOpt = 3,
    keep_sandboxes: Annotated[
        bool, typer.Option(help="On stop, leave the nodes' sandboxes running (the next `up` re-adopts them).")
    ] = False,
    e2b_listen: E2BListenOpt = None,
    e2b_domain: E2BDomainOpt = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
) -> None:
    """Start a node daemon on every Ray node and a gateway in front of them, in the foreground until
    Ctrl-C or SIGTERM; then stop the daemons. Point the SDK at the gateway with DSEC_URL and DSEC_TOKEN."""
    import logging

    import uvloop

    from ..cluster.options import RayOptions
    from ..cluster.runner import run_ray
    from ..web.tokens import ensure_token

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token_path = token_file or state_root / "token"
    try:
        _check(listen, e2b_listen, e2b_domain)
        state_root.mkdir(parents=True, exist_ok=True)
        token = ensure_token(token_path)
        opts = RayOptions(
            listen=listen,
            state_root=state_root.resolve(),
            token=token,
            repository=repository,
            address=address,
            local_nodes=local_nodes,
            node_args=tuple(node_arg or ()),
            trajectory_db=trajectory_db,
            label=label,
            interval=interval,
            misses=misses,
            keep_sandboxes=keep_sandboxes,
            ready=_announce(token_path, e2b_listen),
            e2b_listen=e2b_listen,
            e2b_domain=e2b_domain,
        )
        uvloop.run(run_ray(opts))  # as uvicorn runs the daemon: the gateway's hop costs less
    except DsecError as e:
        _fail(e)


def _check(listen: str, e2b_listen: str | None, e2b_domain: str | None) -> None:
    """Bad addresses fail here, before any node daemon is started."""
    from ..cluster.runner import listen_address
    from ..e2b.hosts import check_domain

    listen_address(listen)
    if e2b_listen is not None:
        listen_address(e2b_listen)
    check_domain(e2b_domain)


def _announce(token_path: Path, e2b_listen: str | None) -> Callable[[str], None]:
    """What to print once the gateway listens: how to point the SDK (and E2B's) at it."""

    def ready(url: str) -> None:
        console.print(f"[green]dsec cluster up[/green]: gateway at {url}")
        console.print(f"  export DSEC_URL={url}")
        console.print(f"  export DSEC_TOKEN=$(cat {token_path})")
        if e2b_listen is not None:
            console.print(f"  export E2B_API_URL={e2b_listen} E2B_SANDBOX_URL={e2b_listen}")
            console.print(f"  export E2B_API_KEY=$(cat {token_path})")

    return ready


@cluster_app.command()
def gateway(
    node: Annotated[list[str], typer.Option("--node", help="A node daemon's URL, http://HOST:PORT (repeatable).")],
    listen: ListenOpt = "http://127.0.0.1:7070",
    token_file: Annotated[
        Path, typer.Option(help="The operator token every node was started with (each node's STATE_DIR/token).")
    ] = DEFAULT_STATE_ROOT / "token",
    interval: IntervalOpt = 1.0,
    misses: MissesOpt = 3,
    e2b_listen: E2BListenOpt = None,
    e2b_domain: E2BDomainOpt = None,
) -> None:
    """A gateway over node daemons started some other way (no Ray), in the foreground."""
    import logging

    from ..cluster.runner import serve_static
    from ..web.tokens import read_token

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve_static(
            node,
            read_token(token_file),
            listen,
            interval=interval,
            misses=misses,
            e2b_listen=e2b_listen,
            e2b_domain=e2b_domain,
        )
    except DsecError as e:
        _fail(e)


@cluster_app.command()
def status(
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print GET /v1/cluster as JSON.")] = False,
) -> None:
    """The gateway's nodes: health, address, capacity, what they hold."""
    import httpx

    from ..cluster.models import ClusterStatus
    from ..sdk.transport import raise_for_reply, resolve_target

    target, secret = resolve_target(url, token)
    if not target.startswith(("http://", "https://")):
        err.print(f"[red]error[/red]: {target} is not a gateway's URL (http://HOST:PORT); set --url or DSEC_URL")
        raise typer.Exit(2)
    try:
        headers = {"authorization": f"Bearer {secret}"} if secret else {}
        reply = httpx.get(target.rstrip("/") + "/v1/cluster", headers=headers, timeout=30)
        raise_for_reply(reply.status_code, reply.content)
    except httpx.HTTPError as e:
        err.print(f"[red]error[/red]: cannot reach the gateway at {target}: {e}")
        raise typer.Exit(2) from None
    except DsecError as e:
        _fail(e)
    st = ClusterStatus.model_validate_json(reply.content)
    if as_json:
        console.print_json(json.dumps(st.model_dump(mode="json")))
        return
    table = Table(
        ident("node"), "health", ident("url"), "cpu free/alloc", "memory free/alloc", "sandboxes", "queued", "why"
    )
    colour = {"healthy": "green", "suspect": "yellow", "lost": "red"}
    for n in st.nodes:
        s = n.status
        cpu = f"{s.free.cpu:.2f}/{s.allocatable.cpu:.2f}" if s else "-"
        mem = f"{s.free.memory / 2**30:.1f}/{s.allocatable.memory / 2**30:.1f} GiB" if s else "-"
        live = sum(c for states in s.sandboxes.values() for c in states.values()) if s else n.routed
        health = f"[{colour.get(n.health, 'white')}]{n.health}[/]"
        table.add_row(n.name, health, n.url, cpu, mem, str(live), str(s.queued if s else "-"), n.reason or "")
    show(table)
    if st.total is not None:
        t = st.total
        console.print(
            f"total: {t.free.cpu:.2f} of {t.allocatable.cpu:.2f} cores and "
            f"{t.free.memory / 2**30:.1f} of {t.allocatable.memory / 2**30:.1f} GiB free; {t.queued} queued"
        )
    if not any(n.health == "healthy" for n in st.nodes):
        err.print("[red]no healthy node[/red]")
        raise typer.Exit(1)
