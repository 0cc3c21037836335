"""What the container kind checks and repairs on the host."""

from __future__ import annotations

import os
from pathlib import Path


def repair_host_devices() -> list[str]:
    """dsec before 2026-12-03 gave crun the host's /dev/null as stdin, which crun chowned to a sandbox's
    root: give it back to host root (a sandbox bound it in and could chmod it for the whole host)."""
    notes = []
    for dev in ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"):
        try:
            st = os.stat(dev)
            if (st.st_uid, st.st_gid) != (0, 0) or (st.st_mode & 0o7777) != 0o666:
                os.chown(dev, 0, 0)
                os.chmod(dev, 0o666)
                notes.append(
                    f"container kind: {dev} was owned by {st.st_uid} mode {st.st_mode & 0o7777:o}; reset to root 666"
                )
        except OSError:
            continue
    return notes


def no_space(path: Path) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 1 << 20
