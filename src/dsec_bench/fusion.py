"""SandboxFusion bench: `print(1)` in Python through dsec's SandboxFusion API, called with the unmodified
``sandbox-fusion`` client as verl calls it, side by side in the same run with a fresh container per call
on the same image: ``podman run --rm`` and a bare ``crun run``. Whole cycle against whole cycle: a call
is the client's request until its answer (a warm function worker lent, the code written to a file and
run, the worker given back), a peer's is its command until it exits. Every system starts the same Python
interpreter afresh per call, from the image dsec/code:1; no pre-started interpreter anywhere.

Latency: one call at a time. Throughput: calls/s with 1, 8 and 32 calls in flight (threads, as verl's
reward workers make them), over a fixed number of calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dsec import AsyncClient, DsecError

from .common import Json, host_facts, phase, private_daemon, repository_flags, summarize, tail, unwind_on_sigterm
from .function import cpu_now, rate_entry, ratio
from .gateway import free_port
from .lifecycle import PODMAN_FLAGS, PODMAN_RUN_FLAGS, ensure_podman, first_line, make_bundle

IMAGE = "dsec/code:1"
CODE = "print(1)"
EXPECTED = "1\n"
PODMAN_REPO = "localhost/dsec-bench-code"  # tagged with the dsec image's digest: a rebuilt image is imported anew
LABELS = {"dsec.fusion": "1"}  # what the SandboxFusion API labels every call's sandbox with
SYSTEMS = ("fusion", "podman", "crun")
LABELS_OF = {"fusion": "SandboxFusion API", "podman": "podman run --rm", "crun": "crun run (fresh)"}
PODMAN_LABEL = "dsec-bench=fusion"
CONCURRENCY = (1, 8, 32)
WARMUP = 5  # untimed calls first: the pool makes its workers, page caches fill
# podman costs hundreds of ms a call: more samples add minutes, not precision (crun gets as many as dsec)
PODMAN_N = 30
PODMAN_MIN_CALLS = 32  # podman's throughput: max(this, 2 × concurrency) calls, at most --calls


def samples(system: str, n: int, calls: int, concurrency: int) -> tuple[int, int]:
    """(sequential calls, calls at ``concurrency``) a system is measured with."""
    if system == "podman":
        return min(n, PODMAN_N), min(calls, max(PODMAN_MIN_CALLS, 2 * concurrency))
    return n, calls


CALL_TIMEOUT = 120.0
STOP_TIMEOUT = 120.0  # the daemon destroys its idle workers one by one as it stops

Call = Callable[[], str | None]  # one call: None, or why it failed


def fusion_call(url: str) -> Call:
    import sandbox_fusion as sf

    request = sf.RunCodeRequest(code=CODE, language="python")

    def call() -> str | None:
        try:
            res = sf.run_code(request, endpoint=url, max_attempts=1, client_timeout=CALL_TIMEOUT)
        except Exception as e:  # the client raises bare Exceptions (HTTP errors, SandboxError)
            return f"{type(e).__name__}: {str(e)[:120]}"
        if res.status != sf.RunStatus.Success or res.run_result is None:
            return f"status {res.status.value}"
        return None if res.run_result.stdout == EXPECTED else "unexpected output"

    return call


def command_call(argv_for: Callable[[], list[str]], scratch: Path) -> Call:
    """A peer's call: its command, stdout to a file of its own (never a pipe: a container can outlive
    its runtime and hold one open), checked for the expected output."""

    def call() -> str | None:
        out = scratch / f"{uuid.uuid4().hex}.out"
        try:
            with out.open("wb") as f:
                argv = argv_for()
                done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, timeout=CALL_TIMEOUT)
            text = out.read_text(errors="replace")
        except (OSError, subprocess.TimeoutExpired) as e:
            return type(e).__name__
        finally:
            out.unlink(missing_ok=True)
        if done.returncode != 0:
            return f"exit {done.returncode}: {text[-120:]}"
        return None if text == EXPECTED else "unexpected output"

    return call


# ---- measurements ------------------------------------------------------------------------------------


def latencies(console: Console, systems: dict[str, Call], n: int, calls: int) -> Json:
    """Sequential calls, one of each system in turn (the order rotating), so that every system meets the
    same load on a machine that others share; a system whose call fails is dropped with why."""
    out: Json = {}
    alive = dict(systems)
    for name, call in systems.items():
        for _ in range(WARMUP):
            if (why := call()) is not None:
                out[name] = {"error": f"a warm-up call failed: {why}"}
                alive.pop(name, None)
                break
    counts = {name: samples(name, n, calls, 1)[0] for name in alive}
    times: dict[str, list[float]] = {name: [] for name in alive}
    with phase(console, f"print(1), one call at a time, in turn: {', '.join(alive)}", sum(counts.values())) as tick:
        for i in range(max(counts.values(), default=0)):
            names = list(alive)
            for name in names[i % len(names) :] + names[: i % len(names)]:
                if name not in alive or len(times[name]) >= counts[name]:
                    continue
                t0 = time.perf_counter()
                why = alive[name]()
                elapsed = time.perf_counter() - t0
                if why is not None:
                    out[name] = {"error": f"a call failed: {why}"}
                    del alive[name]
                    continue
                times[name].append(elapsed)
                tick()
    return out | {name: summarize(times[name]) for name in alive}


def sustained(console: Console, label: str, call: Call, calls: int, concurrency: int, pids: dict[str, int]) -> Json:
    """``calls`` calls, ``concurrency`` threads making them; an untimed round of the same load first
    (the function pool grows to the concurrency)."""
    failures: Counter[str] = Counter()

    def one(tick: Callable[[], None]) -> None:
        if (why := call()) is not None:
            failures[why.split(":")[0]] += 1
        tick()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda _: one(lambda: None), range(min(calls, max(concurrency, WARMUP)))))
        failures.clear()
        with phase(console, f"{label}, {concurrency} in flight", calls) as tick:
            started, cpu = time.perf_counter(), cpu_now(pids)
            list(pool.map(lambda _: one(tick), range(calls)))
            wall = time.perf_counter() - started
    used = {name: s - cpu[name] for name, s in cpu_now(pids).items()}
    return rate_entry(concurrency, calls, failures, wall, "threads", used)


def guarded(concurrency: int | None, measure: Callable[[], Json]) -> Json:
    """A failed system is a result of the run (an error in its place), not the end of the bench."""
    try:
        return measure()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return {"error": f"{type(e).__name__}: {e}"} | ({"concurrency": concurrency} if concurrency else {})


# ---- the image, for dsec and for the peers ---------------------------------------------------------------


async def ensure_image(console: Console, client: AsyncClient) -> None:
    """The built-in image, built by its Dockerfile on first use (minutes, once per layer repository)."""
    console.print(f"ensuring {IMAGE} is built")
    info = await client.build_image(IMAGE)
    if not info.ready:
        raise RuntimeError(f"{IMAGE} is not ready after its build")


@contextlib.contextmanager
def merged_rootfs(layers: list[Path], where: Path) -> Iterator[Path]:
    """The image's layers (mounted by the daemon, lowest first) as one read-only overlay: the very files
    dsec's sandboxes start from, for the peers."""
    for layer in layers:
        if not os.path.ismount(layer):
            raise RuntimeError(f"layer {layer} is not mounted by the bench's daemon")
    target = where / "rootfs"
    target.mkdir()
    lower = ":".join(str(p) for p in reversed(layers))
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower}", str(target)], check=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def podman_image(console: Console, base: list[str], rootfs: Path, tag: str, scratch: Path) -> str:
    name = f"{PODMAN_REPO}:{tag}"
    err = scratch / "podman-import.err"
    if subprocess.run([*base, "image", "exists", name], stdin=subprocess.DEVNULL).returncode == 0:
        return name
    console.print(f"importing {IMAGE} into podman as {name} (once per version of the image)")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    with err.open("wb") as out:
        imp = subprocess.Popen([*base, "import", "-", name], stdin=tar.stdout, stdout=out, stderr=out)
    assert tar.stdout is not None
    tar.stdout.close()  # our copy of the read end would keep tar blocked if the import died
    if imp.wait(timeout=1800) != 0 or tar.wait(timeout=60) != 0:
        raise RuntimeError(f"podman import failed: {tail(err)}")
    return name


# ---- the systems -------------------------------------------------------------------------------------


def throughputs(console: Console, systems: dict[str, Call], n: int, calls: int, pids: dict[str, int]) -> Json:
    """Each concurrency in turn, every system at it before the next: the systems compared at a level are
    measured minutes apart at most."""
    out: Json = {name: [] for name in systems}
    for c in CONCURRENCY:
        for name, call in systems.items():
            total = samples(name, n, calls, c)[1]
            out[name].append(guarded(c, partial(sustained, console, LABELS_OF[name], call, total, c, pids)))
    return out


@contextlib.contextmanager
def peer_calls(
    console: Console, rootfs: Path, tag: str, python: str, scratch: Path, skip: set[str]
) -> Iterator[tuple[dict[str, Call], Json]]:
    """The peers' calls on the image's files, and their versions; what they leave is removed after."""
    calls: dict[str, Call] = {}
    versions: Json = {}
    crun = shutil.which("crun") if "crun" not in skip else None
    crun_base = [crun or "crun", "--root", str(scratch / "crun-state")]
    if crun is not None:
        bundle = make_bundle(crun, scratch / "bundle", rootfs, [python, "-c", CODE])
        run = [*crun_base, "run", "--bundle", str(bundle)]
        calls["crun"] = command_call(lambda: [*run, f"dsec-bench-fusion-{uuid.uuid4().hex[:12]}"], scratch)
        versions["crun"] = first_line([crun, "--version"])
    podman_base: list[str] = []
    if "podman" not in skip:
        podman_base = [ensure_podman(console), *PODMAN_FLAGS]
        image = podman_image(console, podman_base, rootfs, tag, scratch)
        argv = [*podman_base, "run", "--rm", *PODMAN_RUN_FLAGS, "--label", PODMAN_LABEL, image, python, "-c", CODE]
        calls["podman"] = command_call(lambda: argv, scratch)
        versions["podman"] = first_line([*podman_base, "--version"]) + f" ({shlex.join(argv)})"
    try:
        yield calls, versions
    finally:
        if crun is not None:  # everything under the private --root is ours, what a failed run left included
            listing = subprocess.run([*crun_base, "list", "-q"], capture_output=True, text=True, timeout=60)
            for cid in listing.stdout.split():
                subprocess.run([*crun_base, "delete", "--force", cid], capture_output=True, timeout=60)
        if podman_base:  # --rm removes a container only when podman gets that far; the label finds the rest
            ps = [*podman_base, "ps", "-aq", "--filter", f"label={PODMAN_LABEL}"]
            if left := subprocess.run(ps, capture_output=True, text=True, timeout=60).stdout.split():
                subprocess.run([*podman_base, "rm", "-f", *left], capture_output=True, timeout=120)


# ---- the run -----------------------------------------------------------------------------------------


async def interpreter(url: str) -> tuple[str, str]:
    """The interpreter a SandboxFusion python call runs (its path and version): the peers run this one."""
    import sandbox_fusion as sf

    request = sf.RunCodeRequest(
        code="import sys\nprint(sys.executable)\nprint(sys.version.split()[0])", language="python"
    )
    res = await asyncio.to_thread(sf.run_code, request, endpoint=url, max_attempts=1, client_timeout=CALL_TIMEOUT)
    lines = (res.run_result.stdout or "").split() if res.run_result is not None else []
    if res.status != sf.RunStatus.Success or len(lines) != 2:
        raise RuntimeError(f"the first SandboxFusion call failed: {res.status.value} {res.message[:300]}")
    return lines[0], lines[1]


async def measure(
    console: Console, n: int, calls: int, state_dir: Path, repository: Path | None, skip: set[str]
) -> Json:
    url = f"http://127.0.0.1:{free_port()}"
    flags = ["--sandbox-fusion-listen", url, *repository_flags(repository)]
    async with private_daemon(console, state_dir, flags, LABELS, STOP_TIMEOUT) as (proc, client):
        version = (await client.health()).version
        await ensure_image(console, client)
        python, py_version = await interpreter(url)
        pids = {"daemon": proc.pid, "bench": os.getpid()}
        # the daemon's own mounts of the image's layers (its function workers hold them)
        info = await client.image(IMAGE)
        layers = [state_dir / "images" / "mnt" / layer.digest for layer in info.layers]
        tag = (info.digest or "latest").removeprefix("blake3:")[:16]
        with (
            tempfile.TemporaryDirectory(prefix="dsec-bench-fusion-") as tmp,
            merged_rootfs(layers, Path(tmp)) as root,
            peer_calls(console, root, tag, python, Path(tmp), skip) as (peers, versions),
        ):
            systems = {"fusion": fusion_call(url), **peers}
            lat = await asyncio.to_thread(latencies, console, systems, n, calls)
            tp = await asyncio.to_thread(throughputs, console, systems, n, calls, pids)
        pools = [p.model_dump() for p in await client.pools()]
    versions |= {"daemon": version, "python": f"{python} {py_version}", "sandbox_fusion": client_version()}
    return {"latency": lat, "throughput": tp, "versions": versions, "pools": pools}


def client_version() -> str:
    from importlib.metadata import version

    return f"sandbox-fusion {version('sandbox-fusion')}"


# ---- report ------------------------------------------------------------------------------------------


def rates(entries: Any) -> dict[int, float]:
    """Concurrency -> calls/s of the measurements that ran without a failed call."""
    out: dict[int, float] = {}
    for e in entries if isinstance(entries, list) else []:
        if isinstance(e, dict) and e.get("calls_per_s") is not None and not e.get("failures"):
            out[int(e["concurrency"])] = float(e["calls_per_s"])
    return out


def p50(lat: Json, system: str) -> float | None:
    stats = lat.get(system)
    return float(stats["p50_ms"]) if isinstance(stats, dict) and "p50_ms" in stats else None


def compare(lat: Json, tp: Json) -> Json:
    """dsec against each peer: calls/s at each concurrency and at the best of each, p50 latency."""
    fusion = rates(tp.get("fusion"))
    out: Json = {}
    for peer in SYSTEMS[1:]:
        if peer not in tp:
            continue
        theirs = rates(tp[peer])
        out[peer] = {
            "fusion_over_peer_calls_per_s": {str(c): ratio(fusion.get(c), theirs.get(c)) for c in CONCURRENCY},
            "best_fusion_over_best_peer_calls_per_s": ratio(
                max(fusion.values(), default=None), max(theirs.values(), default=None)
            ),
            "peer_p50_over_fusion_p50": ratio(p50(lat, peer), p50(lat, "fusion")),
        }
    return out


def failed(lat: Json, tp: Json) -> int:
    """Failed calls and failed measurements: any makes the figures suspect, and the exit status 1."""
    errors = sum("error" in s for s in lat.values())
    entries = [e for es in tp.values() for e in es]
    return errors + sum(int(sum(e.get("failures", {}).values())) + ("error" in e) for e in entries)


def print_summary(console: Console, result: Json) -> None:
    table = Table(title="print(1) in Python, one call at a time (ms)")
    for col in ("system", "n", "p50", "p99", "mean"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for system, s in result["latency"].items():
        if "p50_ms" in s:
            table.add_row(system, str(s["n"]), *(f"{s[f'{k}_ms']:.1f}" for k in ("p50", "p99", "mean")))
        else:
            table.add_row(system, "-", "-", "-", str(s.get("error"))[:60])
    console.print(table)
    table = Table(title="calls/s (calls)")
    table.add_column("system")
    for c in CONCURRENCY:
        table.add_column(f"c={c}", justify="right")
    for system, entries in result["throughput"].items():
        cells = []
        for e in entries:
            bad = sum(e.get("failures", {}).values())
            cell = "error" if "error" in e else f"{e['calls_per_s']:.1f} ({e['calls']})"
            cells.append(cell + (f" [red]{bad} failed[/red]" if bad else ""))
        table.add_row(system, *cells)
    console.print(table)
    for peer, r in result["comparison"].items():
        best, lower = r["best_fusion_over_best_peer_calls_per_s"], r["peer_p50_over_fusion_p50"]
        console.print(f"against {peer}: x{best} the calls/s (best of each), a p50 x{lower} lower")


def main(
    n: int, calls: int, json_out: Path, state_dir: Path, repository: Path | None = None, skip: set[str] | None = None
) -> int:
    console = Console()
    when = datetime.now(UTC).isoformat(timespec="seconds")
    state_dir = state_dir.resolve()
    unwind_on_sigterm()
    load_before = os.getloadavg()
    try:
        figures = asyncio.run(measure(console, n, calls, state_dir, repository, skip or set()))
    except (DsecError, OSError, RuntimeError, subprocess.SubprocessError) as e:
        console.print(f"[red]bench failed[/red]: {e}")
        return 1
    result: Json = {
        "bench": "fusion",
        "when": when,
        "host": host_facts() | {"nproc": len(os.sched_getaffinity(0)), "loadavg": [load_before, os.getloadavg()]},
        "params": {
            "n": n,
            "calls": calls,
            "podman_n": samples("podman", n, calls, 1)[0],
            "podman_calls": {str(c): samples("podman", n, calls, c)[1] for c in CONCURRENCY},
            "concurrency": list(CONCURRENCY),
            "warmup": WARMUP,
            "repository": str(repository or ""),
            "image": IMAGE,
            "code": CODE,
        },
        "systems": {
            "fusion": "sandbox_fusion.run_code(RunCodeRequest(code='print(1)', language='python')) against dsec serve "
            "--sandbox-fusion-listen: a warm function worker of dsec/code:1 lent, the code written to main.py and "
            "run by python3, the worker given back (reset after the answer); a new HTTP connection per call",
            "podman": f"podman run --rm --network=none {PODMAN_REPO}:DIGEST PYTHON -c 'print(1)': the same "
            "image's files imported into podman",
            "crun": "crun run of a fresh container per call (its own name) from the image's layers as one "
            "read-only overlay: PYTHON -c 'print(1)'; no image storage, network setup or conmon (a lower bound of "
            "a fresh container)",
        },
        "cpu_ms_per_call": "CPU of the daemon, and of the bench with the children it reaped, per call: a peer's "
        "includes its runtime and the interpreter (crun and podman wait for it), the SandboxFusion API's does not "
        "include the interpreter (the worker's agent runs it, a child of neither): not comparable across systems",
        "versions": figures["versions"],
        "latency": figures["latency"],
        "throughput": figures["throughput"],
        "comparison": compare(figures["latency"], figures["throughput"]),
        "pools": figures["pools"],
    }
    json_out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print_summary(console, result)
    console.print(f"wrote {json_out}")
    return 1 if failed(figures["latency"], figures["throughput"]) else 0
