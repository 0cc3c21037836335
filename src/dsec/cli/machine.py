"""``dsec pause``, ``dsec resume``, ``dsec fork``: stopping a sandbox in place and copying a running one."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from ..errors import DsecError
from .common import TokenOpt, UrlOpt, console, err
from .common import client as _client
from .common import fail as _fail


def pause(
    sandbox_ids: Annotated[list[str], typer.Argument(help="Sandbox ids.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Stop every process of sandboxes where they stand (VM kinds: the whole machine) until resumed."""
    _each(sandbox_ids, "pause", url, token)


def resume(
    sandbox_ids: Annotated[list[str], typer.Argument(help="Sandbox ids.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Let paused sandboxes run on."""
    _each(sandbox_ids, "resume", url, token)


def _each(sandbox_ids: list[str], action: str, url: str | None, token: str | None) -> None:
    from ..sdk.sync import Sandbox

    client = _client(url, token)
    failed = False
    for sid in sandbox_ids:
        try:
            getattr(Sandbox.connect(sid, client=client), action)()
            console.print(sid)
        except DsecError as e:
            err.print(f"[red]error[/red] {sid} ({e.code}): {e.message}")
            failed = True
    raise typer.Exit(2 if failed else 0)


def fork(
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox to copy (running).")],
    n: Annotated[int, typer.Option("-n", "--n", min=1, max=64, help="How many copies.")] = 1,
    timeout: Annotated[
        float | None, typer.Option(help="Time to live of each copy in seconds (default: the parent's).")
    ] = None,
    checkpoint: Annotated[
        str | None, typer.Option(help="Copies of this checkpoint (id or name) instead of now (containers).")
    ] = None,
    processes: Annotated[
        bool | None,
        typer.Option("--processes/--files-only", help="Carry processes and memory (VM kinds) or files only."),
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Make N copies of a sandbox; prints their ids. A VM's are restored from one memory snapshot of it (all
    or none); a container's get its files, now or at a checkpoint, and each is made or fails on its own."""
    from ..sdk.sync import Sandbox

    try:
        sb = Sandbox.connect(sandbox_id, client=_client(url, token))
        copies = sb.fork(n, timeout=timeout, checkpoint=checkpoint, processes=processes)
    except DsecError as e:
        _fail(e)
        return
    for copy in copies:
        console.print(copy.id)
    for index, error in copies.failed:
        err.print(f"[red]error[/red] copy {index} ({error.code}): {escape(error.message)}")
    if copies.failed:
        raise typer.Exit(2)


def expose(
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox.")],
    port: Annotated[int, typer.Argument(min=1, max=65535, help="A TCP port on the sandbox's loopback.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Print the URL at which a server on PORT inside the sandbox is reached (HTTP and WebSocket), through
    the daemon, with a secret of the port's own: it can be handed to anything, and ends with the sandbox."""
    from ..sdk.sync import Sandbox

    try:
        console.print(Sandbox.connect(sandbox_id, client=_client(url, token)).expose(port), soft_wrap=True)
    except DsecError as e:
        _fail(e)


def unexpose(
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox.")],
    port: Annotated[int, typer.Argument(min=1, max=65535, help="An exposed port.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Make a port's URL stop working (connections already open through it stay until they close)."""
    from ..sdk.sync import Sandbox

    try:
        Sandbox.connect(sandbox_id, client=_client(url, token)).unexpose(port)
    except DsecError as e:
        _fail(e)
