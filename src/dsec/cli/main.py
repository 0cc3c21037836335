"""``dsec``: serve, run, ps, exec, rm, pause, resume, fork, expose, unexpose, snapshot, top, image, volume,
tenant, trajectory, pool, version, demo, bench."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, cast, get_args

import typer
from rich.table import Table

# the benchmarks are a package of their own (src/dsec_bench); the CLI is the one part of dsec that imports it
from dsec_bench.cli import bench_app

from ..errors import DsecError, InvalidRequest
from ..protocol.names import PullPolicy
from ..protocol.version import __version__
from .checkpoint import checkpoint_app, rollback
from .cluster import cluster_app
from .common import TokenOpt, UrlOpt, console, err, ident, show
from .common import client as _client
from .common import fail as _fail
from .image import image_app
from .machine import expose, fork, pause, resume, unexpose
from .pool import pool_app
from .serve import serve
from .tenant import audit, tenant_app
from .top import top
from .trajectory import trajectory_app
from .volume import VolumeOpt, parse_volumes, volume_app

app = typer.Typer(help="dsec: elastic sandboxes for training and evaluating AI agents.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(cluster_app, name="cluster")
app.add_typer(image_app, name="image")
app.add_typer(pool_app, name="pool")
app.add_typer(tenant_app, name="tenant")
app.add_typer(trajectory_app, name="trajectory")
app.add_typer(volume_app, name="volume")


@app.command()
def version() -> None:
    """Print the dsec version."""
    console.print(f"dsec {__version__}")


@app.command()
def openapi(
    out: Annotated[Path | None, typer.Option(help="Write to this file instead of standard output.")] = None,
) -> None:
    """Print the HTTP API's OpenAPI document (generated from the wire models)."""
    from ..server.openapi import openapi_spec

    text = json.dumps(openapi_spec(), indent=2, sort_keys=True) + "\n"
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)


app.command()(serve)


@app.command()
def run(
    command: Annotated[list[str], typer.Argument(help="Command; one argument runs under /bin/sh -c.")],
    image: Annotated[
        str, typer.Option(help="Image: the node's (dsec/debian:12) or a registry's (registry.example/org/task:1).")
    ] = "dsec/debian:12",
    kind: Annotated[str, typer.Option(help="Sandbox kind.")] = "container",
    pull: Annotated[
        str, typer.Option(help="For a registry image: if-not-present (the node's copy if it has one) or always.")
    ] = "if-not-present",
    timeout: Annotated[float, typer.Option(help="Exec timeout in seconds.")] = 60.0,
    memory: Annotated[str | None, typer.Option(help="Memory limit, e.g. 512Mi.")] = None,
    volume: VolumeOpt = [],  # noqa: B006
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """One shot: create a sandbox, run COMMAND, print its output, destroy the sandbox."""
    from ..sdk.sync import Sandbox

    try:
        client = _client(url, token)
        volumes = parse_volumes(volume)
        if pull not in get_args(PullPolicy):
            raise InvalidRequest(f"--pull {pull!r}: expected if-not-present or always")
        policy = cast(PullPolicy, pull)
        with Sandbox.create(
            image=image, kind=kind, memory=memory, client=client, timeout=timeout + 60, volumes=volumes, pull=policy
        ) as sb:
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


for _command in (pause, resume, fork, rollback, expose, unexpose, audit, top):
    app.command()(_command)


def main() -> None:
    app()
