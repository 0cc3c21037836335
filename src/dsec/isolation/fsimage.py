"""File systems kept in files: a sparse ext4 image per named volume, loop-mounted on the host.

The image's size is the volume's quota: the kernel's ext4 answers ENOSPC inside it, and the node's
disk holds only the blocks written (plus the journal and a little metadata, written at creation).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from pathlib import Path

from ..errors import BackendError
from ..proc import run
from .loop import attach_loop, attached_loop
from .mounts import MS_NODEV, MS_NOSUID, mount, umount

MKFS_TIMEOUT = 300.0


def mkfs_available() -> str | None:
    """Why ext4 images cannot be made here, or None."""
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 is not installed (apt-get install e2fsprogs)"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (the loop driver is not loaded)"
    return None


async def make_ext4(image: Path, size: int) -> None:
    """A new sparse file of ``size`` bytes holding an empty ext4 whose root belongs to root (uid 0: the
    sandbox's root, once mapped); nothing is left at ``image`` if this fails."""
    tmp = image.with_name(image.name + ".new")
    try:
        await asyncio.to_thread(_sparse_file, tmp, size)
        # -m 0: nothing reserved for host root, the quota is the volume's own. The file is new and sparse,
        # so its inode tables and journal read as zeros already: lazy init leaves them unwritten (232 KiB
        # on disk for an empty 16 MiB volume, 4.7 MiB for 60 GiB, against 261 MiB with the journal zeroed)
        mkfs = shutil.which("mkfs.ext4") or "/sbin/mkfs.ext4"  # spawned by path: no search of PATH
        options = "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0"
        argv = [mkfs, "-q", "-F", "-m", "0", "-E", options, str(tmp)]
        status, out = await run(argv, timeout=MKFS_TIMEOUT)
        if status != 0:
            raise BackendError(f"mkfs.ext4 failed ({status}): {out.decode(errors='replace')[-400:]}")
        os.rename(tmp, image)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _sparse_file(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def mount_ext4(image: Path, target: Path) -> None:
    """Mount ``image`` read-write at ``target`` through a self-detaching loop device: the one already
    attached to it if its file system outlived its last host mount (never a second file system over
    the same file), else a new one."""
    target.mkdir(parents=True, exist_ok=True)
    loop_fd, device = attached_loop(image) or attach_loop(image, read_only=False)
    try:
        # noinit_itable: no background thread zeroing inode tables into the sparse file
        mount(device, target, "ext4", MS_NOSUID | MS_NODEV, "noinit_itable")
    except OSError as e:
        raise BackendError(f"cannot mount volume image {image.name} at {target}: {e.strerror}") from e
    finally:
        os.close(loop_fd)  # mounted: the mount holds the device; failed: this detaches it


def unmount(target: Path) -> None:
    """Unmount (lazily if busy: a sandbox's idmapped view of it keeps the file system, not this mount)."""
    try:
        umount(target)
    except OSError:
        umount(target, lazy=True)


def used_bytes(image: Path) -> int:
    """Bytes the node's disk holds for the image (its blocks, not its apparent size)."""
    try:
        return os.stat(image).st_blocks * 512
    except FileNotFoundError:
        return 0


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
