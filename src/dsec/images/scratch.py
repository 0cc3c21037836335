"""Memory to pack a layer in that is uploaded and then thrown away, when the host has it to spare.

ext4 writes a file's data back as soon as the file is closed if the file was truncated to zero first
(auto_da_alloc, for programs that rewrite a file in place). mkfs.erofs truncates its output so; a layer
packed on the node's disk costs its whole size in device writes even when it is deleted a second after,
which a pull on a lazy node does (its chunks are all that is kept). Packed in a tmpfs, it costs nothing
on the disk. The unpacked tree needs no such help: files written and deleted within seconds are mostly
never written back.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

log = logging.getLogger("dsec.images")

SHM = Path("/dev/shm")
MAX_IN_MEMORY = 1 << 30  # a bigger layer is packed on disk: three conversions at once stay within 3 GiB
HEADROOM = 4  # the host keeps at least this many times the layer's size available besides


def _is_tmpfs(path: Path) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(p[1] == str(path) and p[2] == "tmpfs" for p in (line.split() for line in f))
    except OSError:
        return False


def _available() -> int:
    """MemAvailable in bytes (0 when it cannot be read: then nothing goes to memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class MemoryScratch:
    """A directory in /dev/shm of one node's own (keyed by its state directory), made on first use;
    what a killed daemon left there is removed when the next one opens it."""

    def __init__(self, node_root: Path, shm: Path = SHM) -> None:
        key = hashlib.blake2b(str(node_root.resolve()).encode(), digest_size=8).hexdigest()
        self.dir: Path | None = shm / f"dsec-pack-{key}" if _is_tmpfs(shm) else None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def place(self, size: int) -> Path | None:
        """Where a packed layer of about ``size`` bytes goes: this memory directory, or None (the disk)."""
        if self.dir is None or size > MAX_IN_MEMORY or _available() < HEADROOM * size:
            return None
        try:
            self.dir.mkdir(mode=0o700, exist_ok=True)
            room = shutil.disk_usage(self.dir).free
        except OSError as e:
            log.warning("packing a layer on disk: %s is not usable (%s)", self.dir, e)
            return None
        return self.dir if room >= 2 * size else None

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
