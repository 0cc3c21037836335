"""An exec right after a pause, with the cgroup v2 hierarchy mounted without and with ``favordynmods``
(docs/performance.md): an agent's step comes after its model answered, seconds after the last exec.

    PYTHONPATH=src python tools/exec_after_pause.py [--rounds 20] [--json out.json]   # as root

It starts a daemon of its own (told to leave the mount alone, DSEC_CGROUP_FAVORDYNMODS=0), remounts the v2
hierarchy one way then the other, and times ``exec(["true"])`` after each pause: the call as the SDK sees
it, and the command's own duration as the daemon measured it (spawn to exit). The mount is left with
``favordynmods``, as a daemon's start leaves it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from dsec import AsyncSandbox
from dsec.isolation import cgroups
from dsec.isolation.mounts import MS_REMOUNT, mount
from dsec_bench.common import private_daemon

PAUSES = (0.0, 0.01, 0.05, 0.2, 1.0)
LABELS = {"dsec-tool": "exec-after-pause"}


def remount(favour: bool) -> None:
    unified = cgroups.detect().unified
    options = cgroups.cgroup2_options(Path("/proc/self/mountinfo").read_text(), str(unified)) or []
    options = [o for o in options if o != "favordynmods"] + (["favordynmods"] if favour else [])
    mount("cgroup2", unified, "cgroup2", MS_REMOUNT, ",".join(options))


async def measure(sb: AsyncSandbox, rounds: int) -> dict[str, dict[str, float]]:
    out = {}
    for pause in PAUSES:
        calls, durations = [], []
        for _ in range(rounds):
            await asyncio.sleep(pause)
            t0 = time.perf_counter()
            result = await sb.exec(["true"])
            calls.append((time.perf_counter() - t0) * 1000)
            durations.append(result.duration * 1000)
        out[f"{pause:g}"] = {
            "call_p50_ms": round(statistics.median(calls), 2),
            "duration_p50_ms": round(statistics.median(durations), 2),
        }
    return out


async def run(state: Path, rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    os.environ["DSEC_CGROUP_FAVORDYNMODS"] = "0"  # the daemon leaves the mount to this tool
    results = {}
    try:
        async with private_daemon(Console(), state, [], LABELS) as (_, client):
            sb = await client.create(image="dsec/busybox", labels=LABELS)
            for favour in (False, True):
                remount(favour)
                await sb.exec(["true"])
                results["favordynmods" if favour else "plain"] = await measure(sb, rounds)
            await sb.kill()
    finally:
        remount(True)  # as a daemon's start leaves it
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="dsec-pause-"))
    state.chmod(0o711)  # sandboxes' users traverse the state directory
    results = asyncio.run(run(state, args.rounds))
    print(f"exec(['true']) after a pause, p50 of {args.rounds} (ms): the call / the command's own duration")
    print(f"{'pause s':>8} {'plain':>18} {'favordynmods':>18}")
    for pause in PAUSES:
        a, b = results["plain"][f"{pause:g}"], results["favordynmods"][f"{pause:g}"]
        plain = f"{a['call_p50_ms']} / {a['duration_p50_ms']}"
        favoured = f"{b['call_p50_ms']} / {b['duration_p50_ms']}"
        print(f"{pause:>8g} {plain:>18} {favoured:>18}")
    if args.json:
        data = {"tool": "exec_after_pause", "rounds": args.rounds, "pauses_s": PAUSES, "results": results}
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
