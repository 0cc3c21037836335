"""The core's file actions on a sandbox: each needs a running sandbox, and writes wait while its
writable layer is being packed (snapshot). The kinds do the work, confined to the sandbox's root."""

from __future__ import annotations

import asyncio

from ..isolation import tarcheck
from ..kinds.base import FileWatch
from ..protocol.sandbox import FileEntry
from ..tenancy import OPERATOR, Caller
from .sandboxes import Sandboxes


class FileActions:
    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes

    async def read_file(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> bytes:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        return await backend.read_file(rec, path)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, *, caller: Caller = OPERATOR
    ) -> None:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        await self.sandboxes.not_packing(rec.id)
        await backend.write_file(rec, path, data, mode)

    async def list_dir(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> list[FileEntry]:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        return await backend.list_dir(rec, path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False, *, caller: Caller = OPERATOR) -> None:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        await self.sandboxes.not_packing(rec.id)
        await backend.remove(rec, path, recursive)

    async def mkdir(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> None:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        await self.sandboxes.not_packing(rec.id)
        await backend.mkdir(rec, path)

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes, *, caller: Caller = OPERATOR) -> None:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        # every kind gets only archives whose entries stay inside the destination and fit the disk
        data = await asyncio.to_thread(tarcheck.check_upload, data, rec.limits.disk)
        await self.sandboxes.not_packing(rec.id)
        await self.sandboxes.checked(rec, backend.upload_tar(rec, path, data))

    async def download_tar(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> bytes:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        return await self.sandboxes.checked(rec, backend.download_tar(rec, path))

    async def stat(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> FileEntry:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        return await backend.stat(rec, path)

    async def rename(self, sandbox_id: str, source: str, destination: str, *, caller: Caller = OPERATOR) -> None:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        await self.sandboxes.not_packing(rec.id)
        await backend.rename(rec, source, destination)

    async def watch(
        self, sandbox_id: str, path: str, recursive: bool, *, caller: Caller = OPERATOR
    ) -> FileWatch | None:
        """The kind's own watch of a directory (exact events), or None where it has none."""
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        return await backend.watch(rec, path, recursive)

    async def set_metadata(
        self, sandbox_id: str, path: str, metadata: dict[str, str], *, caller: Caller = OPERATOR
    ) -> None:
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        await self.sandboxes.not_packing(rec.id)
        await backend.set_metadata(rec, path, metadata)
