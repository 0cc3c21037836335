"""Soak: a churn of every kind of operation on a private daemon for M minutes, hostile workloads mixed in,
then a full accounting of the node against the baseline taken before the churn.

Order: the daemon starts on a repository of the soak's own (the soak garbage-collects it, which a
shared repository must never undergo); a warm-up runs each scenario once, so what a node makes once
and keeps (helpers, guest assets, VM templates, its nftables table and resolver, layer mounts of the
base image, thread pools) exists before the baseline; the node settles (no sandbox left, counters
steady) and the baseline is taken; the churn runs; the soak removes leftovers, runs the image gc and
polls the accounting until every counter is back within its allowance or the settle time is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import sqlite3
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from dsec import AsyncClient, DsecError

from . import accounting
from .accounting import Allowance, Counters, Known, Node
from .churn import CONTAINER_KINDS, LABELS, VM_KINDS, VM_WORKLOADS, WORKLOADS, Churn, Evicted, Tally, Unexpected
from .common import Json, connect, host_facts, kill_leftovers, private_daemon, unwind_on_sigterm, write_json

KINDS = ("container", "function", "microvm", "vm")
VM_SHAPES = ("plain", "hostile")  # the limits VMs are created with: each its own memory template
SCENARIO_TIMEOUT = 300.0  # a scenario still running after this is cut off (and counted unexpected)
PROGRESS_EVERY = 10.0
SCAN_EVERY = 5.0
RSS_EVERY = 30.0
REMEMBERED = "daemon.idempotency_kib"
REMEMBERED_LIMIT = "daemon.idempotency_limit_kib"
RSS_SAMPLES = 240  # kept at most; older ones thinned out, so a run of any length keeps a bounded list
# Resident memory on a long churn is judged by its growth over the churn's last third, not by how far it
# ends above the baseline: the allocator's warm-up growth levels off at a height that depends on the
# run, a leak keeps the rate it has. docs/reliability.md argues the figures from the two-hour run.
TREND_FROM_S = 120 * 60.0  # a churn at least this long: the last third is 40 minutes of samples
TREND_PART = 1 / 3
# 1 KiB per sandbox at the two-hour run's 17,000 sandboxes an hour is 17 MiB/h; a one-off step of the
# allocator up to 5 MiB inside the 40 minutes reads as at most 12 (that run's steps were 2-3 MiB)
RSS_TREND_KIB_H = 12 << 10
POLL = 2.0
GC_EVERY = 60.0
IDLE_TTL = 5.0  # the daemon's --function-idle-ttl: idle workers go this soon after the churn
IMAGE_CACHE = 1 << 30  # the daemon's --image-cache: the chunk cache may hold up to this

# Weighted scenarios of the container lanes, per kind (snapshot, pause and network are the container
# kind's; the function kind lends pooled workers and has no such calls).
CONTAINER_MIX: dict[str, list[tuple[str, int]]] = {
    "container": [
        ("basic", 4),
        ("snapshot", 2),
        ("network", 1),
        ("pause", 1),
        ("expire", 1),
        ("kill_mid_exec", 1),
        ("hostile", 3),
    ],
    "function": [("basic", 4), ("expire", 1), ("kill_mid_exec", 1), ("hostile", 3)],
}
# the VM lane, in turn: few VMs (TCG here), one at a time, each scenario the kind supports
VM_CYCLE: dict[str, list[str]] = {
    "microvm": ["basic", "fork", "hostile", "network", "kill_mid_exec"],
    "vm": ["basic", "fork", "hostile"],
}
WARMUP: dict[str, list[str]] = {
    "container": ["basic", "network", "snapshot", "pause"],
    "function": ["basic"],
    # a hostile VM has limits of its own: another VM shape, so a template of its own
    "microvm": ["basic", "network", "fork", "hostile", "basic"],
    "vm": ["basic", "fork", "hostile", "basic"],
}


# dsec.isolation.mntns.MountNamespaces' default size (a bench names no internals)
MNTNS_THREADS = 4


def allowances(cpus: int, vm_kinds: int = len(VM_KINDS)) -> dict[str, Allowance]:
    """Where a counter may legitimately end above its baseline (everything else must come back)."""
    executor = min(32, cpus + 4)  # asyncio's default executor: threads made on demand, never retired
    why = (
        "resident memory: CPython keeps freed arenas and the allocator's fragmentation after bursts, a growth "
        f"that levels off; on a churn of {TREND_FROM_S / 60:.0f} minutes or more it is judged instead by its "
        f"growth over the churn's last third, at most {RSS_TREND_KIB_H >> 10} MiB an hour (a leak keeps its rate)"
    )
    return {
        "daemon.rss_kib": Allowance(
            f"{why}; and as much more as the daemon reports holding for Idempotency-Keys (daemon.idempotency_kib)",
            slack=32 << 10,
            ratio=0.2,
            plus=REMEMBERED,
            trend=RSS_TREND_KIB_H,
        ),
        "fetcher.rss_kib": Allowance(why, slack=32 << 10, ratio=0.2, trend=RSS_TREND_KIB_H),
        REMEMBERED: Allowance(
            "the answers of the last minutes' requests, kept for repeats of their Idempotency-Keys, up to the "
            f"bound the daemon reports ({REMEMBERED_LIMIT})",
            bound=REMEMBERED_LIMIT,
        ),
        "daemon.fds": Allowance(
            "as many more as user namespaces kept (daemon.fd.ns_user)", follows="daemon.fd.ns_user"
        ),
        "daemon.threads": Allowance(
            f"the default executor grows on demand to {executor} threads, and the container kind's pool of "
            f"threads that enter sandboxes' mount namespaces to {MNTNS_THREADS}",
            slack=executor + MNTNS_THREADS,
        ),
        "fetcher.threads": Allowance(
            f"the default executor ({executor}) and the chunk cache's pool (8) grow on demand", slack=executor + 8
        ),
        "sqlite.state.sandboxes_finished": Allowance("finished sandbox records are kept 24 h", retained=True),
        "sqlite.audit.audit": Allowance("the audit log keeps its records (--audit-keep-days)", retained=True),
        "uids.ranges_used": Allowance("distinct uid ranges the records name (finished ones too)", retained=True),
        "daemon.fd.ns_user": Allowance(
            "a container backend keeps the user namespace of each uid range it has used, for reuse; the container "
            "kind and the function kind's own backend each keep theirs: two per range at most (ranges are handed "
            "out lowest first, so there are as many as the peak of sandboxes at once)",
            bound="uids.ranges_used",
            per=2,
        ),
        "cache.layer_bytes": Allowance("the chunk cache is bounded by --image-cache", cap=IMAGE_CACHE),
        "cache.layer_chunks": Allowance("the chunk cache is bounded by --image-cache (bytes)", retained=True),
        "cache.vm_templates": Allowance(
            "a memory template (two files) per VM shape: the soak's are its plain and its hostile limits per VM "
            "kind; one that failed to build in the warm-up is built in the churn",
            cap=2 * len(VM_SHAPES) * vm_kinds,
        ),
        "cache.vm_template_bytes": Allowance("one memory image per template (cache.vm_templates)", retained=True),
    }


@dataclass
class Plan:
    kinds: list[str]
    minutes: float
    workers: int
    vm_pause: float
    settle: float
    rng: random.Random = field(default_factory=random.Random)

    def container_picks(self) -> Callable[[], tuple[str, str, str | None]]:
        kinds = [k for k in self.kinds if k in CONTAINER_KINDS]
        choices = [(k, s) for k in kinds for s, w in CONTAINER_MIX[k] for _ in range(w)]
        works = {k: itertools.cycle(WORKLOADS) for k in kinds}

        def pick() -> tuple[str, str, str | None]:
            kind, scenario = self.rng.choice(choices)
            return kind, scenario, next(works[kind]) if scenario == "hostile" else None

        return pick

    def vm_picks(self) -> Iterator[tuple[str, str, str | None]]:
        kinds = [k for k in self.kinds if k in VM_KINDS]
        works = {k: itertools.cycle(VM_WORKLOADS) for k in kinds}
        # microvm twice as often as vm: the vm kind boots a full machine
        order = [k for k in ("microvm", "microvm", "vm") if k in kinds]
        steps = {k: itertools.cycle(VM_CYCLE[k]) for k in kinds}
        for kind in itertools.cycle(order):
            scenario = next(steps[kind])
            yield kind, scenario, next(works[kind]) if scenario == "hostile" else None


async def run_scenario(churn: Churn, kind: str, scenario: str, arg: str | None) -> None:
    tally = churn.tally
    tally.scenarios[kind, scenario if arg is None else f"{scenario}.{arg}"] += 1
    step = getattr(churn, scenario)
    try:
        await asyncio.wait_for(step(kind, arg) if arg is not None else step(kind), SCENARIO_TIMEOUT)
    except Evicted as e:
        tally.error("Evicted", str(e), expected=True)
    except Unexpected as e:
        tally.error("Unexpected", str(e), expected=False)
    except DsecError as e:
        tally.error(type(e).__name__, f"{kind}/{scenario}: {e}", expected=False)
    except TimeoutError:
        tally.error("ScenarioTimeout", f"{kind}/{scenario} ran past {SCENARIO_TIMEOUT:.0f}s", expected=False)
    except Exception as e:  # a transport failure or a bug: counted, and the soak goes on
        tally.error(type(e).__name__, f"{kind}/{scenario}: {e!r}", expected=False)


async def lane(churn: Churn, picks: Iterator[tuple[str, str, str | None]], deadline: float, pause: float) -> None:
    for kind, scenario, arg in picks:
        if time.monotonic() >= deadline:
            return
        await run_scenario(churn, kind, scenario, arg)
        if pause:
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))


def _forever(pick: Callable[[], tuple[str, str, str | None]]) -> Iterator[tuple[str, str, str | None]]:
    while True:
        yield pick()


@dataclass
class Watch:
    """What the soak watches while it churns: names the node uses (for attribution), and the daemon's
    and fetcher's resident memory now and then (a bounded list)."""

    node: Node
    known: Known
    tally: Tally
    client: AsyncClient
    started: float = field(default_factory=time.monotonic)
    rss: list[dict[str, float]] = field(default_factory=list)

    def _processes(self) -> Counters:
        return accounting.process("daemon", self.node.daemon_pid) | accounting.process("fetcher", self.node.fetcher_pid)

    async def sample(self) -> None:
        figures = await asyncio.to_thread(self._processes)
        figures |= await remembered(self.client)
        self.rss.append(
            {"t_s": round(time.monotonic() - self.started, 1)}
            | {k: v for k, v in figures.items() if k.endswith(("rss_kib", "fds", "threads", "idempotency_kib"))}
        )
        if len(self.rss) > RSS_SAMPLES:
            self.rss = self.rss[::2]

    def scan(self) -> None:
        self.known.ids.update(self.tally.created)
        self.tally.created.clear()
        self.known.scan()

    async def run(self, console: Console, deadline: float) -> None:
        last = {"progress": 0.0, "scan": 0.0, "rss": 0.0}
        while True:
            now = time.monotonic()
            if now - last["scan"] >= SCAN_EVERY:
                await asyncio.to_thread(self.scan)
                last["scan"] = now
            if now - last["rss"] >= RSS_EVERY:
                await self.sample()
                last["rss"] = now
            if now - last["progress"] >= PROGRESS_EVERY:
                t = self.tally
                elapsed = now - self.started
                console.print(
                    f"  soak {elapsed:.0f}s, {max(0.0, deadline - now):.0f}s left: {t.total_ops} ops "
                    f"({t.total_ops / max(1e-9, elapsed):.1f}/s); errors {sum(t.expected.values())} expected, "
                    f"{sum(t.unexpected.values())} unexpected"
                )
                last["progress"] = now
            await asyncio.sleep(1.0)


def trend(samples: list[dict[str, float]], key: str, part: float = 0.5) -> float | None:
    """The least-squares slope of ``key`` over the last ``part`` of the samples, per hour (a leak keeps
    climbing; a warm-up's growth levels off)."""
    tail = samples[len(samples) - int(len(samples) * part) :]
    if len(tail) < 3:
        return None
    ts, vs = [s["t_s"] for s in tail], [s[key] for s in tail]
    mt, mv = sum(ts) / len(ts), sum(vs) / len(vs)
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return None
    return round(3600 * sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / var, 1)


def uid_probe(state_dir: Path, sandbox_id: str) -> int:
    """The host uid range a container got (its record's ``uid_base``; -1 without user namespaces). The
    daemon hands out the lowest free range, so after the churn a new sandbox gets the baseline's range
    unless ranges leaked."""
    with contextlib.closing(sqlite3.connect(f"file:{state_dir / 'state.db'}?mode=ro", uri=True)) as db:
        row = db.execute("SELECT runtime FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    base = json.loads(row[0]).get("uid_base") if row else None
    return base if isinstance(base, int) else -1


async def remembered(client: AsyncClient) -> Counters:
    """What the daemon reports holding for Idempotency-Keys, and its bound, its APIs together (KiB)."""
    lines = (await client.metrics()).splitlines()

    def kib(family: str) -> int:
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(family + "{"))) >> 10

    return {REMEMBERED: kib("dsec_idempotency_bytes"), REMEMBERED_LIMIT: kib("dsec_idempotency_bytes_limit")}


async def probe(proc: subprocess.Popen[bytes], state_dir: Path) -> Counters:
    """The uid range a new container gets, and the memory the daemon reports for Idempotency-Keys."""
    async with await connect(proc, state_dir) as client:
        sb = await client.create(image="dsec/busybox", kind="container", labels=LABELS, timeout=60)
        try:
            base = await asyncio.to_thread(uid_probe, state_dir, sb.id)
        finally:
            await sb.kill()
        return {"uids.next_container_base": base} | await remembered(client)


def quiet(c: Counters) -> bool:
    """No sandbox, VM or worker left on the node."""
    keys = ("sandbox.processes", "qemu.processes", "sqlite.state.sandboxes", "files.sandbox_bundles")
    return all(c.get(k, 0) == 0 for k in (*keys, "files.vm_bundles"))


def steady(a: Counters, b: Counters, rules: dict[str, Allowance]) -> bool:
    judged = [k for k in a if not k.startswith("host.") and k not in rules]
    return all(a.get(k) == b.get(k) for k in judged)


Probe = Callable[[], Awaitable[Counters]]
NEVER_QUIET = -2


async def quiet_probe(node: Node, known: Known, probe: Probe, deadline: float) -> Counters:
    """Once no sandbox is left on the node: the uid range a new container gets (NEVER_QUIET if the node
    never got quiet before ``deadline``)."""
    while True:
        if quiet(await asyncio.to_thread(accounting.snapshot, node, known)):
            return await probe()
        if time.monotonic() > deadline:
            return {"uids.next_container_base": NEVER_QUIET}
        await asyncio.sleep(POLL)


async def baseline(
    node: Node, known: Known, rules: dict[str, Allowance], timeout: float, probe: Probe
) -> tuple[Counters, bool]:
    """The node's counters once it is quiet and steady over three polls (False: not within ``timeout``)."""
    deadline = time.monotonic() + timeout
    extra = await quiet_probe(node, known, probe, deadline)
    seen: list[Counters] = []
    while True:
        snap = await asyncio.to_thread(accounting.snapshot, node, known) | extra
        seen = [*seen[-2:], snap]
        if len(seen) == 3 and all(quiet(s) for s in seen) and all(steady(seen[0], s, rules) for s in seen[1:]):
            return snap, True
        if time.monotonic() > deadline:
            return snap, False
        await asyncio.sleep(POLL)


def trends(samples: list[dict[str, float]], churn_s: float) -> dict[str, float]:
    """The resident memory's growth per hour over the churn's last third, on a churn long enough to
    judge by it (else none: the end values are judged)."""
    if churn_s < TREND_FROM_S:
        return {}
    slopes = {k: trend(samples, k, TREND_PART) for k in ("daemon.rss_kib", "fetcher.rss_kib")}
    return {k: v for k, v in slopes.items() if v is not None}


async def settle(
    node: Node,
    known: Known,
    before: Counters,
    rules: dict[str, Allowance],
    timeout: float,
    probe: Probe,
    rates: dict[str, float] | None = None,
) -> tuple[Counters, list[Any], float]:
    """Poll the accounting until no counter is over its allowance, or ``timeout``: the last diff.
    ``rates``: counters' growth per hour, for those judged by their trend (a long soak's memory)."""
    started = time.monotonic()
    extra = await quiet_probe(node, known, probe, started + timeout)
    while True:
        after = await asyncio.to_thread(accounting.snapshot, node, known) | extra
        rows = accounting.diff(before, after, rules, rates)
        if not accounting.leaks(rows) or time.monotonic() - started > timeout:
            return after, rows, time.monotonic() - started
        await asyncio.sleep(POLL)


# ---- the run ----------------------------------------------------------------------------------------


async def warm_up(console: Console, churn: Churn, plan: Plan) -> None:
    """Each warm-up scenario once, again if it failed (what it makes once must exist before the baseline)."""
    for kind in plan.kinds:
        for scenario in WARMUP[kind]:
            arg = "outlives_timeout" if scenario == "hostile" else None
            for _ in range(2):
                failed = sum(churn.tally.unexpected.values())
                await run_scenario(churn, kind, scenario, arg)
                if sum(churn.tally.unexpected.values()) == failed:
                    break
        console.print(f"  warm-up: {kind} done")
    if churn.tally.unexpected:
        console.print(f"[yellow]warm-up errors[/yellow] (not the soak's): {dict(churn.tally.unexpected)}")


async def churn_for(console: Console, churn: Churn, plan: Plan, watch: Watch) -> float:
    """The churn itself: ``plan.workers`` container lanes and one VM lane until the deadline, then what is
    in flight finishes. Returns the churn's seconds."""
    started = time.monotonic()
    deadline = started + plan.minutes * 60
    lanes = []
    if any(k in CONTAINER_KINDS for k in plan.kinds):
        pick = plan.container_picks()
        lanes += [lane(churn, _forever(pick), deadline, 0.0) for _ in range(plan.workers)]
    if any(k in VM_KINDS for k in plan.kinds):
        lanes.append(lane(churn, plan.vm_picks(), deadline, plan.vm_pause))
    if "container" in plan.kinds:  # removed snapshots' layers stay mounted until a gc: one now and then
        lanes.append(lane(churn, itertools.repeat(("node", "gc", None)), deadline, GC_EVERY))
    watcher = asyncio.create_task(watch.run(console, deadline))
    try:
        await asyncio.gather(*lanes)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return time.monotonic() - started


async def run(console: Console, plan: Plan, state_dir: Path) -> Json:
    rules = allowances(os.cpu_count() or 1, sum(k in VM_KINDS for k in plan.kinds))
    flags = ["--repository", str(state_dir / "repository"), "--function-idle-ttl", f"{IDLE_TTL:g}"]
    flags += ["--image-cache", str(IMAGE_CACHE)]
    tally = Tally()
    async with private_daemon(console, state_dir, flags, LABELS) as (proc, client):
        node = Node(state_dir, proc.pid)
        known = Known(node)
        watch = Watch(node, known, tally, client)
        await client.build_image("dsec/busybox")
        async with await connect(proc, state_dir) as warm:
            await warm_up(console, Churn(warm, tally), plan)
            await warm.gc_images()
        watch.scan()
        before, was_quiet = await baseline(node, known, rules, plan.settle, lambda: probe(proc, state_dir))
        console.print(f"baseline taken ({'quiet' if was_quiet else 'NOT quiet: sandboxes were still left'})")
        warm_up_report = tally.report()
        tally = Tally()
        watch.tally = tally
        watch.started = time.monotonic()
        await watch.sample()
        async with await connect(proc, state_dir) as churn_client:
            seconds = await churn_for(console, Churn(churn_client, tally), plan, watch)
        await watch.sample()
        watch.scan()
        console.print(f"churn done in {seconds:.0f}s: {tally.total_ops} operations; settling")
        leftovers = len(await client.list(labels=LABELS))
        if leftovers:
            tally.error("Leftover", f"{leftovers} sandbox(es) of the churn were still live after it", expected=False)
            await kill_leftovers(console, client, LABELS)
        gc = await client.gc_images()
        watch.scan()
        rates = trends(watch.rss, seconds)
        after, rows, settled = await settle(
            node, known, before, rules, plan.settle, lambda: probe(proc, state_dir), rates
        )
    return {
        "churn_s": round(seconds, 1),
        "warm_up": warm_up_report,
        **tally.report(),
        "gc": gc.model_dump(),
        "resources_over_time": watch.rss,
        "trend_per_hour": {
            part: {
                k: trend(watch.rss, k, share) for k in ("daemon.rss_kib", REMEMBERED, "fetcher.rss_kib", "daemon.fds")
            }
            for part, share in (("second_half", 0.5), ("last_third", TREND_PART))
        },
        "judged_by_trend": sorted(rates),
        "accounting": {
            "baseline_quiet": was_quiet,
            "settle_s": round(settled, 1),
            "before": before,
            "after": after,
            "diff": rows,
            "leaks": accounting.leaks(rows),
            "allowances": {k: v.why for k, v in sorted(rules.items())},
        },
    }


def main(
    minutes: float, kinds: list[str], workers: int, vm_pause: float, settle_s: float, json_out: Path, state_dir: Path
) -> int:
    console = Console()
    unwind_on_sigterm()
    state_dir = state_dir.resolve()
    plan = Plan(kinds=kinds, minutes=minutes, workers=workers, vm_pause=vm_pause, settle=settle_s)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    console.print(f"soak: {minutes:g} min of churn on {', '.join(kinds)} ({workers} container lanes)")
    try:
        figures = asyncio.run(run(console, plan, state_dir))
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]soak failed[/red]: {e}")
        return 1
    acc = figures["accounting"]
    unexpected = figures["errors"]["unexpected"]
    result: Json = {
        "bench": "soak",
        "when": when,
        "host": host_facts(),
        "params": {
            "minutes": minutes,
            "kinds": kinds,
            "workers": workers,
            "vm_pause_s": vm_pause,
            "settle_s": settle_s,
        },
        **figures,
        "verdict": {"leaks": acc["leaks"], "unexpected_errors": sum(unexpected.values())},
    }
    path = write_json(json_out.parent, json_out.name, result)
    for row in acc["diff"]:
        if row["verdict"] in ("leak", "retained") or (row["delta"] and row["verdict"] != "info"):
            rate = f" ({row['trend_per_h']:+.0f} an hour over the last third)" if "trend_per_h" in row else ""
            console.print(f"  {row['verdict']:>8} {row['counter']}: {row['before']} -> {row['after']}{rate}")
    console.print_json(data={"operations_total": figures["operations_total"], "errors": figures["errors"]})
    ok = not acc["leaks"] and not unexpected
    verdict = "[green]no leak, no unexpected error[/green]" if ok else "[red]leaks or unexpected errors[/red]"
    console.print(f"{verdict}; wrote {path}")
    return 0 if ok else 1
