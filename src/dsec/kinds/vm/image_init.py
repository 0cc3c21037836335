"""Where an image's own init is, looked up on the host in its stacked layers before a VM boots for it.

The layers are the mounted EROFS directories of the image (lowest first), read the way overlayfs stacks
them: the topmost entry wins, a whiteout (a 0/0 character device) hides what is below it, an opaque
directory hides the lower layers' contents of that directory, and symbolic links resolve inside the
image (Debian 12's /sbin is a link to usr/sbin, and its /sbin/init one to /lib/systemd/systemd).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# Where the kernel itself looks for an init, in its order; its last resort, /bin/sh, is no init system.
CANDIDATES = ("/sbin/init", "/etc/init", "/bin/init")
MAX_LINKS = 40  # as the kernel's own path walk: a loop of links ends there


def _whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def lookup(layers: tuple[Path, ...], path: str) -> os.stat_result | None:
    """The stat of ``path`` in the stacked layers, links followed; None when it is not there."""
    every = tuple(reversed(layers))  # topmost first
    parts = [p for p in path.split("/") if p]
    # what the walk stands in: its components, and per depth the layers whose directory merges there
    where: list[str] = []
    visible: list[tuple[Path, ...]] = [every]
    links = 0
    while parts:
        name = parts.pop(0)
        if name == ".":
            continue
        if name == "..":
            if where:
                where.pop()
                visible.pop()
            continue
        found: tuple[Path, os.stat_result] | None = None
        merged: list[Path] = []
        for layer in visible[-1]:
            entry = layer.joinpath(*where, name)
            try:
                st = os.lstat(entry)
            except OSError:
                continue
            if found is None:
                if _whiteout(st):
                    return None
                found = (entry, st)
            elif _whiteout(st) or not stat.S_ISDIR(st.st_mode):
                break  # below a directory, anything but a directory ends the merge
            if not stat.S_ISDIR(found[1].st_mode):
                break
            merged.append(layer)
            if _opaque(entry):
                break
        if found is None:
            return None
        entry, st = found
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                return None
            target = os.readlink(entry)
            if target.startswith("/"):
                where, visible = [], [every]
            parts = [p for p in target.split("/") if p] + parts
            continue
        if parts and not stat.S_ISDIR(st.st_mode):
            return None
        if not parts:
            return st
        where.append(name)
        visible.append(tuple(merged))
    # the path named the root itself
    return os.stat(every[0]) if every else None


def find(layers: tuple[Path, ...]) -> str | None:
    """The first of CANDIDATES that is an executable file in the image, or None."""
    for candidate in CANDIDATES:
        st = lookup(layers, candidate)
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
            return candidate
    return None
