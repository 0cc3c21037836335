"""Building dsec's VM-side C programs into static binaries, once per source version.

- the guest agent (``guest_agent.c`` and the ``agent_*.c`` parts it is split into, ``agent.h``);
- ``pack-upper`` (``upper_pack.c``), which packs a VM's writable layer; built only where that source is
  present, so an older tree still builds its agent.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ...errors import BackendError

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("guest_agent.c", "agent_io.c", "agent_exec.c", "agent_port.c"))
HEADERS = (HERE / "agent.h",)
BINARY = "guest-agent"
PACK_UPPER_SOURCE = HERE / "upper_pack.c"
PACK_UPPER = "pack-upper"
# Static: these run in guest images that may have no libc at all (or another one).
CFLAGS = ["-static", "-O2", "-Wall", "-Wextra"]


def compile_static(
    name: str, sources: tuple[Path, ...], headers: tuple[Path, ...], dest_dir: Path, mode: int = 0o555
) -> Path:
    """Compile ``sources`` into ``dest_dir/name`` unless the same inputs were built there; returns the binary."""
    h = hashlib.sha256("\0".join(CFLAGS).encode())
    for path in (*sources, *headers):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    digest = h.hexdigest()
    target = dest_dir / name
    stamp = dest_dir / f"{name}.sha256"
    if target.exists() and stamp.exists() and stamp.read_text() == digest:
        return target
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BackendError(f"no C compiler to build dsec's {name} (apt-get install gcc libc6-dev)")
    dest_dir.mkdir(parents=True, exist_ok=True)
    # per-process temporary name: two daemons (or test workers) may build into the same directory
    tmp = dest_dir / f"{name}.{os.getpid()}.tmp"
    argv = [cc, *CFLAGS, "-o", str(tmp), *map(str, sources)]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as e:
        raise BackendError(f"building {name} failed: {e}") from None
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BackendError(f"building {name} failed: {res.stderr[-1500:]}")
    os.chmod(tmp, mode)
    tmp.rename(target)
    stamp_tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
    stamp_tmp.write_text(digest)
    stamp_tmp.rename(stamp)
    return target


def build(dest_dir: Path) -> Path:
    """The guest agent, compiled into ``dest_dir`` unless the same source was built there."""
    return compile_static(BINARY, SOURCES, HEADERS, dest_dir)


def build_pack_upper(dest_dir: Path) -> Path | None:
    """``pack-upper`` compiled into ``dest_dir``, or None where its source is not part of this tree."""
    if not PACK_UPPER_SOURCE.exists():
        return None
    return compile_static(PACK_UPPER, (PACK_UPPER_SOURCE,), (), dest_dir)


async def build_agent(dest_dir: Path) -> Path:
    """:func:`build` off the event loop (a cold build takes about a second)."""
    return await asyncio.to_thread(build, dest_dir)
