"""Function bench: one-shot calls served by a warm pool, side by side in the same run with a fresh
container sandbox per call and a bare host subprocess (no isolation: the lower bound).

Latency: `true` (dsec/busybox) and `python3 -c 'print(1)'` (dsec/debian:12), one call at a time.
Throughput: `true` with 1, 8 and 64 calls in flight, calls/s sustained over a fixed number of calls.
Python is started afresh by every call in all three systems: no pre-started interpreter anywhere, so
the interpreter's own start-up is part of every python figure.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dsec import AsyncClient, DsecError
from dsec.protocol.run import MAX_RUNS, RunRequest

from .common import (
    Json,
    host_facts,
    phase,
    private_daemon,
    repository_flags,
    summarize,
    unwind_on_sigterm,
)

WORKLOADS: dict[str, tuple[str, list[str]]] = {
    "shell": ("dsec/busybox", ["true"]),
    "python": ("dsec/debian:12", ["python3", "-c", "print(1)"]),
}
EXPECTED = {"shell": "", "python": "1\n"}
HOST_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3") or "python3"
HOST_ARGV = {"shell": [shutil.which("true") or "true"], "python": [HOST_PYTHON, "-c", "print(1)"]}
PYTHON_STARTUP = (
    "interpreter started per call (python3 -c 'print(1)'), its start-up included; "
    "no pre-started interpreter in any system"
)
SYSTEMS = ("function", "container", "host")
CONCURRENCY = (1, 8, 64)
WARMUP = 5  # untimed sequential calls first: the pool makes its workers, page caches fill
WARMUP_ROUNDS = 4  # at most, before a throughput measurement of the function kind ...
WARMUP_FRACTION = 5  # ... each of max(concurrency, calls / this) calls
CONTAINER_N = 30  # a fresh container costs tens to hundreds of ms: more samples add minutes, not precision
CONTAINER_MIN_CALLS = 32  # fresh-container throughput: max(this, 2 × concurrency) calls, at most --calls
TARGETS = {"shell_p50_ms": 5.0, "python_p50_ms": 10.0, "calls_per_s": 500.0, "over_container": 10.0}
RUN_LABELS = {"dsec.run": "1"}  # what core/oneshot.py labels every run's sandbox with: finds leftovers
STOP_TIMEOUT = 120.0  # the daemon destroys its idle workers one by one as it stops

Call = Callable[[str], Awaitable[str | None]]  # one call of a workload: None, or why it failed
Cold = Counter[str] | None  # per workload, the function runs no warm worker served (pool misses)
Pids = dict[str, int]  # whose CPU a throughput measurement reads: the daemon's and the bench's


def check(workload: str, exit_code: int | None, stdout: str) -> str | None:
    if exit_code != 0:
        return f"exit {exit_code}"
    return None if stdout == EXPECTED[workload] else "unexpected output"


async def host_call(workload: str) -> str | None:
    proc = await asyncio.create_subprocess_exec(
        *HOST_ARGV[workload], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    out, _ = await proc.communicate()
    return check(workload, proc.returncode, out.decode(errors="replace"))


def dsec_call(client: AsyncClient, kind: str, cold: Cold = None) -> Call:
    """A one-shot run of the workload in a sandbox of ``kind``, counting its pool misses into ``cold``."""

    async def call(workload: str) -> str | None:
        image, argv = WORKLOADS[workload]
        try:
            res = await client.run(image, argv, kind=kind)
        except DsecError as e:
            return e.code
        if cold is not None and not res.warm:
            cold[workload] += 1
        return check(workload, res.exit_code, res.stdout)

    return call


# ---- measurements ------------------------------------------------------------------------------------


async def latency(console: Console, label: str, call: Call, workload: str, n: int, cold: Cold) -> Json:
    for _ in range(WARMUP):
        if (why := await call(workload)) is not None:
            raise RuntimeError(f"{label}: a warm-up call failed: {why}")
    before = cold[workload] if cold is not None else 0
    times: list[float] = []
    with phase(console, label, n) as tick:
        for _ in range(n):
            t0 = time.perf_counter()
            why = await call(workload)
            times.append(time.perf_counter() - t0)
            if why is not None:
                raise RuntimeError(f"{label}: a call failed: {why}")
            tick()
    stats = summarize(times)
    return stats if cold is None else stats | {"cold": cold[workload] - before}


def cpu_now(pids: Pids) -> dict[str, float]:
    """CPU seconds (user + system) of each process and of the children it reaped, from /proc/PID/stat."""
    out = {}
    for name, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    return out


def rate_entry(
    concurrency: int, calls: int, failures: Counter[str], wall: float, mode: str, cpu: dict[str, float]
) -> Json:
    """One throughput measurement; ``cpu``: CPU seconds each process (daemon, bench) spent on it."""
    ok = calls - sum(failures.values())
    entry = {"mode": mode, "concurrency": concurrency, "calls": calls, "ok": ok, "failures": dict(failures)}
    rate = round(ok / wall, 1) if wall > 0 else None
    cpu_ms = {name: round(1000 * seconds / calls, 2) for name, seconds in cpu.items()}
    return entry | {"wall_s": round(wall, 3), "calls_per_s": rate, "cpu_ms_per_call": cpu_ms}


async def sustained(
    console: Console, label: str, call: Call, calls: int, concurrency: int, warmup: int, cold: Cold, pids: Pids
) -> Json:
    """``calls`` calls of `true`, ``concurrency`` in flight, each its own run() request (its own task)."""
    gate, failures = asyncio.Semaphore(concurrency), Counter[str]()

    async def one(tick: Callable[[], None] = lambda: None) -> None:
        async with gate:
            why = await call("shell")
        if why is not None:
            failures[why] += 1
        tick()

    # Untimed rounds of the same load until one right after another makes no worker: the pool grows under
    # sustained load (a call finding every worker still being reset gets a new one); timed calls find it grown.
    for i in range(WARMUP_ROUNDS if cold is not None else 1):
        made = cold["shell"] if cold is not None else 0
        await asyncio.gather(*(one() for _ in range(warmup)))
        if cold is None or (i > 0 and cold["shell"] == made):
            break
    failures.clear()
    before = cold["shell"] if cold is not None else 0
    with phase(console, f"{label}, {concurrency} in flight", calls) as tick:
        started, cpu = time.perf_counter(), cpu_now(pids)
        await asyncio.gather(*(one(tick) for _ in range(calls)))
        wall = time.perf_counter() - started
    used = {name: s - cpu[name] for name, s in cpu_now(pids).items()}
    entry = rate_entry(concurrency, calls, failures, wall, "tasks", used)
    return entry if cold is None else entry | {"cold": cold["shell"] - before}


async def sustained_batch(console: Console, client: AsyncClient, calls: int, concurrency: int, pids: Pids) -> Json:
    """The same calls through run_many: one request per batch of up to MAX_RUNS, fanned out by the daemon."""
    image, argv = WORKLOADS["shell"]
    req = RunRequest(image=image, command=argv, kind="function")
    failures, cold = Counter[str](), 0
    with phase(console, f"function run_many, {concurrency} in flight", calls) as tick:
        started, cpu = time.perf_counter(), cpu_now(pids)
        for first in range(0, calls, MAX_RUNS):
            runs: list[RunRequest | dict[str, Any]] = [req] * min(MAX_RUNS, calls - first)
            for res in await client.run_many(runs, concurrency=concurrency):
                why = res.code if isinstance(res, DsecError) else check("shell", res.exit_code, res.stdout)
                if why is not None:
                    failures[why] += 1
                elif not isinstance(res, DsecError) and not res.warm:
                    cold += 1
                tick()
        wall = time.perf_counter() - started
    used = {name: s - cpu[name] for name, s in cpu_now(pids).items()}
    return rate_entry(concurrency, calls, failures, wall, "run_many", used) | {"cold": cold}


async def guarded(concurrency: int, coro: Awaitable[Json]) -> Json:
    """A failed system is a result of the run (an error in its place), not the end of the bench."""
    try:
        return await coro
    except (DsecError, RuntimeError, OSError) as e:
        return {"concurrency": concurrency, "error": f"{type(e).__name__}: {e}"}


async def versions(client: AsyncClient) -> Json:
    """Of the two pythons compared: the host's and the sandboxes' image's."""
    proc = await asyncio.create_subprocess_exec(
        HOST_PYTHON, "--version", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    host = (await proc.communicate())[0].decode(errors="replace").strip()
    try:
        res = await client.run(WORKLOADS["python"][0], ["python3", "--version"], kind="function")
        inside = (res.stdout or res.stderr).strip()
    except DsecError as e:
        inside = f"error: {e}"
    return {"host": f"{HOST_PYTHON}: {host}", "sandbox": inside}


async def measure(console: Console, client: AsyncClient, n: int, calls: int, pids: Pids) -> Json:
    for image in sorted({image for image, _ in WORKLOADS.values()}):
        console.print(f"ensuring image {image} is built")
        await client.build_image(image)
    cold: Counter[str] = Counter()
    calls_of: dict[str, Call] = {
        "function": dsec_call(client, "function", cold),
        "container": dsec_call(client, "container"),
        "host": host_call,
    }
    lat: Json = {}
    for system in SYSTEMS:
        count, lat[system] = (min(n, CONTAINER_N) if system == "container" else n), {}
        for workload in WORKLOADS:
            label = f"{system} {workload} latency"
            counted = cold if system == "function" else None
            lat[system][workload] = await guarded(
                1, latency(console, label, calls_of[system], workload, count, counted)
            )
    tp: Json = {"function": {"tasks": [], "run_many": []}, "container": {"tasks": []}, "host": {"tasks": []}}
    fn, ct = calls_of["function"], calls_of["container"]
    for c in CONCURRENCY:
        ct_calls = min(calls, max(CONTAINER_MIN_CALLS, 2 * c))  # a fresh container per call: fewer
        warm = max(c, calls // WARMUP_FRACTION)
        runs: list[tuple[str, str, Callable[[], Awaitable[Json]]]] = [
            ("function", "tasks", partial(sustained, console, "function run()", fn, calls, c, warm, cold, pids)),
            ("function", "run_many", partial(sustained_batch, console, client, calls, c, pids)),
            ("container", "tasks", partial(sustained, console, "fresh container", ct, ct_calls, c, 0, None, pids)),
            ("host", "tasks", partial(sustained, console, "host subprocess", host_call, calls, c, c, None, pids)),
        ]
        for system, mode, measurement in runs:
            tp[system][mode].append(await guarded(c, measurement()))
    return {"latency": lat, "throughput": tp}


# ---- judging -----------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def check_target(text: str, value: float | None, ok: Callable[[float], bool], **extra: Any) -> Json:
    # met is None where a figure is missing (a system failed): unknown, which is not the same as missed
    return {"target": text, "value": value, "met": None if value is None else ok(value)} | extra


def p50(lat: Json, system: str, workload: str) -> float | None:
    stats = lat.get(system, {}).get(workload)
    return float(stats["p50_ms"]) if isinstance(stats, dict) and "p50_ms" in stats else None


def rates(entries: Any) -> dict[int, float]:
    """Concurrency -> calls/s of the measurements that ran without a failed call."""
    out: dict[int, float] = {}
    for e in entries if isinstance(entries, list) else []:
        if isinstance(e, dict) and e.get("calls_per_s") is not None and not e.get("failures"):
            out[int(e["concurrency"])] = float(e["calls_per_s"])
    return out


def judge(lat: Json, tp: Json) -> tuple[Json, Json]:
    fn, batch = rates(tp["function"]["tasks"]), rates(tp["function"]["run_many"])
    ct, host = rates(tp["container"]["tasks"]), rates(tp["host"]["tasks"])
    ratios: Json = {
        f"function_{mode}_over_container_calls_per_s": {str(c): ratio(r.get(c), ct.get(c)) for c in CONCURRENCY}
        for mode, r in (("tasks", fn), ("run_many", batch))
    }
    ratios["host_over_function_tasks_calls_per_s"] = {str(c): ratio(host.get(c), fn.get(c)) for c in CONCURRENCY}
    fn_p50 = {w: p50(lat, "function", w) for w in WORKLOADS}
    ratios["function_p50_over_host_p50"] = {w: ratio(fn_p50[w], p50(lat, "host", w)) for w in WORKLOADS}
    ratios["container_p50_over_function_p50"] = {w: ratio(p50(lat, "container", w), fn_p50[w]) for w in WORKLOADS}
    best_c = max(fn, key=lambda c: fn[c], default=None)
    best = fn[best_c] if best_c is not None else None
    best_ct = max(ct.values(), default=None)
    shell, python = p50(lat, "function", "shell"), p50(lat, "function", "python")
    t, cpus = TARGETS, len(os.sched_getaffinity(0))
    text = {
        "shell": f"function `true` p50 ≤ {t['shell_p50_ms']:g} ms",
        "python": f"function `python3 -c 'print(1)'` p50 ≤ {t['python_p50_ms']:g} ms (interpreter start-up included)",
        "rate": f"≥ {t['calls_per_s']:g} calls/s sustained on {cpus} cores (function run() per call, best concurrency)",
        "ratio": f"≥ {t['over_container']:g} × the calls/s of a fresh container per call (best of each)",
    }
    targets = {
        "shell_p50_le_5ms": check_target(text["shell"], shell, lambda v: v <= t["shell_p50_ms"]),
        "python_p50_le_10ms": check_target(text["python"], python, lambda v: v <= t["python_p50_ms"]),
        "calls_per_s_ge_500": check_target(text["rate"], best, lambda v: v >= t["calls_per_s"], concurrency=best_c),
        "ge_10x_fresh_container": check_target(text["ratio"], ratio(best, best_ct), lambda v: v >= t["over_container"]),
    }
    return ratios, targets


def failed(lat: Json, tp: Json) -> int:
    """Failed calls and failed measurements: any makes the figures suspect, and the exit status 1."""
    errors = sum("error" in s for workloads in lat.values() for s in workloads.values())
    entries = [e for modes in tp.values() for es in modes.values() for e in es]
    return errors + sum(int(sum(e.get("failures", {}).values())) + ("error" in e) for e in entries)


# ---- report ------------------------------------------------------------------------------------------


def print_summary(console: Console, result: Json) -> None:
    table = Table(title="dsec function bench: one-shot latency (ms)")
    for col in ("workload", "system", "n", "p50", "p99", "mean", "cold"):
        table.add_column(col, justify="left" if col in ("workload", "system") else "right")
    for workload in WORKLOADS:
        for i, system in enumerate(SYSTEMS):
            s = result["latency"][system][workload]
            last = i == len(SYSTEMS) - 1
            if "p50_ms" in s:
                cells = [f"{s[k]:.2f}" for k in ("p50_ms", "p99_ms", "mean_ms")]
                table.add_row(workload, system, str(s["n"]), *cells, str(s.get("cold", "")), end_section=last)
            else:
                table.add_row(workload, system, "-", "-", "-", str(s.get("error"))[:60], "", end_section=last)
    console.print(table)
    table = Table(title="sustained calls/s of `true` (calls) · CPU ms per call (daemon + bench)")
    table.add_column("system")
    for c in CONCURRENCY:
        table.add_column(f"c={c}", justify="right")
    for system, modes in result["throughput"].items():
        for mode, entries in modes.items():
            cells = []
            for e in entries:
                bad = sum(e.get("failures", {}).values())
                cpu = sum(e.get("cpu_ms_per_call", {}).values())
                cell = "error" if "error" in e else f"{e['calls_per_s']:.1f} ({e['calls']}) · {cpu:.1f}"
                cells.append(cell + (f" [red]{bad} failed[/red]" if bad else ""))
            table.add_row(f"{system} ({mode})", *cells)
    console.print(table)
    marks = {True: "[green]met[/green]", False: "[red]missed[/red]", None: "[yellow]n/a[/yellow]"}
    for target in result["targets"].values():
        console.print(f"{marks[target['met']]}  {target['target']}  (value: {target['value']})")


def main(n: int, calls: int, json_out: Path, state_dir: Path, repository: Path | None = None) -> int:
    console = Console()
    when = datetime.now(UTC).isoformat(timespec="seconds")
    state_dir = state_dir.resolve()
    unwind_on_sigterm()
    load_before = os.getloadavg()

    async def run() -> Json:
        flags = repository_flags(repository)
        # STOP_TIMEOUT: destroying a full pool's workers one by one takes longer than stop_daemon's default
        async with private_daemon(console, state_dir, flags, RUN_LABELS, STOP_TIMEOUT) as (proc, client):
            version = (await client.health()).version
            figures = await measure(console, client, n, calls, {"daemon": proc.pid, "bench": os.getpid()})
            pools = [p.model_dump() for p in await client.pools()]
            return figures | {"version": version, "pools": pools, "python_versions": await versions(client)}

    try:
        figures = asyncio.run(run())
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]bench failed[/red]: {e}")
        return 1

    ratios, targets = judge(figures["latency"], figures["throughput"])
    params = {"n": n, "container_n": min(n, CONTAINER_N), "calls": calls, "concurrency": list(CONCURRENCY)}
    params |= {
        "warmup": WARMUP,
        "warmup_rounds": WARMUP_ROUNDS,
        "warmup_fraction": WARMUP_FRACTION,
        "container_min_calls": CONTAINER_MIN_CALLS,
    }
    result: Json = {
        "bench": "function",
        "when": when,
        "host": host_facts() | {"nproc": len(os.sched_getaffinity(0)), "loadavg": [load_before, os.getloadavg()]},
        "params": params | {"repository": str(repository or ""), "workloads": WORKLOADS},
        "python_startup": PYTHON_STARTUP,
        "systems": {
            "function": "client.run(kind='function'): a warm pool worker, reset and verified after each call",
            "container": "client.run(kind='container'): a container sandbox created and killed per call",
            "host": f"asyncio.create_subprocess_exec on the host, no isolation: {HOST_ARGV}",
        },
        "throughput_modes": {
            "tasks": "one run() request per call, `concurrency` calls in flight (asyncio tasks, a semaphore)",
            "run_many": f"run_many batches of up to {MAX_RUNS} calls, `concurrency` in flight in the daemon",
        },
        "daemon_version": figures["version"],
        "python_versions": figures["python_versions"],
        "latency": figures["latency"],
        "throughput": figures["throughput"],
        "ratios": ratios,
        "targets": targets,
        "target_values": TARGETS,
        "pools": figures["pools"],
    }
    json_out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print_summary(console, result)
    console.print(f"wrote {json_out}")
    return 1 if failed(figures["latency"], figures["throughput"]) else 0
