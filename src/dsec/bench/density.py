"""Density: hold N idle sandboxes on this node and measure the host memory each one costs."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from ..errors import DsecError
from ..sdk.aio import AsyncSandbox
from .common import Json, connect, host_facts, kill_leftovers, phase, release_node, start_daemon, stop_daemon, summarize

LABEL = {"dsec-bench": "density"}
TARGET_N = 1000
TARGET_MIB = 4.0


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


def used(m: dict[str, int]) -> int:
    """Memory the host cannot hand out: what sandboxes really cost, kernel objects included."""
    return m["MemTotal"] - m["MemAvailable"]


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def run(console: Console, n: int, image: str, state_dir: Path, concurrency: int) -> Json:
    proc = start_daemon(state_dir)
    try:
        client = await connect(proc, state_dir)
        await client.build_image(image)
        probe = await AsyncSandbox.create(image=image, client=client, labels=LABEL)  # warm caches first
        await probe.kill()
        await asyncio.sleep(2)
        before, daemon_before = meminfo(), rss(proc.pid)
        gate = asyncio.Semaphore(concurrency)
        made: list[AsyncSandbox] = []
        failures: dict[str, int] = {}
        started = time.perf_counter()
        with phase(console, f"creating {n} idle sandboxes", n) as tick:

            async def one() -> None:
                async with gate:
                    try:
                        made.append(await AsyncSandbox.create(image=image, client=client, labels=LABEL, timeout=3600))
                    except DsecError as e:
                        failures[e.code] = failures.get(e.code, 0) + 1
                    tick()

            await asyncio.gather(*(one() for _ in range(n)))
        create_wall = time.perf_counter() - started
        await asyncio.sleep(3)  # let deferred kernel work settle before reading memory
        after, daemon_after = meminfo(), rss(proc.pid)
        held = len(made)
        per = (used(after) - used(before)) / held if held else 0.0
        # the sandboxes still answer while the node is full
        latencies = []
        for sb in made[:: max(1, held // 20)][:20]:
            t = time.perf_counter()
            await sb.exec(["true"])
            latencies.append(time.perf_counter() - t)
        t = time.perf_counter()
        await kill_leftovers(console, client, LABEL)
        kill_wall = time.perf_counter() - t
        await client.aclose()
        return {
            "held": held,
            "failures": failures,
            "create_wall_s": round(create_wall, 2),
            "creations_per_s": round(held / create_wall, 1) if create_wall else None,
            "host_memory_per_sandbox_mib": round(per / 2**20, 3),
            "host_memory_used_delta_mib": round((used(after) - used(before)) / 2**20, 1),
            "slab_delta_mib": round((after["Slab"] - before["Slab"]) / 2**20, 1),
            "shmem_delta_mib": round((after["Shmem"] - before["Shmem"]) / 2**20, 1),
            "daemon_rss_delta_mib": round((daemon_after - daemon_before) / 2**20, 1),
            "exec_while_full": summarize(latencies) if latencies else None,
            "kill_all_s": round(kill_wall, 2),
        }
    finally:
        stop_daemon(proc)
        release_node(state_dir)


def main(n: int, json_out: Path, state_dir: Path, image: str, concurrency: int) -> int:
    console = Console()
    try:
        figures = asyncio.run(run(console, n, image, state_dir, concurrency))
    except (DsecError, RuntimeError) as e:
        console.print(f"[red]density bench failed[/red]: {e}")
        return 1
    result = {
        "bench": "density",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": host_facts(),
        "params": {"n": n, "image": image, "concurrency": concurrency, "kind": "container"},
        "dsec": figures,
        "targets": {
            f"held >= {TARGET_N}": figures["held"] >= TARGET_N,
            f"host memory per sandbox <= {TARGET_MIB} MiB": figures["host_memory_per_sandbox_mib"] <= TARGET_MIB,
        },
    }
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    console.print_json(json.dumps(result))
    return 0 if not figures["failures"] else 1
