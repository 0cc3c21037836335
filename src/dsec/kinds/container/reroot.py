"""A container's rollback in place: every process but its init ended, another root filesystem put under it.

Stopping the container and creating it again on a checkpoint's layers costs a whole creation: the
runtime, a new init and agent, the network joined again. Here the container stays (init, agent, cgroups,
network namespace, published ports) and only its root changes:

1. every process but the init ends, its cgroup frozen meanwhile so that none forks past the kill;
2. in the sandbox's roots namespace (rootfs.py), the new root is mounted beside the old one, in
   ``reroot/next/``: the image's layers as they are mounted already, the checkpoint's stack over them,
   a new tmpfs for the writable layer;
3. in the container's own mount namespace a detached copy of it is attached over ``/``, made the root
   with ``pivot_root``, and the old root's mounts (/proc, /dev, /sys, the helpers, volumes) are moved
   onto it before the old root is detached; /dev/shm and /dev/mqueue are emptied, as a new container's;
4. back in the roots namespace the new mounts take the old ones' names, so the rest of the kind finds
   the writable layer where it always does; the old ones are unmounted in the background.

Mounts copied into a namespace that a user namespace owns are locked to their parents; the old root can
be detached anyway because ``pivot_root`` hands its lock to the new root.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import re
import secrets
import select
import shutil
import signal
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ...errors import BackendError
from ...isolation import cgroups
from ...isolation.idmap import attach, idmapped_tree
from ...isolation.mntns import switch_namespace
from ...isolation.mounts import MNT_DETACH, MS_NODEV, MS_NOSUID, mount, umount
from .rootfs import NS_FD, SandboxRoots, mount_overlay, unmount_rootfs

log = logging.getLogger("dsec.container")

NEXT = "next"
SCRATCH = "reroot"
_MS_MOVE = 0x2000
_SYS_MOVE_MOUNT = 429
_SYS_PIVOT_ROOT = 155
_AT_FDCWD = -100
_EMPTIED = ("dev/shm", "dev/mqueue")  # memory of the sandbox's that no checkpoint holds
# What a rollback leaves to the background (unmounting the old root, preparing the next) waits this
# long: the call that follows a rollback, most often an exec, then does not share the CPU with it
# (half a millisecond of a ~2 ms exec on a 2-core host, docs/benchmarks.md)
SETTLE_S = 0.02

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(rc: int, what: str) -> None:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def end_all_but(group: Path, init_pid: int, timeout: float = 5.0) -> None:
    """SIGKILL every process of the cgroup ``group`` (and its children) except ``init_pid``, and wait
    until they are gone. Frozen meanwhile: a frozen process cannot fork, and still dies of SIGKILL.
    Each is killed and waited for through a pidfd: a pid reused meanwhile is never signalled."""
    if not [p for p in cgroups.group_pids(group) if p != init_pid]:
        return  # only the init, which starts nothing while the sandbox is rolled back: nothing can fork
    freeze = group / "cgroup.freeze"
    freeze.write_text("1")
    deadline = time.monotonic() + timeout
    try:
        while pids := [p for p in cgroups.group_pids(group) if p != init_pid]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendError(f"processes of the sandbox did not end: {cgroups.describe_members(group)}")
            _kill_and_wait(pids, left)
    finally:
        with contextlib.suppress(FileNotFoundError):
            freeze.write_text("0")


def _kill_and_wait(pids: list[int], timeout: float) -> None:
    fds = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                fds.append(os.pidfd_open(pid))
        waiting = select.poll()
        for fd in fds:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            waiting.register(fd, select.POLLIN)
        end = time.monotonic() + timeout
        remaining = len(fds)
        while remaining and (left := end - time.monotonic()) > 0:
            for fd, _ in waiting.poll(left * 1000):
                waiting.unregister(fd)
                remaining -= 1
    finally:
        for fd in fds:
            os.close(fd)


def _scratch(bundle: Path) -> Path:
    """A small tmpfs in the bundle (in the roots namespace only) where new roots are built and old ones
    wait to be unmounted: the mount points made and removed on each rollback are then in memory, not
    on the state directory's disk (a millisecond or more each there)."""
    area = bundle / SCRATCH
    if not os.path.ismount(area):
        area.mkdir(exist_ok=True)
        mount("tmpfs", area, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=4096,mode=0700")
    for left in area.glob("old-*"):  # a daemon that stopped before its background unmount
        if left not in _pending_drops:  # not the one a background task of this daemon unmounts now
            drop_old(left)
    return area


def prepare_next(
    bundle: Path,
    image_layers: Sequence[Path],
    disk_bytes: int,
    uid_base: int | None,
    userns_fd: int | None,
    stack: Sequence[Path],
) -> None:
    """Mount the new root in ``reroot/next`` (run in the roots namespace): the image's layers as the
    sandbox has them already, ``stack``'s files over them, a new writable layer. Done ahead of a
    rollback, it waits there unchanged: nothing writes to it until it is the container's root."""
    nxt = _scratch(bundle) / NEXT
    if nxt.exists():
        discard_next(bundle)
    nxt.mkdir()
    n = len(image_layers)
    below = [bundle / f"lower-{i}" for i in range(n)] if userns_fd is not None else list(image_layers)
    mount_overlay(nxt, below, [], disk_bytes, uid_base, userns_fd, False, stack)


def open_next(bundle: Path) -> int:
    """A detached copy of the mounted new root, to attach in the container's namespace."""
    return idmapped_tree(bundle / SCRATCH / NEXT / "rootfs", None, read_only=False)


def discard_next(bundle: Path) -> None:
    """Undo ``prepare_next`` (a rollback that went the other way)."""
    nxt = bundle / SCRATCH / NEXT
    unmount_rootfs(nxt)
    _remove_dirs(nxt)


def _remove_dirs(top: Path) -> None:
    """Remove ``top`` and the empty mount points in it; never a recursive delete, which would go
    through a mount that is still there."""
    with contextlib.suppress(FileNotFoundError):
        for child in top.iterdir():
            with contextlib.suppress(OSError):
                child.rmdir()
    with contextlib.suppress(OSError):
        top.rmdir()


def _mountinfo(proc: int) -> list[list[str]]:
    with open(os.open("thread-self/mountinfo", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc), encoding="utf-8") as f:
        return [line.split() for line in f]


_ESCAPED = re.compile(r"\\([0-7]{3})")


def _unescape(point: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes. No codec here: this runs in
    # the container's namespace, where a codec's lazy import would look in the sandbox's files.
    return _ESCAPED.sub(lambda m: chr(int(m.group(1), 8)), point)


def swap_root(tree: int, proc: int) -> None:
    """Make the detached mount ``tree`` the root of the mount namespace this thread is in (the
    container's), with the old root's mounts moved onto it; ``proc``: the host's /proc, opened before
    entering, to read this namespace's mount table by. Nothing here may import lazily: the thread's
    root is the container's, where an import would look in the sandbox's files."""
    entries = _mountinfo(proc)
    root = next(e for e in entries if e[4] == "/")
    kids = [_unescape(e[4]).lstrip("/") for e in entries if e[1] == root[0] and e[4] != "/"]
    old = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        attach(tree, Path("/"), "the new root")
        os.fchdir(tree)
        _check(_libc.syscall(_SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
        for rel in kids:
            _mount_point_like(old, rel)
            where = ("/" + rel).encode()
            _check(_libc.syscall(_SYS_MOVE_MOUNT, old, rel.encode(), _AT_FDCWD, where, 0), f"moving /{rel}")
        # the old root sits on top of the new one at "/" now; "." names that top mount
        _check(_libc.umount2(b".", MNT_DETACH), "detaching the old root")
    finally:
        os.close(old)
    for rel in _EMPTIED:
        _empty(Path("/") / rel)


def _mount_point_like(old: int, rel: str) -> None:
    """The new root's mount point for the old root's mount at ``rel``: there already (the checkpoint
    holds what the runtime made at creation), else made as the runtime makes it, a directory or a file."""
    target = Path("/") / rel
    if os.path.realpath(target) != str(target):
        # the sandbox's own files decide where a symbolic link leads: never mount through one (crun,
        # making the sandbox again, resolves them safely within its root)
        raise BackendError(f"/{rel} goes through a symbolic link in the checkpoint's files")
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    if stat.S_ISDIR(os.stat(rel, dir_fd=old).st_mode):  # what is mounted there, not what is under it
        target.mkdir()
    else:
        target.touch()


def _empty(d: Path) -> None:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in d.iterdir():
            with contextlib.suppress(OSError):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()


def adopt_next(bundle: Path, image_layers: int) -> Path:
    """The new root's mounts take the old one's names in the bundle (run in the roots namespace, once
    the container stands on the new root); the old ones, but the image's layers both share, are moved
    aside to the directory returned, for ``drop_old``: unmounting them frees the old writable layer's
    pages, which takes a while when it is big."""
    area = bundle / SCRATCH
    nxt, old = area / NEXT, area / f"old-{secrets.token_hex(4)}"
    os.mkdir(old)
    shared = {f"lower-{i}" for i in range(image_layers)}
    # one listing each (not pathlib's glob): this runs while the rollback's caller waits
    layers = sorted(n for n in os.listdir(bundle) if n.startswith(("lower-", "stack-")) and n not in shared)
    arriving = sorted(os.listdir(nxt))
    for name in ["rootfs", *layers, "disk"]:
        if os.path.ismount(bundle / name):
            os.mkdir(old / name)
            mount(str(bundle / name), old / name, "", _MS_MOVE)
    for name in layers:
        if name not in arriving:
            with contextlib.suppress(OSError):
                os.rmdir(bundle / name)
    for name in arriving:
        with contextlib.suppress(FileExistsError):
            os.mkdir(bundle / name)
        mount(str(nxt / name), bundle / name, "", _MS_MOVE)
    _remove_dirs(nxt)
    return old


def drop_old(old: Path) -> None:
    """Unmount what ``adopt_next`` moved aside, overlay first, and remove the directory."""
    try:
        names = [p.name for p in old.iterdir()]
    except FileNotFoundError:
        return
    for name in sorted(names, key=lambda n: (n != "rootfs", n == "disk", n)):
        umount(old / name, lazy=True)
    _remove_dirs(old)


async def reroot(
    roots: SandboxRoots,
    sid: str,
    bundle: Path,
    group: Path,
    init_pid: int,
    image_layers: int,
    prepare: Callable[[], None] | None,
) -> asyncio.Task[None]:
    """The four steps above, on one thread of the roots namespace (each hop to a thread costs more than
    most steps); ``prepare``: ``prepare_next`` with the new root's layers, or None where it is mounted
    already. A failure leaves no ``next`` behind, the container perhaps half moved: the caller stops
    it and makes it again. The old root's mounts are let go of in the background (the task returned),
    once the call that follows a rollback has had the CPU (``SETTLE_S``)."""
    fds = []
    try:
        for path, flags in (
            (f"/proc/{init_pid}/ns/mnt", os.O_RDONLY),
            (f"/proc/{init_pid}/fd/{NS_FD}", os.O_RDONLY),
            ("/proc", os.O_PATH | os.O_DIRECTORY),
        ):
            fds.append(os.open(path, flags | os.O_CLOEXEC))
        container, home, proc = fds
        steps = functools.partial(_steps, group, init_pid, bundle, image_layers, prepare, container, home, proc)
        old = await roots.inside(sid, steps)
    finally:
        for fd in fds:
            os.close(fd)
    _pending_drops.add(old)
    task = asyncio.get_running_loop().create_task(_drop_later(roots, sid, old))
    _dropping.add(task)
    task.add_done_callback(_dropping.discard)
    return task


def _steps(
    group: Path,
    init_pid: int,
    bundle: Path,
    image_layers: int,
    prepare: Callable[[], None] | None,
    container: int,
    home: int,
    proc: int,
) -> Path:
    """(On a thread in the roots namespace ``home``.) ``container``: the container's mount namespace."""
    end_all_but(group, init_pid)
    if prepare is not None:
        prepare()
    tree = open_next(bundle)
    try:
        switch_namespace(container)
        swap_root(tree, proc)
    except BaseException:
        switch_namespace(home)
        discard_next(bundle)
        raise
    finally:
        os.close(tree)
    switch_namespace(home)
    return adopt_next(bundle, image_layers)


_dropping: set[asyncio.Task[None]] = set()
_pending_drops: set[Path] = set()  # old roots a background task is unmounting (never two at once)


async def _drop_later(roots: SandboxRoots, sid: str, old: Path) -> None:
    try:
        await asyncio.sleep(SETTLE_S)
        await roots.inside(sid, drop_old, old, own=True)
    except OSError as e:  # the sandbox ended meanwhile: its namespace took the mounts with it
        log.debug("%s: the old root's mounts went with the sandbox (%s)", sid, e)
    finally:
        _pending_drops.discard(old)
