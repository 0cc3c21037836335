"""What every CLI command shares: consoles, the daemon options, error reporting."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from ..errors import DsecError

if TYPE_CHECKING:
    from ..sdk.sync import Client

console = Console()
err = Console(stderr=True)

UrlOpt = Annotated[str | None, typer.Option("--url", envvar="DSEC_URL", help="Daemon URL (unix:///… or http://…).")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="DSEC_TOKEN", help="Bearer token.")]


def ident(header: str) -> Column:
    """A column of names or ids: shown whole, never cut, folded or shortened with an ellipsis."""
    return Column(header, no_wrap=True)


def show(table: Table) -> None:
    """Print a table without cutting its ``ident`` columns: each keeps its widest cell, the other columns
    share what is left, and a line may pass the terminal's width (or a pipe's 80 columns) rather than
    lose characters of a name or an id."""
    need = len(table.columns) + 1  # the borders
    for col in table.columns:
        if col.no_wrap:
            col.min_width = max((cell_len(str(c)) for c in col.cells), default=0)
            col.min_width = max(col.min_width, cell_len(str(col.header)))
            need += col.min_width + 2  # its padding
        else:
            need += 6
    console.print(table, width=max(console.width, need), crop=False)


def fail(e: DsecError) -> NoReturn:
    err.print(f"[red]error[/red] ({e.code}): {escape(e.message)}")  # a message's [...] is not markup
    raise typer.Exit(2)


def client(url: str | None, token: str | None) -> Client:
    from ..sdk.sync import Client  # the SDK loads only for the commands that talk to a daemon

    return Client(url=url, token=token)
