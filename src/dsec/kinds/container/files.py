"""The file API of container sandboxes. Files are read and written on the host, in the sandbox's
overlay root, confined to it by openat2 (isolation/rootpath.py); nothing inside the sandbox is asked.
Archives are the exception: the helper busybox packs and unpacks them inside the sandbox."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import InvalidRequest
from ...isolation.rootpath import RootFS, clean_path
from ...protocol.sandbox import ExecResult, FileEntry
from ...store.records import SandboxRecord
from ..base import MAX_FILE_READ
from . import spec
from .execution import ExecPlan
from .state import ContainerState


class ContainerFiles:
    """Mixed into the ContainerBackend, which provides what is declared here."""

    if TYPE_CHECKING:

        def bundle_dir(self, rec: SandboxRecord) -> Path: ...

        async def _run(self, rec: SandboxRecord, plan: ExecPlan) -> ExecResult: ...

    def _fs(self, rec: SandboxRecord, path: str = "/") -> tuple[RootFS, str]:
        """The file API's view of ``path``: the overlay root, or for a function worker's /tmp (bound
        from beside the writable layer, which the overlay does not show) that directory."""
        state = ContainerState(rec)
        base = state.uid_base
        uid, gid = state.user or (0, 0)
        if base is not None:
            owner: tuple[int, int] | None = (base + uid, base + gid)
        else:
            owner = (uid, gid) if uid or gid else None
        clean = clean_path(path)
        if state.worker and (clean == "tmp" or clean.startswith("tmp/")):
            scratch = self.bundle_dir(rec) / "disk" / "tmp"
            return RootFS(str(scratch), owner=owner), "/" + clean.removeprefix("tmp").lstrip("/")
        return RootFS(str(self.bundle_dir(rec) / "rootfs"), owner=owner), path

    async def read_file(self, rec: SandboxRecord, path: str) -> bytes:
        fs, path = self._fs(rec, path)
        return await asyncio.to_thread(fs.read, path, MAX_FILE_READ)

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, mode: int = 0o644) -> None:
        fs, path = self._fs(rec, path)
        await asyncio.to_thread(fs.write, path, data, mode)

    async def list_dir(self, rec: SandboxRecord, path: str) -> list[FileEntry]:
        fs, path = self._fs(rec, path)
        return await asyncio.to_thread(fs.list, path)

    async def remove(self, rec: SandboxRecord, path: str, recursive: bool = False) -> None:
        fs, path = self._fs(rec, path)
        await asyncio.to_thread(fs.remove, path, recursive)

    async def mkdir(self, rec: SandboxRecord, path: str) -> None:
        fs, path = self._fs(rec, path)
        await asyncio.to_thread(fs.mkdir, path)

    async def stat(self, rec: SandboxRecord, path: str) -> FileEntry:
        fs, inner = self._fs(rec, path)
        entry = await asyncio.to_thread(fs.stat, inner)
        return entry.model_copy(update={"path": "/" + clean_path(path).lstrip(".")})

    async def rename(self, rec: SandboxRecord, source: str, destination: str) -> None:
        src_fs, src = self._fs(rec, source)
        dst_fs, dst = self._fs(rec, destination)
        if src_fs.root != dst_fs.root:
            # a function worker's /tmp is a directory of its own beside the overlay
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
