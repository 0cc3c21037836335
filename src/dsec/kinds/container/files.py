"""The file API of container sandboxes. Files are read and written on the host, in the sandbox's
overlay root (or a named volume's host mount, for paths in it), confined to it by openat2
(isolation/rootpath.py); nothing inside the sandbox is asked.
Archives are the exception: the helper busybox packs and unpacks them inside the sandbox; and so are
reads of /proc and /sys, which exist only in the sandbox's own namespaces."""

from __future__ import annotations

import asyncio
import posixpath
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import FileNotFoundInSandbox, InvalidRequest
from ...isolation import inotify, rootpath_meta
from ...isolation.idmap import RANGE
from ...isolation.rootpath import RootFS, clean_path
from ...isolation.rootwatch import LIMITS, RootWatch
from ...protocol.sandbox import ExecResult, FileEntry
from ...store.records import SandboxRecord, VolumeMount
from ..base import MAX_FILE_READ, FileWatch
from . import spec
from .execution import ExecPlan
from .state import ContainerState

OVERFLOW_ID = 65534  # what the kernel shows for an id outside a user namespace's map


class ContainerFiles:
    """Mixed into the ContainerBackend, which provides what is declared here."""

    _inotify: inotify.Hub | None = None  # made at the first watch: one per backend
    keeps_metadata = True  # as user.e2b.* extended attributes (overlayfs and volumes keep them)

    if TYPE_CHECKING:

        def bundle_dir(self, rec: SandboxRecord) -> Path: ...

        async def _run(self, rec: SandboxRecord, plan: ExecPlan) -> ExecResult: ...

    def _fs(self, rec: SandboxRecord, path: str = "/", *, writing: bool = False) -> tuple[RootFS, str]:
        """The file API's view of ``path``: the overlay root; for a path in a named volume, the volume's
        host mount (which the overlay does not show); for a function worker's /tmp (bound from beside
        the writable layer), that directory. ``writing``: refused on a volume mounted read-only."""
        state = ContainerState(rec)
        base = state.uid_base
        uid, gid = state.user or (0, 0)
        if base is not None:
            owner: tuple[int, int] | None = (base + uid, base + gid)
        else:
            owner = (uid, gid) if uid or gid else None
        clean = clean_path(path)
        volume = _volume_of(rec, clean)
        if volume is not None:
            if writing and volume.read_only:
                raise InvalidRequest(f"{path}: read-only file system (volume {volume.name!r} is mounted read-only)")
            # a volume holds the ids its sandboxes see (its mounts are idmapped): the account as is
            inner = "/" + clean.removeprefix(volume.path.lstrip("/")).lstrip("/")
            return RootFS(volume.source, owner=(uid, gid) if uid or gid else None), inner
        if state.worker and (clean == "tmp" or clean.startswith("tmp/")):
            scratch = self.bundle_dir(rec) / "disk" / "tmp"
            return RootFS(str(scratch), owner=owner), "/" + clean.removeprefix("tmp").lstrip("/")
        return RootFS(str(self.bundle_dir(rec) / "rootfs"), owner=owner), path

    def _mount_point(self, rec: SandboxRecord, path: str) -> None:
        """Refuse to remove or move where a volume is mounted (its root is not an entry of anything)."""
        volume = _volume_of(rec, clean_path(path))
        if volume is not None and clean_path(path) == volume.path.lstrip("/"):
            raise InvalidRequest(f"{path} is where volume {volume.name!r} is mounted: it cannot be removed or moved")

    async def read_file(self, rec: SandboxRecord, path: str) -> bytes:
        if _kernel_view(rec, path):
            return await self._read_inside(rec, path)
        fs, path = self._fs(rec, path)
        return await asyncio.to_thread(fs.read, path, MAX_FILE_READ)

    async def _read_inside(self, rec: SandboxRecord, path: str) -> bytes:
        """A file of the sandbox's /proc or /sys, which exist only in its own namespaces (not in the root
        filesystem the host reads): read there by the helper busybox, as the sandbox's account."""
        target = _absolute(path)
        bb = f"{spec.HELPER_MOUNT}/busybox"
        argv = [bb, "head", "-c", str(MAX_FILE_READ + 1), "--", target]
        plan = ExecPlan(argv=argv, stdin=None, timeout=30, limit=1 << 16, raw=bytearray())
        plan.user = ContainerState(rec).user
        res = await self._run(rec, plan)
        if res.exit_code != 0:
            why = res.stderr.strip()[-300:]
            if "No such file" in why:
                raise FileNotFoundInSandbox(f"no such file or directory in the sandbox: {target}")
            raise InvalidRequest(f"cannot read {target}: {why or f'exit code {res.exit_code}'}")
        assert plan.raw is not None
        if len(plan.raw) > MAX_FILE_READ:
            raise InvalidRequest(f"{target} is larger than {MAX_FILE_READ >> 20} MiB")
        return bytes(plan.raw)

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, mode: int = 0o644) -> None:
        fs, path = self._fs(rec, path, writing=True)

        def written() -> None:
            fs.write(path, data, mode)
            rootpath_meta.set_metadata(fs, path, {})  # a write replaces the file: its metadata goes too

        await asyncio.to_thread(written)

    def _as_seen(
        self, rec: SandboxRecord, path: str, fs: RootFS, found: list[tuple[FileEntry, str]]
    ) -> list[FileEntry]:
        """Entries (each with the path the sandbox names it by, and its path in ``fs``) as the sandbox sees
        them: with its own uids and gids (its root's are shifted by its user namespace, a volume's are
        not), and what rootpath_meta adds (metadata, symlink targets)."""
        base = ContainerState(rec).uid_base
        shift = 0 if base is None or _volume_of(rec, clean_path(path)) is not None else base
        out = []
        for entry, inner in found:
            e = rootpath_meta.describe(fs, entry, inner)
            if shift and e.uid is not None and e.gid is not None:
                e = e.model_copy(update={"uid": _unshift(e.uid, shift), "gid": _unshift(e.gid, shift)})
            out.append(e)
        return out

    async def list_dir(self, rec: SandboxRecord, path: str) -> list[FileEntry]:
        fs, inner = self._fs(rec, path)
        base = _absolute(path)

        def listed() -> list[FileEntry]:
            found = [(e.model_copy(update={"path": posixpath.join(base, e.name)}), e.path) for e in fs.list(inner)]
            return self._as_seen(rec, path, fs, found)

        return await asyncio.to_thread(listed)

    async def remove(self, rec: SandboxRecord, path: str, recursive: bool = False) -> None:
        self._mount_point(rec, path)
        fs, path = self._fs(rec, path, writing=True)
        await asyncio.to_thread(fs.remove, path, recursive)

    async def mkdir(self, rec: SandboxRecord, path: str) -> None:
        fs, path = self._fs(rec, path, writing=True)
        await asyncio.to_thread(fs.mkdir, path)

    async def stat(self, rec: SandboxRecord, path: str) -> FileEntry:
        fs, inner = self._fs(rec, path)
        full = _absolute(path)

        def stated() -> FileEntry:
            entry = fs.stat(inner).model_copy(update={"path": full, "name": posixpath.basename(full) or "/"})
            return self._as_seen(rec, path, fs, [(entry, inner)])[0]

        return await asyncio.to_thread(stated)

    async def watch(self, rec: SandboxRecord, path: str, recursive: bool) -> FileWatch | None:
        fs, inner = self._fs(rec, path)
        if self._inotify is None:
            self._inotify = inotify.Hub()
        watch = RootWatch(self._inotify, fs, inner, recursive=recursive)
        try:
            watch.start()  # on the loop: the events are read there
        except OSError as e:
            if e.errno in LIMITS:
                return None  # the host's inotify limits are reached: the core polls instead
            raise
        return watch

    async def set_metadata(self, rec: SandboxRecord, path: str, metadata: dict[str, str]) -> None:
        fs, inner = self._fs(rec, path, writing=True)
        await asyncio.to_thread(rootpath_meta.set_metadata, fs, inner, metadata)

    async def rename(self, rec: SandboxRecord, source: str, destination: str) -> None:
        self._mount_point(rec, source)
        self._mount_point(rec, destination)
        src_fs, src = self._fs(rec, source, writing=True)
        dst_fs, dst = self._fs(rec, destination, writing=True)
        if src_fs.root != dst_fs.root:
            # a function worker's /tmp and each volume are file systems of their own beside the overlay
            raise InvalidRequest(f"cannot move {source} to {destination}: they are on different file systems")
        await asyncio.to_thread(src_fs.rename, src, dst)

    # Archives are packed and unpacked by the helper busybox inside the sandbox's own namespaces, so
    # whatever a hostile archive names (absolute paths, .., links, devices) stays inside the sandbox.
    async def upload_tar(self, rec: SandboxRecord, path: str, data: bytes) -> None:
        target = _absolute(path)
        bb = f"{spec.HELPER_MOUNT}/busybox"
        script = f'{bb} mkdir -p "$1" && exec {bb} tar -x -o -f - -C "$1"'
        plan = ExecPlan(argv=[bb, "sh", "-c", script, "untar", target], stdin=data, timeout=600, limit=1 << 16)
        res = await self._run(rec, plan)
        if res.exit_code != 0:
            raise InvalidRequest(f"cannot unpack the archive into {path}: {res.stderr.strip()[-500:]}")

    async def download_tar(self, rec: SandboxRecord, path: str) -> bytes:
        target = _absolute(path)
        bb = f"{spec.HELPER_MOUNT}/busybox"
        plan = ExecPlan(
            argv=[bb, "tar", "-c", "-f", "-", "-C", target, "."],
            stdin=None,
            timeout=600,
            limit=1 << 16,
            raw=bytearray(),
        )
        res = await self._run(rec, plan)
        if res.exit_code != 0:
            raise InvalidRequest(f"cannot archive {path}: {res.stderr.strip()[-500:]}")
        assert plan.raw is not None
        return bytes(plan.raw)


def _absolute(path: str) -> str:
    """``path`` made clean and absolute (a name at the root may start with a dot: /.config)."""
    clean = clean_path(path)
    return "/" if clean == "." else "/" + clean


def _kernel_view(rec: SandboxRecord, path: str) -> bool:
    """A path in the sandbox's /proc or /sys (unless a volume is mounted there)."""
    clean = clean_path(path)
    top = clean.split("/", 1)[0]
    return top in ("proc", "sys") and _volume_of(rec, clean) is None


def _unshift(host_id: int, base: int) -> int:
    """A host id of the sandbox's user namespace as the sandbox numbers it; one outside the namespace's
    range is its overflow id, as the kernel shows it inside."""
    inner = host_id - base
    return inner if 0 <= inner < RANGE else OVERFLOW_ID


def _volume_of(rec: SandboxRecord, clean: str) -> VolumeMount | None:
    """The named volume a clean path (relative to /) is in, if any. Mount paths never nest (the
    protocol refuses it), so at most one matches. A path is taken as written: a symlink elsewhere that
    points into a volume is followed in the overlay, whose directory under the mount point the sandbox
    never sees (docs/volumes.md)."""
    for volume in rec.volumes:
        inside = volume.path.lstrip("/")
        if clean == inside or clean.startswith(inside + "/"):
            return volume
    return None
