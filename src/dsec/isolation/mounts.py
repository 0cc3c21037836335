"""mount(2)/umount2(2) through ctypes: spawning ``mount`` costs milliseconds per call and silently adds loop devices."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MNT_DETACH = 2


def mount(source: str, target: str | Path, fstype: str, flags: int = 0, data: str = "") -> None:
    rc = _libc.mount(source.encode(), str(target).encode(), fstype.encode(), flags, data.encode() or None)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def umount(target: str | Path, *, lazy: bool = False) -> None:
    """Unmount; a target that is not mounted is not an error."""
    rc = _libc.umount2(str(target).encode(), MNT_DETACH if lazy else 0)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def is_mountpoint(path: str | Path) -> bool:
    target = str(Path(path))
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4].replace("\\040", " ") == target:
                return True
    return False


def mounts_under(path: str | Path) -> list[str]:
    """Mount points at or below ``path``, deepest first (the order to unmount them in)."""
    root = str(Path(path))
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4:
                point = fields[4].replace("\\040", " ")
                if point == root or point.startswith(root.rstrip("/") + "/"):
                    found.append(point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def unmount_under(path: str | Path) -> int:
    """Detach every mount at or below ``path``; returns how many were mounted."""
    points = mounts_under(path)
    for point in points:
        umount(point, lazy=True)
    return len(points)
