"""Building the guest agent (guest_agent.c) into a static binary, once per source version."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ...errors import BackendError

SOURCE = Path(__file__).with_name("guest_agent.c")
BINARY = "guest-agent"
# Static: the agent runs in guest images that may have no libc at all (or another one).
CFLAGS = ["-static", "-O2", "-Wall", "-Wextra"]


def build(dest_dir: Path) -> Path:
    """Compile the agent into ``dest_dir`` unless the same source was built there; returns the binary."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + "\0".join(CFLAGS).encode()).hexdigest()
    target = dest_dir / BINARY
    stamp = dest_dir / f"{BINARY}.sha256"
    if target.exists() and stamp.exists() and stamp.read_text() == digest:
        return target
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BackendError("no C compiler to build dsec's guest agent (apt-get install gcc libc6-dev)")
    dest_dir.mkdir(parents=True, exist_ok=True)
    # per-process temporary name: two daemons (or test workers) may build into the same directory
    tmp = dest_dir / f"{BINARY}.{os.getpid()}.tmp"
    try:
        res = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, check=False)
    except OSError as e:
        raise BackendError(f"building the guest agent failed: {e}") from None
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BackendError(f"building the guest agent failed: {res.stderr[-1500:]}")
    os.chmod(tmp, 0o555)
    tmp.rename(target)
    stamp.write_text(digest)
    return target


async def build_agent(dest_dir: Path) -> Path:
    """:func:`build` off the event loop (a cold build takes about a second)."""
    return await asyncio.to_thread(build, dest_dir)
