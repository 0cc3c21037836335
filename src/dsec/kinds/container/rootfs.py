"""A container sandbox's root filesystem: image layers under a writable layer on a size-limited tmpfs.

Layout in the bundle: ``lower-N/`` (the image's layers, idmapped when the sandbox has its own user
namespace), ``disk/`` (the tmpfs holding ``upper/`` and ``work/``, and a function worker's ``tmp/``),
``rootfs/`` (the overlay), ``volume-N/`` (the named volumes it mounts, bound in by the runtime).

These mounts are made in a mount namespace of the sandbox's own (``SandboxRoots``), never in the
host's: see isolation/mntns.py for why.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ...errors import BackendError
from ...images.lazy import mount_layer
from ...isolation.idmap import idmapped_bind
from ...isolation.mntns import MountNamespaces, is_mount_namespace
from ...isolation.mounts import MS_NODEV, MS_NOSUID, mount, umount
from ...proc import spawn
from ...store.records import VolumeMount

log = logging.getLogger("dsec.container")

T = TypeVar("T")

# where the sandbox's init holds its mount namespace: what a restarted daemon finds it by. The runtime
# passes fds 3.. in a row and the agent parks a socket on fd 4 while no daemon is attached (agent.c):
# fd 4 starts as a second copy, given up then.
NS_FD = 5


@dataclass
class _Root:
    ns: int | None  # the sandbox's mount namespace while the daemon holds it (until its init does)
    ns_id: tuple[int, int]  # (st_dev, st_ino) of that namespace: what its init's fd must still be
    bundle: int  # the bundle directory opened inside that namespace
    init_pid: int | None = None

    def close(self) -> None:
        for fd in (self.bundle, self.ns):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.ns = None


def _ns_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class SandboxRoots:
    """Each sandbox's mounts in a mount namespace of its own, and the ways into it.

    The daemon reaches the mounts through a descriptor of the bundle opened inside the namespace:
    a path walk from ``/proc/<daemon>/fd/<N>`` stays in that namespace, for the daemon's threads and
    for the helpers it spawns alike. The runtime is started inside it (``start``); mounting more
    (a snapshot's idmapped view) and unmounting happen inside it (``inside``). The sandbox's init is
    given the namespace as fd ``NS_FD`` and holds it as long as it runs: once it does (``settle``), the
    daemon lets its own descriptor go and opens the init's when it needs to enter (each descriptor the
    daemon holds is copied into, and closed in, every process it starts), checking it is the same
    namespace; a restarted daemon finds it the same way (``adopt``). A sandbox made without (an init
    that would not keep the descriptor, or one made before this existed) has its mounts in the host's
    namespace, as before.
    """

    def __init__(self, namespaces: MountNamespaces) -> None:
        self.namespaces = namespaces
        self._roots: dict[str, _Root] = {}

    async def mount(
        self,
        sid: str,
        bundle: Path,
        mounter: Callable[[], None],
        *,
        own_namespace: bool,
    ) -> None:
        """Run ``mounter`` (mount_rootfs, bind_volumes) in a new namespace of the sandbox's own."""

        def build() -> int:
            mounter()
            return os.open(bundle, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

        if not own_namespace:
            await asyncio.to_thread(mounter)
            return
        ns, fd = await self.namespaces.create(build)
        self.forget(sid)
        self._roots[sid] = _Root(ns, _ns_id(ns), fd)

    def init_of(self, sid: str) -> int | None:
        """The sandbox's init, where it holds the sandbox's own mount namespace (None: not known)."""
        root = self._roots.get(sid)
        return root.init_pid if root is not None else None

    def view(self, sid: str, bundle: Path) -> Path:
        """Where the daemon finds the sandbox's bundle with its mounts."""
        root = self._roots.get(sid)
        return bundle if root is None else Path(f"/proc/{os.getpid()}/fd/{root.bundle}")

    def init_fds(self, sid: str) -> dict[int, int]:
        """Descriptors for the sandbox's init beside its channel on fd 3."""
        root = self._roots.get(sid)
        if root is None or root.ns is None:
            return {}
        return {NS_FD - 1: root.ns, NS_FD: root.ns}

    def settle(self, sid: str, init_pid: int) -> None:
        """The sandbox's init (``init_pid``) runs and holds the namespace: the daemon's copy can go."""
        root = self._roots.get(sid)
        if root is None or root.ns is None:
            return
        ns = self._from_init(root.ns_id, init_pid)
        if ns is None:
            return  # keep ours: the init does not hold it (where it would, it is about to be killed)
        os.close(ns)
        os.close(root.ns)
        root.ns, root.init_pid = None, init_pid

    @staticmethod
    def _from_init(ns_id: tuple[int, int] | None, init_pid: int) -> int | None:
        """The init's descriptor of the namespace, if it is one (and the one expected)."""
        try:
            ns = os.open(f"/proc/{init_pid}/fd/{NS_FD}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        if not is_mount_namespace(ns) or (ns_id is not None and _ns_id(ns) != ns_id):
            os.close(ns)  # a recycled pid, or an init made before this existed
            return None
        return ns

    def starter(self, sid: str) -> Callable[[Sequence[str], Mapping[int, int]], Awaitable[int]] | None:
        """How to start a process in the sandbox's namespace (``proc.run``'s ``start``)."""
        root = self._roots.get(sid)
        if root is None or root.ns is None:
            return None
        ns = root.ns

        async def start(argv: Sequence[str], fds: Mapping[int, int]) -> int:
            return await self.namespaces.enter(ns, spawn, argv, fds)

        return start

    async def inside(self, sid: str, fn: Callable[..., T], *args: object, own: bool = False) -> T:
        """Run ``fn`` where the sandbox's mounts are (on a thread either way). ``own``: only in a
        namespace of the sandbox's own, never the host's (work that mounts, for a sandbox that may have
        ended meanwhile)."""
        root = self._roots.get(sid)
        if root is None:
            if own:
                raise OSError(errno.ESRCH, f"sandbox {sid} has no mount namespace of its own (now)")
            return await asyncio.to_thread(fn, *args)
        if root.ns is not None:
            return await self.namespaces.enter(root.ns, fn, *args)
        ns = self._from_init(root.ns_id, root.init_pid) if root.init_pid is not None else None
        if ns is None:
            raise OSError(errno.ESRCH, f"sandbox {sid} no longer runs: its mounts are gone")
        try:
            return await self.namespaces.enter(ns, fn, *args)
        finally:
            os.close(ns)

    async def adopt(self, sid: str, bundle: Path, init_pid: int) -> bool:
        """After a restart: find the namespace of a running sandbox again through its init."""
        if sid in self._roots:
            return True
        ns = self._from_init(None, init_pid)
        if ns is None:
            return False  # made with its mounts in the host's namespace
        try:
            fd = await self.namespaces.enter(ns, os.open, bundle, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            log.warning("%s: cannot reach its mounts again: %s", sid, e)
            return False
        finally:
            ns_id = _ns_id(ns)
            os.close(ns)
        self._roots[sid] = _Root(None, ns_id, fd, init_pid)
        return True

    async def unmount(self, sid: str, bundle: Path) -> None:
        """Undo the mounts (where they are) and let go of the namespace. Called once the sandbox's
        processes are gone: a namespace no process holds any more has taken its mounts with it."""
        root = self._roots.pop(sid, None)
        try:
            if root is None:
                await asyncio.to_thread(unmount_rootfs, bundle)
            elif root.ns is not None:
                await self.namespaces.enter(root.ns, unmount_rootfs, bundle)
        finally:
            if root is not None:
                root.close()

    def forget(self, sid: str) -> None:
        root = self._roots.pop(sid, None)
        if root is not None:
            root.close()


def mount_rootfs(
    bundle: Path,
    layers: Sequence[Path],
    disk_bytes: int,
    uid_base: int | None,
    userns_fd: int | None,
    scratch: bool = False,
    stack: Sequence[Path] = (),
) -> Path:
    """``scratch``: also a ``tmp/`` beside the writable layer, bound at the sandbox's /tmp (function
    workers, whose /tmp is emptied between users without touching the overlay). ``stack``: EROFS files
    (a checkpoint's layers) to mount here, in the sandbox's own namespace, on top of ``layers``."""
    for layer in layers:
        # a layer mount detached under this creation (the layer fetcher was replaced) is an empty
        # directory: a clear error, not a sandbox without its files
        if not os.path.ismount(layer):
            raise BackendError(
                f"image layer {layer.name[:16]} is no longer mounted (the layer fetcher was "
                "restarted while this sandbox was created); create it again"
            )
    return mount_overlay(bundle, [], layers, disk_bytes, uid_base, userns_fd, scratch, stack)


def mount_overlay(
    at: Path,
    mapped_below: Sequence[Path],
    layers: Sequence[Path],
    disk_bytes: int,
    uid_base: int | None,
    userns_fd: int | None,
    scratch: bool = False,
    stack: Sequence[Path] = (),
) -> Path:
    """A root in ``at``: ``layers`` and ``stack``'s files over ``mapped_below`` (layers mounted already,
    as the sandbox sees them: a rollback in place keeps its image's), a new writable layer on top."""
    rootfs, disk = at / "rootfs", at / "disk"
    rootfs.mkdir(parents=True)
    disk.mkdir()
    layers = [*layers, *_mount_stack(at, stack)]
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
        lowers = []
        for i, layer in enumerate(layers, start=len(mapped_below)):
            target = at / f"lower-{i}"
            target.mkdir()
            idmapped_bind(layer, target, userns_fd)
            lowers.append(target)
    lowers = [*mapped_below, *lowers]
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


def _mount_stack(bundle: Path, stack: Sequence[Path]) -> list[Path]:
    """A checkpoint's layer files, each mounted in the bundle (they go with the sandbox's namespace)."""
    mounted = []
    for i, layer in enumerate(stack):
        target = bundle / f"stack-{i}"
        target.mkdir()
        mount_layer(layer, target)
        mounted.append(target)
    return mounted


def unmount_rootfs(bundle: Path) -> None:
    """Undo mount_rootfs and bind_volumes, overlay first; a missing mount is fine (half-created sandboxes)."""
    targets = [
        bundle / "rootfs",
        *sorted(bundle.glob("lower-*")),
        *sorted(bundle.glob("stack-*")),
        *sorted(bundle.glob("volume-*")),
        bundle / "disk",
    ]
    for target in targets:
        try:
            umount(target)
        except OSError:
            umount(target, lazy=True)
