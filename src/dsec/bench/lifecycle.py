"""Lifecycle benchmark: dsec create → exec `true` → kill, side by side with bare crun and podman.

All three systems start containers from the same busybox rootfs (the one dsec built), so the
difference measured is what each system adds around the OCI runtime, not the size of an image.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import DsecError
from ..sdk.aio import AsyncClient, AsyncSandbox

Json = dict[str, Any]

IMAGE = "dsec/busybox"
IMAGES_DIR = Path("/var/tmp/dsec-images")
ROOTFS = IMAGES_DIR / "dsec_busybox@latest" / "rootfs"
PODMAN_IMAGE = "localhost/dsec-bench-busybox:latest"
# This host has no systemd: podman's default cgroup manager (systemd) and events backend (journald)
# both fail without it, so cgroups are driven directly and events go to a file.
PODMAN_FLAGS = ["--cgroup-manager=cgroupfs", "--events-backend=file"]
PODMAN_MAX = 20  # a podman run costs several hundred ms; more iterations add time, not precision
BURST_CONCURRENCY = 64
WARMUP = 2  # untimed first iterations: connection setup, page cache and podman's storage init
LABEL = {"dsec-bench": "lifecycle"}
DAEMON_START_TIMEOUT = 60.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(seconds: Sequence[float]) -> Json:
    ms = [s * 1000.0 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
    }


@contextlib.contextmanager
def phase(console: Console, label: str, total: int) -> Iterator[Callable[[], None]]:
    """Yields a tick(); a live bar on a terminal, a few plain lines in a log."""
    started = time.perf_counter()
    if console.is_terminal:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(label, total=total)
            yield lambda: bar.advance(task)
    else:
        done = 0
        step = max(1, total // 4)

        def tick() -> None:
            nonlocal done
            done += 1
            if done % step == 0 and done < total:
                console.print(f"  {label}: {done}/{total}")

        yield tick
    console.print(f"[green]done[/green] {label}: {total} in {time.perf_counter() - started:.1f}s")


def _tail(path: Path, limit: int = 800) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return ""


# ---- the daemon ------------------------------------------------------------------------------------


def start_daemon(state_dir: Path) -> subprocess.Popen[bytes]:
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "dsec",
        "serve",
        "--state-dir",
        str(state_dir),
        "--listen",
        f"unix://{state_dir}/dsec.sock",
        "--images-dir",
        str(IMAGES_DIR),
        "--log-level",
        "warning",
    ]
    with (state_dir / "daemon.log").open("ab") as log:
        # A session of its own: Ctrl-C must reach the bench, which still needs the daemon to kill
        # its sandboxes, and not the daemon directly.
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )


def stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for_token(proc: subprocess.Popen[bytes], state_dir: Path) -> str:
    deadline = time.monotonic() + DAEMON_START_TIMEOUT
    token_file = state_dir / "token"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited ({proc.returncode}): {_tail(state_dir / 'daemon.log')}")
        with contextlib.suppress(OSError):
            token = token_file.read_text().strip()
            if token:
                return token
        time.sleep(0.05)
    raise RuntimeError(f"the daemon wrote no token within {DAEMON_START_TIMEOUT:.0f}s")


async def wait_healthy(client: AsyncClient, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + DAEMON_START_TIMEOUT
    while True:
        try:
            await client.health()
            return
        except DsecError:
            # The token is written before the socket listens, so refusals are expected for a moment.
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.05)


# ---- dsec ------------------------------------------------------------------------------------------


async def bench_dsec(
    console: Console, client: AsyncClient, proc: subprocess.Popen[bytes], n: int, burst: int
) -> Json:
    try:
        await wait_healthy(client, proc)
        console.print(f"daemon healthy; ensuring image {IMAGE} is built")
        await client.build_image(IMAGE)

        totals: list[float] = []
        to_first_exec: list[float] = []
        with phase(console, "dsec create → exec true → kill", n) as tick:
            for i in range(WARMUP + n):
                t0 = time.perf_counter()
                sb = await client.create(image=IMAGE, labels=LABEL)
                res = await sb.exec(["true"])
                t1 = time.perf_counter()
                await sb.kill()
                t2 = time.perf_counter()
                if res.exit_code != 0:
                    raise RuntimeError(f"`true` exited {res.exit_code} in {sb.id}: {res.stderr[-300:]}")
                if i >= WARMUP:
                    to_first_exec.append(t1 - t0)
                    totals.append(t2 - t0)
                    tick()

        round_trips: list[float] = []
        sb = await client.create(image=IMAGE, labels=LABEL)
        with phase(console, "dsec exec round trip", n) as tick:
            for i in range(WARMUP + n):
                t0 = time.perf_counter()
                res = await sb.exec(["true"])
                dt = time.perf_counter() - t0
                if res.exit_code != 0:
                    raise RuntimeError(f"`true` exited {res.exit_code} in {sb.id}: {res.stderr[-300:]}")
                if i >= WARMUP:
                    round_trips.append(dt)
                    tick()
        await sb.kill()

        return {
            "image": IMAGE,
            "create_exec_kill": summarize(totals),
            "create_to_first_exec": summarize(to_first_exec),
            "exec_round_trip": summarize(round_trips),
            "burst": await run_burst(console, client, burst),
        }
    finally:
        await kill_leftovers(console, client)


async def run_burst(console: Console, client: AsyncClient, burst: int) -> Json:
    gate = asyncio.Semaphore(BURST_CONCURRENCY)
    latencies: list[float] = []

    with phase(console, f"dsec burst of {burst} creations", burst) as tick:

        async def create_one() -> AsyncSandbox | str:
            async with gate:
                t0 = time.perf_counter()
                try:
                    sb = await client.create(image=IMAGE, labels=LABEL)
                except DsecError as e:
                    return e.code
                except Exception as e:  # a failure of one creation is a result, not a reason to stop
                    return type(e).__name__
                finally:
                    tick()
                latencies.append(time.perf_counter() - t0)
                return sb

        started = time.perf_counter()
        results = await asyncio.gather(*(create_one() for _ in range(burst)))
        wall = time.perf_counter() - started

    created = [r for r in results if isinstance(r, AsyncSandbox)]
    failures = Counter(r for r in results if isinstance(r, str))

    async def kill_one(sb: AsyncSandbox) -> None:
        async with gate:
            await sb.kill()

    started = time.perf_counter()
    await asyncio.gather(*(kill_one(sb) for sb in created))
    kill_wall = time.perf_counter() - started
    return {
        "size": burst,
        "concurrency": BURST_CONCURRENCY,
        "wall_s": round(wall, 3),
        "creations_per_s": round(burst / wall, 2),
        "succeeded": len(created),
        "failures": dict(failures),
        "create_latency": summarize(latencies) if latencies else None,
        "kill_all_wall_s": round(kill_wall, 3),
    }


async def kill_leftovers(console: Console, client: AsyncClient) -> None:
    try:
        left = await client.list(labels=LABEL)
        results = await asyncio.gather(
            *(AsyncSandbox(info, client).kill() for info in left), return_exceptions=True
        )
    except DsecError as e:
        console.print(f"[red]could not clean up the bench's sandboxes[/red]: {e}")
        return
    errors = [r for r in results if isinstance(r, BaseException)]
    if left:
        console.print(f"killed {len(left) - len(errors)} leftover sandbox(es); {len(errors)} failed")


# ---- peers -----------------------------------------------------------------------------------------


def timed_runs(
    console: Console, label: str, count: int, argv_for: Callable[[int], list[str]], err: Path
) -> list[float]:
    times: list[float] = []
    with phase(console, label, count) as tick:
        for i in range(WARMUP + count):
            argv = argv_for(i)
            # Never pipes: a container inherits them and outlives crun, so reading one to EOF hangs.
            with err.open("wb") as err_file:
                t0 = time.perf_counter()
                status = subprocess.run(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_file, timeout=120
                ).returncode
                dt = time.perf_counter() - t0
            if status != 0:
                raise RuntimeError(f"{shlex.join(argv)} exited {status}: {_tail(err)}")
            if i >= WARMUP:
                times.append(dt)
                tick()
    return times


def quiet(argv: list[str], err: Path, timeout: float = 60) -> int:
    with err.open("wb") as err_file:
        return subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_file, timeout=timeout
        ).returncode


def first_line(argv: list[str]) -> str:
    out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30).stdout
    return out.strip().splitlines()[0] if out.strip() else ""


def make_bundle(crun: str, bundle: Path, args: list[str]) -> Path:
    bundle.mkdir(parents=True)
    subprocess.run([crun, "spec"], cwd=bundle, check=True, stdin=subprocess.DEVNULL, timeout=30)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = args
    cfg["root"] = {"path": str(ROOTFS), "readonly": True}
    (bundle / "config.json").write_text(json.dumps(cfg))
    return bundle


def bench_crun(console: Console, n: int) -> Json:
    crun = shutil.which("crun")
    if crun is None:
        return {"error": "crun is not on PATH"}
    with tempfile.TemporaryDirectory(prefix="dsec-bench-crun-") as tmp:
        root = Path(tmp) / "state"
        root.mkdir()
        err = Path(tmp) / "stderr.log"
        base = [crun, "--root", str(root)]
        run_bundle = make_bundle(crun, Path(tmp) / "run", ["/bin/true"])
        long_bundle = make_bundle(crun, Path(tmp) / "long", ["/bin/sleep", "100000"])
        try:
            runs = timed_runs(
                console,
                "crun run true",
                n,
                lambda i: [*base, "run", "--bundle", str(run_bundle), f"dsec-bench-run-{i}"],
                err,
            )
            if quiet([*base, "run", "--detach", "--bundle", str(long_bundle), "dsec-bench-long"], err):
                raise RuntimeError(f"crun run --detach failed: {_tail(err)}")
            execs = timed_runs(
                console, "crun exec true", n, lambda _: [*base, "exec", "dsec-bench-long", "/bin/true"], err
            )
        finally:
            # Everything under our private --root is ours; a failed run may have left a container.
            listing = subprocess.run([*base, "list", "-q"], capture_output=True, text=True, timeout=30)
            for cid in listing.stdout.split():
                quiet([*base, "delete", "--force", cid], err)
    return {"version": first_line([crun, "--version"]), "run": summarize(runs), "exec": summarize(execs)}


def ensure_podman(console: Console) -> str:
    found = shutil.which("podman")
    if found:
        return found
    console.print("podman is not on PATH: installing it with `apt-get install -y -q podman`")
    with tempfile.NamedTemporaryFile(prefix="dsec-bench-apt-", suffix=".log") as log:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", "podman"]
        # A file, not a pipe: a service started by a postinst script could hold a pipe open forever.
        status = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, timeout=1200)
        if status.returncode != 0:
            raise RuntimeError(f"apt-get install podman failed: {_tail(Path(log.name))}")
    found = shutil.which("podman")
    if found is None:
        raise RuntimeError("podman is still not on PATH after installing it")
    return found


def bench_podman(console: Console, n: int) -> Json:
    base = [ensure_podman(console), *PODMAN_FLAGS]
    count = min(n, PODMAN_MAX)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-podman-") as tmp:
        err = Path(tmp) / "stderr.log"
        if quiet([*base, "image", "exists", PODMAN_IMAGE], err) != 0:
            console.print(f"importing {ROOTFS} into podman as {PODMAN_IMAGE}")
            tar = subprocess.Popen(["tar", "-C", str(ROOTFS), "-c", "."], stdout=subprocess.PIPE)
            with err.open("wb") as err_file:
                imp = subprocess.Popen(
                    [*base, "import", "-", PODMAN_IMAGE], stdin=tar.stdout, stdout=err_file, stderr=err_file
                )
            assert tar.stdout is not None
            tar.stdout.close()  # so that tar gets SIGPIPE if the import dies
            if imp.wait(timeout=300) != 0 or tar.wait(timeout=60) != 0:
                raise RuntimeError(f"podman import failed: {_tail(err)}")
        label = "=".join(next(iter(LABEL.items())))
        try:
            runs = timed_runs(
                console,
                "podman run --rm true",
                count,
                lambda _: [
                    *base,
                    "run",
                    "--rm",
                    "--network=none",
                    "--label",
                    label,
                    PODMAN_IMAGE,
                    "/bin/true",
                ],
                err,
            )
        finally:
            listing = subprocess.run(
                [*base, "ps", "-aq", "--filter", f"label={label}"], capture_output=True, text=True, timeout=60
            )
            if listing.stdout.split():
                quiet([*base, "rm", "-f", *listing.stdout.split()], err)
    return {
        "version": first_line([*base, "--version"]),
        "global_flags": PODMAN_FLAGS,
        "count": count,
        "run": summarize(runs),
    }


# ---- report ----------------------------------------------------------------------------------------


def _p50(system: Json, key: str) -> float | None:
    stats = system.get(key)
    return float(stats["p50_ms"]) if isinstance(stats, dict) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def judge(dsec: Json, crun: Json, podman: Json) -> tuple[Json, Json]:
    first_exec, exec_rtt = _p50(dsec, "create_to_first_exec"), _p50(dsec, "exec_round_trip")
    ratios = {
        "dsec_create_exec_p50_over_crun_run_p50": _ratio(first_exec, _p50(crun, "run")),
        "podman_run_p50_over_dsec_create_exec_p50": _ratio(_p50(podman, "run"), first_exec),
        "dsec_exec_p50_over_crun_exec_p50": _ratio(exec_rtt, _p50(crun, "exec")),
    }
    vs_crun, vs_podman = (
        ratios["dsec_create_exec_p50_over_crun_run_p50"],
        ratios["podman_run_p50_over_dsec_create_exec_p50"],
    )
    b = dsec["burst"]
    targets = {
        "create_exec_p50_within_1_5x_crun": {
            "target": "dsec create→first exec p50 ≤ 1.5 × bare crun run p50",
            "value": vs_crun,
            "met": None if vs_crun is None else vs_crun <= 1.5,
        },
        "10x_faster_than_podman": {
            "target": "podman run p50 ≥ 10 × dsec create→first exec p50",
            "value": vs_podman,
            "met": None if vs_podman is None else vs_podman >= 10.0,
        },
        "exec_round_trip_p50_le_5ms": {
            "target": "dsec exec round trip p50 ≤ 5 ms",
            "value": exec_rtt,
            "met": exec_rtt is not None and exec_rtt <= 5.0,
        },
        "burst_100_per_s_all_ok": {
            "target": "burst ≥ 100 creations/s with 100% success",
            "value": b["creations_per_s"],
            "met": b["creations_per_s"] >= 100.0 and b["succeeded"] == b["size"],
        },
    }
    return ratios, targets


def print_summary(console: Console, result: Json) -> None:
    table = Table(title="dsec lifecycle bench (ms)")
    for col in ("system", "measurement", "n", "p50", "p99", "mean"):
        table.add_column(col, justify="left" if col in ("system", "measurement") else "right")
    rows = [
        ("dsec", "create → exec true", "create_to_first_exec"),
        ("dsec", "create → exec → kill", "create_exec_kill"),
        ("dsec", "exec round trip", "exec_round_trip"),
        ("crun", "run true", "run"),
        ("crun", "exec true", "exec"),
        ("podman", "run --rm true", "run"),
    ]
    for system, what, key in rows:
        stats = result["systems"][system].get(key)
        if isinstance(stats, dict):
            table.add_row(
                system, what, str(stats["n"]), *(f"{stats[k]:.1f}" for k in ("p50_ms", "p99_ms", "mean_ms"))
            )
        else:
            why = result["systems"][system].get("error") or "skipped"
            table.add_row(system, what, "-", "-", "-", str(why)[:60])
    console.print(table)
    b = result["systems"]["dsec"]["burst"]
    console.print(
        f"burst: {b['succeeded']}/{b['size']} created in {b['wall_s']:.2f}s = {b['creations_per_s']:.1f}/s"
        f" (failures: {b['failures'] or 'none'})"
    )
    for t in result["targets"].values():
        mark = {True: "[green]met[/green]", False: "[red]missed[/red]", None: "[yellow]n/a[/yellow]"}[
            t["met"]
        ]
        console.print(f"{mark}  {t['target']}  (value: {t['value']})")


def main(n: int, burst: int, json_out: Path, state_dir: Path, skip_podman: bool) -> int:
    console = Console()
    state_dir = state_dir.resolve()
    proc = start_daemon(state_dir)
    try:
        token = wait_for_token(proc, state_dir)
        client = AsyncClient(url=f"unix://{state_dir}/dsec.sock", token=token)

        async def dsec_phase() -> Json:
            try:
                return await bench_dsec(console, client, proc, n, burst)
            finally:
                await client.aclose()

        dsec = asyncio.run(dsec_phase())
        # The peers run while the daemon is up: it mounts the v1 hugetlb hierarchy crun needs here.
        peers: dict[str, Json] = {}
        for name, bench in (("crun", bench_crun), ("podman", bench_podman)):
            if name == "podman" and skip_podman:
                peers[name] = {"skipped": True}
                continue
            try:
                peers[name] = bench(console, n)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                console.print(f"[red]{name} failed[/red]: {e}")
                peers[name] = {"error": str(e)}
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]bench failed[/red]: {e}")
        return 1
    finally:
        stop_daemon(proc)

    ratios, targets = judge(dsec, peers["crun"], peers["podman"])
    result: Json = {
        "bench": "lifecycle",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        },
        "params": {
            "n": n,
            "burst": burst,
            "burst_concurrency": BURST_CONCURRENCY,
            "warmup": WARMUP,
            "image": IMAGE,
            "rootfs": str(ROOTFS),
            "skip_podman": skip_podman,
        },
        "systems": {"dsec": dsec, **peers},
        "ratios": ratios,
        "targets": targets,
    }
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(console, result)
    console.print(f"wrote {json_out}")
    return 0
