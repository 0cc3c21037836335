"""The file API of container sandboxes. Files are read and written on the host, in the sandbox's
overlay root (or a named volume's host mount, for paths in it), confined to it by openat2
(isolation/rootpath.py); nothing inside the sandbox is asked.
Archives are the exception: the helper busybox packs and unpacks them inside the sandbox."""

from __future__ import annotations

import asyncio
import posixpath
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import InvalidRequest
from ...isolation.rootpath import RootFS, clean_path
from ...protocol.sandbox import ExecResult, FileEntry
from ...store.records import SandboxRecord, VolumeMount
from ..base import MAX_FILE_READ
from . import spec
from .execution import ExecPlan
from .state import ContainerState


class ContainerFiles:
    """Mixed into the ContainerBackend, which provides what is declared here."""

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
        fs, path = self._fs(rec, path)
        return await asyncio.to_thread(fs.read, path, MAX_FILE_READ)

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, mode: int = 0o644) -> None:
        fs, path = self._fs(rec, path, writing=True)
        await asyncio.to_thread(fs.write, path, data, mode)

    async def list_dir(self, rec: SandboxRecord, path: str) -> list[FileEntry]:
        fs, inner = self._fs(rec, path)
        entries = await asyncio.to_thread(fs.list, inner)
        if inner == path:
            return entries
        # the view's paths are the volume's own: give them as the sandbox names them
        base = "/" + clean_path(path).lstrip(".")
        return [e.model_copy(update={"path": posixpath.join(base, e.name)}) for e in entries]

    async def remove(self, rec: SandboxRecord, path: str, recursive: bool = False) -> None:
        self._mount_point(rec, path)
        fs, path = self._fs(rec, path, writing=True)
        await asyncio.to_thread(fs.remove, path, recursive)

    async def mkdir(self, rec: SandboxRecord, path: str) -> None:
        fs, path = self._fs(rec, path, writing=True)
        await asyncio.to_thread(fs.mkdir, path)

    async def stat(self, rec: SandboxRecord, path: str) -> FileEntry:
        fs, inner = self._fs(rec, path)
        entry = await asyncio.to_thread(fs.stat, inner)
        full = "/" + clean_path(path).lstrip(".")
        return entry.model_copy(update={"path": full, "name": posixpath.basename(full) or "/"})

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
        target = "/" + clean_path(path).lstrip(".")
        bb = f"{spec.HELPER_MOUNT}/busybox"
        script = f'{bb} mkdir -p "$1" && exec {bb} tar -x -o -f - -C "$1"'
        plan = ExecPlan(argv=[bb, "sh", "-c", script, "untar", target], stdin=data, timeout=600, limit=1 << 16)
        res = await self._run(rec, plan)
        if res.exit_code != 0:
            raise InvalidRequest(f"cannot unpack the archive into {path}: {res.stderr.strip()[-500:]}")

    async def download_tar(self, rec: SandboxRecord, path: str) -> bytes:
        target = "/" + clean_path(path).lstrip(".")
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
