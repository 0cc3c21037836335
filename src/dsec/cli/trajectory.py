"""``dsec trajectory ls|show|export|rm``: the trajectory log, read back."""

from __future__ import annotations

import base64
import json
import sys
from typing import IO, Annotated, Any

import typer
from rich.table import Table

from ..errors import DsecError
from ..protocol.trajectory import RecordedCall
from .common import TokenOpt, UrlOpt, ident
from .common import client as _client
from .common import fail as _fail
from .common import show as show_table

trajectory_app = typer.Typer(
    help="Trajectories: the durable log of every call a trainer made to its sandbox.", no_args_is_help=True
)

IdArg = Annotated[str, typer.Argument(help="The trajectory's id, e.g. job-17/rollout-3.")]


@trajectory_app.command("ls")
def ls(
    prefix: Annotated[str, typer.Option(help="Only ids starting with this (e.g. job-17/).")] = "",
    limit: Annotated[int, typer.Option(min=1, max=10000)] = 1000,
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """List your trajectories, most recently written first."""
    try:
        found = _client(url, token).trajectories(prefix, limit)
    except DsecError as e:
        _fail(e)
        return
    table = Table(ident("ID"), "CALLS", ident("SANDBOX"), "KIND", ident("IMAGE"), "REBUILDS", "CLOSED", "UPDATED")
    for t in found:
        table.add_row(
            t.id,
            str(t.length),
            t.sandbox_id,
            t.kind,
            t.image,
            str(t.rebuilds),
            "yes" if t.closed else "",
            t.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    show_table(table)


@trajectory_app.command("show")
def show(trajectory_id: IdArg, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """One trajectory and its calls, a line each."""
    client = _client(url, token)
    try:
        info = client.trajectory(trajectory_id)
        table = Table("SEQ", "OP", "STATUS", "WHAT", "EXIT", "MS", "NOTE", title=f"{info.id} on {info.sandbox_id}")
        for rec in client.trajectory_calls(trajectory_id):
            exit_code = (rec.result or {}).get("exit_code") if rec.op == "exec" else None
            ms = f"{rec.duration_ms:.1f}" if rec.duration_ms is not None else ""
            table.add_row(
                str(rec.seq), rec.op, rec.status, _what(rec)[:60], "" if exit_code is None else str(exit_code), ms,
                rec.note or "",
            )  # fmt: skip
    except DsecError as e:
        _fail(e)
        return
    show_table(table)


@trajectory_app.command("export")
def export(
    trajectory_id: IdArg,
    jsonl: Annotated[bool, typer.Option("--jsonl", help="One JSON record per call (the only format).")] = True,
    output: Annotated[str, typer.Option("-o", "--output", help="A file to write (default: standard output).")] = "-",
    url: UrlOpt = None,
    token: TokenOpt = None,
) -> None:
    """Training-ready records, one JSON object per call: its command or request, outputs, exit code, timings."""
    client = _client(url, token)
    out: IO[str] = sys.stdout if output == "-" else open(output, "w", encoding="utf-8")
    try:
        info = client.trajectory(trajectory_id)
        for rec in client.trajectory_calls(trajectory_id):
            out.write(json.dumps(training_record(info.id, rec), ensure_ascii=False) + "\n")
    except DsecError as e:
        _fail(e)
    finally:
        if out is not sys.stdout:
            out.close()


@trajectory_app.command("rm")
def rm(trajectory_id: IdArg, url: UrlOpt = None, token: TokenOpt = None) -> None:
    """Forget a trajectory and its calls (refused while its sandbox runs)."""
    try:
        _client(url, token).remove_trajectory(trajectory_id)
    except DsecError as e:
        _fail(e)
        return
    print(trajectory_id)


def training_record(trajectory_id: str, rec: RecordedCall) -> dict[str, Any]:
    """A call as a training record: flat, with the exec fields at the top level."""
    out: dict[str, Any] = {
        "trajectory": trajectory_id,
        "seq": rec.seq,
        "op": rec.op,
        "status": rec.status,
        "request": rec.request,
        "started_at": rec.started_at.isoformat(),
        "duration_ms": rec.duration_ms,
    }
    result = rec.result or {}
    if rec.op == "exec" and rec.status == "done":
        out["command"] = rec.request.get("cmd")
        for key in ("exit_code", "signal", "stdout", "stderr", "truncated", "timed_out", "oom_killed"):
            out[key] = result.get(key)
    elif "error" in result:
        out["error"] = result["error"]
    elif result:
        out["result"] = result
    if rec.result_bytes is not None:
        data = base64.b64decode(rec.result_bytes)
        try:
            out["output"] = data.decode()
        except UnicodeDecodeError:
            out["output"], out["output_encoding"] = rec.result_bytes, "base64"
    if rec.note:
        out["note"] = rec.note
    return out


def _what(rec: RecordedCall) -> str:
    if rec.op == "exec":
        cmd = rec.request.get("cmd")
        return cmd if isinstance(cmd, str) else " ".join(cmd or [])
    if "path" in rec.request:
        return str(rec.request["path"])
    return json.dumps(rec.request)[:60] if rec.request else ""
