"""The per-node tiers on a creation's path, each measured alone (no daemon): admission and the state
database. docs/scaling.md extrapolates from these to a cluster; the whole path is `dsec bench burst`."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

# what this bench measures is these internals alone, without a daemon (the whole path is `dsec bench burst`)
from dsec.core.admission import Admission, AdmissionOptions, Claim
from dsec.protocol.sandbox import Limits, State
from dsec.store.records import new_record
from dsec.store.sqlite import SandboxStore

from .common import Json, host_facts

WRITES_PER_SANDBOX = 4  # creating, running, stopping, stopped


async def admission_rate(n: int, tenants: int) -> Json:
    """Admit and release ``n`` claims: uncontended, then with every creation queued behind a full node."""
    adm = Admission(AdmissionOptions(cpu_capacity=1e9, memory_capacity=1 << 60))
    started = time.perf_counter()
    for i in range(n):
        claim = Claim(f"t{i % tenants}", 0.25, 1 << 27)
        await adm.admit(claim, 0)
        adm.bind(str(i), claim)
        adm.release(str(i))
    free_s = time.perf_counter() - started
    # a node with room for one: every other creation waits in its tenant's queue and is served in turn
    full = Admission(AdmissionOptions(cpu_capacity=0.25, cpu_ratio=1, memory_capacity=1 << 60))
    first = Claim("t0", 0.25, 1)
    await full.admit(first, 0)
    full.bind("held", first)
    claims = [Claim(f"t{i % tenants}", 0.25, 1) for i in range(n)]
    waiters = [asyncio.create_task(full.admit(c, 600)) for c in claims]
    await asyncio.sleep(0)
    queued_at_peak = full.queued
    started = time.perf_counter()
    held = "held"
    for i, task in enumerate(waiters):
        full.release(held)
        await task
        held = str(i)
        full.bind(held, claims[i])
    queued_s = time.perf_counter() - started
    return {
        "n": n,
        "tenants": tenants,
        "uncontended_per_s": round(n / free_s),
        "queued_at_peak": queued_at_peak,
        "queued_served_per_s": round(n / queued_s),
    }


def state_rate(n: int, directory: Path) -> Json:
    """Sandbox records written through the state database as the lifecycle writes them."""
    store = SandboxStore(directory / "state.db")
    try:
        recs = [new_record("container", "dsec/busybox", "d" * 64, 600, Limits(), {}, {}) for _ in range(n)]
        started = time.perf_counter()
        for rec in recs:
            for state in (State.creating, State.running, State.stopping, State.stopped):
                rec.state = state
                store.put(rec)
        seconds = time.perf_counter() - started
    finally:
        store.close()
    writes = n * WRITES_PER_SANDBOX
    return {
        "sandboxes": n,
        "writes": writes,
        "writes_per_s": round(writes / seconds),
        "sandboxes_per_s": round(n / seconds),
    }


def main(json_out: Path, n: int, tenants: int) -> int:
    console = Console()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-tiers-", dir="/var/tmp") as tmp:
        result = {
            "bench": "tiers",
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": host_facts(),
            "admission": asyncio.run(admission_rate(n, tenants)),
            "state_db": state_rate(min(n, 20_000), Path(tmp)),
        }
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    console.print_json(json.dumps(result))
    return 0
