"""`dsec bench pull`: K task images sharing a large base, pulled and run on a cold node, dsec against podman.

The bench writes K images (a base of a few hundred MB in a few layers, shared, and a small layer per image:
``taskimages``) as an OCI layout, starts a registry of its own on loopback and pushes them there with skopeo.
Then, in the same run, whole cycle against whole cycle, each image once, ``--concurrency`` at a time:

- dsec: a daemon on a fresh state directory and a fresh layer repository; ``create(image=REF)``, ``exec
  /bin/true``, kill;
- podman: on a fresh storage root, ``podman pull REF`` then ``podman run --rm REF /bin/true``.

Rounds: ``cold`` (page cache dropped before each side), ``warm`` (the same node and storage again; each side
uses the copy it has without asking the registry: dsec's default ``if-not-present``, podman's
``--pull=missing``), and ``second_node`` (dsec only: a second cold node on the same layer repository, which
should start every image without a request to the registry). For each: when the first and the last image
had run its command and when its cycle was done, bytes served by the registry (its access log), bytes
written by the side's processes (/proc/PID/io) and the growth of its storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from dsec import AsyncClient, AsyncSandbox, DsecError

from . import plots
from .common import Json, host_facts, phase, private_daemon, release_node, unwind_on_sigterm, write_with_plots
from .images import disk_written, drop_caches
from .lifecycle import ensure_podman
from .pullside import Podman, add_io, io_delta, io_snapshot, remove_dirs, tree_bytes, written
from .registry import LocalRegistry, push, traffic
from .taskimages import Family, write_family

LABEL = {"dsec-bench": "pull"}
REPOSITORY = "bench/pull"  # in the registry: REPOSITORY/task-NN:1
BUSYBOX = Path("/bin/busybox")
TARGET_SPEEDUP = 2.0
TARGET_REGISTRY_RATIO = 1.1
TARGET_DISK_RATIO = 0.5
# small requests, so that every image's sandbox fits the node at once whatever --concurrency is
CPU, MEMORY, MEMORY_REQUEST, TTL = 0.05, "128Mi", "16Mi", 1800.0


@dataclass(frozen=True)
class Params:
    k: int = 20
    base_mb: int = 300
    base_layers: int = 3
    task_kb: int = 512
    incompressible: float = 0.35
    concurrency: int = 8
    seed: str = "dsec-bench-pull"

    def as_json(self) -> Json:
        return {
            "k": self.k,
            "base_mb": self.base_mb,
            "base_layers": self.base_layers,
            "task_kb": self.task_kb,
            "incompressible": self.incompressible,
            "concurrency": self.concurrency,
            "seed": self.seed,
        }


@dataclass
class Outcome:
    """One image's cycle; times in seconds since its round started."""

    ref: str
    ready: float | None = None  # its command had run (podman: `run --rm` returned)
    done: float | None = None  # its cycle was over (dsec: the sandbox killed)
    error: str | None = None


@dataclass
class Round:
    """One side's round as measured: its cycles, and what it cost the registry and the disk."""

    outcomes: list[Outcome]
    wall_s: float
    registry: Json
    io: dict[str, int]
    storage_growth: int
    device_written: int | None


def side_figures(r: Round) -> Json:
    """One side's figures in one round."""
    ok = [o for o in r.outcomes if o.error is None and o.done is not None]
    ready = sorted(o.ready for o in ok if o.ready is not None)
    done = sorted(o.done for o in ok if o.done is not None)
    return {
        "n": len(r.outcomes),
        "succeeded": len(ok),
        # by kind ("create: image_not_found", "pull: exit 125"); the first one in full below
        "failures": dict(Counter(":".join(o.error.split(":", 2)[:2]) for o in r.outcomes if o.error)),
        "first_error": next((f"{o.ref}: {o.error}" for o in r.outcomes if o.error), None),
        "first_ready_s": round(ready[0], 3) if ready else None,
        "last_ready_s": round(ready[-1], 3) if ready else None,
        "last_done_s": round(done[-1], 3) if done else None,
        "wall_s": round(r.wall_s, 3),
        "ready_s": [round(t, 3) for t in ready],
        "done_s": [round(t, 3) for t in done],
        "registry": r.registry,
        "disk": {
            "written_bytes": written(r.io),
            "io": r.io,
            "storage_growth_bytes": r.storage_growth,
            "device_written_bytes": r.device_written,
        },
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def check(text: str, value: float | None, ok: Callable[[float], bool], valid: bool = True) -> Json:
    # met is None when a side failed or was skipped: unknown, which is not the same as missed
    return {"target": text, "value": value, "met": None if value is None or not valid else ok(value)}


def all_ok(side: Json | None) -> bool:
    """Every image of the side's round went through its cycle."""
    return side is not None and side["n"] > 0 and side["succeeded"] == side["n"]


def at(figures: Json | None, *keys: str) -> Any:
    """``figures[k1][k2]...``, or None where a side or a figure is missing."""
    value: Any = figures
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def judge(rounds: Json, unique_layer_bytes: int) -> tuple[Json, Json]:
    """Ratios and the issue's targets from the rounds' figures. Speed compares whole cycles: when the
    last of the K cycles was over on each side (podman's `run --rm` ends with the container removed)."""
    dsec, podman = at(rounds, "cold", "dsec"), at(rounds, "cold", "podman")
    second = at(rounds, "second_node", "dsec")
    both = all_ok(dsec) and all_ok(podman)
    # a cold node must have asked the registry something: none read means the access log was not understood,
    # and then no registry figure (a second node's zero least of all) can be trusted
    log_read = bool(at(dsec, "registry", "requests"))
    speedup = ratio(at(podman, "last_done_s"), at(dsec, "last_done_s"))
    registry = ratio(at(dsec, "registry", "bytes"), unique_layer_bytes)
    disk = ratio(at(dsec, "disk", "written_bytes"), at(podman, "disk", "written_bytes"))
    ratios = {
        "cold_podman_over_dsec_all_done": speedup,
        "cold_podman_over_dsec_first_ready": ratio(at(podman, "first_ready_s"), at(dsec, "first_ready_s")),
        "cold_podman_over_dsec_last_ready": ratio(at(podman, "last_ready_s"), at(dsec, "last_ready_s")),
        "cold_dsec_registry_bytes_over_unique_layer_bytes": registry,
        "cold_podman_registry_bytes_over_unique_layer_bytes": ratio(
            at(podman, "registry", "bytes"), unique_layer_bytes
        ),
        "cold_dsec_over_podman_disk_written": disk,
        "cold_dsec_over_podman_storage_growth": ratio(
            at(dsec, "disk", "storage_growth_bytes"), at(podman, "disk", "storage_growth_bytes")
        ),
        "warm_podman_over_dsec_all_done": ratio(
            at(rounds, "warm", "podman", "last_done_s"), at(rounds, "warm", "dsec", "last_done_s")
        ),
    }
    targets = {
        "all_ready_2x_faster_than_podman": check(
            f"all K images' cycles done ≥ {TARGET_SPEEDUP:g}× faster than podman's (cold)",
            speedup,
            lambda v: v >= TARGET_SPEEDUP,
            both,
        ),
        "registry_bytes_le_1_1x_unique_layers": check(
            f"registry bytes fetched by dsec ≤ {TARGET_REGISTRY_RATIO:g}× the unique layer bytes (cold)",
            registry,
            lambda v: v <= TARGET_REGISTRY_RATIO,
            all_ok(dsec) and log_read,
        ),
        "disk_written_le_0_5x_podman": check(
            f"bytes written to disk by dsec ≤ {TARGET_DISK_RATIO:g}× podman's (cold)",
            disk,
            lambda v: v <= TARGET_DISK_RATIO,
            both,
        ),
        "second_node_asks_registry_nothing": check(
            "a second node on the same layer repository starts every image with no registry request",
            at(second, "registry", "requests"),
            lambda v: v == 0,
            all_ok(second) and log_read,
        ),
    }
    return ratios, targets


# ---- the sides -------------------------------------------------------------------------------------------


async def bounded(
    console: Console, label: str, refs: list[str], concurrency: int, one: Callable[[Outcome, float], Awaitable[None]]
) -> tuple[list[Outcome], float]:
    """``one`` for every image, ``concurrency`` at a time; returns the outcomes and the round's wall time."""
    gate = asyncio.Semaphore(concurrency)
    outcomes = [Outcome(ref) for ref in refs]
    with phase(console, label, len(refs)) as tick:
        t0 = time.perf_counter()

        async def gated(o: Outcome) -> None:
            async with gate:
                await one(o, t0)
            tick()

        await asyncio.gather(*(gated(o) for o in outcomes))
        return outcomes, time.perf_counter() - t0


async def dsec_cycle(client: AsyncClient, o: Outcome, t0: float) -> None:
    try:
        sb = await AsyncSandbox.create(
            image=o.ref, client=client, labels=LABEL, cpu=CPU, memory=MEMORY, memory_request=MEMORY_REQUEST, timeout=TTL
        )
    except DsecError as e:
        o.error = f"create: {e.code}: {e.message[:200]}"
        return
    try:
        res = await sb.exec(["/bin/true"], timeout=120)
        if res.exit_code != 0:
            o.error = f"exec: exit {res.exit_code}: {res.stderr[-200:]}"
        else:
            o.ready = time.perf_counter() - t0
    except DsecError as e:
        o.error = f"exec: {e.code}: {e.message[:200]}"
    finally:
        with contextlib.suppress(DsecError):
            await sb.kill()
    if o.error is None:
        o.done = time.perf_counter() - t0


@dataclass
class Node:
    """A dsec node of the bench: its state directory, the shared repository, the daemon's process id."""

    state: Path
    repository: Path
    pid: int = 0

    def writers(self) -> list[int]:
        """The node's processes that write: the daemon, and the layer fetcher it leaves running."""
        pids = [self.pid]
        with contextlib.suppress(OSError, ValueError):
            pids.append(int((self.state / "images" / "fetcher" / "fetcher.pid").read_text().strip()))
        return pids


async def measured(
    registry: LocalRegistry,
    dirs: list[Path],
    pids: Callable[[], list[int]],
    cold: bool,
    run: Callable[[], Awaitable[tuple[list[Outcome], float]]],
) -> Round:
    """A round of one side, with what it cost the registry and the disk around it."""
    if cold:
        await asyncio.to_thread(drop_caches)
    os.sync()
    offset, grown0, device0 = registry.offset(), tree_bytes(*dirs), disk_written(dirs[0])
    io0 = io_snapshot(pids())
    outcomes, wall = await run()
    io = io_delta(io0, io_snapshot(pids()))
    os.sync()  # what is still dirty is written by now, and counted by the device
    device1 = disk_written(dirs[0])
    device = device1 - device0 if device1 is not None and device0 is not None else None
    grown = tree_bytes(*dirs) - grown0
    return Round(outcomes, wall, traffic(registry.requests_since(offset)), io, grown, device)


async def dsec_round(
    console: Console,
    registry: LocalRegistry,
    refs: list[str],
    params: Params,
    node: Node,
    client: AsyncClient,
    label: str,
    cold: bool,
) -> Round:
    title = f"dsec {label}: {len(refs)} images, create → exec → kill"

    async def run() -> tuple[list[Outcome], float]:
        return await bounded(console, title, refs, params.concurrency, lambda o, t0: dsec_cycle(client, o, t0))

    return await measured(registry, [node.state, node.repository], node.writers, cold, run)


async def dsec_rounds(
    console: Console, registry: LocalRegistry, refs: list[str], params: Params, node: Node, name: str
) -> dict[str, Round]:
    """Cold, then (on the first node) warm: the same daemon, the images already on the node."""
    flags = ["--repository", str(node.repository)]
    async with private_daemon(console, node.state, flags, LABEL) as (proc, client):
        node.pid = proc.pid
        rounds = {name: await dsec_round(console, registry, refs, params, node, client, name, True)}
        if name == "cold":
            rounds["warm"] = await dsec_round(console, registry, refs, params, node, client, "warm", False)
    return rounds


async def podman_cycle(podman: Podman, o: Outcome, t0: float, pull_first: bool, tag: str) -> dict[str, int]:
    """``podman pull`` (cold) then ``podman run --rm``; returns the I/O figures of its commands."""
    total: dict[str, int] = {}
    if pull_first:
        status, io = await podman.run(podman.pull_argv(o.ref), f"{tag}-pull")
        total = add_io(total, io)
        if status != 0:
            o.error = f"pull: exit {status}: {podman.error_tail(tag + '-pull')}"
            return total
    status, io = await podman.run(podman.run_argv(o.ref, "never" if pull_first else "missing"), f"{tag}-run")
    total = add_io(total, io)
    if status != 0:
        o.error = f"run: exit {status}: {podman.error_tail(tag + '-run')}"
        return total
    o.ready = o.done = time.perf_counter() - t0
    return total


async def podman_round(
    console: Console, registry: LocalRegistry, refs: list[str], params: Params, podman: Podman, label: str, cold: bool
) -> Round:
    """Cold: pull, then run; warm: run with the copy the storage has (--pull=missing, as dsec's default)."""
    ios: list[dict[str, int]] = []
    what = "pull + run --rm" if cold else "run --rm --pull=missing"

    async def one(o: Outcome, t0: float) -> None:
        ios.append(await podman_cycle(podman, o, t0, cold, f"{label}-{refs.index(o.ref):02d}"))

    async def run() -> tuple[list[Outcome], float]:
        return await bounded(console, f"podman {label}: {len(refs)} images, {what}", refs, params.concurrency, one)

    # podman's figures come from each command's wrapper, not from a process of the bench's
    r = await measured(registry, [podman.root, podman.downloads], list, cold, run)
    for io in ios:
        r.io = add_io(r.io, io)
    return r


# ---- the run ---------------------------------------------------------------------------------------------


def prepare(console: Console, work: Path, params: Params, registry: LocalRegistry) -> tuple[Family, list[str]]:
    """The family written as a layout and pushed: the references both sides pull."""
    if not BUSYBOX.exists():
        raise RuntimeError(f"{BUSYBOX} (a static busybox, Debian's busybox-static) is needed for the base")
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise RuntimeError("skopeo is not on PATH (apt-get install skopeo)")
    with console.status(f"writing {params.k} images over a {params.base_mb} MB base"):
        family = write_family(
            work / "layout",
            k=params.k,
            base_bytes=params.base_mb * 10**6,
            base_layers=params.base_layers,
            task_bytes=params.task_kb * 1000,
            incompressible=params.incompressible,
            busybox=BUSYBOX,
            seed=params.seed,
        )
    refs = []
    with phase(console, f"pushing to {registry.host} with skopeo", params.k) as tick:
        for name in family.names:
            push(skopeo, family.layout, name, registry.host, f"{REPOSITORY}/{name}:1", work / "skopeo")
            refs.append(f"{registry.host}/{REPOSITORY}/{name}:1")
            tick()
    shutil.rmtree(family.layout, ignore_errors=True)  # the registry has it now; its bytes would blur the disk figures
    return family, refs


def podman_storage(binary: str, work: Path) -> tuple[Podman, Path]:
    """A fresh storage for podman: the layers on the disk dsec's side uses, the run root on a tmpfs (where
    podman keeps it by default); returns it and the tmpfs directory to remove."""
    shm = Path("/dev/shm")
    volatile = Path(tempfile.mkdtemp(prefix="dsec-bench-pull-", dir=shm if shm.is_dir() else None))
    return Podman.fresh(binary, work / "podman", volatile), volatile


async def podman_side(
    console: Console, work: Path, params: Params, registry: LocalRegistry, refs: list[str]
) -> tuple[dict[str, Round], Json]:
    """podman's cold and warm rounds on a storage made for them and removed after, and podman's facts."""
    binary = await asyncio.to_thread(ensure_podman, console)
    podman, volatile = podman_storage(binary, work)
    try:
        # podman's storage made before the clock starts, as dsec's daemon is up before its rounds
        status, _ = await podman.run(podman.argv("info"), "init")
        if status != 0:
            raise RuntimeError(f"podman info on the bench's storage failed: {podman.error_tail('init')}")
        rounds = {}
        for label, cold in (("cold", True), ("warm", False)):
            rounds[label] = await podman_round(console, registry, refs, params, podman, label, cold)
        return rounds, {"version": podman.version(), "storage_driver": podman.storage_driver()}
    finally:
        await asyncio.to_thread(podman.remove_all)
        remove_dirs(volatile)


async def run_all(
    console: Console, work: Path, params: Params, registry: LocalRegistry, refs: list[str], skip_podman: bool
) -> tuple[dict[str, dict[str, Round]], Json]:
    """dsec's rounds, then podman's; a podman that fails is reported (with its error) beside dsec's figures."""
    rounds: dict[str, dict[str, Round]] = {"cold": {}, "warm": {}, "second_node": {}}
    repository = work / "dsec" / "repository"
    for name, node_dir in (("cold", "node1"), ("second_node", "node2")):
        node = Node(work / "dsec" / node_dir, repository)
        for label, r in (await dsec_rounds(console, registry, refs, params, node, name)).items():
            rounds[label]["dsec"] = r
    podman: Json = {"skipped": skip_podman}
    if not skip_podman:
        try:
            by_round, facts = await podman_side(console, work, params, registry, refs)
            podman |= facts
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            console.print(f"[red]podman failed[/red]: {e}")
            podman["error"] = str(e)
        else:
            for label, r in by_round.items():
                rounds[label]["podman"] = r
    return rounds, podman


def versions(podman: str) -> Json:
    out = {"podman": podman}
    for name, argv in (
        ("skopeo", ["skopeo", "--version"]),
        ("docker-registry", ["dpkg-query", "-W", "docker-registry"]),
    ):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out[name] = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    return out


def draw(out: Path, prefix: str, rounds: Json) -> list[str]:
    if not plots.available():
        raise RuntimeError(plots.MISSING)
    done = {f"{label}: {side}": figures["done_s"] for label, sides in rounds.items() for side, figures in sides.items()}
    written_mb = {
        f"{label}: {side}": {
            "registry MB": figures["registry"]["bytes"] / 1e6,
            "written MB": figures["disk"]["written_bytes"] / 1e6,
            "storage growth MB": figures["disk"]["storage_growth_bytes"] / 1e6,
        }
        for label, sides in rounds.items()
        for side, figures in sides.items()
    }
    paths = [
        plots.cumulative(out / f"{prefix}-cycles.png", "images whose cycle is done, over time", done),
        plots.bars(out / f"{prefix}-bytes.png", "bytes per side and round", "MB", written_mb),
    ]
    return [p.name for p in paths]


def forget(work: Path) -> None:
    """Remove the run's directory; a node an interrupted run left has its fetcher stopped and its mounts
    released first (a normal run's daemons did that as they stopped)."""
    for node in ("node1", "node2"):
        if (work / "dsec" / node).is_dir():
            release_node(work / "dsec" / node)
    remove_dirs(work)


def main(params: Params, json_out: Path, state_dir: Path, plot: bool, skip_podman: bool) -> int:
    console = Console()
    unwind_on_sigterm()
    when = datetime.now(UTC).isoformat(timespec="seconds")
    work = state_dir.resolve() / "run"
    forget(work)  # what an interrupted run left
    work.mkdir(parents=True)
    try:
        with LocalRegistry(work / "registry") as registry:
            family, refs = prepare(console, work, params, registry)
            rounds, podman = asyncio.run(run_all(console, work, params, registry, refs, skip_podman))
    except (DsecError, OSError, RuntimeError, subprocess.SubprocessError) as e:
        console.print(f"[red]pull bench failed[/red]: {e}")
        return 1
    finally:
        forget(work)
    figures = {label: {side: side_figures(r) for side, r in sides.items()} for label, sides in rounds.items()}
    ratios, targets = judge(figures, family.unique_layer_bytes)
    result: Json = {
        "bench": "pull",
        "when": when,
        "host": host_facts() | {"versions": versions(str(podman.get("version", "")))},
        "params": params.as_json() | {"images": refs, "family": family.summary()},
        "podman": podman,
        "cycles": {
            "dsec": "AsyncSandbox.create(image=REF) → exec /bin/true → kill (pull: if-not-present)",
            "podman_cold": "podman pull --tls-verify=false REF; podman run --rm --pull=never REF /bin/true",
            "podman_warm": "podman run --rm --pull=missing REF /bin/true",
        },
        "rounds": figures,
        "ratios": ratios,
        "targets": targets,
    }
    out, prefix = json_out.resolve().parent, json_out.stem
    shown = {"ratios": ratios, "targets": targets}
    write_with_plots(
        console, out, prefix, result, (lambda: draw(out, prefix, figures)) if plot else (lambda: []), shown
    )
    failed = any(f["succeeded"] != f["n"] for sides in figures.values() for f in sides.values())
    return 1 if failed or "error" in podman else 0
