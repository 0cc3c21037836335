"""``dsec``: serve, run, ps, exec, rm, pause, resume, fork, snapshot, top, image, tenant, trajectory, version,
demo, bench."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..errors import DsecError, InvalidRequest
from ..protocol.version import __version__
from .bench import bench_app
from .cluster import cluster_app
from .common import TokenOpt, UrlOpt, console, err, ident, show
from .common import client as _client
from .common import fail as _fail
from .image import image_app
from .machine import fork, pause, resume
from .tenant import audit, tenant_app
from .top import top
from .trajectory import trajectory_app

app = typer.Typer(help="dsec: elastic sandboxes for training and evaluating AI agents.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(cluster_app, name="cluster")
app.add_typer(image_app, name="image")
app.add_typer(tenant_app, name="tenant")
app.add_typer(trajectory_app, name="trajectory")


@app.command()
def version() -> None:
    """Print the dsec version."""
    console.print(f"dsec {__version__}")


@app.command()
def openapi(
    out: Annotated[Path | None, typer.Option(help="Write to this file instead of standard output.")] = None,
) -> None:
    """Print the HTTP API's OpenAPI document (generated from the wire models)."""
    from ..server.app import openapi_spec

    text = json.dumps(openapi_spec(), indent=2, sort_keys=True) + "\n"
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)


@app.command()
def serve(
    state_dir: Annotated[Path, typer.Option(help="Where state, images and sandboxes live.")] = Path("/var/lib/dsec"),
    listen: Annotated[
        str | None, typer.Option(help="unix:///path or http://127.0.0.1:PORT (default: STATE_DIR/dsec.sock).")
    ] = None,
    repository: Annotated[
        str | None,
        typer.Option(
            help="Layer repository: a directory (any shared file system mount) or s3://bucket/prefix?endpoint=URL "
            "(credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY). Default: STATE_DIR/images/repository."
        ),
    ] = None,
    image_cache: Annotated[
        str, typer.Option(help="Size cap of the node's cache of fetched layer chunks (LRU), e.g. 20G.")
    ] = "20G",
    scrub: Annotated[
        list[str] | None,
        typer.Option("--scrub", help="A residue rule (glob under /) for every layer this node packs (repeatable)."),
    ] = None,
    canary: Annotated[
        list[str] | None,
        typer.Option(
            "--canary",
            help="A string no image published here may hold in any layer: publishes are refused (repeatable).",
        ),
    ] = None,
    eager_layers: Annotated[
        bool, typer.Option("--eager-layers", help="Fetch every layer whole before use instead of lazily.")
    ] = False,
    resolve: Annotated[
        list[str] | None,
        typer.Option(
            "--resolve",
            help="NAME=IP: the platform resolver answers NAME with IP for sandboxes that may resolve it "
            "(repeatable; like curl's --resolve).",
        ),
    ] = None,
    full_deny: Annotated[
        list[str] | None,
        typer.Option(
            "--full-deny",
            help="A network (CIDR) sandboxes with network='full' do not reach (repeatable; default: the private "
            "ranges 10/8, 172.16/12, 192.168/16, 100.64/10, 198.18/15; 'none': no extra networks).",
        ),
    ] = None,
    audit_keep_days: Annotated[
        float, typer.Option(min=0.001, help="Delete audit records older than this many days.")
    ] = 90.0,
    audit_max_records: Annotated[
        int, typer.Option(min=1, help="Keep at most this many audit records (the newest; ~170 bytes each).")
    ] = 1_000_000,
    function_pool: Annotated[
        list[str] | None,
        typer.Option(
            "--function-pool",
            help="IMAGE=N: keep N function workers of IMAGE (default limits) warm from start (repeatable).",
        ),
    ] = None,
    function_max: Annotated[
        int, typer.Option(min=1, max=4096, help="Function workers per pool (image, limits, network, tenant).")
    ] = 64,
    function_idle_ttl: Annotated[
        float, typer.Option(min=0.1, help="Seconds an idle function worker above its pool's minimum is kept.")
    ] = 60.0,
    function_tenant_max: Annotated[
        int, typer.Option(min=1, help="Function workers one tenant may hold at once (all its pools).")
    ] = 256,
    function_max_uses: Annotated[
        int, typer.Option(min=1, help="Users a function worker serves before it is replaced anyway.")
    ] = 500,
    trajectory_db: Annotated[
        str | None,
        typer.Option(
            help="Where the trajectory log lives: sqlite:///PATH or postgresql://USER@HOST/DB (several nodes "
            "sharing one log). Default: trajectories.db in the state directory."
        ),
    ] = None,
    trajectory_durable: Annotated[
        bool,
        typer.Option(
            help="SQLite: sync every commit of the trajectory log to disk (synchronous=FULL), so it survives "
            "a power loss too; by default it survives the daemon's crash, not the machine's."
        ),
    ] = False,
    trajectory_keep_days: Annotated[
        float, typer.Option(min=0.001, help="Delete trajectories not written to for this many days.")
    ] = 30.0,
    node_name: Annotated[
        str | None, typer.Option(help="This node's name in status, metrics and sandbox info (default: host name).")
    ] = None,
    cpu_capacity: Annotated[
        float | None,
        typer.Option(min=0.01, help="Cores for sandboxes (default: the CPUs this daemon may run on)."),
    ] = None,
    memory_capacity: Annotated[
        str | None,
        typer.Option(help="Memory for sandboxes, e.g. 20G (default: host memory minus 1 GiB and 5%)."),
    ] = None,
    cpu_ratio: Annotated[
        float, typer.Option(min=0.01, help="CPU oversubscription: CPU requests may add up to capacity x this.")
    ] = 8.0,
    memory_ratio: Annotated[
        float, typer.Option(min=0.01, help="Memory oversubscription: memory requests may add up to capacity x this.")
    ] = 1.2,
    queue_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds a creation beyond capacity waits in its tenant's queue before it is answered 429 "
            "with Retry-After (a creation may ask for another wait with queue_timeout).",
        ),
    ] = 30.0,
    max_queue: Annotated[
        int, typer.Option(min=0, help="Creations that may wait at once (all tenants); past it: 429 at once.")
    ] = 100_000,
    evict_at: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=1.0,
            help="Memory pressure (share of the node's memory in use) at which sandboxes furthest above "
            "their memory request are evicted, one per 2 s.",
        ),
    ] = 0.95,
    e2b_listen: Annotated[
        str | None,
        typer.Option(
            help="Also serve the E2B-compatible API (control and in-sandbox) on http://HOST:PORT: set "
            "E2B_API_URL and E2B_SANDBOX_URL to it and E2B_API_KEY to a dsec token (docs/e2b.md)."
        ),
    ] = None,
    e2b_image: Annotated[str, typer.Option(help="The image of E2B's default template, 'base'.")] = "dsec/debian:12",
    e2b_kind: Annotated[
        str, typer.Option(help="The kind of E2B sandboxes whose template and metadata name none.")
    ] = "container",
    e2b_template: Annotated[
        list[str] | None,
        typer.Option(
            "--e2b-template",
            help="NAME=IMAGE or NAME=IMAGE@KIND: an E2B template name for a dsec image (repeatable).",
        ),
    ] = None,
    e2b_network: Annotated[
        str,
        typer.Option(
            help="Network of E2B sandboxes that ask for nothing: 'full' (E2B's default: the internet, not the "
            "host, private ranges or other sandboxes) or 'none' (loopback only)."
        ),
    ] = "full",
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
) -> None:
    """Run the node daemon."""
    from ..core.admission import AdmissionOptions
    from ..core.trajectory.recorder import TrajectoryOptions
    from ..isolation.network.options import NetworkOptions, parse_full_deny
    from ..isolation.network.static import parse_resolve
    from ..kinds.function.options import FunctionOptions
    from ..protocol.residue import check_canaries
    from ..server.app import AuditOptions, ImageOptions
    from ..server.app import serve as run_server
    from ..units import parse_size

    try:
        try:
            cache_max = parse_size(image_cache)
        except ValueError as e:
            raise InvalidRequest(f"--image-cache: {e}") from None
        options = ImageOptions(
            repository=repository,
            cache_max=cache_max,
            lazy=not eager_layers,
            scrub=tuple(scrub or ()),
            canaries=tuple(check_canaries(canary or ())),
        )
        # bad entries fail here, not in the daemon's log
        network = NetworkOptions(static=parse_resolve(resolve or []))
        if full_deny:
            network = dataclasses.replace(network, full_deny=parse_full_deny(full_deny))
        audit = AuditOptions(keep_days=audit_keep_days, max_records=audit_max_records)
        function = FunctionOptions.of(
            function_pool or [], function_max, function_idle_ttl, function_tenant_max, function_max_uses
        )
        if trajectory_db is not None and not trajectory_db.startswith(("sqlite:///", "postgresql://", "postgres://")):
            raise InvalidRequest("--trajectory-db: use sqlite:///PATH or postgresql://USER@HOST/DB")
        trajectory = TrajectoryOptions(trajectory_db, trajectory_durable, trajectory_keep_days)
        try:
            mem_cap = parse_size(memory_capacity) if memory_capacity is not None else None
        except ValueError as e:
            raise InvalidRequest(f"--memory-capacity: {e}") from None
        admission = AdmissionOptions(
            cpu_capacity=cpu_capacity,
            memory_capacity=mem_cap,
            cpu_ratio=cpu_ratio,
            memory_ratio=memory_ratio,
            queue_timeout=queue_timeout,
            max_queue=max_queue,
            node_name=node_name,
        )
        e2b = None
        if e2b_listen is not None:
            from ..e2b.service import E2BOptions

            e2b = E2BOptions.of(e2b_listen, e2b_image, e2b_kind, e2b_template or [], e2b_network)
        run_server(
            state_dir, listen, options, log_level, audit, network, function, trajectory, admission, evict_at, e2b=e2b
        )
    except DsecError as e:
        _fail(e)


@app.command()
def run(
    command: Annotated[list[str], typer.Argument(help="Command; one argument runs under /bin/sh -c.")],
    image: Annotated[str, typer.Option(help="Image name.")] = "dsec/debian:12",
    kind: Annotated[str, typer.Option(help="Sandbox kind.")] = "container",
    timeout: Annotated[float, typer.Option(help="Exec timeout in seconds.")] = 60.0,
    memory: Annotated[str | None, typer.Option(help="Memory limit, e.g. 512Mi.")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """One shot: create a sandbox, run COMMAND, print its output, destroy the sandbox."""
    from ..sdk.sync import Sandbox

    try:
        client = _client(url, token)
        with Sandbox.create(image=image, kind=kind, memory=memory, client=client, timeout=timeout + 60) as sb:
            cmd: str | list[str] = command[0] if len(command) == 1 else command
            res = sb.exec(cmd, timeout=timeout)
    except DsecError as e:
        _fail(e)
        return
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.timed_out:
        err.print(f"[yellow]timed out after {timeout}s[/yellow]")
    raise typer.Exit(res.exit_code if res.exit_code is not None else 1)


@app.command()
def ps(
    label: Annotated[list[str], typer.Option("--label", "-l", help="key=value filter; repeatable.")] = [],  # noqa: B006
    all: Annotated[bool, typer.Option("--all", "-a", help="Include stopped, failed and lost sandboxes.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List sandboxes."""
    labels = {}
    for item in label:
        k, sep, v = item.partition("=")
        if not sep:
            err.print(f"[red]error[/red]: --label {item!r} must look like key=value")
            raise typer.Exit(2)
        labels[k] = v
    try:
        items = _client(url, token).list(labels, include_finished=all)
    except DsecError as e:
        _fail(e)
        return
    if as_json:
        console.print_json(json.dumps([i.model_dump(mode="json") for i in items]))
        return
    table = Table(ident("ID"), "KIND", ident("IMAGE"), "STATE", "CREATED", "EXPIRES", "LABELS", "REASON")
    for i in items:
        table.add_row(
            i.id,
            i.kind,
            i.image,
            f"{i.state.value} (waiting for {i.waiting})" if i.waiting else i.state.value,
            i.created_at.strftime("%H:%M:%S"),
            i.expires_at.strftime("%H:%M:%S"),
            ",".join(f"{k}={v}" for k, v in i.labels.items()),
            i.reason or "",
        )
    show(table)
    try:
        pools = _client(url, token).pools()
    except DsecError:
        pools = []
    if pools:
        ptable = Table(
            ident("FUNCTION POOL"),
            ident("TENANT"),
            "WORKERS",
            "IDLE",
            "LENT",
            "MIN",
            "MAX",
            "HITS",
            "MISSES",
            "RESETS",
            "REJECTED",
            "WAITED",
            title="warm pools",
        )
        for p in pools:
            ptable.add_row(
                p.image,
                p.tenant,
                *(
                    str(v)
                    for v in (
                        p.workers,
                        p.idle,
                        p.lent,
                        p.min_idle,
                        p.max_workers,
                        p.hits,
                        p.misses,
                        p.resets,
                        p.rejected,
                        p.waited,
                    )
                ),
            )
        show(ptable)


@app.command("exec")
def exec_(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id.")],
    command: Annotated[list[str], typer.Argument(help="Command; one argument runs under /bin/sh -c.")],
    timeout: Annotated[float, typer.Option(help="Timeout in seconds.")] = 60.0,
    idle_timeout: Annotated[
        float | None, typer.Option(help="Kill the command after this many seconds without output.")
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Run a command in a running sandbox, streaming its output."""
    from ..sdk.sync import Sandbox

    code = 1
    try:
        sb = Sandbox.connect(sandbox_id, client=_client(url, token))
        cmd: str | list[str] = command[0] if len(command) == 1 else command
        for event in sb.exec_stream(cmd, timeout=timeout, idle_timeout=idle_timeout):
            if event.type == "stdout" and event.data:
                sys.stdout.write(event.data)
                sys.stdout.flush()
            elif event.type == "stderr" and event.data:
                sys.stderr.write(event.data)
                sys.stderr.flush()
            elif event.type == "result" and event.result is not None:
                code = event.result.exit_code if event.result.exit_code is not None else 1
                if event.result.idle_timed_out:
                    err.print(f"[yellow]killed after {idle_timeout}s without output[/yellow]")
                elif event.result.timed_out:
                    err.print(f"[yellow]timed out after {timeout}s[/yellow]")
    except DsecError as e:
        _fail(e)
    raise typer.Exit(code)


@app.command()
def rm(
    sandbox_ids: Annotated[list[str], typer.Argument(help="Sandbox ids.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Kill sandboxes."""
    from ..sdk.sync import Sandbox

    client = _client(url, token)
    failed = False
    for sid in sandbox_ids:
        try:
            Sandbox.connect(sid, client=client).kill()
            console.print(sid)
        except DsecError as e:
            err.print(f"[red]error[/red] {sid} ({e.code}): {e.message}")
            failed = True
    raise typer.Exit(2 if failed else 0)


@app.command()
def snapshot(
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox whose changes to pack.")],
    name: Annotated[str, typer.Argument(help="repo:tag of the new image (must not exist yet).")],
    scrub: Annotated[
        list[str] | None, typer.Option("--scrub", help="Also leave out paths matching this glob (repeatable).")
    ] = None,
    no_default_scrub: Annotated[
        bool, typer.Option("--no-default-scrub", help="Do not apply the node's default residue rules.")
    ] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Pack a running sandbox's changes into a new image on top of its own (pack_diff)."""
    from ..sdk.sync import Sandbox

    try:
        sb = Sandbox.connect(sandbox_id, client=_client(url, token))
        info = sb.snapshot(name, scrub=scrub or [], scrub_defaults=not no_default_scrub)
    except DsecError as e:
        _fail(e)
        return
    diff = info.layers[-1] if info.layers and info.layers[-1].role == "diff" else None
    size = f", diff layer {diff.size} bytes" if diff else ", no changes"
    console.print(f"{info.name} ({(info.digest or '')[:12]}{size}; {len(info.scrubbed)} paths scrubbed)")


@app.command()
def images(
    build: Annotated[str | None, typer.Option(help="Build this built-in image now.")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List images (and build a built-in one with --build)."""
    from ..units import format_size

    try:
        client = _client(url, token)
        if build:
            with console.status(f"building {build} (first build of dsec/debian:12 takes about a minute)…"):
                client.build_image(build)
        items = client.images()
    except DsecError as e:
        _fail(e)
        return
    table = Table(ident("NAME"), "READY", "SIZE", "DESCRIPTION")
    for i in items:
        table.add_row(i.name, "yes" if i.ready else "no (built on first use)", format_size(i.size), i.description)
    show(table)


@app.command()
def demo(
    n: Annotated[int, typer.Option("--n", help="Sandboxes in the rollout burst.", min=1, max=4096)] = 64,
    concurrency: Annotated[int, typer.Option(help="Sandboxes in flight at once.", min=1, max=1024)] = 64,
    state_dir: Annotated[Path, typer.Option(help="State dir of the daemon started if none runs.")] = Path(
        "/var/lib/dsec"
    ),
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """The main job: a burst of agent-style rollouts (apply a patch, run tests, reward) on the local daemon."""
    from ..demo.rollouts import main as demo_main

    raise typer.Exit(demo_main(n=n, concurrency=concurrency, state_dir=state_dir, url=url, token=token))


for _command in (pause, resume, fork, audit, top):
    app.command()(_command)


def main() -> None:
    app()
