"""Overload: a burst ``factor`` times what the node admits at once, and no request may fail.

The daemon is started with a CPU capacity that admits N / factor of the bench's sandboxes at once
(``--cpu-capacity``, ratio 1). Each sandbox runs one short exec and is killed, which frees its place.
Two rounds of N requests fired at once:

- ``sdk_retry``: the SDK's defaults. Creations beyond capacity wait in the node's queue (its
  ``--queue-timeout``); one still waiting at its deadline is answered 429 with Retry-After, and the SDK
  waits as told and asks again. Every request must end served.
- ``raw``: ``wait_for_capacity=0`` and a short ``queue_timeout``, so the 429s reach the bench. Every
  request must end served (possibly after queueing) or refused with 429 and a Retry-After: none failed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from dsec import AsyncClient, DsecError

from . import plots
from .burst import LABEL, Outcome, Spec, individual, latency_figures, phase_samples, queue_plot, thin, warm_up
from .common import (
    Json,
    NodeSampler,
    connect,
    host_facts,
    kill_leftovers,
    metric_sum,
    node_figures,
    phase,
    private_daemon,
    repository_flags,
    unwind_on_sigterm,
    write_with_plots,
)

ROUNDS = ("sdk_retry", "raw")
NODE_QUEUE_TIMEOUT = 30.0  # the node's default --queue-timeout


def admitted_at_once(n: int, factor: float) -> int:
    return max(1, int(n / factor))


def daemon_flags(n: int, factor: float, spec: Spec, queue_timeout: float = NODE_QUEUE_TIMEOUT) -> list[str]:
    """CPU is the resource that runs out: capacity for exactly N / factor of the bench's requests."""
    cores = admitted_at_once(n, factor) * spec.cpu
    return ["--cpu-capacity", f"{cores:.6g}", "--cpu-ratio", "1", "--queue-timeout", f"{queue_timeout:g}"]


async def answered_429(client: AsyncClient) -> float:
    """The daemon's own count of the 429s it answered (the SDK's retries hide them from the bench)."""
    return metric_sum(await client.metrics(), "dsec_creation_failures_total", reason="overloaded")


def round_figures(outcomes: list[Outcome], daemon_429: float, peak: dict[str, float]) -> Json:
    n = len(outcomes)
    served = [o for o in outcomes if o.ok]
    refused = [o for o in outcomes if o.error == "overloaded"]
    told = [o.retry_after for o in refused if o.retry_after is not None and o.retry_after > 0]
    failed = n - len(served) - len(refused)
    ends = [o.first_exec for o in served if o.first_exec is not None]
    wall = max(ends, default=0.0)
    return {
        "n": n,
        "served": len(served),
        "refused_429": len(refused),
        "refused_with_retry_after": len(told),
        "failed": failed,
        "failures": dict(Counter(o.error for o in outcomes if o.error and o.error != "overloaded")),
        "served_plus_refused_is_n": len(served) + len(refused) == n,
        "retry_after_s": {"min": round(min(told), 3), "max": round(max(told), 3)} if told else None,
        "daemon_answered_429": int(daemon_429),
        "served_wall_s": round(wall, 3),
        "served_per_s": round(len(served) / wall, 2) if wall else None,
        "latency": latency_figures(outcomes),
        "node_peak": peak,
    }


async def one_round(
    console: Console, client: AsyncClient, spec: Spec, n: int, name: str, raw_queue_timeout: float
) -> tuple[Json, list[Outcome], list[Json]]:
    before = await answered_429(client)
    with phase(console, f"overload round {name}: {n} requests", n) as tick:
        async with NodeSampler(client, time.perf_counter(), interval=0.2) as sampler:
            if name == "raw":
                outcomes, _ = await individual(
                    client, spec, n, tick, wait_for_capacity=0, queue_timeout=raw_queue_timeout, kill=True
                )
            else:
                outcomes, _ = await individual(client, spec, n, tick, kill=True)
    daemon_429 = await answered_429(client) - before
    peak = {k: sampler.peak(k) for k in ("queued", "starting", "held", "requested_cpu", "rtt_ms")}
    return round_figures(outcomes, daemon_429, peak), outcomes, sampler.samples


async def run(
    console: Console, spec: Spec, n: int, factor: float, raw_queue_timeout: float, state_dir: Path, flags: list[str]
) -> tuple[Json, dict[str, tuple[Json, list[Outcome], list[Json]]]]:
    async with private_daemon(console, state_dir, flags, LABEL) as (proc, client):
        await warm_up(client, spec)
        node = node_figures(await client.node())
        rounds = {}
        for name in ROUNDS:
            # a fresh client per round (see burst.run): each round's requests reach the node alike
            async with await connect(proc, state_dir) as fresh:
                rounds[name] = await one_round(console, fresh, spec, n, name, raw_queue_timeout)
            await kill_leftovers(console, client, LABEL)
            await asyncio.sleep(2)
        return node, rounds


def draw(out: Path, prefix: str, n: int, rounds: dict[str, tuple[Json, list[Outcome], list[Json]]]) -> list[str]:
    done: dict[str, list[float]] = {}
    for name, (_, outcomes, _) in rounds.items():
        done[f"{name}: served"] = [o.first_exec for o in outcomes if o.first_exec is not None and o.ok]
        refused = [o.refused_at for o in outcomes if o.error == "overloaded" and o.refused_at is not None]
        if refused:
            done[f"{name}: answered 429"] = refused
    samples = {}
    for name, (_, outcomes, _) in rounds.items():
        samples.update({f"{name}: {k}": v for k, v in phase_samples(outcomes).items() if k.startswith("client")})
    written = [
        plots.cdf(out / f"{prefix}-cdf.png", f"overload, {n} requests: latency of the served", samples),
        plots.cumulative(out / f"{prefix}-completions.png", f"overload, {n} requests: answers over time", done),
        queue_plot(
            out / f"{prefix}-queue.png",
            f"overload, {n} requests: the node's queue over time",
            {name: s for name, (_, _, s) in rounds.items()},
        ),
    ]
    return [p.name for p in written]


def targets(figures: dict[str, Json]) -> Json:
    retry, raw = figures["sdk_retry"], figures["raw"]
    return {
        "sdk_retry: every request served, none failed": retry["served"] == retry["n"] and retry["failed"] == 0,
        "raw: none failed (each served or answered 429)": raw["failed"] == 0 and raw["served_plus_refused_is_n"],
        "raw: every 429 carried a Retry-After": raw["refused_with_retry_after"] == raw["refused_429"],
    }


def main(
    n: int,
    kind: str,
    factor: float,
    out: Path,
    state_dir: Path,
    repository: Path | None = None,
    raw_queue_timeout: float = 1.0,
    node_queue_timeout: float = NODE_QUEUE_TIMEOUT,
    spec: Spec | None = None,
    serve_args: list[str] | None = None,
) -> int:
    console = Console()
    spec = spec or Spec(kind=kind)
    unwind_on_sigterm()
    state_dir = state_dir.resolve()
    when = datetime.now(UTC).isoformat(timespec="seconds")
    node_flags = daemon_flags(n, factor, spec, node_queue_timeout) + list(serve_args or [])
    flags = repository_flags(repository) + node_flags
    try:
        node, rounds = asyncio.run(run(console, spec, n, factor, raw_queue_timeout, state_dir, flags))
    except (DsecError, OSError, RuntimeError) as e:
        console.print(f"[red]overload bench failed[/red]: {e}")
        return 1
    figures = {name: r[0] for name, r in rounds.items()}
    result: Json = {
        "bench": "overload",
        "when": when,
        "host": host_facts(),
        "params": {
            "n": n,
            "kind": kind,
            "factor": factor,
            "admitted_at_once": admitted_at_once(n, factor),
            "requests": {"cpu": spec.cpu, "memory": spec.memory, "memory_request": spec.memory_request},
            "image": spec.image,
            "daemon_flags": node_flags,
            "sdk_retry": {"queue_timeout": f"the node's ({node_queue_timeout:g} s)", "wait_for_capacity": "default"},
            "raw": {"queue_timeout": raw_queue_timeout, "wait_for_capacity": 0},
            "each_sandbox": "create, exec `true`, read its timings, kill",
            "repository": str(repository or ""),
        },
        "node_at_start": node,
        "rounds": figures,
        "node_samples": {name: thin(r[2]) for name, r in rounds.items()},
        "targets": targets(figures),
    }
    prefix = f"overload-{kind}"
    shown = {"rounds": figures, "targets": result["targets"]}
    write_with_plots(console, out, prefix, result, lambda: draw(out, prefix, n, rounds), shown)
    return 0 if all(result["targets"].values()) else 1
