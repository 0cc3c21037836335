"""The benches' own mounts (a tmpfs to fill, a plain EROFS to read beside the node's lazy one) and the
mount table as any process on the host sees it: the kernel's interface, not dsec's helpers.

mount(2) by ctypes rather than util-linux's ``mount``: given a regular file of a type libblkid knows
(EROFS), ``mount`` puts a loop device under it, and the local EROFS the images bench compares against
must be mounted straight from its file, as the node mounts a layer.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

MS_RDONLY = 1
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def mount(source: str, target: str | Path, fstype: str, flags: int = 0, data: str = "") -> None:
    rc = _libc.mount(source.encode(), str(target).encode(), fstype.encode(), flags, data.encode() or None)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def umount(target: str | Path, *, lazy: bool = False) -> None:
    """Unmount; a target that is not mounted is not an error (cleanup runs whatever happened before)."""
    rc = _libc.umount2(str(target).encode(), MNT_DETACH if lazy else 0)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mount_points() -> list[str]:
    """Every mount point of this process's mount namespace (/proc/self/mountinfo)."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        return [fields[4].replace("\\040", " ") for line in f if len(fields := line.split()) > 4]


def is_mountpoint(path: str | Path) -> bool:
    return str(Path(path)) in mount_points()


def unmount_under(path: str | Path) -> int:
    """Detach every mount at or below ``path``, deepest first; returns how many there were."""
    root = str(Path(path))
    below = [p for p in mount_points() if p == root or p.startswith(root.rstrip("/") + "/")]
    for point in sorted(below, key=lambda p: p.count("/"), reverse=True):
        umount(point, lazy=True)
    return len(below)
