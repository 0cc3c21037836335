"""What every CLI command shares: consoles, the daemon options, error reporting."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console

from ..errors import DsecError

if TYPE_CHECKING:
    from ..sdk.sync import Client

console = Console()
err = Console(stderr=True)

UrlOpt = Annotated[str | None, typer.Option("--url", envvar="DSEC_URL", help="Daemon URL (unix:///… or http://…).")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="DSEC_TOKEN", help="Bearer token.")]


def fail(e: DsecError) -> NoReturn:
    err.print(f"[red]error[/red] ({e.code}): {e.message}")
    raise typer.Exit(2)


def client(url: str | None, token: str | None) -> Client:
    from ..sdk.sync import Client  # the SDK loads only for the commands that talk to a daemon

    return Client(url=url, token=token)
