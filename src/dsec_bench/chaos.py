"""Chaos: one fault at a time injected into a node while a burst of creations and execs runs on it.

For each fault the bench starts a node of its own: its state directory on a file system of its own (a
tmpfs, so it can be filled), the layer cache on another, and a layer repository of the bench's own
seeded from ``--repository`` by hard links (the burst publishes snapshots; the shared one stays
untouched). The node is warmed up and its leak accounting's baseline taken (bench/accounting.py); then
the burst runs (bench/faults.py: 64 lifecycles of create, exec, an occasional snapshot, kill) with the
fault injected into it. Afterwards:

- every request has ended, with a result or a clear error (no hang, no ``internal``);
- the node recovers: a killed daemon is started again on the same state directory and re-adopts the
  sandboxes that survived, each of which answers an exec; a new sandbox is created and answers;
- SQLite (``PRAGMA integrity_check`` of every database of the state directory) and the layer
  repository (``dsec image verify``, every chunk read and hashed) are intact;
- once its sandboxes are killed, no counter of the node is above its baseline (the soak's accounting).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from dsec import AsyncClient, AsyncSandbox, DsecError, InvalidRequest
from dsec.isolation.mounts import is_mountpoint, mount, umount

from . import accounting
from .accounting import Known, Node
from .common import Json, connect, host_facts, kill_leftovers, release_node, start_daemon, stop_daemon, write_json
from .faults import FAULTS, LABELS, Burst, Requests, Target
from .seed import seed_repository
from .soak import allowances, baseline, probe, settle

BUILTINS = ("dsec/busybox:latest", "dsec/debian:12")
STATE_FS = "1g"  # the node's state directory: a file system of its own, to be filled
CACHE_FS = "256m"  # the layer cache's
SETTLE_S = 120.0
BURST = 64


@dataclass(frozen=True)
class Case:
    fault: str
    image: str = "dsec/busybox"
    command: str = "echo ok"
    vms: int = 0

    @staticmethod
    def of(fault: str) -> Case:
        if fault == "qemu":
            return Case(fault, vms=2)
        if fault == "layer-cache-full":  # a large image, read cold through the full cache
            return Case(fault, image="dsec/debian:12", command="python3 -c 'print(\"ok\")'")
        return Case(fault)


@contextlib.contextmanager
def node_file_systems(state: Path) -> Iterator[Path]:
    """The state directory on a tmpfs of its own, and the layer cache on another; returns the cache's."""
    state.mkdir(parents=True, exist_ok=True)
    mount("dsec-chaos-state", state, "tmpfs", 0, f"size={STATE_FS},mode=0711")
    cache = state / "images" / "fetcher" / "cache"
    try:
        cache.mkdir(parents=True)
        mount("dsec-chaos-cache", cache, "tmpfs", 0, f"size={CACHE_FS},mode=0700")
        yield cache
    finally:
        release_node(state)
        if is_mountpoint(state):
            umount(state, lazy=True)


def integrity(state: Path, repository: Path) -> Json:
    """SQLite's integrity check of each database in the state directory, and the repository's."""
    checks: Json = {}
    for db in sorted(state.glob("*.db")):
        try:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
                checks[db.name] = "; ".join(row[0] for row in conn.execute("PRAGMA integrity_check"))
        except sqlite3.Error as e:
            checks[db.name] = f"cannot check: {e}"
    checks["repository"] = verify_repository(repository)
    return checks


def verify_repository(repository: Path) -> str:
    """`dsec image verify` of the repository (every chunk read and hashed): "ok", or what it found."""
    argv = [sys.executable, "-m", "dsec", "image", "verify", "--repository", str(repository), "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    try:
        report = json.loads(proc.stdout)
    except ValueError:  # it failed before it could check anything: its reason is on stderr
        return f"cannot check: {(proc.stderr.strip() or f'exit status {proc.returncode}')[-300:]}"
    return "ok" if report.get("ok") is True else "; ".join(report.get("problems", [])[:5])


async def recover(client: AsyncClient, requests: Requests) -> Json:
    """After the fault: which of the burst's sandboxes the node still holds, whether each answers, and
    whether a new sandbox can be made and answers."""
    held = await client.list(labels=LABELS)
    answering = 0
    for info in held:
        if info.state.value != "running":
            continue
        with contextlib.suppress(DsecError):
            res = await AsyncSandbox(info, client).exec("echo alive", timeout=60)
            answering += res.stdout == "alive\n"
    fresh = await requests.one("create after the fault", AsyncSandbox.create(image="dsec/busybox", client=client))
    works = False
    answered = None  # what the new sandbox's command gave, when it was not the expected output
    if fresh is not None:
        answer = await requests.one("exec after the fault", fresh.exec("echo fresh", timeout=60))
        works = answer is not None and answer.stdout == "fresh\n"
        if answer is not None and not works:
            answered = {"exit_code": answer.exit_code, "stdout": answer.stdout[-300:], "stderr": answer.stderr[-300:]}
        await requests.one("kill after the fault", fresh.kill())
    running = sum(1 for i in held if i.state.value == "running")
    found: Json = {"held": len(held), "running": running, "running_answering": answering, "new_sandbox_works": works}
    return found | ({"new_sandbox_answered": answered} if answered is not None else {})


async def warm_up(client: AsyncClient, case: Case) -> None:
    """What a node makes once and keeps (helpers, layer mounts, guest assets, a VM template) exists before
    the baseline. Only ``echo`` runs: most of an image's chunks (the case's command among them) stay
    unread, so a burst reading them fetches into the cache."""
    for image in dict.fromkeys(["dsec/busybox", case.image]):
        sb = await AsyncSandbox.create(image=image, client=client, labels=LABELS)
        await sb.exec("echo warm")
        await sb.kill()
    for _ in range(2 if case.vms else 0):  # the first boots, the second restores from the template
        vm = await AsyncSandbox.create(
            image="dsec/busybox", kind="microvm", client=client, labels=LABELS, memory="192Mi"
        )
        await vm.exec("echo warm")
        await vm.kill()
        await asyncio.sleep(5)  # the template is saved in the background after the first boot


async def run_case(console: Console, case: Case, root: Path, repository: Path) -> Json:
    state = root / case.fault
    started = time.monotonic()
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        phases[name] = round(time.monotonic() - started - sum(phases.values()), 1)

    with node_file_systems(state) as cache:
        flags = ["--repository", str(repository), "--log-level", "info"]
        proc = start_daemon(state, *flags)
        client = await connect(proc, state)
        lap("start")
        try:
            await warm_up(client, case)
            lap("warm_up")
            rules = allowances(os.cpu_count() or 1, 1 if case.vms else 0)
            known = Known(Node(state, proc.pid))
            before, quiet = await baseline(known.node, known, rules, SETTLE_S, lambda: probe(proc, state))
            lap("baseline")
            requests = Requests()
            burst = Burst(client, requests, image=case.image, command=case.command, vms=case.vms)
            if not case.vms:
                burst.hold.set()
            target = Target(state, proc.pid, cache)
            what, inject = FAULTS[case.fault]
            if case.fault == "layer-cache-full":  # full before the burst's first fetch
                done = await inject(target, burst)
                await burst.run(BURST)
            else:
                fault = asyncio.create_task(inject(target, burst))
                await burst.run(BURST)
                done = await fault
            lap("burst")
            (state / "chaos-filler").unlink(missing_ok=True)
            (cache / "chaos-filler").unlink(missing_ok=True)
            if proc.poll() is not None or case.fault == "daemon":
                await client.aclose()
                proc.wait()
                proc = start_daemon(state, *flags)
                client = await connect(proc, state)
            recovered = await recover(client, requests)
            lap("recovery")
            known.scan()
            await kill_leftovers(console, client, LABELS)
            # the burst's pooled keep-alive connections are the client's, not the node's: dropped
            await client.aclose()
            client = await connect(proc, state)
            node = Node(state, proc.pid)
            known.node = node
            _, rows, settled = await settle(node, known, before, rules, SETTLE_S, lambda: probe(proc, state))
        finally:
            await client.aclose()
            stop_daemon(proc)
            lap("settle")
        checks = await asyncio.to_thread(integrity, state, repository)
        lap("integrity")
    return {
        "fault": case.fault,
        "what": what,
        "done": done,
        "requests": requests.report(),
        "fault_problems": burst.problems,
        "recovery": recovered,
        "integrity": checks,
        "baseline_quiet": quiet,
        "leaks": accounting.leaks(rows),
        "diff": [r for r in rows if r["delta"]],
        "seconds": round(time.monotonic() - started, 1),
        "settle_s": round(settled, 1),
        "phases": phases,
    }


def verdict(row: Json) -> list[str]:
    """What went wrong in a case (nothing: it passed)."""
    problems = list(row.get("fault_problems", []))
    req = row["requests"]
    if req["hung"]:
        problems.append(f"{req['hung']} request(s) never ended")
    if req["unclear_errors"]:
        problems.append(f"unclear errors: {req['unclear_errors']}")
    if not row["recovery"]["new_sandbox_works"]:
        problems.append("no new sandbox could be made and run after the fault")
    if row["recovery"]["running_answering"] != row["recovery"]["running"]:
        problems.append("a sandbox the node holds as running does not answer")
    bad = {k: v for k, v in row["integrity"].items() if v != "ok"}
    if bad:
        problems.append(f"integrity: {bad}")
    if row["leaks"]:
        problems.append(f"leaks: {row['leaks']}")
    return problems


def seed(source: Path, dest: Path) -> None:
    try:
        seed_repository(source, dest, BUILTINS)
    except FileNotFoundError as e:
        raise InvalidRequest(
            f"{e}: build the built-in images into it first (dsec image build, or any daemon on it), "
            "or name another with --repository"
        ) from None


def main(faults: list[str], root: Path, source: Path, json_out: Path) -> int:
    console = Console()
    root = root.resolve()
    repository = root / "repository"
    when = datetime.now(UTC).isoformat(timespec="seconds")
    seed(source, repository)
    rows = []
    for fault in faults:
        console.print(f"chaos: {fault} ({FAULTS[fault][0]})")
        try:
            row = asyncio.run(run_case(console, Case.of(fault), root, repository))
        except (DsecError, OSError, RuntimeError, subprocess.SubprocessError) as e:
            row = {"fault": fault, "what": FAULTS[fault][0], "error": f"{type(e).__name__}: {e}"}
        row["problems"] = verdict(row) if "error" not in row else [row["error"]]
        ok = not row["problems"]
        console.print(f"  {'[green]ok[/green]' if ok else '[red]failed[/red]'}: {row.get('done', '')}")
        for problem in row["problems"]:
            console.print(f"    {problem}")
        rows.append(row)
    result: Json = {"bench": "chaos", "when": when, "host": host_facts(), "burst": BURST, "cases": rows}
    path = write_json(json_out.parent, json_out.name, result)
    failed = [r["fault"] for r in rows if r["problems"]]
    console.print(f"{len(rows) - len(failed)} of {len(rows)} faults handled; wrote {path}")
    return 1 if failed else 0


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """A markdown table of the cases (docs/reliability.md)."""
    out = [
        "| fault | what happened | requests ok | clear errors | failed commands | unclear / hung | recovery "
        "| integrity | leaks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q, rec = r["requests"], r["recovery"]
        errors = ", ".join(f"`{k}` {v}" for k, v in q["clear_errors"].items()) or "none"
        after = f"{rec['running_answering']} of {rec['running']} held sandboxes answer" if rec["held"] else "none held"
        new = "a new sandbox works" if rec["new_sandbox_works"] else "**no new sandbox**"
        intact = "ok" if all(v == "ok" for v in r["integrity"].values()) else "**damaged**"
        out.append(
            f"| {r['what']} | {r['done']} | {q['ok']} | {errors} | {q['failed_commands']} | "
            f"{len(q['unclear_errors'])} / {q['hung']} | {after}; {new} | {intact} | {len(r['leaks'])} |"
        )
    return out
