"""``dsec checkpoint …`` and ``dsec rollback``: a sandbox's files kept under an id, and put back in place."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from ..errors import DsecError
from ..units import format_size
from .common import TokenOpt, UrlOpt, client, console, fail, ident, show

if TYPE_CHECKING:
    from ..sdk.sync import Sandbox

checkpoint_app = typer.Typer(
    help="Checkpoints of a sandbox: its files kept on the node, to roll back to in place or fork from.",
    no_args_is_help=True,
)

SandboxArg = Annotated[str, typer.Argument(help="The sandbox.")]
CheckpointArg = Annotated[str, typer.Argument(help="A checkpoint's id (c1, c2, ...) or name.")]


def _sandbox(sandbox_id: str, url: str | None, token: str | None) -> Sandbox:
    from ..sdk.sync import Sandbox

    return Sandbox.connect(sandbox_id, client=client(url, token))


@checkpoint_app.command("create")
def create(
    sandbox_id: SandboxArg,
    name: Annotated[str | None, typer.Option("--name", help="A name to roll back to it by.")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Keep the sandbox's files as they are now; prints the checkpoint's id."""
    try:
        info = _sandbox(sandbox_id, url, token).checkpoint(name)
    except DsecError as e:
        fail(e)
    console.print(f"{info.id}  {format_size(info.size)}, held {info.seconds * 1000:.0f} ms")


@checkpoint_app.command("ls")
def ls(
    sandbox_id: SandboxArg,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List the sandbox's checkpoints, oldest first."""
    try:
        items = _sandbox(sandbox_id, url, token).checkpoints()
    except DsecError as e:
        fail(e)
    if as_json:
        console.print_json(data=[i.model_dump(mode="json") for i in items])
        return
    table = Table(ident("ID"), ident("NAME"), "SIZE", "TAKEN", "CAPTURES")
    for c in items:
        taken = datetime.datetime.fromtimestamp(c.created_at).strftime("%Y-%m-%d %H:%M:%S")
        captures = "files and processes" if c.processes else "files"
        table.add_row(c.id, c.name or "-", format_size(c.size), taken, captures)
    show(table)


@checkpoint_app.command("rm")
def rm(sandbox_id: SandboxArg, checkpoints: list[str], url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Remove checkpoints and free their disk."""
    sb = None
    for ref in checkpoints:
        try:
            sb = sb or _sandbox(sandbox_id, url, token)
            sb.remove_checkpoint(ref)
        except DsecError as e:
            fail(e)
        console.print(ref)


def rollback(sandbox_id: SandboxArg, checkpoint: CheckpointArg, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Put a sandbox back to a checkpoint in place: its processes are ended, its files are as they were."""
    try:
        _sandbox(sandbox_id, url, token).rollback(checkpoint)
    except DsecError as e:
        fail(e)
    console.print(sandbox_id)
