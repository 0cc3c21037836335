"""A directory in overlayfs's on-disk format packed into one EROFS image.

The directory may hold overlayfs whiteouts (character devices 0/0) and opaque directories (the
``trusted.overlay.opaque`` xattr); EROFS keeps both, so a packed layer stacks under overlayfs exactly as
the directory would. Other device nodes are refused: a sandbox cannot make them, and a layer that
carried one would hand it to every sandbox started from the image.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BackendError, InvalidRequest, StorageFull
from ..proc import run
from .scrub import ScrubRules

# Plain EROFS inlines small files (compact) but writes holes as zeros; chunk-based files keep holes
# sparse. A layer that holds a sparse file is packed chunk-based (measured here: a 1 GiB sparse file
# packs to 4 MB that way and to 1 GB plain, while 2,000 small files take 1.9x the space chunk-based).
SPARSE_SLACK = 64 << 10


@dataclass
class TreeScan:
    entries: int = 0
    files: int = 0
    bytes: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    sparse_files: int = 0
    scrubbed: list[str] = field(default_factory=list)  # relative paths left out of the layer
    dropped: list[str] = field(default_factory=list)  # sockets (meaningless outside the sandbox), dropped devices


@dataclass
class StagedLayer:
    """A packed layer on the node's disk, not yet published (ImageStore.pack)."""

    blob: Path
    scan: TreeScan
    seconds: float


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def scan(root: Path, rules: ScrubRules | None = None, *, drop_devices: bool = False) -> TreeScan:
    """Walk ``root`` without following links: counts, sparse files, scrub matches.

    Device nodes are refused, or with ``drop_devices`` left out: an OS tree made by a bootstrap tool
    carries /dev nodes that a sandbox never sees (it gets its own /dev), while a sandbox's own writable
    layer cannot legitimately hold one.
    """
    result = TreeScan()
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(root / rel if rel else root))
        except OSError as e:
            raise BackendError(f"cannot read {rel or '/'} while packing: {e}") from e
        for entry in entries:
            path = f"{rel}/{entry.name}" if rel else entry.name
            if rules is not None and rules.matches(path):
                result.scrubbed.append(path)
                continue
            st = entry.stat(follow_symlinks=False)
            result.entries += 1
            if stat.S_ISDIR(st.st_mode):
                try:
                    if os.getxattr(entry.path, "trusted.overlay.opaque", follow_symlinks=False) == b"y":
                        result.opaque_dirs += 1
                except OSError:
                    pass
                stack.append(path)
            elif stat.S_ISREG(st.st_mode):
                result.files += 1
                result.bytes += st.st_size
                if st.st_blocks * 512 + SPARSE_SLACK < st.st_size:
                    result.sparse_files += 1
            elif _is_whiteout(st):
                result.whiteouts += 1
            elif (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)) and drop_devices:
                result.dropped.append(path)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                raise InvalidRequest(f"refusing to pack device node /{path}: layers may not carry devices")
            elif stat.S_ISSOCK(st.st_mode):
                result.dropped.append(path)
    return result


def mkfs_argv(src: Path, out: Path, scanned: TreeScan) -> list[str]:
    tool = shutil.which("mkfs.erofs")
    if tool is None:
        raise BackendError("mkfs.erofs is not installed (apt-get install erofs-utils)")
    argv = [tool, "--quiet", "--preserve-mtime"]
    if scanned.sparse_files:
        argv.append("--chunksize=4096")
    for rel in (*scanned.scrubbed, *scanned.dropped):
        argv.append(f"--exclude-path={rel}")
    argv += [str(out), str(src)]
    return argv


async def mkfs(src: Path, out: Path, scanned: TreeScan) -> None:
    """Pack ``src`` (already scanned) into the EROFS image ``out``, leaving out what the scan excluded."""
    status, output = await run(mkfs_argv(src, out, scanned), timeout=3600)
    if status != 0:
        await asyncio.to_thread(out.unlink, missing_ok=True)
        text = output.decode(errors="replace").strip()[-2000:]
        if "No space left" in text:
            raise StorageFull(f"no space left on the node to pack {src}: {text}")
        raise BackendError(f"mkfs.erofs failed with status {status}: {text}")
