"""E2B bench: what an unmodified E2B client pays against dsec, next to dsec's own SDK, in one run.

One node daemon on TCP loopback serving both APIs; one container sandbox of the same image. The same
work is done through the ``e2b`` SDK (``commands.run``, ``files.write``/``read``) and through dsec's
``AsyncSandbox`` (``exec`` of the very argv E2B runs, ``/bin/bash -l -c CMD``, and the file API),
alternately, one call at a time. Creation to first command is measured both ways too. The difference
is the E2B path: its SDK (connectrpc over reqwest), the Connect framing, the process table, and the
account lookup; the exec underneath is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
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
    unwind_on_sigterm,
)
from .gateway import START_TIMEOUT, answering, free_port, spawn

IMAGE = "dsec/debian:12"
CMD = "true"
ARGV = ["/bin/bash", "-l", "-c", CMD]  # what the e2b SDK asks envd to run for commands.run(CMD)
FILE_BYTES = 64 << 10
WARMUP = 20


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


async def measure(console: Console, client: AsyncClient, e2b_url: str, token: str, n: int, creates: int) -> Json:
    try:
        from e2b import AsyncSandbox as E2BSandbox
    except ImportError:
        raise RuntimeError("the e2b package is not installed (pip install e2b; `make test` installs it)") from None

    meta = {"dsec-bench": "e2b"}
    box = await E2BSandbox.create(
        IMAGE, timeout=600 + n, metadata=meta, api_key=token, api_url=e2b_url, sandbox_url=e2b_url
    )
    native = await AsyncSandbox.connect(box.sandbox_id, client=client)
    data = os.urandom(FILE_BYTES)
    try:

        async def e2b_run() -> None:
            await box.commands.run(CMD)

        async def native_run() -> None:
            res = await native.exec(ARGV)
            if res.exit_code != 0:
                raise RuntimeError(f"`{CMD}` exited {res.exit_code}: {res.stderr[:200]}")

        async def e2b_files() -> None:
            await box.files.write("/tmp/bench.bin", data)
            if bytes(await box.files.read("/tmp/bench.bin", format="bytes")) != data:
                raise RuntimeError("the E2B read returned other bytes")

        async def native_files() -> None:
            await native.files.write("/tmp/bench.bin", data)
            if await native.files.read("/tmp/bench.bin") != data:
                raise RuntimeError("the dsec read returned other bytes")

        pairs = {"run": (e2b_run, native_run), "files": (e2b_files, native_files)}
        out: Json = {}
        for what, (via_e2b, via_dsec) in pairs.items():
            for _ in range(WARMUP):
                await via_e2b()
                await via_dsec()
            times: dict[str, list[float]] = {"e2b": [], "dsec": []}
            with phase(console, f"{what}: E2B SDK and dsec SDK alternately", n) as tick:
                for i in range(n):
                    order = [("e2b", via_e2b), ("dsec", via_dsec)]
                    for name, fn in order if i % 2 == 0 else order[::-1]:
                        times[name].append(await _timed(fn))
                    tick()
            out[what] = {name: summarize(values) for name, values in times.items()}
    finally:
        with contextlib.suppress(Exception):
            await box.kill()

    async def e2b_create() -> None:
        made = await E2BSandbox.create(
            IMAGE, timeout=120, metadata=meta, api_key=token, api_url=e2b_url, sandbox_url=e2b_url
        )
        await made.commands.run(CMD)
        await made.kill()

    async def native_create() -> None:
        made = await AsyncSandbox.create(image=IMAGE, timeout=120, labels={"dsec-bench": "e2b"}, client=client)
        await made.exec(ARGV)
        await made.kill()

    created: dict[str, list[float]] = {"e2b": [], "dsec": []}
    with phase(console, "create, first command, kill: both ways alternately", creates) as tick:
        for i in range(creates):
            order = [("e2b", e2b_create), ("dsec", native_create)]
            for name, fn in order if i % 2 == 0 else order[::-1]:
                created[name].append(await _timed(fn))
            tick()
    out["create_run_kill"] = {name: summarize(values) for name, values in created.items()}
    return out


def _ratios(lat: Json) -> Json:
    return {
        what: {
            "added_p50_ms": round(pair["e2b"]["p50_ms"] - pair["dsec"]["p50_ms"], 3),
            "ratio_p50": round(pair["e2b"]["p50_ms"] / pair["dsec"]["p50_ms"], 3) if pair["dsec"]["p50_ms"] else None,
        }
        for what, pair in lat.items()
    }


def run(
    n: int = 300,
    creates: int = 20,
    state_dir: Path = Path("/var/lib/dsec-bench-e2b"),
    repository: Path | None = None,
    console: Console | None = None,
) -> Json:
    """Start a daemon with the E2B API, measure, stop it; the figures as a JSON-ready dict."""
    console = console or Console()
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    repo = repository or IMAGES_DIR / "repository"
    node_url, e2b_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log = state_dir / "daemon.log"
    argv = [sys.executable, "-m", "dsec", "serve", "--state-dir", str(state_dir), "--listen", node_url]
    argv += ["--e2b-listen", e2b_url, "--e2b-network", "none", "--repository", str(repo), "--log-level", "warning"]
    node = spawn(argv, log)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    try:

        async def go() -> Json:
            token = await operator_token(state_dir, START_TIMEOUT)
            client = AsyncClient(url=node_url, token=token)
            try:
                await answering(client, node, log)
                return await measure(console, client, e2b_url, token, n, creates) | {
                    "version": (await client.health()).version
                }
            finally:
                await client.aclose()

        lat = asyncio.run(go())
    finally:
        stop_daemon(node, timeout=30)
        release_node(state_dir)
    version = lat.pop("version")
    return {
        "bench": "e2b",
        "when": when,
        "host": host_facts() | {"nproc": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg()},
        "params": {"n": n, "creates": creates, "warmup": WARMUP, "command": ARGV, "file_bytes": FILE_BYTES},
        "daemon_version": version,
        "setup": "one node daemon on TCP loopback serving dsec's API and the E2B API (--e2b-listen, network "
        "none); the e2b SDK (AsyncSandbox) and dsec's AsyncSandbox do the same work in one container sandbox, "
        "alternately, one call at a time",
        "latency": lat,
        "e2b_vs_dsec": _ratios(lat),
    }


def print_summary(console: Console, result: Json) -> None:
    table = Table(title="the E2B SDK vs dsec's SDK on the same daemon and sandbox (ms)")
    for col in ("work", "path", "p50", "p99", "mean"):
        table.add_column(col, justify="left" if col in ("work", "path") else "right")
    for what, pair in result["latency"].items():
        for name in ("e2b", "dsec"):
            s = pair[name]
            table.add_row(what, name, *(f"{s[f'{k}_ms']:.3f}" for k in ("p50", "p99", "mean")))
        r = result["e2b_vs_dsec"][what]
        table.add_row(what, "e2b - dsec", f"{r['added_p50_ms']:+.3f}", "", f"x{r['ratio_p50']}", style="bold")
    console.print(table)


def main(n: int, creates: int, json_out: Path, state_dir: Path, repository: Path | None = None) -> int:
    console = Console()
    unwind_on_sigterm()
    try:
        result = run(n=n, creates=creates, state_dir=state_dir, repository=repository, console=console)
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]bench failed[/red]: {e}")
        return 1
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(console, result)
    console.print(f"wrote {json_out}")
    return 0
