"""``sb.files``: file operations on one sandbox (single files, directories, tar archives)."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..models import FileEntry, FileList

if TYPE_CHECKING:
    from .aio import AsyncSandbox


class AsyncFiles:
    """File operations on one sandbox: ``sb.files``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    def _url(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self._sb.id}/files{suffix}"

    async def read(self, path: str) -> bytes:
        reply = await self._sb._t.request("GET", self._url(), params={"path": path})
        return reply.content

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        content = data.encode() if isinstance(data, str) else bytes(data)
        await self._sb._t.request("PUT", self._url(), params={"path": path, "mode": mode}, content=content)

    async def list(self, path: str = "/") -> list[FileEntry]:
        reply = await self._sb._t.request("GET", self._url("/list"), params={"path": path})
        return FileList.model_validate_json(reply.content).entries

    async def remove(self, path: str, recursive: bool = False) -> None:
        params: dict[str, str] = {"path": path, "recursive": "true" if recursive else "false"}
        await self._sb._t.request("DELETE", self._url(), params=params)

    async def mkdir(self, path: str) -> None:
        await self._sb._t.request("POST", self._url("/mkdir"), params={"path": path})

    async def upload_tar(self, path: str, data: bytes) -> None:
        """Unpack a tar archive (bytes) into directory ``path`` inside the sandbox."""
        url = f"/v1/sandboxes/{self._sb.id}/archive"
        await self._sb._t.request("PUT", url, params={"path": path}, content=data, timeout=900)

    async def download_tar(self, path: str) -> bytes:
        """A tar archive of directory ``path`` inside the sandbox."""
        url = f"/v1/sandboxes/{self._sb.id}/archive"
        reply = await self._sb._t.request("GET", url, params={"path": path}, timeout=900)
        return reply.content

    async def upload_dir(self, local_dir: str | Path, path: str) -> None:
        """Copy a local directory's contents into ``path`` inside the sandbox."""
        await self.upload_tar(path, await asyncio.to_thread(_pack, Path(local_dir)))

    async def download_dir(self, path: str, local_dir: str | Path) -> None:
        """Copy directory ``path`` from the sandbox into a local directory (links and devices are refused)."""
        data = await self.download_tar(path)
        await asyncio.to_thread(_extract, data, Path(local_dir))


def _pack(src: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(src), arcname=".")
    return buf.getvalue()


def _extract(data: bytes, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(str(dest), filter="data")
