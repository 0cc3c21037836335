"""Gateway bench: what the cluster gateway adds to an exec round trip.

One node daemon on TCP loopback and a gateway in front of it (its own process, as in a cluster); one
container sandbox made through the gateway. ``true`` is run in it alternately straight at the node and
through the gateway, one call at a time, by the same SDK client code over the same kind of transport
(TCP), so the difference is the gateway's hop: its HTTP server, the routing lookup and the second
connection. Target: the gateway adds at most 2 ms (p50).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dsec import AsyncClient, AsyncSandbox, DsecError

from .common import (
    IMAGES_DIR,
    Json,
    host_facts,
    operator_token,
    phase,
    release_node,
    stop_daemon,
    summarize,
    tail,
    unwind_on_sigterm,
)

IMAGE = "dsec/busybox"
CMD = ["true"]
WARMUP = 30
TARGET_ADDED_MS = 2.0
START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        # a session of its own: Ctrl-C stops the bench, which then stops these in order
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)


async def answering(client: AsyncClient, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited ({proc.returncode}): {tail(log)}")
        with contextlib.suppress(DsecError):
            await client.health()
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no answer within {START_TIMEOUT:.0f} s: {tail(log)}")


async def measure(console: Console, direct: AsyncClient, via: AsyncClient, n: int) -> Json:
    sb = await AsyncSandbox.create(image=IMAGE, timeout=600 + n, labels={"dsec-bench": "gateway"}, client=via)
    try:
        at_node = await AsyncSandbox.connect(sb.id, client=direct)
        for _ in range(WARMUP):
            await at_node.exec(CMD)
            await sb.exec(CMD)
        times: dict[str, list[float]] = {"direct": [], "gateway": []}
        with phase(console, "exec `true`, node and gateway alternately", n) as tick:
            for i in range(n):
                # alternate which goes first, so neither always follows the other's noise
                order = [("direct", at_node), ("gateway", sb)] if i % 2 == 0 else [("gateway", sb), ("direct", at_node)]
                for name, handle in order:
                    started = time.perf_counter()
                    res = await handle.exec(CMD)
                    times[name].append(time.perf_counter() - started)
                    if res.exit_code != 0:
                        raise RuntimeError(f"`true` exited {res.exit_code} through {name}: {res.stderr[:200]}")
                tick()
        return {name: summarize(values) for name, values in times.items()}
    finally:
        with contextlib.suppress(DsecError):
            await sb.kill()


def judge(lat: Json) -> Json:
    d, g = lat["direct"], lat["gateway"]
    added = {k: round(g[f"{k}_ms"] - d[f"{k}_ms"], 3) for k in ("p50", "p99", "mean")}
    ratio = {k: round(g[f"{k}_ms"] / d[f"{k}_ms"], 3) if d[f"{k}_ms"] else None for k in ("p50", "p99", "mean")}
    target = {
        "target": f"the cluster gateway adds <= {TARGET_ADDED_MS:g} ms to an exec round trip (p50)",
        "value": added["p50"],
        "met": added["p50"] <= TARGET_ADDED_MS,
    }
    return {"added_ms": added, "ratio": ratio, "target": target}


def run(
    n: int = 500,
    state_dir: Path = Path("/var/lib/dsec-bench-gateway"),
    repository: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Start a node daemon and a gateway, measure, stop them; the figures as a JSON-ready dict."""
    console = console or Console()
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    repo = repository or IMAGES_DIR / "repository"
    node_url = f"http://127.0.0.1:{free_port()}"
    gateway_url = f"http://127.0.0.1:{free_port()}"
    node_log, gateway_log = state_dir / "daemon.log", state_dir / "gateway.log"
    argv = [sys.executable, "-m", "dsec", "serve", "--state-dir", str(state_dir), "--listen", node_url]
    argv += ["--repository", str(repo), "--node-name", "bench-node", "--log-level", "warning"]
    node = spawn(argv, node_log)
    gateway: subprocess.Popen[bytes] | None = None
    when = datetime.now(UTC).isoformat(timespec="seconds")
    try:

        async def go() -> Json:
            nonlocal gateway
            token = await operator_token(state_dir, START_TIMEOUT)
            direct = AsyncClient(url=node_url, token=token)
            via = AsyncClient(url=gateway_url, token=token)
            try:
                await answering(direct, node, node_log)
                gw = [sys.executable, "-m", "dsec", "cluster", "gateway", "--node", node_url]
                gw += ["--token-file", str(state_dir / "token"), "--listen", gateway_url]
                gateway = spawn(gw, gateway_log)
                await answering(via, gateway, gateway_log)
                version = (await direct.health()).version
                return await measure(console, direct, via, n) | {"version": version}
            finally:
                await direct.aclose()
                await via.aclose()

        lat = asyncio.run(go())
    finally:
        if gateway is not None:
            stop_daemon(gateway)
        stop_daemon(node, timeout=30)
        release_node(state_dir)
    version = lat.pop("version")
    return {
        "bench": "gateway",
        "when": when,
        "host": host_facts() | {"nproc": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg()},
        "params": {"n": n, "warmup": WARMUP, "command": CMD, "image": IMAGE, "repository": str(repo)},
        "daemon_version": version,
        "setup": "one node daemon (TCP loopback) and `dsec cluster gateway` in front of it, each its own "
        "process; the same AsyncClient code calls exec `true` straight at the node and through the gateway, "
        "alternately, one call at a time",
        "latency": lat,
        **judge(lat),
    }


def print_summary(console: Console, result: Json) -> None:
    lat = result["latency"]
    table = Table(title=f"exec `true` round trip (ms), {result['params']['n']} calls each, alternately")
    for col in ("path", "p50", "p99", "mean", "min", "max"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for name in ("direct", "gateway"):
        s = lat[name]
        table.add_row(name, *(f"{s[f'{k}_ms']:.3f}" for k in ("p50", "p99", "mean", "min", "max")))
    a, r = result["added_ms"], result["ratio"]
    table.add_row("added", *(f"{a[k]:+.3f}" for k in ("p50", "p99", "mean")), "", "", style="bold")
    table.add_row("ratio", *(f"{r[k]:.2f}x" if r[k] else "-" for k in ("p50", "p99", "mean")), "", "")
    console.print(table)
    t = result["target"]
    console.print(f"{'[green]met[/green]' if t['met'] else '[red]missed[/red]'}  {t['target']}  (value: {t['value']})")


def main(n: int, json_out: Path, state_dir: Path, repository: Path | None = None) -> int:
    console = Console()
    unwind_on_sigterm()
    try:
        result = run(n=n, state_dir=state_dir, repository=repository, console=console)
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]bench failed[/red]: {e}")
        return 1
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(console, result)
    console.print(f"wrote {json_out}")
    return 0
