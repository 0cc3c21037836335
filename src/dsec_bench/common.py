"""What every benchmark shares: statistics, progress display, a private daemon, cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dsec import AsyncClient, AsyncSandbox, DsecError
from dsec.isolation.mounts import unmount_under
from dsec.protocol.node import NodeStatus
from dsec.stats import percentile as percentile

Json = dict[str, Any]

IMAGES_DIR = Path("/var/tmp/dsec-images")
DAEMON_START_TIMEOUT = 60.0


def summarize(seconds: Sequence[float]) -> Json:
    ms = [s * 1000.0 for s in seconds]
    stats = {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "mean": statistics.fmean(ms)}
    stats |= {"min": min(ms), "max": max(ms)}
    return {"n": len(ms)} | {f"{k}_ms": round(v, 3) for k, v in stats.items()}


@contextlib.contextmanager
def phase(console: Console, label: str, total: int) -> Iterator[Callable[[], None]]:
    """Yields a tick(): a live bar on a terminal, a line per quarter in a log."""
    started = time.perf_counter()
    done = 0
    if console.is_terminal:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(label, total=total)

            def advance() -> None:
                nonlocal done
                done += 1
                bar.advance(task)

            yield advance
    else:

        def tick() -> None:
            nonlocal done
            done += 1
            if done % max(1, total // 4) == 0 and done < total:
                console.print(f"  {label}: {done}/{total}")

        yield tick
    # a phase may end early (a bench that stops at the first refusal): say how far it got
    count = str(total) if done == total else f"{done} of {total}"
    console.print(f"[green]done[/green] {label}: {count} in {time.perf_counter() - started:.1f}s")


def tail(path: Path, limit: int = 800) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return ""


# ---- the daemon ------------------------------------------------------------------------------------


def start_daemon(state_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "dsec", "serve", "--state-dir", str(state_dir)]
    argv += ["--listen", f"unix://{state_dir}/dsec.sock", "--repository", str(IMAGES_DIR / "repository"), *extra]
    argv += ["--log-level", "warning"]
    with (state_dir / "daemon.log").open("ab") as log:
        # A session of its own, so that Ctrl-C stops the bench but not the daemon, which is still
        # needed to kill the bench's sandboxes before it is stopped.
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)


def repository_flags(repository: Path | None) -> list[str]:
    # a second --repository overrides start_daemon's default (the last one given wins)
    return ["--repository", str(repository)] if repository is not None else []


def release_node(state_dir: Path) -> None:
    """Stop what a daemon leaves running on purpose so its sandboxes outlive it: the layer fetcher and
    the layer mounts. Benchmarks call it after stopping their daemon."""
    pid_file = state_dir / "images" / "fetcher" / "fetcher.pid"
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
    unmount_under(state_dir)


def unwind_on_sigterm() -> None:
    """The daemon has a session of its own, so SIGTERM must unwind the bench like Ctrl-C for its
    sandboxes to be killed; re-raised as SIGINT, it gets asyncio.run's clean cancellation."""
    interruptible = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    on_term = (lambda *_: signal.raise_signal(signal.SIGINT)) if interruptible else signal.default_int_handler
    signal.signal(signal.SIGTERM, on_term)


def stop_daemon(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def connect(proc: subprocess.Popen[bytes], state_dir: Path) -> AsyncClient:
    """A client of the daemon once it answers."""
    deadline = time.monotonic() + DAEMON_START_TIMEOUT
    client: AsyncClient | None = None
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):  # the daemon writes its token at its first start
            if client is None and (token := (state_dir / "token").read_text().strip()):
                client = AsyncClient(url=f"unix://{state_dir}/dsec.sock", token=token)
        if client is not None:
            # The token is written before the socket listens: refusals are expected for a moment.
            with contextlib.suppress(DsecError):
                await client.health()
                return client
        await asyncio.sleep(0.05)
    if client is not None:
        await client.aclose()
    if proc.poll() is not None:
        raise RuntimeError(f"the daemon exited ({proc.returncode}): {tail(state_dir / 'daemon.log')}")
    raise RuntimeError(f"the daemon did not answer within {DAEMON_START_TIMEOUT:.0f}s")


async def kill_leftovers(console: Console, client: AsyncClient, labels: dict[str, str]) -> None:
    # More than one pass: a create cancelled on our side (Ctrl-C) still completes in the daemon and can
    # appear after the first listing.
    killed, left = 0, []
    try:
        for attempt in range(4):
            if not (left := await client.list(labels=labels)) or attempt == 3:
                break
            kills = (AsyncSandbox(info, client).kill() for info in left)
            results = await asyncio.gather(*kills, return_exceptions=True)  # one failure stops no other
            killed += sum(r is None for r in results)
            await asyncio.sleep(0.5)
    except DsecError as e:
        console.print(f"[red]could not clean up all of the bench's sandboxes[/red]: {e}")
    if killed or left:
        console.print(f"killed {killed} leftover sandbox(es)" + (f"; {len(left)} remain" if left else ""))


@contextlib.asynccontextmanager
async def private_daemon(
    console: Console, state_dir: Path, flags: Sequence[str], labels: dict[str, str], stop_timeout: float = 10.0
) -> AsyncIterator[tuple[subprocess.Popen[bytes], AsyncClient]]:
    """A daemon of the bench's own and a client of it. On the way out, Ctrl-C and failures included, the
    sandboxes labelled ``labels`` are killed (none may outlive the bench), then the daemon is stopped
    and what it leaves running on purpose is released."""
    proc = start_daemon(state_dir, *flags)
    try:
        client = await connect(proc, state_dir)
        try:
            yield proc, client
        finally:
            with contextlib.suppress(DsecError, RuntimeError):
                await kill_leftovers(console, client, labels)
            await client.aclose()
    finally:
        stop_daemon(proc, timeout=stop_timeout)
        release_node(state_dir)


async def operator_token(state_dir: Path, timeout: float) -> str:
    """The operator's token, which a daemon writes at its first start ("" if it did not in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if token := (state_dir / "token").read_text().strip():
                return token
        await asyncio.sleep(0.05)
    return ""


def host_facts() -> Json:
    """The machine a bench ran on, for its JSON."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    return {"cpus": os.cpu_count(), "kernel": os.uname().release, "memory_bytes": total}


def write_json(out_dir: Path, name: str, result: Json) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    return path


def write_with_plots(
    console: Console, out: Path, prefix: str, result: Json, draw: Callable[[], list[str]], shown: Json
) -> Path:
    """The end of a bench that plots: ``result["plots"]`` from ``draw`` (none, said so, when matplotlib is
    missing: the JSON is still worth having), then ``PREFIX.json`` in ``out``, and ``shown`` printed."""
    try:
        result["plots"] = draw()
    except RuntimeError as e:
        console.print(f"[yellow]no plots[/yellow]: {e}")
        result["plots"] = []
    path = write_json(out, f"{prefix}.json", result)
    console.print_json(data=shown)
    console.print(f"wrote {path} and {len(result['plots'])} plot(s) in {out}")
    return path


def node_figures(node: NodeStatus) -> Json:
    """What admission saw at one moment: the part of GET /v1/node a bench reports."""
    return {
        "capacity": node.capacity.model_dump(),
        "ratios": node.ratios.model_dump(),
        "allocatable": node.allocatable.model_dump(),
        "requested": node.requested.model_dump(),
        "free": node.free.model_dump(),
        "queued": node.queued,
        "starting": dict(node.starting),
        "start_slots": dict(node.start_slots),
        "sandboxes": {kind: sum(states.values()) for kind, states in node.sandboxes.items()},
        "memory_pressure": node.memory_pressure,
        "evictions": node.evictions,
    }


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include ``labels`` (0 if there is none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        have = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        if all(have.get(k, "").strip('"') == v for k, v in labels.items()):
            total += float(value)
    return total


class NodeSampler:
    """GET /v1/node every ``interval`` seconds while a bench runs: queue depth, creations in progress,
    sandboxes held and requests admitted, over time (seconds since ``t0``, a perf_counter value)."""

    def __init__(self, client: AsyncClient, t0: float, interval: float = 0.25) -> None:
        self.client, self.t0, self.interval = client, t0, interval
        self.samples: list[Json] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(DsecError):
                asked = time.perf_counter()
                node = await self.client.node()
                self.samples.append(
                    {
                        "t": round(asked - self.t0, 3),
                        # a cheap request: its round trip shows how busy the daemon's event loop is
                        "rtt_ms": round((time.perf_counter() - asked) * 1000, 1),
                        "queued": node.queued,
                        "starting": sum(node.starting.values()),
                        "held": sum(sum(states.values()) for states in node.sandboxes.values()),
                        "requested_cpu": node.requested.cpu,
                        "requested_memory": node.requested.memory,
                        "memory_pressure": node.memory_pressure,
                    }
                )
            await asyncio.sleep(self.interval)

    async def __aenter__(self) -> NodeSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def peak(self, key: str) -> float:
        return max((float(s[key]) for s in self.samples), default=0.0)


def cpu_seconds(pid: int, children: bool = True) -> float:
    """CPU seconds (user + system) of a process, and with ``children`` of the children it reaped (for the
    daemon: the crun processes of its creations), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11 : 15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def host_busy_seconds() -> float:
    """CPU seconds the whole host spent busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
