"""Sample where a process's resident memory is, once a minute, into a JSON array: the heap (glibc's main
arena), anonymous mappings of 1 MiB or more (thread arenas, Python's arenas), smaller ones, mapped files,
stacks; with its threads and fds. Used beside `dsec bench soak` to tell a leak from a plateau.

    python tools/smaps.py STATE_DIR OUT.json   # samples the daemon and fetcher whose command line names STATE_DIR
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


def processes(tag: str) -> list[tuple[int, str]]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = b" ".join(argv).decode(errors="replace")
        if tag in line and ("serve" in line or "fetch" in line) and "smaps.py" not in line:
            found.append((int(entry), "serve" if " serve" in line else "fetch"))
    return found


def where(pid: int) -> dict[str, int]:
    """KiB resident by kind of mapping."""
    out = dict.fromkeys(("heap", "anon_big", "anon_small", "file", "stack", "other", "anon_big_n", "n"), 0)
    kind = "other"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        m = MAPPING.match(line)
        if m:
            size, name = int(m[2], 16) - int(m[1], 16), m[3].strip()
            out["n"] += 1
            if name == "[heap]":
                kind = "heap"
            elif not name:
                kind = "anon_big" if size >= 1 << 20 else "anon_small"
                out["anon_big_n"] += kind == "anon_big"
            else:
                kind = "file" if name.startswith("/") else "stack" if name.startswith("[stack") else "other"
        elif line.startswith("Rss:"):
            out[kind] += int(line.split()[1])
    return out


def sample(pid: int, role: str) -> dict[str, object] | None:
    try:
        found: dict[str, object] = {"t": time.time(), "pid": pid, "role": role, **where(pid)}
        status = Path(f"/proc/{pid}/status").read_text()
        found["threads"] = int(re.search(r"Threads:\s+(\d+)", status)[1])  # type: ignore[index]
        found["rss"] = int(re.search(r"VmRSS:\s+(\d+)", status)[1])  # type: ignore[index]
        found["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, TypeError):
        return None  # it ended between the listing and the read
    return found


def main(tag: str, out: Path, every: float = 60.0) -> None:
    samples: list[dict[str, object]] = []
    while True:
        samples += [s for pid, role in processes(tag) if (s := sample(pid, role)) is not None]
        # the whole array again each time (a few hundred samples): the file is valid JSON whenever it stops
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(samples))
        tmp.replace(out)
        time.sleep(every)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
