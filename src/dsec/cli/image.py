"""``dsec image …``: list, inspect, history, stats, remove, gc, import, pull, build."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
from rich.table import Table

from ..errors import DsecError, InvalidRequest
from ..protocol.pull import PullPolicy, PullProgress
from ..protocol.sandbox import ImageInfo
from ..units import format_size
from .common import TokenOpt, UrlOpt, client, console, fail, ident, show

image_app = typer.Typer(help="Images: layered, versioned, lazily fetched.", no_args_is_help=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _short(digest: str | None) -> str:
    return digest[:12] if digest else "-"


def _table(items: list[ImageInfo]) -> Table:
    table = Table(ident("NAME"), ident("VERSION"), "LAYERS", "SIZE", "CREATED", "DESCRIPTION")
    for i in items:
        created = i.created_at.strftime("%Y-%m-%d %H:%M") if i.created_at else "-"
        if not i.ready:
            table.add_row(i.name, "-", "-", "-", "-", f"{i.description} (built on first use)")
            continue
        roles = ",".join(layer.role for layer in i.layers)
        table.add_row(i.name, _short(i.digest), roles, format_size(i.size), created, i.description)
    return table


@image_app.command("ls")
def ls(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """List images."""
    try:
        items = client(url, token).images()
    except DsecError as e:
        fail(e)
    if as_json:
        console.print_json(data=[i.model_dump(mode="json") for i in items])
    else:
        show(_table(items))


@image_app.command("inspect")
def inspect(name: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Show an image's version, layers, lineage and what residue was scrubbed, as JSON."""
    try:
        info = client(url, token).image(name)
    except DsecError as e:
        fail(e)
    console.print_json(info.model_dump_json())


@image_app.command("history")
def history(name: str, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """The version NAME points at, then its ancestors (the images it was built on or snapshotted from)."""
    try:
        items = client(url, token).image_history(name)
    except DsecError as e:
        fail(e)
    if as_json:
        console.print_json(data=[i.model_dump(mode="json") for i in items])
        return
    table = Table(ident("VERSION"), ident("PUBLISHED AS"), "LAYERS", "SIZE", ident("FROM SANDBOX"), "SCRUBBED")
    for i in items:
        table.add_row(
            _short(i.digest),
            i.name,
            str(len(i.layers)),
            format_size(i.size),
            i.source_sandbox or "-",
            str(len(i.scrubbed)),
        )
    show(table)


@image_app.command("stats")
def stats(name: str, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """How much of the image this node fetched (the exposed fraction), chunk hit rate, time spent waiting."""
    try:
        s = client(url, token).image_stats(name)
    except DsecError as e:
        fail(e)
    if as_json:
        console.print_json(s.model_dump_json())
        return
    rate = f"{s.chunk_hit_rate:.1%}" if s.chunk_hit_rate is not None else "-"
    console.print(
        f"{s.name}: {format_size(s.fetched_bytes)} of {format_size(s.size)} fetched "
        f"({s.exposed_fraction:.1%} exposed, {s.mode}); chunk hit rate {rate}; "
        f"{s.fetch_wait_seconds:.2f}s waiting on fetches"
    )
    table = Table(ident("LAYER"), "SIZE", "FETCHED", "READ", "HITS", "MISSES", "WAIT", "ERRORS")
    for layer in s.layers:
        table.add_row(
            _short(layer.digest),
            format_size(layer.size),
            format_size(layer.fetched_bytes),
            format_size(layer.read_bytes),
            str(layer.chunk_hits),
            str(layer.chunk_misses),
            f"{layer.fetch_wait_seconds:.2f}s",
            str(layer.errors),
        )
    show(table)


@image_app.command("rm")
def rm(names: list[str], url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Free image names (refused while a live sandbox runs on one); `dsec image gc` reclaims the space."""
    failed = False
    c = client(url, token)
    for name in names:
        try:
            c.remove_image(name)
            console.print(name)
        except DsecError as e:
            console.print(f"[red]{name}[/red]: {e.message}")
            failed = True
    raise typer.Exit(2 if failed else 0)


@image_app.command("gc")
def gc(url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Delete versions, layers and chunks that no image references (never one in use)."""
    try:
        with console.status("collecting…"):
            r = client(url, token).gc_images()
    except DsecError as e:
        fail(e)
    console.print(
        f"deleted {r.images_deleted} versions, {r.layers_deleted} layers, {r.chunks_deleted} chunks "
        f"({format_size(r.bytes_freed)}); kept {r.kept_layers} layers, {r.kept_chunks} chunks"
    )


@image_app.command("import")
def import_(
    path: Annotated[Path, typer.Argument(help="OCI image layout directory or `docker save` tarball.")],
    name: Annotated[str, typer.Argument(help="repo:tag of the new image.")],
    reference: Annotated[str | None, typer.Option(help="Which image, when the input holds several.")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Import an image you already have (read on the daemon's node)."""
    try:
        with console.status(f"importing {path}…"):
            info = client(url, token).import_image(path.resolve(), name, reference)
    except DsecError as e:
        fail(e)
    console.print(_table([info]))


@image_app.command("pull")
def pull(
    reference: Annotated[str, typer.Argument(help="registry.example:5000/org/task:1, python:3.11, ...@sha256:...")],
    always: Annotated[
        bool, typer.Option("--always", help="Ask the registry even if the node has the image (pull if it moved).")
    ] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Pull a registry image onto the node: each layer fetched and converted once, shared by every image
    that has it."""
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[layers]}"),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(f"pulling {reference}", total=None, layers="")

        def shown(p: PullProgress) -> None:
            layers = f"layers {p.layers_done}/{p.layers} ({p.layers_reused} shared)" if p.layers else p.phase
            bar.update(task, total=p.bytes_total or None, completed=p.bytes_fetched, layers=layers)

        try:
            policy: PullPolicy = "always" if always else "if-not-present"
            info = client(url, token).pull(reference, policy=policy, on_progress=shown)
        except DsecError as e:
            fail(e)
    console.print(f"{info.name} {_short(info.digest)} {format_size(info.size)}")


@image_app.command("push")
def push(
    name: Annotated[str, typer.Argument(help="The dsec image to push (a build, a snapshot, a pulled image).")],
    reference: Annotated[str, typer.Argument(help="Where: registry.example:5000/org/env:1.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Push an image to an OCI registry as a standard image (docker pull / podman pull run it)."""
    try:
        with console.status(f"pushing {name} to {reference}…"):
            result = client(url, token).push(name, reference)
    except DsecError as e:
        fail(e)
    console.print(
        f"{result.reference}: {result.layers} layers, {result.layers_uploaded} uploaded "
        f"({format_size(result.bytes_uploaded)}) in {result.seconds:.1f}s"
    )


@image_app.command("build")
def build(
    target: Annotated[
        str,
        typer.Argument(
            help="A build spec file (TOML), a built-in image name (dsec/debian:12), or a Dockerfile's build "
            "context directory (docker build's CONTEXT)."
        ),
    ] = ".",
    name: Annotated[
        str | None, typer.Option("--name", "--tag", "-t", help="Publish under this name (repo:tag).")
    ] = None,
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="The Dockerfile (default: CONTEXT/Dockerfile).")
    ] = None,
    arg: Annotated[
        list[str] | None,
        typer.Option("--arg", "--build-arg", help="Build argument NAME=VALUE (repeatable)."),
    ] = None,
    secret: Annotated[
        list[str] | None,
        typer.Option(
            "--secret",
            help="A secret: NAME (its value from the environment variable NAME), or Docker's "
            "id=NAME[,env=VAR|,src=FILE] (repeatable).",
        ),
    ] = None,
    stage: Annotated[str | None, typer.Option("--target", help="Dockerfile: the stage to build.")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Build an image: from a Dockerfile (docker build -f Dockerfile -t name:tag CONTEXT) or a TOML spec,
    each step a layer in a builder sandbox, cached by its inputs, residue scrubbed."""
    c = client(url, token)
    try:
        args = dict(_pair(a) for a in arg or [])
        secrets = dict(_secret(s) for s in secret or [])
        if file is not None or Path(target).is_dir():
            if name is None:
                raise InvalidRequest("a Dockerfile build needs -t NAME:TAG")
            with console.status(f"building {file or Path(target) / 'Dockerfile'}…"):
                result = c.build_dockerfile(
                    name, target, dockerfile=file, build_args=args, secrets=secrets, target=stage
                )
        elif not Path(target).is_file():
            with console.status(f"building {target} (dsec/debian:12 takes about a minute)…"):
                console.print(_table([c.build_image(target)]))
            return
        else:
            with console.status(f"building {target}…"):
                result = c.build(Path(target), name, args=args, secrets=secrets)
    except DsecError as e:
        fail(e)
    table = Table("STEP", ident("LAYER"), "CACHED", "SECONDS", "SIZE", "SCRUBBED")
    for step in result.steps:
        layer = step.layer
        table.add_row(
            f"{step.index + 1}. {step.description}",
            _short(layer.digest) if layer else "-",
            "yes" if step.cached else "no",
            f"{step.seconds:.1f}",
            format_size(layer.size) if layer else "-",
            str(len(step.scrubbed)),
        )
    show(table)
    console.print(_table([result.image]))


def _secret(text: str) -> tuple[str, str]:
    """--secret NAME (from the environment), or id=NAME[,env=VAR|,src=FILE] as docker build takes it."""
    if "=" not in text:
        if text not in os.environ:
            raise InvalidRequest(f"--secret {text}: no environment variable {text} holds its value")
        return text, os.environ[text]
    fields = dict(part.partition("=")[::2] for part in text.split(","))
    sid = fields.get("id", "")
    if not sid:
        raise InvalidRequest(f"--secret {text!r}: expected id=NAME[,env=VAR|,src=FILE]")
    if "src" in fields or "source" in fields:
        src = Path(fields.get("src") or fields["source"])
        try:
            return sid, src.read_text()
        except OSError as e:
            raise InvalidRequest(f"--secret {sid}: cannot read {src}: {e}") from None
    var = fields.get("env", sid)
    if var not in os.environ:
        raise InvalidRequest(f"--secret {sid}: no environment variable {var} holds its value")
    return sid, os.environ[var]


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise InvalidRequest(f"--arg {text!r}: expected NAME=VALUE")
    return key, value


@image_app.command("verify")
def verify_repository(
    repository: Annotated[
        str,
        typer.Option(
            help="The layer repository to check: a directory or s3://bucket/prefix?endpoint=URL (as `dsec serve "
            "--repository`). Default: the default state directory's."
        ),
    ] = "/var/lib/dsec/images/repository",
    quick: Annotated[bool, typer.Option(help="Check that chunks exist without reading them.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check the layer repository's integrity: tags, versions, layer manifests, and every chunk (read and
    hashed, each layer as a whole too). Exits 1 if anything is damaged. Reads the repository directly:
    no daemon needed."""
    import asyncio
    import json

    from ..images.catalog import Catalog
    from ..images.repository import open_repository
    from ..images.verify import verify

    if "://" not in repository and not repository.startswith("throttle:") and not Path(repository).is_dir():
        fail(InvalidRequest(f"no layer repository at {repository} (not a directory)"))
    try:
        report = asyncio.run(verify(Catalog(open_repository(repository)), read_chunks=not quick))
    except DsecError as e:
        fail(e)
    if as_json:
        print(json.dumps({**report.__dict__, "ok": report.ok}))
    else:
        console.print(
            f"{report.tags} tags, {report.versions} versions, {report.layers} layers, {report.chunks} chunks"
            + ("" if quick else f", {format_size(report.bytes_read)} read and hashed")
        )
        for problem in report.problems:
            console.print(f"[red]damaged[/red] {problem}")
        if report.problem_count > len(report.problems):
            console.print(f"… and {report.problem_count - len(report.problems)} more")
        console.print("[green]ok[/green]" if report.ok else f"[red]{report.problem_count} problem(s)[/red]")
    raise typer.Exit(0 if report.ok else 1)
