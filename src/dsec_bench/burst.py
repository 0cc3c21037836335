"""Burst: N creations fired at once, each followed by one exec (its first), then all killed.

Two ways of asking, measured one after the other on the same node: ``individual`` (N concurrent
``AsyncSandbox.create`` calls, what a trainer's rollout workers do; the headline) and ``batch`` (one
``create_many(N)`` request streaming each sandbox as it is ready). For each: creations/s, success rate,
failures by code, client latency (create, create -> first exec) and the daemon's phases per sandbox
(``SandboxInfo.timings``: queue, rootfs, runtime, total, first_exec), plus the node's queue over time.

All N requests are in flight at once and the daemon starts 32 at a time, so a creation's client latency
includes its wait for a start slot (the ``queue`` phase); ``service`` (total - queue) is what one
creation itself takes.

``held``: the bursts are run again with that many idle sandboxes held on the node (created before,
never touched, killed at the end): a creation should cost the same however many others run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from dsec import AsyncClient, AsyncSandbox, DsecError, Overloaded

from . import plots
from .common import (
    Json,
    NodeSampler,
    connect,
    cpu_seconds,
    host_busy_seconds,
    host_facts,
    kill_leftovers,
    node_figures,
    phase,
    private_daemon,
    repository_flags,
    summarize,
    unwind_on_sigterm,
    write_with_plots,
)

LABEL = {"dsec-bench": "burst"}
MODES = ("individual", "batch")
DAEMON_PHASES = ("queue", "rootfs", "runtime", "total", "first_exec")
TARGET_RATE = 100.0
TARGET_P99_S = 1.0
WARMUP = 4
SIDE_GATE = 64  # reads and kills after the burst: in flight at once
HELD_LABEL = {"dsec-bench": "burst-held"}
HELD_GATE = 32  # held sandboxes created at once
TARGET_HELD_RATIO = 0.8  # the rate with the most held, against the rate with the fewest


@dataclass(frozen=True)
class Spec:
    """What every sandbox of a burst is: small requests, so that N fit the node at once."""

    image: str = "dsec/busybox"
    kind: str = "container"
    cpu: float = 0.01
    memory: str = "64Mi"
    memory_request: str = "16Mi"

    def create_args(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "kind": self.kind,
            "cpu": self.cpu,
            "memory": self.memory,
            "memory_request": self.memory_request,
            "labels": LABEL,
        }


@dataclass
class Outcome:
    """One request of a burst; times are seconds since the burst started."""

    index: int
    sent: float = 0.0
    created: float | None = None
    first_exec: float | None = None
    error: str | None = None
    retry_after: float | None = None  # a 429's Retry-After, when it was answered one
    refused_at: float | None = None  # when a create that gave no sandbox was answered
    timings: dict[str, float] = field(default_factory=dict)
    sb: AsyncSandbox | None = None

    @property
    def ok(self) -> bool:
        return self.first_exec is not None and self.error is None


async def first_exec(o: Outcome, sb: AsyncSandbox, t0: float) -> None:
    try:
        res = await sb.exec(["true"], timeout=120)
    except DsecError as e:
        o.error = f"exec:{e.code}"
        return
    if res.exit_code != 0:
        o.error = f"exec:exit {res.exit_code}"
        return
    o.first_exec = time.perf_counter() - t0


async def read_timings(o: Outcome) -> None:
    """The daemon's phases of its creation and of its first exec (GET /v1/sandboxes/ID)."""
    if o.sb is not None:
        with contextlib.suppress(DsecError):
            o.timings = dict((await o.sb.info()).timings)


async def individual(
    client: AsyncClient,
    spec: Spec,
    n: int,
    tick: Callable[[], None],
    *,
    concurrency: int = 0,
    wait_for_capacity: float | None = None,
    queue_timeout: float | None = None,
    kill: bool = False,
) -> tuple[list[Outcome], float]:
    """``n`` create calls at once (``concurrency`` in flight if set), each then running its first exec;
    with ``kill``, each reads its timings and is killed at once, freeing its place for the next.
    ``wait_for_capacity`` None: the SDK's default."""
    # left out unless given: the SDK's default applies without the bench restating its value
    waiting: dict[str, Any] = {} if wait_for_capacity is None else {"wait_for_capacity": wait_for_capacity}
    gate = asyncio.Semaphore(concurrency or n)
    outcomes = [Outcome(i) for i in range(n)]
    t0 = time.perf_counter()

    async def one(o: Outcome) -> None:
        async with gate:
            o.sent = time.perf_counter() - t0
            try:
                sb = await AsyncSandbox.create(
                    client=client,
                    timeout=3600,
                    queue_timeout=queue_timeout,
                    **waiting,
                    **spec.create_args(),
                )
            except Overloaded as e:
                o.error, o.refused_at = e.code, time.perf_counter() - t0
                retry_after = e.detail.get("retry_after")
                o.retry_after = float(retry_after) if isinstance(retry_after, int | float) else None
            except DsecError as e:
                o.error, o.refused_at = e.code, time.perf_counter() - t0
            else:
                o.created, o.sb = time.perf_counter() - t0, sb
                await first_exec(o, sb, t0)
                if kill:
                    await read_timings(o)
                    with contextlib.suppress(DsecError):
                        await sb.kill()
            tick()

    await asyncio.gather(*(one(o) for o in outcomes))
    return outcomes, t0


async def batch(client: AsyncClient, spec: Spec, n: int, tick: Callable[[], None]) -> tuple[list[Outcome], float]:
    """One create_many(n) request; each sandbox runs its first exec as soon as it is streamed back."""
    outcomes = [Outcome(i) for i in range(n)]
    execs: list[asyncio.Task[None]] = []
    t0 = time.perf_counter()
    async for item in AsyncSandbox.create_many(n, client=client, timeout=3600, **spec.create_args()):
        if isinstance(item, DsecError):
            o = outcomes[item.index if item.index is not None else 0]
            o.error = item.code
            tick()
            continue
        o = outcomes[item.batch_index if item.batch_index is not None else 0]
        o.created, o.sb = time.perf_counter() - t0, item

        async def run(o: Outcome = o, sb: AsyncSandbox = item) -> None:
            await first_exec(o, sb, t0)
            tick()

        execs.append(asyncio.create_task(run()))
    await asyncio.gather(*execs)
    return outcomes, t0


def latency_figures(outcomes: list[Outcome]) -> Json:
    """Client-side latencies and the daemon's phases, each summarized (ms)."""
    created = [o for o in outcomes if o.created is not None]
    out: Json = {}
    if created:
        out["client_create"] = summarize([o.created - o.sent for o in created if o.created is not None])
    done = [o.first_exec - o.sent for o in outcomes if o.first_exec is not None]
    if done:
        out["client_create_to_first_exec"] = summarize(done)
    for name in DAEMON_PHASES:
        values = [o.timings[name] for o in outcomes if name in o.timings]
        if values:
            out[f"daemon_{name}"] = summarize(values)
    service = [o.timings["total"] - o.timings.get("queue", 0.0) for o in outcomes if "total" in o.timings]
    if service:
        out["daemon_service"] = summarize(service)  # what a creation itself took, its wait excluded
    outside = [
        o.created - o.sent - o.timings["total"] for o in created if o.created is not None and "total" in o.timings
    ]
    if outside:
        # the client's create latency beyond the daemon's create path: the request waiting to be read
        # (accept, HTTP, validation, the image's resolution) and the answer's way back
        out["outside_create_path"] = summarize([max(0.0, v) for v in outside])
    return out


def run_figures(outcomes: list[Outcome], cpu: Json) -> Json:
    n = len(outcomes)
    created = [o.created for o in outcomes if o.created is not None]
    execs = [o.first_exec for o in outcomes if o.first_exec is not None]
    ok = sum(o.ok for o in outcomes)
    last_created, last_exec = max(created, default=0.0), max(execs, default=0.0)
    return {
        "n": n,
        "succeeded": ok,
        "failed": n - ok,
        "success_rate": round(ok / n, 4) if n else None,
        "failures": dict(Counter(o.error for o in outcomes if o.error)),
        "created_wall_s": round(last_created, 3),
        "creations_per_s": round(len(created) / last_created, 2) if last_created else None,
        "first_exec_wall_s": round(last_exec, 3),
        "first_execs_per_s": round(len(execs) / last_exec, 2) if last_exec else None,
        "latency": latency_figures(outcomes),
        "cpu": cpu,
    }


async def kill_all(outcomes: list[Outcome]) -> float:
    gate = asyncio.Semaphore(SIDE_GATE)

    async def one(sb: AsyncSandbox) -> None:
        async with gate:
            with contextlib.suppress(DsecError):
                await sb.kill()

    started = time.perf_counter()
    await asyncio.gather(*(one(o.sb) for o in outcomes if o.sb is not None))
    return time.perf_counter() - started


async def read_all_timings(outcomes: list[Outcome]) -> None:
    gate = asyncio.Semaphore(SIDE_GATE)

    async def one(o: Outcome) -> None:
        async with gate:
            await read_timings(o)

    await asyncio.gather(*(one(o) for o in outcomes))


@dataclass
class Measured:
    """A finished run: its outcomes, the node sampled meanwhile, and its figures."""

    outcomes: list[Outcome]
    samples: list[Json]
    figures: Json


async def measure(
    console: Console, client: AsyncClient, daemon_pid: int, spec: Spec, n: int, mode: str, concurrency: int
) -> Measured:
    with phase(console, f"{spec.kind} burst of {n}, {mode}", n) as tick:
        me = os.getpid()
        cpu0, own0, mine0 = cpu_seconds(daemon_pid), cpu_seconds(daemon_pid, children=False), cpu_seconds(me)
        busy0 = host_busy_seconds()
        t_start = time.perf_counter()
        async with NodeSampler(client, t_start) as sampler:
            if mode == "batch":
                outcomes, _ = await batch(client, spec, n, tick)
            else:
                outcomes, _ = await individual(client, spec, n, tick, concurrency=concurrency)
            wall = time.perf_counter() - t_start
            cpu = {
                # the daemon's own, and with the crun processes it reaped; the bench's is the client side
                "daemon_cpu_ms_per_creation": round(1000 * (cpu_seconds(daemon_pid, children=False) - own0) / n, 2),
                "daemon_and_crun_cpu_ms_per_creation": round(1000 * (cpu_seconds(daemon_pid) - cpu0) / n, 2),
                "bench_cpu_ms_per_creation": round(1000 * (cpu_seconds(me) - mine0) / n, 2),
                "host_cpu_ms_per_creation": round(1000 * (host_busy_seconds() - busy0) / n, 2),
                "host_busy_cores": round((host_busy_seconds() - busy0) / wall, 2) if wall else None,
            }
            await read_all_timings(outcomes)
            figures = run_figures(outcomes, cpu)
            figures["kill_all_s"] = round(await kill_all(outcomes), 2)
            figures["node_peak"] = {k: sampler.peak(k) for k in ("queued", "starting", "held", "rtt_ms")}
    return Measured(outcomes, sampler.samples, figures)


async def warm_up(client: AsyncClient, spec: Spec) -> None:
    await client.build_image(spec.image)
    for _ in range(WARMUP):
        sb = await AsyncSandbox.create(client=client, **spec.create_args())
        await sb.exec(["true"])
        await sb.kill()


async def hold(console: Console, client: AsyncClient, spec: Spec, count: int, held: list[AsyncSandbox]) -> float:
    """Bring the idle sandboxes held up to ``count`` (the smallest requests: they only have to exist);
    returns the seconds it took."""
    missing = count - len(held)
    if missing <= 0:
        return 0.0
    gate = asyncio.Semaphore(HELD_GATE)
    args = spec.create_args() | {"cpu": 0.001, "memory_request": "4Mi", "labels": HELD_LABEL, "timeout": 24 * 3600}
    began = time.perf_counter()
    with phase(console, f"holding {count} idle sandboxes", missing) as tick:

        async def one() -> None:
            async with gate:
                held.append(await AsyncSandbox.create(client=client, **args))
                tick()

        await asyncio.gather(*(one() for _ in range(missing)))
    return time.perf_counter() - began


async def run(
    console: Console,
    spec: Spec,
    n: int,
    modes: list[str],
    concurrency: int,
    state_dir: Path,
    flags: list[str],
    held_levels: list[int],
) -> tuple[Json, dict[int, dict[str, Measured]]]:
    async with private_daemon(console, state_dir, flags, LABEL) as (proc, client):
        await warm_up(client, spec)
        node = node_figures(await client.node())
        by_level: dict[int, dict[str, Measured]] = {}
        held: list[AsyncSandbox] = []
        try:
            await measure_levels(
                console, proc, client, spec, n, modes, concurrency, state_dir, held_levels, by_level, held
            )
        finally:
            await kill_leftovers(console, client, HELD_LABEL)
        return node, by_level


async def measure_levels(
    console: Console,
    proc: Any,
    client: AsyncClient,
    spec: Spec,
    n: int,
    modes: list[str],
    concurrency: int,
    state_dir: Path,
    held_levels: list[int],
    by_level: dict[int, dict[str, Measured]],
    held: list[AsyncSandbox],
) -> None:
    for level in held_levels:
        await hold(console, client, spec, level, held)
        measured = by_level[level] = {}
        for mode in modes:
            # A client of its own for each run: under load the daemon takes requests on the
            # connections a client keeps open well before those on new ones, so a second run on the
            # first one's client would see its requests arrive in another order (and the queue in
            # another shape).
            async with await connect(proc, state_dir) as fresh:
                measured[mode] = await measure(console, fresh, proc.pid, spec, n, mode, concurrency)
            await kill_leftovers(console, client, LABEL)
            await asyncio.sleep(2)  # the kills' deferred work, before the next run


def thin(samples: list[Json], keep: int = 150) -> list[Json]:
    """At most about ``keep`` of the node's samples, evenly spread, for the JSON (the plots get all)."""
    return samples[:: max(1, len(samples) // keep)]


def ms(values: list[float]) -> list[float]:
    return [v * 1000 for v in values]


def phase_samples(outcomes: list[Outcome]) -> dict[str, list[float]]:
    """Per phase, every creation's milliseconds: the CDF's input."""
    out = {
        "client: create": ms([o.created - o.sent for o in outcomes if o.created is not None]),
        "client: create -> first exec": ms([o.first_exec - o.sent for o in outcomes if o.first_exec is not None]),
    }
    for name in DAEMON_PHASES:
        out[f"daemon: {name}"] = ms([o.timings[name] for o in outcomes if name in o.timings])
    out["daemon: service (total - queue)"] = ms(
        [o.timings["total"] - o.timings.get("queue", 0.0) for o in outcomes if "total" in o.timings]
    )
    return {k: v for k, v in out.items() if v}


def queue_plot(path: Path, title: str, samples: dict[str, list[Json]]) -> Path:
    left: dict[str, tuple[list[float], list[float]]] = {}
    right: dict[str, tuple[list[float], list[float]]] = {}
    for label, rows in samples.items():
        t = [float(s["t"]) for s in rows]
        left[f"{label}: queued for capacity"] = (t, [float(s["queued"]) for s in rows])
        left[f"{label}: creating"] = (t, [float(s["starting"]) for s in rows])
        right[f"{label}: sandboxes live"] = (t, [float(s["held"]) for s in rows])
    return plots.lines(
        path, title, "seconds since the burst started", "creations", left, right=right, right_label="sandboxes live"
    )


def draw(out: Path, prefix: str, headline: str, measured: dict[str, Measured]) -> list[str]:
    kind_n = f"{len(measured[headline].outcomes)}"
    done = {}
    for mode, m in measured.items():
        done[f"{mode}: created"] = [o.created for o in m.outcomes if o.created is not None]
        done[f"{mode}: first exec done"] = [o.first_exec for o in m.outcomes if o.first_exec is not None]
    written = [
        plots.cdf(
            out / f"{prefix}-cdf.png",
            f"burst of {kind_n}, {headline}: latency by phase",
            phase_samples(measured[headline].outcomes),
        ),
        plots.cumulative(out / f"{prefix}-completions.png", f"burst of {kind_n}: completions over time", done),
        plots.rate(
            out / f"{prefix}-rate.png",
            f"burst of {kind_n}: creations per second",
            {k: v for k, v in done.items() if k.endswith("created")},
        ),
        queue_plot(
            out / f"{prefix}-queue.png",
            f"burst of {kind_n}: the node's queue over time",
            {mode: m.samples for mode, m in measured.items()},
        ),
    ]
    return [p.name for p in written]


def targets(figures: Json) -> Json:
    rate = figures.get("creations_per_s")
    lat = figures["latency"]
    service = lat.get("daemon_service", {}).get("p99_ms")
    client = lat.get("client_create", {}).get("p99_ms")
    return {
        f"creations/s >= {TARGET_RATE:g}": rate is not None and rate >= TARGET_RATE,
        "100% success": figures["failed"] == 0,
        f"p99 of a creation's own time (daemon total - queue) <= {TARGET_P99_S:g} s": service is not None
        and service <= TARGET_P99_S * 1000,
        f"p99 client create (all {figures['n']} in flight at once) <= {TARGET_P99_S:g} s": client is not None
        and client <= TARGET_P99_S * 1000,
    }


def held_targets(by_level: dict[int, dict[str, Measured]], headline: str) -> Json:
    """The rate with the most sandboxes held against the rate with the fewest (one level: nothing)."""
    if len(by_level) < 2:
        return {}
    low, high = min(by_level), max(by_level)
    first = by_level[low][headline].figures.get("creations_per_s")
    last = by_level[high][headline].figures.get("creations_per_s")
    met = bool(first and last is not None and last >= TARGET_HELD_RATIO * first)
    return {f"rate with {high} held >= {TARGET_HELD_RATIO:.0%} of the rate with {low} held": met}


def main(
    n: int,
    kind: str,
    out: Path,
    state_dir: Path,
    repository: Path | None = None,
    modes: list[str] | None = None,
    concurrency: int = 0,
    spec: Spec | None = None,
    serve_args: list[str] | None = None,
    held: list[int] | None = None,
) -> int:
    console = Console()
    levels = sorted(set(held or [0]))
    modes = modes or list(MODES)
    spec = spec or Spec(kind=kind)
    unwind_on_sigterm()
    state_dir = state_dir.resolve()
    when = datetime.now(UTC).isoformat(timespec="seconds")
    flags = repository_flags(repository) + list(serve_args or [])
    try:
        node, by_level = asyncio.run(run(console, spec, n, modes, concurrency, state_dir, flags, levels))
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]burst bench failed[/red]: {e}")
        return 1
    headline = modes[0]
    measured = by_level[levels[0]]
    runs = {mode: m.figures for mode, m in measured.items()}
    by_held = {str(level): {mode: m.figures for mode, m in ms.items()} for level, ms in by_level.items()}
    result: Json = {
        "bench": "burst",
        "when": when,
        "host": host_facts(),
        "params": {
            "n": n,
            "kind": kind,
            "modes": modes,
            "concurrency": concurrency or n,
            "requests": {"cpu": spec.cpu, "memory": spec.memory, "memory_request": spec.memory_request},
            "image": spec.image,
            "room_made_by": "small requests per sandbox" + ("" if serve_args else "; the daemon's default capacity"),
            "daemon_flags": list(serve_args or []),
            "repository": str(repository or ""),
        },
        "node_at_start": node,
        "headline": headline,
        "runs": runs,
        "node_samples": {mode: thin(m.samples) for mode, m in measured.items()},
        "held_levels": levels,
        "runs_by_held": by_held if len(levels) > 1 else {},
        "rate_by_held": {level: ms[headline].figures.get("creations_per_s") for level, ms in by_level.items()},
        "targets": targets(runs[headline]) | held_targets(by_level, headline),
    }
    prefix = f"burst-{kind}"
    shown = {"runs": runs, "rate_by_held": result["rate_by_held"], "targets": result["targets"]}
    write_with_plots(console, out, prefix, result, lambda: draw(out, prefix, headline, measured), shown)
    return 0 if all(m.figures["failed"] == 0 for ms in by_level.values() for m in ms.values()) else 1
