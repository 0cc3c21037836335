"""``dsec volume …``: create, list, inspect, remove named volumes; and ``--volume`` of ``dsec run``."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ..errors import DsecError, InvalidRequest
from ..protocol.volumes import VolumeInfo
from ..units import format_size
from .common import TokenOpt, UrlOpt, client, console, fail, ident, show

volume_app = typer.Typer(help="Named volumes: file systems of a set size that outlive sandboxes.", no_args_is_help=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
VolumeOpt = Annotated[
    list[str],
    typer.Option("--volume", "-v", help="Mount a named volume: PATH=NAME (read-write) or PATH=NAME:ro; repeatable."),
]


def parse_volumes(items: list[str]) -> dict[str, str | tuple[str, str]]:
    """``--volume`` options as ``Sandbox.create(volumes=...)`` takes them."""
    volumes: dict[str, str | tuple[str, str]] = {}
    for item in items:
        path, sep, ref = item.partition("=")
        name, colon, mode = ref.partition(":")
        if not sep or not path or not name or (colon and mode not in ("ro", "rw")):
            raise InvalidRequest(f"--volume {item!r} must look like /path=name or /path=name:ro")
        volumes[path] = (name, mode) if colon else name
    return volumes


def _users(v: VolumeInfo) -> str:
    return ", ".join(f"{u.sandbox} ({u.mode})" for u in v.users) or "-"


@volume_app.command("create")
def create(
    name: str,
    size: Annotated[str, typer.Option("--size", "-s", help="Its quota, e.g. 10Gi (16Mi to 16Ti).")] = "1Gi",
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Make an empty volume NAME on the node."""
    try:
        info = client(url, token).create_volume(name, size=size)
    except DsecError as e:
        fail(e)
    console.print(f"{info.name} ({format_size(info.size)})")


@volume_app.command("ls")
def ls(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """List the volumes you may mount."""
    try:
        items = client(url, token).volumes()
    except DsecError as e:
        fail(e)
    if as_json:
        console.print_json(data=[i.model_dump(mode="json") for i in items])
        return
    table = Table(ident("NAME"), "SIZE", "ON DISK", "CREATED", ident("OWNER"), "MOUNTED BY")
    for v in items:
        created = v.created_at.strftime("%Y-%m-%d %H:%M")
        table.add_row(v.name, format_size(v.size), format_size(v.used), created, v.owner or "-", _users(v))
    show(table)


@volume_app.command("inspect")
def inspect(name: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Show a volume's size, bytes on disk and the sandboxes that mount it, as JSON."""
    try:
        info = client(url, token).volume(name)
    except DsecError as e:
        fail(e)
    console.print_json(info.model_dump_json())


@volume_app.command("rm")
def rm(names: list[str], url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Delete volumes and their contents (refused while a live sandbox mounts one)."""
    c = client(url, token)
    for name in names:
        try:
            c.remove_volume(name)
        except DsecError as e:
            fail(e)
        console.print(name)
