"""The core's file actions on a sandbox: each needs a running sandbox, and writes wait while its
writable layer is being packed (snapshot). The kinds do the work, confined to the sandbox's root."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from ..isolation import tarcheck
from ..protocol.sandbox import FileEntry
from ..tenancy import OPERATOR, Caller

if TYPE_CHECKING:
    from ..kinds.base import Backend
    from ..store.records import SandboxRecord

T = TypeVar("T")


class FileActions:
    """Mixed into the SandboxManager, which provides what is declared here."""

    if TYPE_CHECKING:
        _packing: dict[str, asyncio.Event]

        def _running(self, sandbox_id: str, caller: Caller = OPERATOR) -> tuple[SandboxRecord, Backend]: ...

        async def _checked(self, rec: SandboxRecord, op: Awaitable[T]) -> T: ...

    async def read_file(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> bytes:
        rec, backend = self._running(sandbox_id, caller)
        return await backend.read_file(rec, path)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644, *, caller: Caller = OPERATOR
    ) -> None:
        rec, backend = self._running(sandbox_id, caller)
        await self._not_packing(rec.id)
        await backend.write_file(rec, path, data, mode)

    async def list_dir(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> list[FileEntry]:
        rec, backend = self._running(sandbox_id, caller)
        return await backend.list_dir(rec, path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False, *, caller: Caller = OPERATOR) -> None:
        rec, backend = self._running(sandbox_id, caller)
        await self._not_packing(rec.id)
        await backend.remove(rec, path, recursive)

    async def mkdir(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> None:
        rec, backend = self._running(sandbox_id, caller)
        await self._not_packing(rec.id)
        await backend.mkdir(rec, path)

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes, *, caller: Caller = OPERATOR) -> None:
        rec, backend = self._running(sandbox_id, caller)
        # every kind gets only archives whose entries stay inside the destination and fit the disk
        data = await asyncio.to_thread(tarcheck.check_upload, data, rec.limits.disk)
        await self._not_packing(rec.id)
        await self._checked(rec, backend.upload_tar(rec, path, data))

    async def download_tar(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> bytes:
        rec, backend = self._running(sandbox_id, caller)
        return await self._checked(rec, backend.download_tar(rec, path))

    async def _not_packing(self, sandbox_id: str) -> None:
        packing = self._packing.get(sandbox_id)
        if packing is not None:
            await packing.wait()

    async def stat(self, sandbox_id: str, path: str, *, caller: Caller = OPERATOR) -> FileEntry:
        rec, backend = self._running(sandbox_id, caller)
        return await backend.stat(rec, path)

    async def rename(self, sandbox_id: str, source: str, destination: str, *, caller: Caller = OPERATOR) -> None:
        rec, backend = self._running(sandbox_id, caller)
        await self._not_packing(rec.id)
        await backend.rename(rec, source, destination)
