"""Checkpoint bench: checkpoint, rollback and fork(8) of a sandbox against what a user has without them,
snapshot → new image → create.

For each kind and diff size (a few KiB in a few files; ``big_mb`` MB of random bytes in a few files),
on a sandbox whose writable layer holds that diff, each round times whole SDK calls as a user sees them,
ours and the alternative alternately:

- save the state: ``checkpoint()`` (removed again, untimed) against ``snapshot(name)`` (image removed),
  the diff's files written anew before each round (untimed);
- back to it: with a checkpoint taken once, change files, then ``rollback(c)`` → an exec `true` answered,
  against killing a sandbox made from a snapshot (taken once) and creating a new one from it → `true`;
- eight copies: ``fork(8, checkpoint=c)`` → all eight answered `true` (concurrently), against eight
  concurrent creations from the snapshot → all eight answered; for containers also the same fork served
  by a warm pool of the parent's image (checkpoint_pool.py). Copies are killed untimed.

The save rounds come first: after a rollback the sandbox's files live in checkpoint layers and its
writable layer is empty, so a checkpoint taken then would not pack the diff. A kind whose sandboxes
cannot take checkpoints is recorded with the error it answered, not measured.

Snapshots publish into a repository of the bench's own, seeded from ``--repository`` by hard links,
and garbage-collected at the end: nothing is written to the repository others use.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dsec import AsyncClient, AsyncSandbox, DsecError, InvalidRequest
from dsec.protocol.checkpoints import CheckpointInfo

from . import plots
from .checkpoint_pool import pooled_fork, warm_pool
from .common import IMAGES_DIR, Json, host_facts, phase, private_daemon, summarize, unwind_on_sigterm, write_json
from .seed import seed_repository

IMAGE = "dsec/busybox"
LABELS = {"dsec-bench": "checkpoint"}  # every sandbox of the bench (fork copies inherit it): finds leftovers
KINDS = ("container", "function", "microvm", "vm")
SIZES = ("small", "big")
FORK_N = 8
WARMUP = 1  # untimed first round of each size: cold layer mounts, the first pack
FILES = 4  # the diff's files, small or big
SMALL_FILE_BYTES = 2048
TTL = 3600.0  # a safety net only: the bench kills what it makes
STOP_TIMEOUT = 60.0
DIR = "/bench"  # not /tmp: a snapshot scrubs that
MEASURES = (
    "checkpoint",
    "snapshot",
    "rollback_call",
    "rollback_first_exec",
    "recreate_first_exec",
    "fork8_call",
    "fork8_all_answered",
    "create8_all_answered",
    "fork8_pooled_all_answered",
)
# what a user does, ours against the alternative: (ours, alternative) measures
OPS = {
    "save the state": ("checkpoint", "snapshot"),
    "back to it → first exec": ("rollback_first_exec", "recreate_first_exec"),
    "8 copies → all answered": ("fork8_all_answered", "create8_all_answered"),
    "8 copies from a warm pool → all answered": ("fork8_pooled_all_answered", "create8_all_answered"),
}
RATIOS = {  # alternative p50 / ours p50
    "snapshot_over_checkpoint": ("snapshot", "checkpoint"),
    "recreate_over_rollback": ("recreate_first_exec", "rollback_first_exec"),
    "create8_over_fork8": ("create8_all_answered", "fork8_all_answered"),
    "create8_over_fork8_pooled": ("create8_all_answered", "fork8_pooled_all_answered"),
}
ROLLBACK_MS, FORK_MS, FASTER = 50.0, 500.0, 5.0  # the targets, for containers


@dataclass(frozen=True)
class Diff:
    name: str
    sizes: tuple[int, ...]  # bytes of each file

    @classmethod
    def of(cls, name: str, total: int) -> Diff:
        """``total`` bytes spread over FILES files (the first ones take the remainder)."""
        each, extra = divmod(total, FILES)
        return cls(name, tuple(each + (i < extra) for i in range(FILES)))

    def script(self) -> str:
        """Writes the diff: random bytes, so that no packing shrinks it."""
        writes = [f"head -c {n} /dev/urandom > {DIR}/f-{i + 1}" for i, n in enumerate(self.sizes)]
        return " && ".join([f"mkdir -p {DIR}", *writes])

    def facts(self) -> Json:
        return {"files": len(self.sizes), "bytes": sum(self.sizes), "path": DIR}


def diffs(big_mb: int) -> list[Diff]:
    return [Diff.of("small", FILES * SMALL_FILE_BYTES), Diff.of("big", big_mb << 20)]


def change(i: int) -> str:
    """What a round does to the files before it goes back: adds, removes and changes some."""
    return f"echo {i} > {DIR}/marker && rm {DIR}/f-1 && echo x >> {DIR}/f-{FILES} && touch {DIR}/new-{i}"


RESTORED = f"[ ! -e {DIR}/marker ] && [ -e {DIR}/f-1 ]"


def disk_for(big_mb: int) -> str:
    """A sandbox's disk limit: its writable layer and the checkpoints it holds (the base one and the one
    a round takes) count against it."""
    return f"{max(1024, 4 * big_mb + 256)}Mi"


def error_body(e: BaseException, stage: str) -> Json:
    if isinstance(e, DsecError):
        return {"code": e.code, "message": e.message, "stage": stage}
    return {"code": type(e).__name__, "message": str(e), "stage": stage}


# ---- figures ---------------------------------------------------------------------------------------


def figures(samples: dict[str, list[float]]) -> tuple[Json, Json, Json]:
    """Per measure (seconds in): its statistics, its samples in ms (for re-plotting), and the ratios."""
    measurements = {m: summarize(v) for m, v in samples.items() if v}
    raw = {m: [round(s * 1000, 3) for s in v] for m, v in samples.items() if v}
    return measurements, raw, ratios(measurements)


def ratios(measurements: Json) -> Json:
    out: Json = {}
    for name, (alt, ours) in RATIOS.items():
        a, o = measurements.get(alt), measurements.get(ours)
        out[name] = round(a["p50_ms"] / o["p50_ms"], 2) if a and o and o["p50_ms"] > 0 else None
    return out


def _p50(kinds: Json, size: str, measure: str) -> float | None:
    stats = kinds.get("container", {}).get(size, {}).get("measurements", {}).get(measure)
    return float(stats["p50_ms"]) if stats else None


def _ratio(kinds: Json, size: str, name: str) -> float | None:
    value = kinds.get("container", {}).get(size, {}).get("ratios", {}).get(name)
    return float(value) if value is not None else None


def _check(text: str, value: float | None, ok: Callable[[float], bool], **more: object) -> Json:
    # met is None where nothing was measured: unknown, which is not the same as missed
    return {"target": text, "value": value, "met": None if value is None else ok(value)} | more


def judge(kinds: Json) -> Json:
    """The issue's targets, for containers: p50s, and ratios of p50s (alternative over ours)."""
    targets = {
        "container_rollback_small_p50_le_50ms": _check(
            f"container rollback of a small diff → first exec answered, p50 ≤ {ROLLBACK_MS:g} ms",
            _p50(kinds, "small", "rollback_first_exec"),
            lambda v: v <= ROLLBACK_MS,
            rollback_call_p50_ms=_p50(kinds, "small", "rollback_call"),
        )
    }
    for size in SIZES:
        targets[f"container_fork8_{size}_p50_le_500ms"] = _check(
            f"container fork(8) of a {size} diff → all 8 answered, p50 ≤ {FORK_MS / 1000:g} s",
            _p50(kinds, size, "fork8_all_answered"),
            lambda v: v <= FORK_MS,
        )
    for size in SIZES:
        targets[f"container_rollback_{size}_ge_5x_recreate"] = _check(
            f"{size} diff: kill + create from a snapshot → first exec p50 ≥ {FASTER:g} × rollback → first exec p50",
            _ratio(kinds, size, "recreate_over_rollback"),
            lambda v: v >= FASTER,
        )
        targets[f"container_fork8_{size}_ge_5x_create8"] = _check(
            f"{size} diff: 8 creations from a snapshot → all answered p50 ≥ {FASTER:g} × fork(8) → all answered p50",
            _ratio(kinds, size, "create8_over_fork8"),
            lambda v: v >= FASTER,
        )
        targets[f"container_fork8_pooled_{size}_ge_5x_create8"] = _check(
            f"{size} diff: 8 creations from a snapshot → all answered p50 ≥ {FASTER:g} × fork(8) from a warm pool",
            _ratio(kinds, size, "create8_over_fork8_pooled"),
            lambda v: v >= FASTER,
        )
    return targets


def failures(kinds: Json) -> list[str]:
    """What failed (a refusal is a result, not a failure)."""
    out = []
    for kind, entry in kinds.items():
        if "error" in entry:
            out.append(f"{kind}: {entry['error']['message']}")
        for size in SIZES:
            if "error" in entry.get(size, {}):
                out.append(f"{kind} {size}: {entry[size]['error']['message']}")
    return out


# ---- measuring ---------------------------------------------------------------------------------------


async def must(sb: AsyncSandbox, cmd: str | list[str], what: str, timeout: float = 60.0) -> None:
    res = await sb.exec(cmd, timeout=timeout)
    if res.exit_code != 0:
        raise RuntimeError(f"{what}: exit {res.exit_code} in {sb.id}: {(res.stderr or res.stdout)[-300:]}")


async def run_true(sb: AsyncSandbox) -> None:
    await must(sb, ["true"], "`true`")


async def kill_all(sandboxes: Iterable[AsyncSandbox]) -> None:
    await asyncio.gather(*(sb.kill() for sb in sandboxes), return_exceptions=True)


@dataclass
class Run:
    """One kind and diff size being measured: its samples so far, and the step under way (an error names it)."""

    client: AsyncClient
    kind: str
    diff: Diff
    rounds: int
    disk: str
    token: str
    samples: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MEASURES})
    stage: str = "create"
    checkpoint_bytes: int | None = None

    def keep(self, i: int, measure: str, seconds: float) -> None:
        if i >= WARMUP:
            self.samples[measure].append(seconds)

    def image(self, i: int | str) -> str:
        return f"dsec-bench/checkpoint-{self.token}-{self.kind}-{self.diff.name}:{i}"

    async def create(self, image: str = IMAGE) -> AsyncSandbox:
        return await self.client.create(
            image=image, kind=self.kind, labels=LABELS, disk=self.disk, timeout=TTL, wait_for_capacity=120.0
        )

    async def timed(self, i: int, measure: str, call: Awaitable[object]) -> float:
        t0 = time.perf_counter()
        await call
        seconds = time.perf_counter() - t0
        self.keep(i, measure, seconds)
        return seconds


async def save_rounds(run: Run, sb: AsyncSandbox, tick: Callable[[], None]) -> None:
    """checkpoint() against snapshot(), on the diff in the writable layer, new bytes each round: a snapshot
    of bytes the repository already holds would publish no chunk, which no user's new state gets."""
    for i in range(WARMUP + run.rounds):
        if i:
            run.stage = "rewrite the diff"
            await must(sb, run.diff.script(), "writing the diff", timeout=600.0)
        run.stage = "checkpoint"
        t0 = time.perf_counter()
        c = await sb.checkpoint()
        run.keep(i, "checkpoint", time.perf_counter() - t0)
        run.checkpoint_bytes = c.size
        await sb.remove_checkpoint(c)  # at most 16 per sandbox
        run.stage = "snapshot"
        await run.timed(i, "snapshot", sb.snapshot(run.image(f"r{i}")))
        await run.client.remove_image(run.image(f"r{i}"))
        if i >= WARMUP:
            tick()


async def rollback_rounds(
    run: Run, sb: AsyncSandbox, base: CheckpointInfo, snap: str, tick: Callable[[], None]
) -> None:
    """rollback() → first exec against kill + create from the snapshot → first exec."""
    alt = await run.create(snap)
    try:
        for i in range(WARMUP + run.rounds):
            run.stage = "rollback"
            await must(sb, change(i), "changing the files")
            t0 = time.perf_counter()
            await sb.rollback(base)
            run.keep(i, "rollback_call", time.perf_counter() - t0)
            await run_true(sb)
            run.keep(i, "rollback_first_exec", time.perf_counter() - t0)
            await must(sb, RESTORED, "the files after the rollback")
            run.stage = "kill + create from the snapshot"
            await must(alt, change(i), "changing the files")
            t0 = time.perf_counter()
            await alt.kill()
            alt = await run.create(snap)
            await run_true(alt)
            run.keep(i, "recreate_first_exec", time.perf_counter() - t0)
            await must(alt, RESTORED, "the files of a sandbox created from the snapshot")
            if i >= WARMUP:
                tick()
    finally:
        await kill_all([alt])


async def fork_once(run: Run, i: int, sb: AsyncSandbox, base: CheckpointInfo) -> None:
    run.stage = "fork"
    t0 = time.perf_counter()
    copies = await sb.fork(FORK_N, checkpoint=base)
    run.keep(i, "fork8_call", time.perf_counter() - t0)
    try:
        if copies.failed:
            index, e = copies.failed[0]
            raise RuntimeError(f"{len(copies.failed)} of {FORK_N} copies failed; copy {index}: {e}")
        await asyncio.gather(*(run_true(c) for c in copies))
        run.keep(i, "fork8_all_answered", time.perf_counter() - t0)
        await must(copies[0], RESTORED, "the files of a copy")
    finally:
        await kill_all(copies)


async def create8_once(run: Run, i: int, snap: str) -> None:
    run.stage = "create 8 from the snapshot"
    t0 = time.perf_counter()
    made = await asyncio.gather(*(run.create(snap) for _ in range(FORK_N)), return_exceptions=True)
    sandboxes = [m for m in made if isinstance(m, AsyncSandbox)]
    try:
        for m in made:
            if isinstance(m, BaseException):
                raise m
        await asyncio.gather(*(run_true(s) for s in sandboxes))
        run.keep(i, "create8_all_answered", time.perf_counter() - t0)
    finally:
        await kill_all(sandboxes)


async def measure_size(console: Console, run: Run) -> Json:
    label = f"{run.kind}, {run.diff.name} diff"
    sb: AsyncSandbox | None = None
    snap = run.image("base")
    error = None
    try:
        sb = await run.create()
        run.stage = "write the diff"
        await must(sb, run.diff.script(), "writing the diff", timeout=600.0)
        with phase(console, f"{label}: checkpoint | snapshot", run.rounds) as tick:
            await save_rounds(run, sb, tick)
        run.stage = "take the base checkpoint and snapshot"
        base = await sb.checkpoint("base")
        await sb.snapshot(snap)
        with phase(console, f"{label}: rollback | kill + create", run.rounds) as tick:
            await rollback_rounds(run, sb, base, snap, tick)
        with phase(console, f"{label}: fork(8) | create 8", run.rounds) as tick:
            for i in range(WARMUP + run.rounds):
                await fork_once(run, i, sb, base)
                await create8_once(run, i, snap)
                if i >= WARMUP:
                    tick()
        # after the others: the pool's refills in the background must not slow what they measure
        async with warm_pool(run.client, IMAGE, run.kind, run.disk, FORK_N) as pooled:
            if pooled:
                with phase(console, f"{label}: fork(8) from a warm pool", run.rounds) as tick:
                    for i in range(WARMUP + run.rounds):
                        run.stage = "fork from a warm pool"
                        took = await pooled_fork(run.client, sb, base, FORK_N, run_true)
                        run.keep(i, "fork8_pooled_all_answered", took)
                        if i >= WARMUP:
                            tick()
    except (DsecError, RuntimeError) as e:
        console.print(f"[red]{label} failed[/red] at {run.stage}: {e}")
        error = error_body(e, run.stage)
    finally:
        if sb is not None:
            await kill_all([sb])
        with contextlib.suppress(DsecError):
            await run.client.remove_image(snap)
    measurements, raw, rat = figures(run.samples)
    entry: Json = {"diff": run.diff.facts(), "checkpoint_bytes": run.checkpoint_bytes, "measurements": measurements}
    entry |= {"ratios": rat, "samples_ms": raw}
    return entry | ({"error": error} if error else {})


async def refusal(client: AsyncClient, kind: str) -> Json | None:
    """The error a sandbox of ``kind`` answers when asked for a checkpoint, or None if it takes one."""
    sb = await client.create(image=IMAGE, kind=kind, labels=LABELS, timeout=TTL, wait_for_capacity=120.0)
    try:
        try:
            c = await sb.checkpoint()
        except InvalidRequest as e:
            return {"code": e.code, "message": e.message}
        await sb.remove_checkpoint(c)
        return None
    finally:
        await kill_all([sb])


async def measure_kind(console: Console, client: AsyncClient, kind: str, rounds: int, big_mb: int) -> Json:
    try:
        refused = await refusal(client, kind)
    except DsecError as e:
        console.print(f"[red]{kind}[/red]: {e}")
        return {"status": "failed", "error": error_body(e, "create")}
    if refused is not None:
        console.print(f"[yellow]{kind} refuses checkpoints[/yellow] ({refused['code']}): {refused['message']}")
        return {"status": "refused", "refused": refused}
    token = secrets.token_hex(3)
    entry: Json = {"status": "measured"}
    for diff in diffs(big_mb):
        entry[diff.name] = await measure_size(console, Run(client, kind, diff, rounds, disk_for(big_mb), token))
    if any("error" in entry[s] for s in SIZES):
        entry["status"] = "failed"
    return entry


async def measure(
    console: Console, state_dir: Path, repository: Path, kinds: list[str], rounds: int, big_mb: int
) -> Json:
    flags = ["--repository", str(repository)]
    async with private_daemon(console, state_dir, flags, LABELS, STOP_TIMEOUT) as (_, client):
        version = (await client.health()).version
        console.print(f"daemon {version} up; ensuring {IMAGE} is built")
        await client.build_image(IMAGE)
        by_kind = {kind: await measure_kind(console, client, kind, rounds, big_mb) for kind in kinds}
        with contextlib.suppress(DsecError):  # the bench's own repository: its snapshots' bytes go
            await client.gc_images()
    return {"version": version, "kinds": by_kind}


# ---- report ------------------------------------------------------------------------------------------


def measured_sizes(entry: Json) -> dict[str, Json]:
    return {s: entry[s] for s in SIZES if isinstance(entry.get(s), dict) and entry[s]["measurements"]}


def draw(out: Path, kinds: Json) -> list[str]:
    """Per measured kind: the p50 of each operation, ours beside the alternative (log scale: they differ by
    orders of magnitude), and the CDF of going back to a state, rollback against kill + create."""
    written = []
    for kind, entry in kinds.items():
        sizes = measured_sizes(entry)
        if not sizes:
            continue
        groups: dict[str, dict[str, float]] = {}
        backs: dict[str, list[float]] = {}
        for size, e in sizes.items():
            m = e["measurements"]
            groups[f"dsec ({size} diff)"] = {op: m[ours]["p50_ms"] for op, (ours, _) in OPS.items() if ours in m}
            groups[f"snapshot → image → create ({size} diff)"] = {
                op: m[alt]["p50_ms"] for op, (_, alt) in OPS.items() if alt in m
            }
            raw = e["samples_ms"]
            backs[f"rollback → first exec ({size} diff)"] = raw.get("rollback_first_exec", [])
            backs[f"kill + create from snapshot → first exec ({size} diff)"] = raw.get("recreate_first_exec", [])
        title = f"{kind}: checkpoint, rollback, fork(8) against snapshot → image → create (p50)"
        written.append(plots.bars(out / f"checkpoint-{kind}-p50.png", title, "milliseconds", groups, log_y=True))
        written.append(
            plots.cdf(
                out / f"checkpoint-{kind}-rollback-cdf.png",
                f"{kind}: back to a saved state, each round",
                backs,
                ylabel="share of rounds at or below",
            )
        )
    return [p.name for p in written]


def _cells(stats: Json | None) -> list[str]:
    return [f"{stats['p50_ms']:.1f}", f"{stats['p99_ms']:.1f}"] if stats else ["-", "-"]


def print_summary(console: Console, result: Json) -> None:
    rows: list[tuple[str, str, str | None]] = [(op, ours, alt) for op, (ours, alt) in OPS.items()]
    rows[2:2] = [("rollback call", "rollback_call", None)]
    rows.append(("fork(8) call", "fork8_call", None))
    for kind, entry in result["kinds"].items():
        if entry["status"] == "refused":
            r = entry["refused"]
            console.print(f"[yellow]{kind}[/yellow]: refused ({r['code']}): {r['message']}")
            continue
        if "error" in entry:
            console.print(f"[red]{kind}[/red]: {entry['error']['message']}")
        table = Table(title=f"dsec bench checkpoint: {kind} (ms)")
        for col in ("diff", "operation", "dsec p50", "p99", "alternative p50", "p99", "alternative / dsec"):
            table.add_column(col, justify="left" if col in ("diff", "operation") else "right")
        for size, e in measured_sizes(entry).items():
            m = e["measurements"]
            for j, (op, ours, alt) in enumerate(rows):
                ratio = m.get(alt) and m.get(ours) and m[alt]["p50_ms"] / m[ours]["p50_ms"]
                cells = _cells(m.get(ours)) + _cells(m.get(alt) if alt else None)
                table.add_row(size, op, *cells, f"{ratio:.1f}×" if ratio else "-", end_section=j == len(rows) - 1)
        console.print(table)
        for size in SIZES:
            if "error" in entry.get(size, {}):
                err = entry[size]["error"]
                console.print(f"[red]{kind} {size} failed[/red] at {err['stage']}: {err['message']}")
    marks = {True: "[green]met[/green]", False: "[red]missed[/red]", None: "[yellow]n/a[/yellow]"}
    for t in result["targets"].values():
        console.print(f"{marks[t['met']]}  {t['target']}  (value: {t['value']})")


def build_result(when: str, params: Json, measured: Json) -> Json:
    kinds = measured["kinds"]
    return {
        "bench": "checkpoint",
        "when": when,
        "host": host_facts(),
        "params": params,
        "daemon_version": measured["version"],
        "measures": {
            "checkpoint": "sb.checkpoint() (then removed, untimed); the diff's bytes are new each round",
            "snapshot": "sb.snapshot(name): a new image version published (then removed, untimed), of the "
            "same diff as the round's checkpoint",
            "rollback_call": "sb.rollback(c) after files were changed",
            "rollback_first_exec": "sb.rollback(c) → exec `true` answered",
            "recreate_first_exec": "kill the sandbox, create one from the snapshot image → exec `true` answered",
            "fork8_call": f"sb.fork({FORK_N}, checkpoint=c)",
            "fork8_all_answered": f"sb.fork({FORK_N}, checkpoint=c) → exec `true` answered in all (concurrently)",
            "create8_all_answered": f"{FORK_N} concurrent creations from the snapshot image → `true` answered in all",
            "fork8_pooled_all_answered": f"sb.fork({FORK_N}, checkpoint=c) with a warm pool of {FORK_N} for the "
            "parent's image and limits (refilled, untimed, before each round): every copy one of its sandboxes",
        },
        "kinds": kinds,
        "targets": judge(kinds),
        "failures": failures(kinds),
    }


def main(
    kinds: list[str],
    rounds: int,
    big_mb: int,
    json_out: Path | None,
    out: Path,
    state_dir: Path,
    repository: Path | None,
) -> int:
    console = Console()
    when = datetime.now(UTC).isoformat(timespec="seconds")
    state_dir = state_dir.resolve()
    source = (repository or IMAGES_DIR / "repository").resolve()
    own = state_dir / "repository"
    unwind_on_sigterm()
    try:
        seed_repository(source, own, [f"{IMAGE}:latest"])
    except FileNotFoundError:
        console.print(f"{IMAGE} is not in {source}: the bench's daemon builds it")
    except OSError as e:
        console.print(f"[red]error[/red]: cannot seed the bench's repository {own} from {source}: {e}")
        return 2
    try:
        measured = asyncio.run(measure(console, state_dir, own, kinds, rounds, big_mb))
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]bench failed[/red]: {e}")
        return 1
    except KeyboardInterrupt:  # the daemon killed what the bench made before it was stopped
        console.print("[yellow]interrupted[/yellow]: nothing written")
        return 130
    params: Json = {"kinds": kinds, "rounds": rounds, "warmup": WARMUP, "big_mb": big_mb, "fork_n": FORK_N}
    params |= {"image": IMAGE, "disk": disk_for(big_mb), "diffs": {d.name: d.facts() for d in diffs(big_mb)}}
    params |= {"change": change(0), "repository": str(source), "bench_repository": str(own)}
    result = build_result(when, params, measured)
    try:
        result["plots"] = draw(out, result["kinds"])
    except RuntimeError as e:
        console.print(f"[yellow]no plots[/yellow]: {e}")
        result["plots"] = []
    path = json_out or out / "checkpoint.json"
    write_json(path.parent, path.name, result)
    print_summary(console, result)
    console.print(f"wrote {path} and {len(result['plots'])} plot(s) in {out}")
    return 1 if result["failures"] else 0
