"""What the container kind checks and repairs on the host."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ...errors import BackendError


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


def install_helpers(helper_dir: Path) -> None:
    """Static busybox and catatonit, copied so that a host package upgrade never changes a running sandbox."""
    for name in ("busybox", "catatonit"):
        src = shutil.which(name)
        if src is None:
            raise BackendError(f"{name} is not installed (apt-get install busybox-static catatonit)")
        dst = helper_dir / name
        if not dst.exists() or os.path.getsize(dst) != os.path.getsize(src):
            tmp = dst.with_suffix(".tmp")
            shutil.copy2(src, tmp)
            os.chmod(tmp, 0o555)
            tmp.rename(dst)
