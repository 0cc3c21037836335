"""Density: hold N idle sandboxes of one kind on this node, sampling the host memory they cost and how
creation slows as the count grows; with ``until_full``, keep creating until the node refuses (429) or a
creation fails, and record that N with what admission saw at that moment.

Admission counts each sandbox's requests, not its use: at the default requests (0.25 cpu, a quarter of
512 MiB) a 2-core node admits 64 sandboxes. Holding thousands of idle ones takes small requests, which
the bench passes and records in its JSON (``params.requests``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from dsec import AsyncClient, AsyncSandbox, DsecError, Overloaded

from . import plots
from .common import (
    Json,
    cpu_seconds,
    host_busy_seconds,
    host_facts,
    kill_leftovers,
    node_figures,
    percentile,
    phase,
    private_daemon,
    repository_flags,
    summarize,
    unwind_on_sigterm,
    write_with_plots,
)

LABEL = {"dsec-bench": "density"}
KINDS = ("container", "microvm", "function")
PHASES = ("queue", "rootfs", "runtime", "total")
# deferred kernel work (RCU frees, slab) before the final memory reading; meanwhile the idle node's CPU
# is measured, over several of the daemon's 2 s usage samples
SETTLE_S = 10.0
TEMPLATE_WAIT_S = 600.0


@dataclass(frozen=True)
class Shape:
    """What each sandbox of a kind is, and the targets it is judged by."""

    image: str
    cpu: float
    memory: str
    memory_request: str
    concurrency: int
    target_n: int
    target_mib: float


SHAPES = {
    # 0.005 cpu and 8 MiB: 3,200 fit in 2 cores x 8 and ~3,300 in the memory allocatable (an idle
    # container costs ~1 MiB of host memory, so the memory request is still 8x what it uses)
    "container": Shape("dsec/busybox", 0.005, "64Mi", "8Mi", 32, 1000, 4.0),
    "function": Shape("dsec/busybox", 0.005, "64Mi", "8Mi", 32, 1000, 4.0),
    # a VM's guest may touch all of its memory: it requests all of it, so admission stops before the host
    # runs out (~140 of them at 192 MiB on 24 GiB); VMs start one at a time under TCG anyway
    "microvm": Shape("dsec/busybox", 0.05, "192Mi", "192Mi", 4, 64, 160.0),
}


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


def host_mounts() -> int:
    """Mounts in the host's namespace: every new sandbox's mount namespace starts as a copy of them."""
    with open("/proc/self/mountinfo", "rb") as f:
        return sum(1 for _ in f)


def mib(n: float) -> float:
    return round(n / 2**20, 3)


@dataclass
class Options:
    kind: str
    n: int
    until_full: bool
    max_n: int
    shape: Shape
    queue_timeout: float
    sample_every: int
    min_available: int  # bytes of MemAvailable below which no more sandboxes are made


def daemon_flags(kind: str, limit: int) -> list[str]:
    if kind == "function":
        # a function sandbox holds a pool worker: the pools must be allowed that many
        workers = str(min(4096, max(64, limit)))
        return ["--function-max", workers, "--function-tenant-max", workers]
    return []


class Filler:
    """Creates sandboxes, ``concurrency`` at a time, until the target, a refusal (until_full), the memory
    floor or the maximum; samples the host every ``sample_every`` sandboxes held."""

    def __init__(self, console: Console, client: AsyncClient, opts: Options, daemon_pid: int) -> None:
        self.console, self.client, self.opts, self.daemon_pid = console, client, opts, daemon_pid
        self.made: list[AsyncSandbox] = []
        self.creations: list[tuple[float, float]] = []  # (done at, client seconds), in the order made
        self.timings: list[dict[str, float]] = []  # the daemon's phases of each, read once all are made
        self.failures: Counter[str] = Counter()
        self.attempted = 0
        self.stop: Json | None = None  # why creation stopped before its target, and the node then
        self.samples: list[Json] = []
        self.before: dict[str, int] = {}
        self.daemon_before = 0
        self.t0 = 0.0
        self._last_sample = (0.0, 0)  # (t, creations) at the previous sample

    @property
    def limit(self) -> int:
        return self.opts.max_n if self.opts.until_full else self.opts.n

    async def create(self) -> AsyncSandbox:
        s = self.opts.shape
        return await AsyncSandbox.create(
            image=s.image,
            kind=self.opts.kind,
            client=self.client,
            cpu=s.cpu,
            memory=s.memory,
            memory_request=s.memory_request,
            labels=LABEL,
            timeout=24 * 3600,
            queue_timeout=self.opts.queue_timeout,
            wait_for_capacity=0,  # a refusal is a result here, not something to wait out
        )

    async def halt(self, reason: str, message: str) -> None:
        if self.stop is not None:
            return
        self.stop = {"reason": reason, "message": message[:500], "held": len(self.made), "attempted": self.attempted}
        self.console.print(f"[yellow]stopped creating[/yellow] at {len(self.made)} held: {reason}: {message[:200]}")
        with contextlib.suppress(DsecError):
            self.stop["node"] = node_figures(await self.client.node())

    async def worker(self, tick: Callable[[], None]) -> None:
        while self.stop is None and self.attempted < self.limit:
            self.attempted += 1
            started = time.perf_counter()
            try:
                sb = await self.create()
            except Overloaded as e:
                self.failures[e.code] += 1
                if self.opts.until_full:
                    await self.halt("overloaded", e.message)
            except DsecError as e:
                self.failures[e.code] += 1
                if self.opts.until_full:
                    await self.halt(e.code, e.message)
            else:
                done = time.perf_counter()
                self.made.append(sb)
                self.creations.append((done - self.t0, done - started))
                if len(self.made) % self.opts.sample_every == 0:
                    await self.sample()
                if meminfo()["MemAvailable"] < self.opts.min_available:
                    floor = f"MemAvailable below {mib(self.opts.min_available):.0f} MiB"
                    await self.halt("host_memory_floor", floor)
            tick()
        if self.stop is None and self.opts.until_full and self.attempted >= self.limit:
            await self.halt("max", f"--max {self.opts.max_n} creations attempted without a refusal")

    async def sample(self) -> None:
        now, held = time.perf_counter() - self.t0, len(self.made)
        m = meminfo()
        delta = used(m) - used(self.before)
        t_prev, n_prev = self._last_sample
        step = self.creations[n_prev:]
        self._last_sample = (now, len(self.creations))
        client_ms = [c[1] * 1000 for c in step]
        entry: Json = {
            "held": held,
            "t_s": round(now, 2),
            "host_used_delta_mib": round(mib(delta), 1),
            "host_memory_per_sandbox_mib": round(mib(delta / held), 3),
            "slab_delta_mib": round(mib(m["Slab"] - self.before["Slab"]), 1),
            "daemon_rss_mib": round(mib(rss(self.daemon_pid)), 1),
            "host_mounts": host_mounts(),
            "creations_per_s": round(len(step) / (now - t_prev), 2) if now > t_prev else None,
            "create_p50_ms": round(percentile(client_ms, 50), 1) if client_ms else None,
            "create_p99_ms": round(percentile(client_ms, 99), 1) if client_ms else None,
        }
        with contextlib.suppress(DsecError):
            node = await self.client.node()
            entry |= {"requested_cpu": node.requested.cpu, "requested_memory_mib": round(mib(node.requested.memory))}
        self.samples.append(entry)
        self.console.print(
            f"  {held} held: {entry['host_memory_per_sandbox_mib']:.2f} MiB each, "
            f"{entry['creations_per_s']}/s, create p50 {entry['create_p50_ms']} ms"
        )

    async def read_timings(self) -> None:
        """The daemon's phases of each creation (SandboxInfo.timings), read after the fill so the reads
        do not slow it down."""
        gate = asyncio.Semaphore(32)

        async def one(sb: AsyncSandbox) -> dict[str, float]:
            async with gate:
                try:
                    return dict((await sb.info()).timings)
                except DsecError:
                    return {}

        self.timings = list(await asyncio.gather(*(one(sb) for sb in self.made)))

    async def fill(self) -> None:
        self.before, self.daemon_before = meminfo(), rss(self.daemon_pid)
        self.t0 = time.perf_counter()
        what = f"up to {self.limit} until the node refuses" if self.opts.until_full else str(self.opts.n)
        with phase(self.console, f"{self.opts.kind}: creating {what} idle sandboxes", self.limit) as tick:
            await asyncio.gather(*(self.worker(tick) for _ in range(self.opts.shape.concurrency)))


async def warm_up(console: Console, filler: Filler) -> Json:
    """The image built and caches warm; for VMs, a template of this very shape saved, so the sandboxes
    measured restore from it as a node in service would (the first VM of a shape boots cold)."""
    started = time.perf_counter()
    await filler.client.build_image(filler.opts.shape.image)
    vm = filler.opts.kind == "microvm"
    deadline = time.monotonic() + TEMPLATE_WAIT_S
    boots = 0
    while True:
        sb = await filler.create()
        await sb.exec(["true"])
        started_from = (await sb.info()).started_from
        await sb.kill()
        if not vm or started_from == "snapshot":
            break
        boots += 1
        if time.monotonic() > deadline:
            raise RuntimeError(f"no microvm template was saved within {TEMPLATE_WAIT_S:.0f} s")
        if boots == 1:
            console.print("microvm: waiting for the first VM's template")
        await asyncio.sleep(2)
    await asyncio.sleep(2)
    return {"s": round(time.perf_counter() - started, 1), "cold_boots": boots}


async def exec_while_full(made: list[AsyncSandbox]) -> Json | None:
    """The held sandboxes still answer: ``true`` in up to 20 of them, spread over the ones made."""
    latencies = []
    for sb in made[:: max(1, len(made) // 20)][:20]:
        t = time.perf_counter()
        await sb.exec(["true"], timeout=60)
        latencies.append(time.perf_counter() - t)
    return summarize(latencies) if latencies else None


async def idle_cpu(daemon_pid: int) -> Json:
    """Cores busy while the sandboxes are held and nothing is asked of the node: the daemon (its usage
    sampler reads every sandbox's cgroup) and the whole host (idle VMs' timers, for one)."""
    own, busy, started = cpu_seconds(daemon_pid, children=False), host_busy_seconds(), time.perf_counter()
    await asyncio.sleep(SETTLE_S)
    wall = time.perf_counter() - started
    return {
        "daemon": round((cpu_seconds(daemon_pid, children=False) - own) / wall, 3),
        "host": round((host_busy_seconds() - busy) / wall, 3),
    }


def creation_figures(filler: Filler) -> Json:
    out: Json = {}
    if filler.creations:
        out["client"] = summarize([c[1] for c in filler.creations])
    for name in PHASES:
        values = [t[name] for t in filler.timings if name in t]
        if values:
            out[name] = summarize(values)
    return out


async def run(console: Console, opts: Options, state_dir: Path, flags: list[str]) -> tuple[Json, Filler]:
    async with private_daemon(console, state_dir, flags, LABEL) as (proc, client):
        filler = Filler(console, client, opts, proc.pid)
        warm = await warm_up(console, filler)
        node_start = node_figures(await client.node())
        await filler.fill()
        await filler.read_timings()
        wall = filler.creations[-1][0] if filler.creations else 0.0
        idle = await idle_cpu(proc.pid)
        after, daemon_after = meminfo(), rss(proc.pid)
        held = len(filler.made)
        delta = used(after) - used(filler.before)
        figures: Json = {
            "held": held,
            "attempted": filler.attempted,
            "failures": dict(filler.failures),
            "stopped": filler.stop,
            "create_wall_s": round(wall, 2),
            "creations_per_s": round(held / wall, 2) if wall else None,
            "creation": creation_figures(filler),
            "host_memory_per_sandbox_mib": round(mib(delta / held), 3) if held else None,
            "host_memory_used_delta_mib": round(mib(delta), 1),
            "slab_delta_mib": round(mib(after["Slab"] - filler.before["Slab"]), 1),
            "shmem_delta_mib": round(mib(after["Shmem"] - filler.before["Shmem"]), 1),
            "daemon_rss_delta_mib": round(mib(daemon_after - filler.daemon_before), 1),
            "idle_cpu_cores": idle,
            "node_at_start": node_start,
            "node_when_held": node_figures(await client.node()),
            "exec_while_full": await exec_while_full(filler.made),
            "warmup": warm,
        }
        t = time.perf_counter()
        await kill_leftovers(console, client, LABEL)
        figures["kill_all_s"] = round(time.perf_counter() - t, 2)
        return figures, filler


def draw(out: Path, kind: str, filler: Filler) -> list[str]:
    prefix = f"density-{kind}"
    held = [s["held"] for s in filler.samples]
    written = [
        plots.lines(
            out / f"{prefix}-memory.png",
            f"{kind}: host memory as idle sandboxes are held",
            "sandboxes held",
            "host memory used, MiB (delta)",
            {"MemTotal - MemAvailable": (held, [s["host_used_delta_mib"] for s in filler.samples])},
            right={"MiB per sandbox": (held, [s["host_memory_per_sandbox_mib"] for s in filler.samples])},
            right_label="MiB per sandbox",
        )
    ]
    index = list(range(1, len(filler.creations) + 1))
    series = {"client (SDK create)": (index, [c[1] * 1000 for c in filler.creations])}
    for name in ("runtime", "rootfs"):
        values = [t.get(name, 0.0) * 1000 for t in filler.timings]
        if any(values):
            series[f"daemon: {name}"] = (index[: len(values)], values)
    written.append(
        plots.scatter(
            out / f"{prefix}-latency.png",
            f"{kind}: creation latency as the node fills (line: rolling median)",
            "creation number (sandboxes held when it ended)",
            "ms",
            series,
            log_y=True,
            window=max(5, len(index) // 50),
        )
    )
    rates = [(s["held"], s["creations_per_s"]) for s in filler.samples if s["creations_per_s"] is not None]
    if rates:
        written.append(
            plots.lines(
                out / f"{prefix}-rate.png",
                f"{kind}: creation rate as the node fills",
                "sandboxes held",
                "creations per second",
                {f"over each {filler.opts.sample_every} made": ([r[0] for r in rates], [r[1] for r in rates])},
            )
        )
    return [p.name for p in written]


def targets(kind: str, shape: Shape, figures: Json) -> Json:
    held, per = figures["held"], figures["host_memory_per_sandbox_mib"]
    unit = "idle containers" if kind != "microvm" else "idle micro-VMs"
    out = {
        f"held >= {shape.target_n} {unit}": held >= shape.target_n,
        f"host memory per sandbox <= {shape.target_mib} MiB": per is not None and per <= shape.target_mib,
    }
    if kind != "microvm":
        out[f"held >= {2 * shape.target_n} {unit} (goal)"] = held >= 2 * shape.target_n
    return out


def main(
    kind: str,
    n: int,
    out: Path,
    state_dir: Path,
    repository: Path | None = None,
    until_full: bool = False,
    max_n: int = 10_000,
    concurrency: int | None = None,
    sample_every: int = 50,
    queue_timeout: float = 0.5,
    min_available_mib: int = 3072,
    image: str | None = None,
    serve_args: list[str] | None = None,
) -> int:
    """``serve_args``: more ``dsec serve`` flags (e.g. a smaller --cpu-capacity, to find the full node
    sooner); they are recorded in the JSON."""
    console = Console()
    if kind not in SHAPES:
        console.print(f"[red]--kind must be one of {', '.join(KINDS)}[/red]")
        return 2
    if repository is not None and not repository.is_dir():
        console.print(f"[red]--repository {repository} is not a directory[/red]")
        return 2
    shape = SHAPES[kind]
    shape = replace(shape, concurrency=concurrency or shape.concurrency, image=image or shape.image)
    opts = Options(kind, n, until_full, max(n, max_n), shape, queue_timeout, sample_every, min_available_mib << 20)
    unwind_on_sigterm()
    state_dir = state_dir.resolve()
    when = datetime.now(UTC).isoformat(timespec="seconds")
    flags = daemon_flags(kind, opts.max_n if until_full else n) + list(serve_args or [])
    try:
        figures, filler = asyncio.run(run(console, opts, state_dir, repository_flags(repository) + flags))
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]density bench failed[/red]: {e}")
        return 1
    params = {
        "kind": kind,
        "n": n,
        "until_full": until_full,
        "max": opts.max_n if until_full else None,
        "image": shape.image,
        "concurrency": shape.concurrency,
        "sample_every": sample_every,
        "queue_timeout": queue_timeout,
        "wait_for_capacity": 0,
        "min_available_mib": min_available_mib,
        "requests": {"cpu": shape.cpu, "memory": shape.memory, "memory_request": shape.memory_request},
        "room_made_by": "small requests per sandbox" + ("" if serve_args else "; the daemon's default capacity"),
        "daemon_flags": flags,
        "repository": str(repository or ""),
    }
    result: Json = {
        "bench": "density",
        "when": when,
        "host": host_facts(),
        "params": params,
        "dsec": figures,
        "samples": filler.samples,
        "targets": targets(kind, shape, figures),
    }
    summary = {k: v for k, v in figures.items() if k not in ("node_at_start", "node_when_held")}
    shown = {"dsec": summary, "targets": result["targets"]}
    write_with_plots(console, out, f"density-{kind}", result, lambda: draw(out, kind, filler), shown)
    unexpected = sum(figures["failures"].values()) if not until_full else 0
    return 0 if not unexpected else 1
