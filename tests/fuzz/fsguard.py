"""A scratch tree to extract into, and a record of everything around the destination, to prove an
extraction wrote nothing outside it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

DEPTH = 4  # the destination's depth under the root: deeper than any '..' run the strategies draw


def _scratch_parent() -> str | None:
    # tmpfs when there is one: thousands of small trees, made and removed per example
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


@contextlib.contextmanager
def fuzz_root() -> Iterator[tuple[Path, Path]]:
    """(root, dest): ``dest`` is empty, DEPTH levels below ``root``; every level also holds a file, a
    directory with a file and a symlink, the things a hostile archive would aim at."""
    top = Path(tempfile.mkdtemp(prefix="dsec-fuzz-", dir=_scratch_parent()))
    try:
        level = top
        for i in range(DEPTH):
            (level / "secret").write_bytes(b"keep %d\n" % i)
            (level / "a").mkdir()
            (level / "a" / "b").write_bytes(b"keep\n")
            (level / "d").symlink_to("a")
            level = level / f"l{i}"
            level.mkdir()
        dest = level / "dest"
        dest.mkdir()
        yield top, dest
    finally:
        shutil.rmtree(top, ignore_errors=True)


def snapshot(root: Path, skip: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under ``root`` but ``skip``'s subtree: type, mode, owner, links, size, times, content,
    link target and extended attributes."""
    seen: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != skip]
        for name in [*dirnames, *filenames, "."]:
            p = here / name
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                extra: object = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            else:
                extra = None
            xattrs = sorted(os.listxattr(p, follow_symlinks=False))
            key = os.path.relpath(p, root)
            seen[key] = (st.st_mode, st.st_uid, st.st_gid, st.st_nlink, st.st_size, st.st_mtime_ns, extra, xattrs)
    return seen


def strange_entries(dest: Path) -> list[str]:
    """Entries an extraction must never leave: anything but files, directories, symlinks and overlayfs
    whiteouts (0/0 character devices)."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(dest):
        for name in [*dirnames, *filenames]:
            st = os.lstat(os.path.join(dirpath, name))
            whiteout = stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode) or whiteout):
                bad.append(f"{os.path.join(dirpath, name)}: mode {st.st_mode:o} rdev {st.st_rdev}")
    return bad


def allocated(root: Path) -> tuple[int, int]:
    """(bytes of disk the tree under ``root`` takes, entries in it), each inode counted once."""
    inodes: dict[int, int] = {}
    entries = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            st = os.lstat(os.path.join(dirpath, name))
            inodes[st.st_ino] = st.st_blocks * 512
            entries += 1
    return sum(inodes.values()), entries
