"""A container sandbox's root filesystem: image layers under a writable layer on a size-limited tmpfs.

Layout in the bundle: ``lower-N/`` (the image's layers, idmapped when the sandbox has its own user
namespace), ``disk/`` (the tmpfs holding ``upper/`` and ``work/``, and a function worker's ``tmp/``),
``rootfs/`` (the overlay), ``volume-N/`` (the named volumes it mounts, bound in by the runtime).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ...errors import BackendError
from ...isolation.idmap import idmapped_bind
from ...isolation.mounts import MS_NODEV, MS_NOSUID, mount, umount
from ...store.records import VolumeMount


def mount_rootfs(
    bundle: Path,
    layers: Sequence[Path],
    disk_bytes: int,
    uid_base: int | None,
    userns_fd: int | None,
    scratch: bool = False,
) -> Path:
    """``scratch``: also a ``tmp/`` beside the writable layer, bound at the sandbox's /tmp (function
    workers, whose /tmp is emptied between users without touching the overlay)."""
    for layer in layers:
        # a layer mount detached under this creation (the layer fetcher was replaced) is an empty
        # directory: a clear error, not a sandbox without its files
        if not os.path.ismount(layer):
            raise BackendError(
                f"image layer {layer.name[:16]} is no longer mounted (the layer fetcher was "
                "restarted while this sandbox was created); create it again"
            )
    rootfs, disk = bundle / "rootfs", bundle / "disk"
    rootfs.mkdir(parents=True)
    disk.mkdir()
    # The writable layer lives on its own tmpfs: its size is the disk limit, its inode count bounded,
    # and its pages are charged to the memory cgroup of whoever writes them.
    inodes = max(16384, min(disk_bytes // 4096, 4 << 20))
    owner = f",uid={uid_base},gid={uid_base}" if uid_base is not None else ""
    mount("tmpfs", disk, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_bytes},nr_inodes={inodes},mode=0755{owner}")
    for sub in ("upper", "work", "tmp") if scratch else ("upper", "work"):
        (disk / sub).mkdir()
        if uid_base is not None:
            os.chown(disk / sub, uid_base, uid_base)
    if scratch:
        os.chmod(disk / "tmp", 0o1777)
    lowers = list(layers)
    if userns_fd is not None:
        # each layer shown through the sandbox's id mapping: host root's files are the sandbox root's
        mapped = []
        for i, layer in enumerate(layers):
            target = bundle / f"lower-{i}"
            target.mkdir()
            idmapped_bind(layer, target, userns_fd)
            mapped.append(target)
        lowers = mapped
    # Named by descriptor: overlayfs shows its options verbatim in the sandbox's /proc/self/mountinfo,
    # and host paths there would tell a sandbox where the daemon keeps its state.
    fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in [*reversed(lowers), disk / "upper", disk / "work"]]
    try:
        *lower_fds, upper, work = (f"/proc/self/fd/{fd}" for fd in fds)
        mount("overlay", rootfs, "overlay", 0, f"lowerdir={':'.join(lower_fds)},upperdir={upper},workdir={work}")
    finally:
        for fd in fds:
            os.close(fd)
    return rootfs


def bind_volumes(bundle: Path, volumes: Sequence[VolumeMount], userns_fd: int | None) -> None:
    """Each named volume's host mount shown at ``volume-N`` in the bundle (N its place in ``volumes``),
    read-only where the sandbox mounts it so, through the sandbox's id mapping: the volume's files
    keep the ids the sandboxes see (root's are host root's on disk), whichever sandbox wrote them.
    The runtime binds these at their paths (spec.py); the read-only flag is locked in the sandbox's
    user namespace, so its root cannot remount them writable."""
    for i, volume in enumerate(volumes):
        target = bundle / f"volume-{i}"
        target.mkdir()
        idmapped_bind(Path(volume.source), target, userns_fd, read_only=volume.read_only)


def unmount_rootfs(bundle: Path) -> None:
    """Undo mount_rootfs and bind_volumes, overlay first; a missing mount is fine (half-created sandboxes)."""
    targets = [bundle / "rootfs", *sorted(bundle.glob("lower-*")), *sorted(bundle.glob("volume-*")), bundle / "disk"]
    for target in targets:
        try:
            umount(target)
        except OSError:
            umount(target, lazy=True)
