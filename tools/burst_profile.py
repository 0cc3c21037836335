"""Hold H idle container sandboxes, then fire N creations at once (each with its first exec) while a
profiler records: ``perf`` (system-wide, call graphs) or ``py-spy`` (the daemon's Python, samples holding
the GIL). What docs/performance.md's "Where a creation's time goes" was measured with.

    PYTHONPATH=src python tools/burst_profile.py --held 3000 --n 200 --perf /tmp/p3000.data
    perf report -i /tmp/p3000.data --no-children --sort comm -g none --stdio
    PYTHONPATH=src python tools/burst_profile.py --held 2000 --n 200 --py-spy /tmp/g2000.txt --py-spy-bin ./py-spy
    python tools/burst_profile.py --summarize /tmp/g2000.txt

Run as root on a node with the test images (``make test`` builds them); py-spy is not a dependency of
dsec: fetch its wheel (``pip download py-spy``) and point --py-spy-bin at the binary inside.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from pathlib import Path

from rich.console import Console

from dsec import AsyncSandbox
from dsec_bench.burst import HELD_LABEL, LABEL, Spec, hold, individual, warm_up
from dsec_bench.common import kill_leftovers, private_daemon, repository_flags


async def main(args: argparse.Namespace) -> None:
    console = Console()
    flags = repository_flags(Path(args.repository))
    async with private_daemon(console, Path(args.state_dir), flags, LABEL) as (proc, client):
        spec = Spec()
        await warm_up(client, spec)
        held: list[AsyncSandbox] = []
        try:
            await hold(console, client, spec, args.held, held)
            await asyncio.sleep(2)  # the fill's deferred work, before measuring
            argv: list[str] = []
            if args.perf:
                argv = ["perf", "record", "-a", "-g", "-F", "499", "-o", args.perf]
            elif args.py_spy:
                argv = [args.py_spy_bin, "record", "-f", "raw", "-r", "250", "-o", args.py_spy]
                argv += ["-p", str(proc.pid), "--nonblocking", "--gil"]
            recorder = await asyncio.create_subprocess_exec(*argv) if argv else None
            await asyncio.sleep(0.5)
            began = time.perf_counter()
            outcomes, _ = await individual(client, spec, args.n, lambda: None)
            wall = time.perf_counter() - began
            if recorder is not None:
                recorder.send_signal(2)
                await recorder.wait()
            ok = sum(o.ok for o in outcomes)
            console.print(f"held {args.held}: {ok}/{args.n} created in {wall:.2f} s = {ok / wall:.1f}/s")
            await kill_leftovers(console, client, LABEL)
        finally:
            await kill_leftovers(console, client, HELD_LABEL)


def summarize(raw: Path, top: int = 60) -> None:
    """The frames py-spy saw most often (each counted once per sample it is in), as shares of all samples."""
    total, seen = 0, Counter[str]()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        for frame in set(stack.split(";")):
            seen[frame] += int(count)
    for frame, n in seen.most_common(top):
        print(f"{100 * n / max(total, 1):5.1f}% {frame[:150]}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--held", type=int, default=0)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--perf", help="perf.data to write")
    p.add_argument("--py-spy", help="py-spy raw output to write")
    p.add_argument("--py-spy-bin", default="py-spy")
    p.add_argument("--state-dir", default="/var/lib/dsec-burst-profile")
    p.add_argument("--repository", default="/var/tmp/dsec-test-images/repository")
    p.add_argument("--summarize", help="only print the top frames of a py-spy raw file written before")
    parsed = p.parse_args()
    if parsed.summarize:
        summarize(Path(parsed.summarize))
    else:
        asyncio.run(main(parsed))
