"""Lifecycle benchmark: dsec create → exec `true` → kill, side by side with bare crun and podman.

All three systems start containers from the same busybox rootfs (the directory dsec built), so
the difference measured is what each system adds around the OCI runtime, not the size of an image.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dsec import AsyncClient, AsyncSandbox, DsecError

from .common import (
    Json,
    connect,
    kill_leftovers,
    phase,
    release_node,
    start_daemon,
    stop_daemon,
    summarize,
    tail,
    unwind_on_sigterm,
)
from .warm import bench_warm

IMAGE = "dsec/busybox"
PODMAN_IMAGE = "localhost/dsec-bench-busybox:latest"
# Without systemd (as here) podman 4.3 falls back to these by itself; naming them keeps the measured
# path the same on a host with systemd, where systemd-run scopes and journald would add to each run.
PODMAN_FLAGS = ["--cgroup-manager=cgroupfs", "--events-backend=file"]
# Podman asks crun for 1048576 open files and processes by default. Here root lacks CAP_SYS_RESOURCE,
# so crun cannot raise a hard limit and every run fails with EPERM; lowering a limit is always allowed
# (podman itself ends up with an NPROC hard limit of 32768 on this host, below the shell's).
PODMAN_RUN_FLAGS = ["--network=none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
PODMAN_MAX = 20  # a podman run costs hundreds of ms; more iterations add minutes, not precision
BURST_CPU = 0.01  # as the scale bench's burst asks
BURST_CONCURRENCY = 64
WARMUP = 2  # untimed first iterations: connection setup, cold page cache, podman's storage init
LABEL = ("dsec-bench", "lifecycle")  # marks everything the bench creates, to find leftovers


# ---- dsec ------------------------------------------------------------------------------------------


async def sample(
    console: Console, label: str, count: int, step: Callable[[], Awaitable[tuple[float, ...]]]
) -> list[tuple[float, ...]]:
    samples: list[tuple[float, ...]] = []
    with phase(console, label, count) as tick:
        for i in range(WARMUP + count):
            measured = await step()
            if i >= WARMUP:
                samples.append(measured)
                tick()
    return samples


async def run_true(sb: AsyncSandbox) -> None:
    res = await sb.exec(["true"])
    if res.exit_code != 0:
        raise RuntimeError(f"`true` exited {res.exit_code} in {sb.id}: {res.stderr[-300:]}")


async def bench_dsec(console: Console, client: AsyncClient, n: int, burst: int) -> Json:
    labels = dict([LABEL])
    try:
        version = (await client.health()).version
        console.print(f"daemon healthy; ensuring image {IMAGE} is built")
        await client.build_image(IMAGE)

        async def lifecycle() -> tuple[float, float]:
            t0 = time.perf_counter()
            sb = await client.create(image=IMAGE, labels=labels)
            await run_true(sb)
            t1 = time.perf_counter()
            await sb.kill()
            return t1 - t0, time.perf_counter() - t0

        cycles = await sample(console, "dsec create → exec true → kill", n, lifecycle)
        sb = await client.create(image=IMAGE, labels=labels)

        async def round_trip() -> tuple[float]:
            t0 = time.perf_counter()
            await run_true(sb)
            return (time.perf_counter() - t0,)

        trips = await sample(console, "dsec exec round trip", n, round_trip)
        await sb.kill()
        warm = await bench_warm(console, client, IMAGE, n, labels, sample, run_true)
        return {
            "version": version,
            "image": IMAGE,
            "create_to_first_exec": summarize([c[0] for c in cycles]),
            "create_exec_kill": summarize([c[1] for c in cycles]),
            "exec_round_trip": summarize([t[0] for t in trips]),
            "warm_pool": warm,
            "burst": await run_burst(console, client, burst, labels),
        }
    finally:
        await kill_leftovers(console, client, labels)


async def run_burst(console: Console, client: AsyncClient, burst: int, labels: dict[str, str]) -> Json:
    gate = asyncio.Semaphore(BURST_CONCURRENCY)
    latencies: list[float] = []

    with phase(console, f"dsec burst of {burst} creations", burst) as tick:

        async def create_one() -> AsyncSandbox | str:
            async with gate:
                t0 = time.perf_counter()
                try:
                    # a token CPU request: the burst holds all it made until the end, and the node's
                    # admission (16 CPUs of requests here) would otherwise queue it past 64 sandboxes
                    sb = await client.create(image=IMAGE, labels=labels, cpu=BURST_CPU)
                except DsecError as e:
                    return e.code
                except Exception as e:  # one failed creation is a result to count, not a reason to stop
                    return type(e).__name__
                finally:
                    tick()
                latencies.append(time.perf_counter() - t0)
                return sb

        started = time.perf_counter()
        results = await asyncio.gather(*(create_one() for _ in range(burst)))
        wall = time.perf_counter() - started

    created = [r for r in results if isinstance(r, AsyncSandbox)]

    async def kill_one(sb: AsyncSandbox) -> None:
        async with gate:
            await sb.kill()

    started = time.perf_counter()
    await asyncio.gather(*(kill_one(sb) for sb in created))
    return {
        "size": burst,
        "concurrency": BURST_CONCURRENCY,
        "wall_s": round(wall, 3),
        "creations_per_s": round(burst / wall, 2),
        "succeeded": len(created),
        "failures": dict(Counter(r for r in results if isinstance(r, str))),
        "create_latency": summarize(latencies) if latencies else None,
        "kill_all_wall_s": round(time.perf_counter() - started, 3),
    }


async def image_rootfs(client: AsyncClient, state_dir: Path) -> Path:
    """The mounted layer dsec starts the image from; the peers start from this very directory."""
    info = await client.image(IMAGE)
    if len(info.layers) != 1:
        raise RuntimeError(f"{IMAGE} has {len(info.layers)} layers; the peers need it as one directory")
    return state_dir / "images" / "mnt" / info.layers[0].digest


# ---- peers -----------------------------------------------------------------------------------------


def quiet(argv: list[str], err: Path, timeout: float = 120) -> int:
    # Never pipes: a container inherits them and can outlive crun, so reading one to EOF can hang.
    with err.open("wb") as err_file:
        return subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_file, timeout=timeout
        ).returncode


def timed_runs(
    console: Console, label: str, count: int, argv_for: Callable[[int], list[str]], err: Path
) -> list[float]:
    times: list[float] = []
    with phase(console, label, count) as tick:
        for i in range(WARMUP + count):
            argv = argv_for(i)
            t0 = time.perf_counter()
            status = quiet(argv, err)
            elapsed = time.perf_counter() - t0
            if status != 0:
                raise RuntimeError(f"{shlex.join(argv)} exited {status}: {tail(err)}")
            if i >= WARMUP:
                times.append(elapsed)
                tick()
    return times


def timed_burst(console: Console, label: str, count: int, argv_for: Callable[[int], list[str]], tmp: Path) -> Json:
    """``count`` starts at once (BURST_CONCURRENCY in flight, as for dsec): creations/s and successes."""
    from concurrent.futures import ThreadPoolExecutor

    with phase(console, label, count) as tick:

        def one(i: int) -> int:
            status = quiet(argv_for(i), tmp / f"burst-{i}.err")  # one file each: they run at once
            tick()
            return status

        started = time.perf_counter()
        with ThreadPoolExecutor(BURST_CONCURRENCY) as pool:
            statuses = list(pool.map(one, range(count)))
        wall = time.perf_counter() - started
    ok = sum(1 for s in statuses if s == 0)
    return {
        "size": count,
        "concurrency": BURST_CONCURRENCY,
        "wall_s": round(wall, 3),
        "succeeded": ok,
        "creations_per_s": round(count / wall, 2),
    }


def first_line(argv: list[str]) -> str:
    out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30).stdout
    return next(iter(out.strip().splitlines()), "")


def make_bundle(crun: str, bundle: Path, rootfs: Path, args: list[str]) -> Path:
    bundle.mkdir(parents=True)
    subprocess.run([crun, "spec"], cwd=bundle, check=True, stdin=subprocess.DEVNULL, timeout=30)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"] |= {"terminal": False, "args": args}
    cfg["root"] = {"path": str(rootfs), "readonly": True}
    (bundle / "config.json").write_text(json.dumps(cfg))
    return bundle


def bench_crun(console: Console, n: int, burst: int, rootfs: Path) -> Json:
    crun = shutil.which("crun")
    if crun is None:
        return {"error": "crun is not on PATH"}
    with tempfile.TemporaryDirectory(prefix="dsec-bench-crun-") as tmp:
        err, base = Path(tmp) / "stderr.log", [crun, "--root", f"{tmp}/state"]
        run_bundle = make_bundle(crun, Path(tmp) / "run", rootfs, ["/bin/true"])
        long_bundle = make_bundle(crun, Path(tmp) / "long", rootfs, ["/bin/sleep", "100000"])
        try:
            run_argv = [*base, "run", "--bundle", str(run_bundle)]
            runs = timed_runs(console, "crun run true", n, lambda i: [*run_argv, f"dsec-bench-{i}"], err)
            if quiet([*base, "run", "--detach", "--bundle", str(long_bundle), "dsec-bench-long"], err):
                raise RuntimeError(f"crun run --detach failed: {tail(err)}")
            exec_argv = [*base, "exec", "dsec-bench-long", "/bin/true"]
            execs = timed_runs(console, "crun exec true", n, lambda _: exec_argv, err)
            detach_argv = [*base, "run", "--detach", "--bundle", str(long_bundle)]
            bursts = timed_burst(console, "crun burst", burst, lambda i: [*detach_argv, f"dsec-burst-{i}"], Path(tmp))
        finally:
            # Everything under the private --root is ours, including what a failed run left behind.
            listing = subprocess.run([*base, "list", "-q"], capture_output=True, text=True, timeout=30)
            for cid in listing.stdout.split():
                quiet([*base, "delete", "--force", cid], err)
    version = first_line([crun, "--version"])
    return {"version": version, "run": summarize(runs), "exec": summarize(execs), "burst": bursts}


def ensure_podman(console: Console) -> str:
    if found := shutil.which("podman"):
        return found
    console.print("podman is not on PATH: installing it with `apt-get install -y -q podman`")
    with tempfile.TemporaryDirectory(prefix="dsec-bench-apt-") as tmp:
        log = Path(tmp) / "apt.log"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        with log.open("wb") as out:
            # A file, not a pipe: a service that a postinst script starts could hold a pipe open.
            cmd = ["apt-get", "install", "-y", "-q", "podman"]
            status = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, timeout=1200)
        if status.returncode != 0:
            raise RuntimeError(f"apt-get install podman failed: {tail(log)}")
    if found := shutil.which("podman"):
        return found
    raise RuntimeError("podman is still not on PATH after installing it")


def bench_podman(console: Console, n: int, burst: int, rootfs: Path) -> Json:
    base, count = [ensure_podman(console), *PODMAN_FLAGS], min(n, PODMAN_MAX)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-podman-") as tmp:
        err = Path(tmp) / "stderr.log"
        if quiet([*base, "image", "exists", PODMAN_IMAGE], err) != 0:
            console.print(f"importing {rootfs} into podman as {PODMAN_IMAGE}")
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            with err.open("wb") as out:
                imp = subprocess.Popen([*base, "import", "-", PODMAN_IMAGE], stdin=tar.stdout, stdout=out, stderr=out)
            assert tar.stdout is not None
            tar.stdout.close()  # our copy of the read end would keep tar blocked if the import died
            if imp.wait(timeout=300) != 0 or tar.wait(timeout=60) != 0:
                raise RuntimeError(f"podman import failed: {tail(err)}")
        label = "=".join(LABEL)
        run_argv = [*base, "run", "--rm", *PODMAN_RUN_FLAGS, "--label", label, PODMAN_IMAGE, "/bin/true"]
        try:
            runs = timed_runs(console, "podman run --rm true", count, lambda _: run_argv, err)
            # podman's burst is capped like its runs: each start costs hundreds of ms here
            detach = [*base, "run", "-d", *PODMAN_RUN_FLAGS, "--label", label, PODMAN_IMAGE, "/bin/sleep", "100000"]
            bursts = timed_burst(console, "podman burst", min(burst, PODMAN_MAX), lambda _: detach, Path(tmp))
        finally:
            # --rm removes a container only when podman gets that far; the label finds the others.
            ps = [*base, "ps", "-aq", "--filter", f"label={label}"]
            if left := subprocess.run(ps, capture_output=True, text=True, timeout=60).stdout.split():
                quiet([*base, "rm", "-f", *left], err)
    version = first_line([*base, "--version"])
    return {"version": version, "argv": shlex.join(run_argv), "count": count, "run": summarize(runs), "burst": bursts}


# ---- report ----------------------------------------------------------------------------------------


def _p50(system: Json, key: str) -> float | None:
    stats = system.get(key)
    return float(stats["p50_ms"]) if isinstance(stats, dict) else None


def _rate(system: Json) -> float | None:
    b = system.get("burst")
    return float(b["creations_per_s"]) if isinstance(b, dict) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _check(text: str, value: float | None, ok: Callable[[float], bool]) -> Json:
    # met is None where a peer was skipped or failed: unknown, which is not the same as missed.
    return {"target": text, "value": value, "met": None if value is None else ok(value)}


def judge(dsec: Json, crun: Json, podman: Json) -> tuple[Json, Json]:
    """Whole cycle against whole cycle: ``crun run`` and ``podman run --rm`` delete their container when
    it exits, so dsec's figure for them is create → exec → kill, not create → first exec."""
    cycle, exec_rtt = _p50(dsec, "create_exec_kill"), _p50(dsec, "exec_round_trip")
    warm_first = _p50(dsec.get("warm_pool") or {}, "create_to_first_exec")
    vs_crun = _ratio(cycle, _p50(crun, "run"))
    vs_podman = _ratio(_p50(podman, "run"), cycle)
    ratios = {
        "dsec_create_exec_kill_p50_over_crun_run_p50": vs_crun,
        "podman_run_rm_p50_over_dsec_create_exec_kill_p50": vs_podman,
        "dsec_create_first_exec_p50_over_crun_run_p50": _ratio(_p50(dsec, "create_to_first_exec"), _p50(crun, "run")),
        "dsec_exec_p50_over_crun_exec_p50": _ratio(exec_rtt, _p50(crun, "exec")),
        "dsec_warm_create_exec_kill_p50_over_crun_run_p50": _ratio(
            _p50(dsec.get("warm_pool") or {}, "create_exec_kill"), _p50(crun, "run")
        ),
        "dsec_burst_rate_over_crun_burst_rate": _ratio(dsec["burst"]["creations_per_s"], _rate(crun)),
        "dsec_burst_rate_over_podman_burst_rate": _ratio(dsec["burst"]["creations_per_s"], _rate(podman)),
    }
    rate, burst_ok = dsec["burst"]["creations_per_s"], dsec["burst"]["succeeded"] == dsec["burst"]["size"]
    targets = {
        "create_exec_kill_p50_le_1_5x_crun_run": _check(
            "dsec create → exec → kill p50 ≤ 1.5 × bare crun run p50 (both whole cycles)", vs_crun, lambda v: v <= 1.5
        ),
        "podman_run_rm_ge_10x_dsec_create_exec_kill": _check(
            "podman run --rm p50 ≥ 10 × dsec create → exec → kill p50", vs_podman, lambda v: v >= 10.0
        ),
        "exec_round_trip_p50_le_5ms": _check("dsec exec round trip p50 ≤ 5 ms", exec_rtt, lambda v: v <= 5.0),
        "warm_create_to_first_exec_p50_le_5ms": _check(
            "from a warm pool: dsec create → first exec p50 ≤ 5 ms", warm_first, lambda v: v <= 5.0
        ),
        "burst_ge_100_per_s_all_ok": _check(
            "burst ≥ 100 creations/s with 100% success", rate, lambda v: v >= 100.0 and burst_ok
        ),
    }
    return ratios, targets


def print_summary(console: Console, result: Json) -> None:
    table = Table(title="dsec lifecycle bench (ms)")
    for col in ("system", "measurement", "n", "p50", "p99", "mean"):
        table.add_column(col, justify="left" if col in ("system", "measurement") else "right")
    # In pairs that do like work: podman's --rm removes the container, as dsec's kill does.
    rows = [("dsec", "create → exec true", "create_to_first_exec"), ("crun", "run true", "run")]
    rows += [("dsec", "create → exec → kill", "create_exec_kill"), ("podman", "run --rm true", "run")]
    rows += [("dsec", "exec round trip", "exec_round_trip"), ("crun", "exec true", "exec")]
    rows += [
        ("warm", "create → exec true", "create_to_first_exec"),
        ("warm", "create → exec → kill", "create_exec_kill"),
    ]
    for i, (system, what, key) in enumerate(rows):
        s = result["systems"]["dsec"].get("warm_pool") or {} if system == "warm" else result["systems"][system]
        if isinstance(stats := s.get(key), dict):
            cells = (f"{stats[k]:.1f}" for k in ("p50_ms", "p99_ms", "mean_ms"))
            table.add_row(system, what, str(stats["n"]), *cells, end_section=i % 2 == 1)
        else:
            why = str(s.get("error") or "skipped")[:60]
            table.add_row(system, what, "-", "-", "-", why, end_section=i % 2 == 1)
    console.print(table)
    for system in ("dsec", "crun", "podman"):
        b = result["systems"][system].get("burst")
        if isinstance(b, dict):
            console.print(
                f"{system} burst: {b['succeeded']}/{b['size']} started in {b['wall_s']:.2f}s"
                f" = {b['creations_per_s']:.1f}/s"
            )
    marks = {True: "[green]met[/green]", False: "[red]missed[/red]", None: "[yellow]n/a[/yellow]"}
    for t in result["targets"].values():
        console.print(f"{marks[t['met']]}  {t['target']}  (value: {t['value']})")


def main(n: int, burst: int, json_out: Path, state_dir: Path, skip_podman: bool) -> int:
    console = Console()
    when = datetime.now(UTC).isoformat(timespec="seconds")
    state_dir = state_dir.resolve()
    unwind_on_sigterm()
    proc = start_daemon(state_dir)
    try:

        async def dsec_phase() -> tuple[Json, Path]:
            client = await connect(proc, state_dir)
            try:
                return await bench_dsec(console, client, n, burst), await image_rootfs(client, state_dir)
            finally:
                await client.aclose()

        dsec, rootfs = asyncio.run(dsec_phase())
        # The peers run while the daemon is up: it mounts the v1 hugetlb hierarchy crun needs here.
        peers: dict[str, Json] = {"podman": {"skipped": True}}
        for name, bench in (("crun", bench_crun), ("podman", bench_podman)):
            if name == "podman" and skip_podman:
                continue
            try:
                peers[name] = bench(console, n, burst, rootfs)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                console.print(f"[red]{name} failed[/red]: {e}")
                peers[name] = {"error": str(e)}
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]bench failed[/red]: {e}")
        return 1
    finally:
        stop_daemon(proc)
        release_node(state_dir)

    ratios, targets = judge(dsec, peers["crun"], peers["podman"])
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    params = {"n": n, "burst": burst, "burst_concurrency": BURST_CONCURRENCY, "warmup": WARMUP}
    result: Json = {
        "bench": "lifecycle",
        "when": when,
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "memory_bytes": memory},
        "params": params | {"image": IMAGE, "rootfs": str(rootfs), "skip_podman": skip_podman},
        "systems": {"dsec": dsec, "crun": peers["crun"], "podman": peers["podman"]},
        "ratios": ratios,
        "targets": targets,
    }
    json_out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print_summary(console, result)
    console.print(f"wrote {json_out}")
    return 0
