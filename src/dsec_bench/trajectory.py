"""Trajectory bench: how fast a restarted trainer fast-forwards through a recorded trajectory, and what
logging costs a live call.

Record: one container sandbox bound to a trajectory runs ``steps`` distinct, deterministic execs
(`echo step-I`) live. Fast-forward: a fresh client per repetition (a new connection, as a restarted
trainer) creates with the same trajectory id and issues the same calls; every one must come back
replayed with the output recorded live, or the bench fails. Logging overhead: `true` in a sandbox bound
to a trajectory and in a plain one of the same image and limits, alternately, side by side in one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import stat
import statistics
import time
import uuid
from collections.abc import Awaitable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dsec import AsyncClient, AsyncSandbox, DsecError, ExecResult

from .common import (
    Json,
    host_facts,
    phase,
    private_daemon,
    repository_flags,
    summarize,
    unwind_on_sigterm,
)
from .function import cpu_now

IMAGE = "dsec/busybox"
LABELS = {"dsec-bench": "trajectory"}  # every sandbox of the bench: finds leftovers
LATENCY_CMD = ["true"]
FAST_FORWARDS = 3  # repetitions, each with a fresh client
WARMUP = 20  # untimed calls on each latency sandbox first
CHUNK = 1000  # a fast-forward's progress advances every this many steps (a tick per step would be timed)
MIN_STEPS, MAX_STEPS = 10, 100_000  # at a few ms per live exec, 100,000 steps record in minutes
MIN_N, MAX_N = 10, 100_000
TTL_BASE, TTL_PER_STEP = 600.0, 0.1  # a safety net only: the bench kills its sandboxes itself
TARGET_STEPS = 10_000
TARGETS = {"steps_per_s": 5000.0, "seconds_for_10000": 2.0, "overhead": 0.10}
EXAMPLES = 5  # mismatches quoted in the JSON, of each fast-forward
STOP_TIMEOUT = 60.0
# recorded calls per page a fast-forward fetches, reported beside its figures: the SDK's documented value
# (docs/trajectory.md), stated here because the SDK's constant is private; a unit test holds them equal
SDK_PAGE = 1000


def step_cmd(i: int) -> list[str]:
    """Step ``i``'s call: cheap, distinct from every other step's, and the same in every run."""
    return ["echo", f"step-{i}"]


def expected(i: int) -> str:
    return f"step-{i}\n"


def sandbox_spec(steps: int) -> Json:
    """What every sandbox of the bench is created with (a resume must repeat it exactly)."""
    return {"image": IMAGE, "kind": "container", "timeout": TTL_BASE + TTL_PER_STEP * steps, "labels": LABELS}


def closed_ancestor(path: Path) -> Path | None:
    """A directory on ``path`` (itself included, those that exist) that others may not search: the
    sandboxes' mapped users could not reach their root filesystems under it (crun fails with EACCES)."""
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.stat().st_mode & stat.S_IXOTH:
                return p
    return None


def validate(
    steps: int, n: int, repository: Path | None = None, json_out: Path | None = None, state_dir: Path | None = None
) -> str | None:
    """Why these arguments cannot be measured, or None."""
    if not MIN_STEPS <= steps <= MAX_STEPS:
        return f"--steps must be between {MIN_STEPS} and {MAX_STEPS:,}, not {steps}"
    if not MIN_N <= n <= MAX_N:
        return f"--n must be between {MIN_N} and {MAX_N:,}, not {n}"
    if repository is not None and not repository.is_dir():
        return f"--repository {repository} is not a directory"
    if json_out is not None:
        if json_out.is_dir():
            return f"--json {json_out} is a directory"
        if not json_out.resolve().parent.is_dir():
            return f"--json {json_out}: directory {json_out.resolve().parent} does not exist"
    if state_dir is not None:
        if state_dir.exists() and not state_dir.is_dir():
            return f"--state-dir {state_dir} is not a directory"
        if (closed := closed_ancestor(state_dir.resolve())) is not None:
            return (
                f"--state-dir {state_dir}: others may not search {closed} (mode "
                f"{stat.S_IMODE(closed.stat().st_mode):o}), so the sandboxes' users could not reach their files "
                "(chmod o+x it, or choose another directory)"
            )
    return None


def check_live(i: int, res: ExecResult) -> str | None:
    """Why a recorded step's live result is wrong, or None."""
    if res.replayed:
        return "answered from the log while recording"
    if res.exit_code != 0:
        return f"exit {res.exit_code}: {res.stderr[-200:]!r}"
    if res.stdout != expected(i):
        return f"stdout {res.stdout[:80]!r}, expected {expected(i)!r}"
    return None


def verify(results: Sequence[ExecResult], recorded: Sequence[str]) -> list[str]:
    """Every way a fast-forward's results differ from the recording: each must be replayed, with the
    stdout recorded live at its step (steps count from 1)."""
    problems: list[str] = []
    if len(results) != len(recorded):
        problems.append(f"{len(results)} results for {len(recorded)} recorded steps")
    for i, (res, out) in enumerate(zip(results, recorded, strict=False), start=1):
        if not res.replayed:
            problems.append(f"step {i}: ran live, not replayed")
        if res.exit_code != 0:
            problems.append(f"step {i}: exit {res.exit_code}")
        if res.stdout != out:
            problems.append(f"step {i}: stdout {res.stdout[:80]!r}, recorded {out[:80]!r}")
    return problems


def cpu_per_step(used: dict[str, float], steps: int) -> dict[str, float]:
    """CPU microseconds each process spent per step."""
    return {name: round(1e6 * seconds / steps, 1) for name, seconds in used.items()}


def run_entry(
    k: int,
    steps: int,
    create_s: float,
    replay_s: float,
    per_step: Sequence[float],
    problems: Sequence[str],
    cpu: dict[str, float],
    **extra: Any,
) -> Json:
    """One fast-forward: its resuming create and its steps timed apart; ``cpu``: CPU seconds used."""
    entry: Json = {"run": k, "steps": steps, "create_ms": round(create_s * 1000, 3), "replay_s": round(replay_s, 4)}
    entry |= {
        "total_s": round(create_s + replay_s, 4),
        "steps_per_s": round(steps / replay_s, 1) if replay_s > 0 else None,
        "projected_10000_s": round(create_s + replay_s * TARGET_STEPS / steps, 4),
        "per_step": summarize(per_step) if per_step else None,
        "cpu_us_per_step": cpu_per_step(cpu, steps),
        "mismatches": len(problems),
        "mismatch_examples": list(problems[:EXAMPLES]),
    }
    return entry | extra


def ok_runs(runs: Sequence[Json]) -> list[Json]:
    """The fast-forwards that completed and replayed every step as recorded."""
    return [r for r in runs if "error" not in r and not r.get("mismatches")]


def aggregate(runs: Sequence[Json]) -> Json:
    """Best and median of the sound fast-forwards, figure by figure (best: the fastest)."""
    good = ok_runs(runs)
    out: Json = {"runs_ok": len(good), "runs_failed": len(runs) - len(good)}
    for key, fastest in (("steps_per_s", max), ("replay_s", min), ("create_ms", min), ("total_s", min)):
        values = [float(r[key]) for r in good if r.get(key) is not None]
        out[key] = {
            "best": fastest(values) if values else None,
            "median": round(statistics.median(values), 4) if values else None,
        }
    projected = [float(r["projected_10000_s"]) for r in good]
    out["projected_10000_s"] = {
        "best": min(projected) if projected else None,
        "median": round(statistics.median(projected), 4) if projected else None,
    }
    return out


def overhead(logged: Json, plain: Json) -> Json:
    """Logged over plain, minus 1: the share of a live call's latency that logging adds."""

    def rel(key: str) -> float | None:
        a, b = logged.get(key), plain.get(key)
        return round(float(a) / float(b) - 1, 4) if a is not None and b else None

    return {"p50": rel("p50_ms"), "mean": rel("mean_ms"), "p99": rel("p99_ms")}


def check_target(text: str, value: float | None, met: bool | None, **extra: Any) -> Json:
    # met is None where a figure is missing (a phase failed): unknown, which is not the same as missed
    return {"target": text, "value": value, "met": None if value is None else met} | extra


def judge(steps: int, ff: Json, lat: Json) -> Json:
    t = TARGETS
    rate = ff["steps_per_s"]["median"]
    ten_k = ff["projected_10000_s"]["median"]
    over = lat.get("overhead", {}).get("p50") if "error" not in lat else None
    mean_over = lat.get("overhead", {}).get("mean") if "error" not in lat else None
    text = {
        "rate": f"fast-forward ≥ {t['steps_per_s']:,.0f} replayed steps/s "
        f"(median of {FAST_FORWARDS} fresh clients, the resuming create excluded)",
        "ten_k": f"fast-forward of a {TARGET_STEPS:,}-step trajectory ≤ {t['seconds_for_10000']:g} s "
        "(median; the resuming create included)",
        "overhead": f"logging adds ≤ {t['overhead']:.0%} to live exec latency (p50 logged / p50 plain - 1)",
    }
    return {
        "ff_steps_per_s_ge_5000": check_target(
            text["rate"], rate, rate is not None and rate >= t["steps_per_s"], best=ff["steps_per_s"]["best"]
        ),
        "ff_10000_steps_le_2s": check_target(
            text["ten_k"],
            ten_k,
            ten_k is not None and ten_k <= t["seconds_for_10000"],
            extrapolated=steps != TARGET_STEPS,
            steps=steps,
        ),
        "logging_overhead_le_10pct": check_target(
            text["overhead"], over, over is not None and over <= t["overhead"], mean_value=mean_over
        ),
    }


def failed(runs: Sequence[Json], lat: Json) -> int:
    """Fast-forwards that failed or replayed something else than the recording, and a failed latency
    phase: any makes the exit status 1."""
    return sum(1 for r in runs if "error" in r or r.get("mismatches")) + ("error" in lat)


# ---- measurements ------------------------------------------------------------------------------------


async def record(
    console: Console, client: AsyncClient, spec: Json, tid: str, steps: int, pids: dict[str, int]
) -> tuple[AsyncSandbox, list[str], Json]:
    """The live steps, logged; returns the sandbox, the stdout of each step and the figures."""
    t0 = time.perf_counter()
    sb = await AsyncSandbox.create(**spec, trajectory=tid, client=client)
    create_s = time.perf_counter() - t0
    if sb.trajectory is None or sb.trajectory.recorded != 1:
        raise RuntimeError(f"trajectory {tid!r} is not new: {sb.trajectory!r}")
    outputs: list[str] = []
    times: list[float] = []
    with phase(console, f"recording {steps:,} live steps", steps) as tick:
        started, cpu = time.perf_counter(), cpu_now(pids)
        for i in range(1, steps + 1):
            t = time.perf_counter()
            res = await sb.exec(step_cmd(i))
            times.append(time.perf_counter() - t)
            if (why := check_live(i, res)) is not None:
                raise RuntimeError(f"recording step {i}: {why}")
            outputs.append(res.stdout)
            tick()
        wall = time.perf_counter() - started
    used = {name: s - cpu[name] for name, s in cpu_now(pids).items()}
    info = await client.trajectory(tid)
    if info.length != steps + 1:
        raise RuntimeError(f"the log holds {info.length} calls of trajectory {tid!r}, not {steps + 1}")
    figures: Json = {"trajectory": tid, "sandbox": sb.id, "create_ms": round(create_s * 1000, 3)}
    figures |= {
        "steps": steps,
        "wall_s": round(wall, 3),
        "steps_per_s": round(steps / wall, 1),
        "per_step": summarize(times),
        "cpu_us_per_step": cpu_per_step(used, steps),
        "log_length": info.length,
    }
    return sb, outputs, figures


async def fast_forward(
    console: Console, k: int, url: str, token: str, spec: Json, tid: str, recorded: list[str], pids: dict[str, int]
) -> Json:
    """A restarted trainer: a new client, the same create, the same calls; all answered from the log."""
    steps = len(recorded)
    client = AsyncClient(url=url, token=token)
    try:
        t0 = time.perf_counter()
        sb = await AsyncSandbox.create(**spec, trajectory=tid, client=client)
        create_s = time.perf_counter() - t0
        traj = sb.trajectory
        if traj is None or traj.recorded != steps + 1:
            raise RuntimeError(f"the resumed sandbox does not hold the {steps + 1} recorded calls: {traj!r}")
        results: list[ExecResult] = []
        times: list[float] = []
        label = f"fast-forward {k}/{FAST_FORWARDS} (×{CHUNK} steps)"
        with phase(console, label, math.ceil(steps / CHUNK)) as tick:
            started, cpu = time.perf_counter(), cpu_now(pids)
            for i in range(1, steps + 1):
                t = time.perf_counter()
                results.append(await sb.exec(step_cmd(i)))
                times.append(time.perf_counter() - t)
                if i % CHUNK == 0 or i == steps:
                    tick()
            replay_s = time.perf_counter() - started
        used = {name: s - cpu[name] for name, s in cpu_now(pids).items()}
        problems = verify(results, recorded)
        counts = {"replayed": traj.replayed, "live": traj.live, "position": traj.position}
        return run_entry(k, steps, create_s, replay_s, times, problems, used, sandbox=sb.id, trajectory=counts)
    finally:
        await client.aclose()


async def guarded(coro: Awaitable[Json], **where: Any) -> Json:
    """A failed phase is a result of the run (an error in its place), not the end of the bench."""
    try:
        return await coro
    except (DsecError, RuntimeError, OSError) as e:
        return where | {"error": f"{type(e).__name__}: {e}"}


async def live_latency(console: Console, client: AsyncClient, spec: Json, tid: str, n: int) -> Json:
    """`true` in a logged and a plain sandbox alternately (which goes first alternates too)."""
    logged = await AsyncSandbox.create(**spec, trajectory=tid, client=client)
    plain = await AsyncSandbox.create(**spec, client=client)
    pair = {"logged": logged, "plain": plain}
    times: dict[str, list[float]] = {"logged": [], "plain": []}

    async def call(name: str) -> float:
        t = time.perf_counter()
        res = await pair[name].exec(LATENCY_CMD)
        elapsed = time.perf_counter() - t
        if res.exit_code != 0 or res.replayed:
            raise RuntimeError(f"{name} `true`: exit {res.exit_code}, replayed {res.replayed}")
        return elapsed

    try:
        for _ in range(WARMUP):
            for name in pair:
                await call(name)
        with phase(console, f"live exec latency, logged and plain alternately, {n} each", n) as tick:
            for i in range(n):
                for name in ("logged", "plain") if i % 2 == 0 else ("plain", "logged"):
                    times[name].append(await call(name))
                tick()
    finally:
        for sb in (logged, plain):
            with contextlib.suppress(DsecError):
                await sb.kill()
    stats = {name: summarize(ts) for name, ts in times.items()}
    return stats | {"overhead": overhead(stats["logged"], stats["plain"]), "warmup": WARMUP, "trajectory": tid}


async def measure(
    console: Console, client: AsyncClient, state_dir: Path, steps: int, n: int, pids: dict[str, int]
) -> Json:
    console.print(f"ensuring image {IMAGE} is built")
    await client.build_image(IMAGE)
    run_id = f"{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    spec = sandbox_spec(steps)
    tid = f"bench-trajectory/{run_id}/record"
    sb, outputs, rec = await record(console, client, spec, tid, steps, pids)
    token = (state_dir / "token").read_text().strip()
    runs: list[Json] = []
    for k in range(1, FAST_FORWARDS + 1):
        entry = await guarded(fast_forward(console, k, client.url, token, spec, tid, outputs, pids), run=k)
        if "error" not in entry:
            entry["same_sandbox"] = entry["sandbox"] == sb.id
        runs.append(entry)
        console.print(fast_forward_line(entry))
    await sb.kill()  # logged: it closes the trajectory
    lat_tid = f"bench-trajectory/{run_id}/latency"
    lat = await guarded(live_latency(console, client, spec, lat_tid, n))
    for t in (tid, lat_tid):  # the bench's trajectories are of no use after it
        with contextlib.suppress(DsecError):
            await client.remove_trajectory(t)
    return {"record": rec, "fast_forward": {"runs": runs, **aggregate(runs)}, "latency": lat}


def fast_forward_line(entry: Json) -> str:
    if "error" in entry:
        return f"  fast-forward {entry['run']}: [red]{entry['error']}[/red]"
    bad = f"  [red]{entry['mismatches']} mismatches[/red]" if entry["mismatches"] else ""
    return (
        f"  fast-forward {entry['run']}: create {entry['create_ms']:.1f} ms, "
        f"{entry['steps']:,} steps in {entry['replay_s']:.3f} s = {entry['steps_per_s']:,.0f} steps/s{bad}"
    )


# ---- report ------------------------------------------------------------------------------------------


def print_summary(console: Console, result: Json) -> None:
    rec, ff = result["record"], result["fast_forward"]
    table = Table(title=f"dsec trajectory bench: record and fast-forward ({rec['steps']:,} exec steps)")
    table.add_column("phase", no_wrap=True)
    for col in ("create ms", "seconds", "steps/s", "p50 ms/step", "max ms/step", "daemon CPU µs/step"):
        table.add_column(col, justify="right")

    def cpu(entry: Json) -> str:
        return f"{entry['cpu_us_per_step'].get('daemon', 0.0):.1f}"

    table.add_row(
        "record (live)",
        f"{rec['create_ms']:.1f}",
        f"{rec['wall_s']:.2f}",
        f"{rec['steps_per_s']:,.0f}",
        f"{rec['per_step']['p50_ms']:.3f}",
        f"{rec['per_step']['max_ms']:.1f}",
        cpu(rec),
        end_section=True,
    )
    for r in ff["runs"]:
        if "error" in r:
            table.add_row(f"fast-fwd {r['run']}", "-", "-", "-", "-", "-", f"[red]{str(r['error'])[:50]}[/red]")
            continue
        bad = f" [red]{r['mismatches']} mismatches[/red]" if r["mismatches"] else ""
        table.add_row(
            f"fast-fwd {r['run']}{bad}",
            f"{r['create_ms']:.1f}",
            f"{r['replay_s']:.3f}",
            f"{r['steps_per_s']:,.0f}",
            f"{r['per_step']['p50_ms']:.4f}",
            f"{r['per_step']['max_ms']:.1f}",
            cpu(r),
        )
    for which in ("best", "median"):
        rate = ff["steps_per_s"][which]
        cells = [ff["create_ms"][which], ff["replay_s"][which]]
        table.add_row(
            f"fast-fwd {which}",
            *("-" if v is None else f"{v:.3f}" for v in cells),
            "-" if rate is None else f"{rate:,.0f}",
            "",
            "",
            "",
            style="bold",
        )
    console.print(table)
    lat = result["latency"]
    if "error" in lat:
        console.print(f"[red]live latency failed[/red]: {lat['error']}")
    else:
        table = Table(title=f"live exec `true` latency (ms), alternating, after {lat['warmup']} warm-up calls each")
        for col in ("sandbox", "n", "p50", "p99", "mean", "max"):
            table.add_column(col, justify="left" if col == "sandbox" else "right")
        for name in ("logged", "plain"):
            s = lat[name]
            table.add_row(name, str(s["n"]), *(f"{s[k]:.3f}" for k in ("p50_ms", "p99_ms", "mean_ms", "max_ms")))
        o = lat["overhead"]
        ratios = ["-" if o[k] is None else f"{o[k]:+.1%}" for k in ("p50", "p99", "mean")]
        table.add_row("logging overhead", "", *ratios, "", style="bold")
        console.print(table)
    marks = {True: "[green]met[/green]", False: "[red]missed[/red]", None: "[yellow]n/a[/yellow]"}
    for target in result["targets"].values():
        console.print(f"{marks[target['met']]}  {target['target']}  (value: {target['value']})")


def main(n: int, steps: int, json_out: Path, state_dir: Path, repository: Path | None = None) -> int:
    console = Console()
    if (why := validate(steps, n, repository, json_out, state_dir)) is not None:
        console.print(f"[red]error[/red]: {why}")
        return 2
    when = datetime.now(UTC).isoformat(timespec="seconds")
    state_dir = state_dir.resolve()
    unwind_on_sigterm()
    load_before = os.getloadavg()

    async def run() -> Json:
        flags = repository_flags(repository)
        async with private_daemon(console, state_dir, flags, LABELS, STOP_TIMEOUT) as (proc, client):
            version = (await client.health()).version
            pids = {"daemon": proc.pid, "bench": os.getpid()}
            return await measure(console, client, state_dir, steps, n, pids) | {"version": version}

    try:
        figures = asyncio.run(run())
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]bench failed[/red]: {e}")
        return 1

    runs, lat = figures["fast_forward"]["runs"], figures["latency"]
    params: Json = {"steps": steps, "n": n, "fast_forwards": FAST_FORWARDS, "warmup": WARMUP, "sdk_page": SDK_PAGE}
    params |= {"image": IMAGE, "sandbox": sandbox_spec(steps), "repository": str(repository or "")}
    params |= {"step_command": step_cmd(1), "latency_command": LATENCY_CMD}
    result: Json = {
        "bench": "trajectory",
        "when": when,
        "host": host_facts() | {"nproc": len(os.sched_getaffinity(0)), "loadavg": [load_before, os.getloadavg()]},
        "params": params,
        "daemon_version": figures["version"],
        "phases": {
            "record": "one container sandbox bound to a trajectory runs the steps live (each logged)",
            "fast_forward": "a fresh client per run creates with the same trajectory id and issues the same "
            "calls; each must come back replayed with the stdout recorded live",
            "latency": "`true` in a sandbox bound to a trajectory and in a plain one (same image and limits), "
            "alternately, one call at a time",
        },
        "record": figures["record"],
        "fast_forward": figures["fast_forward"],
        "latency": lat,
        "targets": judge(steps, figures["fast_forward"], lat),
        "target_values": TARGETS,
        "failures": failed(runs, lat),
    }
    json_out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print_summary(console, result)
    console.print(f"wrote {json_out}")
    if result["failures"]:
        console.print(f"[red]{result['failures']} fast-forward or latency run(s) failed or did not match[/red]")
    return 1 if result["failures"] else 0
