"""`dsec bench images`: a cold burst on a large image, lazy versus eager, over a simulated network link.

Each mode gets a fresh node (empty chunk cache, page cache dropped) whose repository sits behind a
link with a fixed per-request latency and a bandwidth cap (stated in the output). N sandboxes are
created at once; each runs a small task that imports a few Python modules and runs a unit test. Then,
on the same node: warm-read throughput against a plain local EROFS mount of the same layer, pack_diff
of a small diff, and snapshot → new sandbox latency.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from dsec import AsyncClient, AsyncSandbox, DsecError, ImageSpec
from dsec.isolation.mounts import MS_RDONLY, mount, umount

from .common import IMAGES_DIR, Json, connect, kill_leftovers, phase, release_node, start_daemon, stop_daemon, summarize

IMAGE = "dsec/bench-toolkit:1"
TOOLKIT = ("python3-numpy", "python3-scipy", "python3-pandas", "python3-sympy", "python3-matplotlib", "gcc", "g++")
MIN_IMAGE = 500 * 10**6
LABEL = {"bench": "images"}
TASK = r"""python3 - <<'EOF'
import decimal, fractions, json, unittest
import numpy

class Task(unittest.TestCase):
    def test_sum(self):
        self.assertEqual(int(numpy.arange(10).sum()), 45)

unittest.main(argv=["task"], exit=True, verbosity=0)
EOF"""


def drop_caches() -> None:
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def disk_written(path: Path) -> int | None:
    """Bytes written so far to the block device holding ``path`` (None on a device without stats)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if int(fields[0]) == major and int(fields[1]) == minor:
                return int(fields[9]) * 512
    return None


async def prepare(console: Console, state_dir: Path) -> Json:
    """The bench image, built once on the bench repository (the build cache makes reruns instant)."""
    proc = start_daemon(state_dir / "builder")
    try:
        client = await connect(proc, state_dir / "builder")
        try:
            try:
                info = await client.image(IMAGE)
            except DsecError:
                with console.status(f"building {IMAGE} (apt: {' '.join(TOOLKIT)}; minutes on the first run)"):
                    info = (await client.build(ImageSpec("dsec/debian:12").apt(*TOOLKIT), IMAGE)).image
        finally:
            await client.aclose()
    finally:
        stop_daemon(proc)
        release_node(state_dir / "builder")
    if info.size < MIN_IMAGE:
        raise RuntimeError(f"{IMAGE} is {info.size} bytes, smaller than the {MIN_IMAGE} the bench needs")
    return {"name": IMAGE, "size": info.size, "layers": [{"role": x.role, "size": x.size} for x in info.layers]}


async def burst(console: Console, client: AsyncClient, n: int) -> tuple[float, list[float], list[str]]:
    ready: list[float] = []
    failures: list[str] = []
    started = time.perf_counter()
    with phase(console, f"{n} sandboxes: create + first exec", n) as tick:

        async def one() -> None:
            t = time.perf_counter()
            try:
                sb = await AsyncSandbox.create(image=IMAGE, client=client, labels=LABEL, memory="1Gi", timeout=900)
                res = await sb.exec(TASK, timeout=300)
                if res.exit_code != 0:
                    failures.append(f"task exited {res.exit_code}: {res.stderr[-300:]}")
                else:
                    ready.append(time.perf_counter() - t)
            except DsecError as e:
                failures.append(f"{e.code}: {e.message[:300]}")
            tick()

        await asyncio.gather(*(one() for _ in range(n)))
    return time.perf_counter() - started, ready, failures


def read_tree(root: Path) -> tuple[int, float]:
    """Read every regular file under ``root``; returns (bytes, seconds)."""
    total = 0
    started = time.perf_counter()
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                if not os.path.isfile(path) or os.path.islink(path):
                    continue
                with open(path, "rb", buffering=0) as f:
                    while chunk := f.read(1 << 20):
                        total += len(chunk)
            except OSError:
                continue
    return total, time.perf_counter() - started


def mount_source(mountpoint: Path) -> str | None:
    """The source of the topmost mount at ``mountpoint``: the one no other mount there sits on."""
    here: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if fields[4] == str(mountpoint):
                here[fields[0]] = (fields[1], right.split()[1])
    parents = {parent for parent, _ in here.values()}
    return next((source for mid, (_, source) in here.items() if mid not in parents), None)


async def switched(client: AsyncClient, mountpoint: Path, local: Path, timeout: float = 120.0) -> None:
    """Wait for the layer's local file, then create a sandbox (which switches the mount) and wait for it."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(local.exists):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no complete local file {local} within {timeout:g}s of reading the whole layer")
        await asyncio.sleep(0.2)
    sb = await AsyncSandbox.create(image=IMAGE, client=client, labels=LABEL)
    await sb.kill()
    while mount_source(mountpoint) != str(local):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the mount at {mountpoint} did not switch to {local}: {mount_source(mountpoint)}")
        await asyncio.sleep(0.1)


async def warm_reads(node: Path, client: AsyncClient) -> Json:
    """The largest layer read through the node's lazy mount (every chunk fetched, so switched to the
    layer's local file; page cache dropped) versus a plain EROFS mount of a local copy of the same layer."""
    info = await client.image(IMAGE)
    layer = max(info.layers, key=lambda x: x.size)
    lazy_mount = node / "images" / "mnt" / layer.digest
    await asyncio.to_thread(read_tree, lazy_mount)  # fills the chunk cache
    # every chunk is here now: the fetcher writes the layer's local file, and the next sandbox of the
    # image switches the node's mount of the layer to it (docs/images.md, "Lazy layers that become complete")
    await switched(client, lazy_mount, node / "images" / "blobs" / layer.digest)
    local = node / "bench-local"
    local.mkdir(exist_ok=True)
    blob = local / "layer.erofs"
    await asyncio.to_thread(shutil.copyfile, node / "images" / "fetcher" / "mnt" / layer.digest, blob)
    target = local / "mnt"
    target.mkdir(exist_ok=True)
    mount(str(blob), target, "erofs", MS_RDONLY)
    rates: dict[str, float] = {}
    try:
        for where, root in (("lazy", lazy_mount), ("local", target)):
            # node cache warm, page cache cold: what a new node-local sandbox sees after others ran
            drop_caches()
            size, seconds = await asyncio.to_thread(read_tree, root)
            rates[f"{where}_cold_page_cache"] = size / seconds / 1e6
            # page cache warm too: the steady state of a busy node
            size, seconds = await asyncio.to_thread(read_tree, root)
            rates[f"{where}_warm"] = size / seconds / 1e6
    finally:
        umount(target, lazy=True)
        shutil.rmtree(local, ignore_errors=True)
    return {
        "layer_size": layer.size,
        "bytes_read": size,
        **{f"{k}_mb_s": round(v, 1) for k, v in rates.items()},
        "ratio": round(rates["lazy_warm"] / rates["local_warm"], 3),
        "ratio_cold_page_cache": round(rates["lazy_cold_page_cache"] / rates["local_cold_page_cache"], 3),
    }


async def snapshots(client: AsyncClient) -> Json:
    sb = await AsyncSandbox.create(image=IMAGE, client=client, labels=LABEL)
    packs, sizes, to_new = [], [], []
    try:
        await sb.exec("mkdir -p /work && for i in $(seq 1 20); do echo result-$i > /work/f$i; done")
        for i in range(5):
            await sb.exec(f"echo round-{i} > /work/round")
            name = f"bench/snapshot:{os.getpid()}-{time.monotonic_ns()}"
            t = time.perf_counter()
            info = await sb.snapshot(name)
            packs.append(time.perf_counter() - t)
            sizes.append(info.layers[-1].size)
            new = await AsyncSandbox.create(image=name, client=client, labels=LABEL)
            await new.exec("cat /work/round")
            to_new.append(time.perf_counter() - t)
            await new.kill()
            await client.remove_image(name)
    finally:
        await sb.kill()
    return {"pack_diff": summarize(packs), "diff_layer_bytes": max(sizes), "snapshot_to_new_sandbox": summarize(to_new)}


def fresh_node(node: Path) -> int | None:
    """An empty node directory (whatever an interrupted run left is released first), page cache dropped;
    returns the disk's bytes-written counter."""
    if node.exists():
        release_node(node)
        shutil.rmtree(node, ignore_errors=True)
    node.mkdir(parents=True)
    drop_caches()
    return disk_written(node)


async def run_mode(console: Console, mode: str, n: int, node: Path, link: str, extras: bool) -> Json:
    written_before = await asyncio.to_thread(fresh_node, node)
    args = ["--repository", f"throttle:{link}:{IMAGES_DIR / 'repository'}", "--log-level", "warning"]
    if mode == "eager":
        args.append("--eager-layers")
    proc = start_daemon(node, *args)
    try:
        client = await connect(proc, node)
        try:
            wall, ready, failures = await burst(console, client, n)
            stats = await client.image_stats(IMAGE)
            await asyncio.to_thread(subprocess.run, ["sync"], check=False)  # count what is still dirty too
            written_after = disk_written(node)
            result: Json = {
                "all_ready_s": round(wall, 3),
                "ready": len(ready),
                "failures": failures[:5],
                "failure_count": len(failures),
                "first_exec": summarize(ready) if ready else None,
                "bytes_fetched": stats.fetched_bytes,
                "image_size": stats.size,
                "exposed_fraction": round(stats.exposed_fraction, 4),
                "chunk_hit_rate": stats.chunk_hit_rate,
                "fetch_wait_s": round(stats.fetch_wait_seconds, 3),
                "disk_written_bytes": (
                    written_after - written_before if written_after is not None and written_before else None
                ),
            }
            await kill_leftovers(console, client, LABEL)
            if extras:
                console.print("warm reads and snapshots…")
                result["warm_reads"] = await warm_reads(node, client)
                result["snapshots"] = await snapshots(client)
            return result
        finally:
            await kill_leftovers(console, client, LABEL)
            await client.aclose()
    finally:
        stop_daemon(proc)
        release_node(node)


def main(n: int, json_out: Path, state_dir: Path, latency_ms: float, bandwidth_mb_s: float) -> int:
    console = Console()
    state_dir = state_dir.resolve()
    link = f"{latency_ms:g}:{bandwidth_mb_s:g}"
    try:
        image = asyncio.run(prepare(console, state_dir))
        results: Json = {}
        for mode, extras in (("eager", False), ("lazy", True), ("lazy_prefetch", False)):
            # lazy_prefetch: another cold node, after the lazy run stored its access traces
            console.print(f"[bold]{mode}[/bold]: cold node, {n} sandboxes")
            results[mode] = asyncio.run(
                run_mode(console, "eager" if mode == "eager" else "lazy", n, state_dir / mode, link, extras)
            )
    except (DsecError, RuntimeError, OSError) as e:
        console.print(f"[red]images bench failed[/red]: {e}")
        return 1
    eager, lazy = results["eager"], results["lazy"]
    speedup = eager["all_ready_s"] / lazy["all_ready_s"] if lazy["all_ready_s"] else None
    we, wl = eager["disk_written_bytes"], lazy["disk_written_bytes"]
    write_saving = 1 - wl / we if we and wl is not None else None
    warm = lazy.get("warm_reads", {})
    snaps = lazy.get("snapshots", {})
    figures = {
        "lazy_speedup_all_ready": round(speedup, 2) if speedup else None,
        "lazy_disk_write_saving": round(write_saving, 3) if write_saving is not None else None,
        "exposed_fraction": lazy["exposed_fraction"],
        "warm_read_ratio": warm.get("ratio"),
        "warm_read_ratio_cold_page_cache": warm.get("ratio_cold_page_cache"),
        "pack_diff_p50_ms": snaps.get("pack_diff", {}).get("p50_ms"),
        "snapshot_to_new_sandbox_p50_ms": snaps.get("snapshot_to_new_sandbox", {}).get("p50_ms"),
    }
    targets = {
        "lazy >= 1.7x faster to all-ready": (speedup or 0) >= 1.7,
        "lazy writes >= 50% less to disk": (write_saving or 0) >= 0.5,
        "exposed fraction <= 15%": lazy["exposed_fraction"] <= 0.15,
        "warm reads >= 90% of local EROFS": (warm.get("ratio") or 0) >= 0.9,
        "pack_diff of a small diff <= 100 ms": (figures["pack_diff_p50_ms"] or 1e9) <= 100,
        "snapshot -> new sandbox <= 300 ms": (figures["snapshot_to_new_sandbox_p50_ms"] or 1e9) <= 300,
    }
    out = {
        "bench": "images",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "params": {
            "n": n,
            "image": image,
            "task": "python3: import decimal, fractions, json, unittest, numpy; one unittest",
            "link": {"latency_ms": latency_ms, "bandwidth_mb_s": bandwidth_mb_s, "how": "throttle: repository"},
            "chunk_size": 1 << 20,
        },
        "results": results,
        "figures": figures,
        "targets": targets,
    }
    json_out.write_text(json.dumps(out, indent=2) + "\n")
    console.print_json(json.dumps({"figures": figures, "targets": targets}))
    failed = any(results[m]["failure_count"] for m in results)
    return 1 if failed else 0
