"""``dsec pool …``: warm pools of sandboxes made ahead (docs/pools.md); and ``dsec serve --warm``'s parsing."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import DsecError, InvalidRequest
from ..protocol.pools import SPEC_FORM, WarmPoolInfo, WarmPoolSpec, default_name, parse_warm
from .common import TokenOpt, UrlOpt, client, console, fail, ident, show

pool_app = typer.Typer(help="Warm pools: sandboxes made ahead, handed to creations that match.", no_args_is_help=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def warm_specs(items: list[str]) -> dict[str, WarmPoolSpec]:
    """``dsec serve --warm`` entries, each named after its image and kind."""
    named: dict[str, WarmPoolSpec] = {}
    for item in items:
        spec = parse_warm(item)
        named[default_name(spec, set(named))] = spec
    return named


def _network(value: str | None) -> object:
    if value is None or value == "none":
        return None
    if value == "full":
        return "full"
    return {"allow": [v for v in value.split(",") if v]}


@pool_app.command("set")
def set_pool(
    name: Annotated[str, typer.Argument(help="The pool's name.")],
    spec: Annotated[str, typer.Argument(help=f"What it keeps: {escape(SPEC_FORM)}.")],
    network: Annotated[
        str | None, typer.Option(help="none (default), full, or a comma-separated allowlist (HOST:PORT,...).")
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="The tenant it serves (default: the operator).")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Add or change the warm pool NAME. Operator only."""
    try:
        parsed = parse_warm(spec)
        body = {**parsed.model_dump(), "network": _network(network), "tenant": tenant}
        try:
            full = WarmPoolSpec.model_validate(body)
        except ValueError as e:
            raise InvalidRequest(f"pool {name}: {e}") from None
        info = client(url, token).set_warm_pool(
            name, full.image, full.size, kind=full.kind, limits=full.limits, network=full.network, tenant=full.tenant
        )
    except DsecError as e:
        fail(e)
    console.print(f"{info.name}: {info.spec.size} x {info.spec.image} ({info.spec.kind})")


@pool_app.command("ls")
def ls(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """The node's warm pools and their counters. Operator only."""
    try:
        pools = client(url, token).warm_pools()
    except DsecError as e:
        fail(e)
    if as_json:
        console.print_json(json.dumps([p.model_dump(mode="json") for p in pools]))
        return
    show(table(pools))


def table(pools: list[WarmPoolInfo]) -> Table:
    t = Table(ident("name"), ident("image"), "kind", "tenant", "idle/size", "filling", "claims", "misses", "refills")
    t.add_column("drained")
    t.add_column("waiting")
    for p in pools:
        s = p.spec
        t.add_row(
            p.name,
            s.image,
            s.kind,
            s.tenant or "admin",
            f"{p.idle}/{s.size}",
            str(p.filling),
            str(p.claims),
            str(p.misses),
            str(p.refills),
            str(p.drained),
            p.waiting or "",
        )
    return t


@pool_app.command("rm")
def rm(name: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Remove the warm pool NAME and kill its idle sandboxes. Operator only."""
    try:
        client(url, token).remove_warm_pool(name)
    except DsecError as e:
        fail(e)
    console.print(f"removed {name}")
