"""``dsec tenant add|ls|rm|quota`` (operator only) and ``dsec audit``."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated

import typer
from rich.table import Table

from ..errors import DsecError
from .common import TokenOpt, UrlOpt, console, err, ident, show
from .common import client as _client
from .common import fail as _fail

tenant_app = typer.Typer(
    help="Tenants: each has its own token and sees only its own sandboxes and images (operator token only).",
    no_args_is_help=True,
)


@tenant_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="1-63 characters of a-z, 0-9 and '-'.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Create a tenant and print its token (shown this once: only its hash is kept)."""
    try:
        created = _client(url, token).create_tenant(name)
    except DsecError as e:
        _fail(e)
        return
    err.print(f"tenant {created.name} created; its token (shown only now):")
    print(created.token)


@tenant_app.command("ls")
def ls(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List tenants, removed ones included (a name is never reused)."""
    try:
        items = _client(url, token).tenants()
    except DsecError as e:
        _fail(e)
        return
    if as_json:
        console.print_json(json.dumps([t.model_dump(mode="json") for t in items]))
        return
    table = Table(ident("NAME"), "CREATED", "SANDBOXES", "STATE")
    for t in items:
        state = "operator" if t.operator else ("removed " + t.revoked_at.isoformat() if t.revoked_at else "active")
        table.add_row(t.name, t.created_at.strftime("%Y-%m-%d %H:%M:%S"), str(t.sandboxes), state)
    show(table)


@tenant_app.command("rm")
def rm(
    names: Annotated[list[str], typer.Argument(help="Tenant names.")],
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Revoke tenants' tokens at once and kill their live sandboxes (their images stay)."""
    client = _client(url, token)
    failed = False
    for name in names:
        try:
            removed = client.remove_tenant(name)
            console.print(f"{removed.name} (killed {len(removed.killed)} sandboxes)")
        except DsecError as e:
            err.print(f"[red]error[/red] {name} ({e.code}): {e.message}")
            failed = True
    raise typer.Exit(2 if failed else 0)


@tenant_app.command("quota")
def quota(
    name: Annotated[str, typer.Argument(help="The tenant.")],
    sandboxes: Annotated[int | None, typer.Option(min=0, help="Live sandboxes it may hold at once.")] = None,
    cpu: Annotated[float | None, typer.Option(min=0, help="Sum of its CPU requests, in cores.")] = None,
    memory: Annotated[str | None, typer.Option(help="Sum of its memory requests, e.g. 64Gi.")] = None,
    clear: Annotated[bool, typer.Option("--clear", help="Remove every bound (the node's capacity only).")] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Show or set what a tenant may hold on the node at once; creations past it wait in the tenant's
    queue, then get 429. Without bounds given: show the current ones."""
    client = _client(url, token)
    try:
        if clear:
            got = client.set_quota(name)
        elif sandboxes is None and cpu is None and memory is None:
            got = client.quota(name)
        else:
            current = client.quota(name)
            got = client.set_quota(
                name,
                sandboxes=sandboxes if sandboxes is not None else current.sandboxes,
                cpu=cpu if cpu is not None else current.cpu,
                memory=memory if memory is not None else current.memory,
            )
    except DsecError as e:
        _fail(e)
        return
    console.print_json(got.model_dump_json())


def audit(
    sandbox: Annotated[str | None, typer.Option("--sandbox", help="Only calls on this sandbox.")] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's calls (operator only).")] = None,
    since: Annotated[
        datetime | None, typer.Option("--since", help="Only calls at or after this time (e.g. 2026-01-31T12:00).")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=10_000, help="The newest this many.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines.")] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Show audited API calls: your own (with the operator token: everyone's, refused calls included)."""
    try:
        records = _client(url, token).audit(sandbox=sandbox, tenant=tenant, since=since, limit=limit)
    except DsecError as e:
        _fail(e)
        return
    if as_json:
        for r in records:
            print(r.model_dump_json())
        return
    table = Table("TIME", ident("TENANT"), "METHOD", "ROUTE", ident("SANDBOX"), "STATUS", "MS", "COMMAND")
    for r in records:
        table.add_row(
            r.time.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
            r.tenant or "(unknown)",
            r.method,
            r.route,
            r.sandbox or "",
            str(r.status),
            f"{r.duration_ms:.1f}",
            r.command or "",
        )
    show(table)
