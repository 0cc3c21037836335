"""``sb.files``: file operations on one sandbox (single files, directories, tar archives)."""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol, TypeVar

from ..protocol.sandbox import FileEntry, FileList
from ..protocol.trajectory import RecordedCall
from .trajectory import Params, no_result, recorded_bytes
from .transport import Transport

T = TypeVar("T")


class LoggedCall(Protocol):
    """How the sandbox makes a call its trajectory logs (and answers from its log when resuming)."""

    def __call__(
        self,
        op: str,
        params: Params,
        payload: bytes | None,
        live: Callable[[dict[str, str]], Awaitable[T]],
        decode: Callable[[RecordedCall], T],
    ) -> Awaitable[T]: ...


class AsyncFiles:
    """File operations on one sandbox: ``sb.files``."""

    def __init__(self, sandbox_id: str, transport: Callable[[], Transport], call: LoggedCall) -> None:
        self._id = sandbox_id
        self._transport = transport  # the client's, looked up at each call
        self._call = call

    def _url(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self._id}/files{suffix}"

    async def read(self, path: str) -> bytes:
        async def live(headers: dict[str, str]) -> bytes:
            reply = await self._transport().request("GET", self._url(), params={"path": path}, headers=headers)
            return reply.content

        return await self._call("read", {"path": path}, None, live, recorded_bytes)

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        content = data.encode() if isinstance(data, str) else bytes(data)
        params = {"path": path, "mode": mode}

        async def live(headers: dict[str, str]) -> None:
            await self._transport().request("PUT", self._url(), params=params, content=content, headers=headers)

        await self._call("write", params, content, live, no_result)

    async def list(self, path: str = "/") -> list[FileEntry]:
        async def live(headers: dict[str, str]) -> list[FileEntry]:
            reply = await self._transport().request("GET", self._url("/list"), params={"path": path}, headers=headers)
            return FileList.model_validate_json(reply.content).entries

        return await self._call("list", {"path": path}, None, live, _entries)

    async def remove(self, path: str, recursive: bool = False) -> None:
        params: dict[str, str] = {"path": path, "recursive": "true" if recursive else "false"}

        async def live(headers: dict[str, str]) -> None:
            await self._transport().request("DELETE", self._url(), params=params, headers=headers)

        await self._call("remove", {"path": path, "recursive": recursive}, None, live, no_result)

    async def mkdir(self, path: str) -> None:
        async def live(headers: dict[str, str]) -> None:
            await self._transport().request("POST", self._url("/mkdir"), params={"path": path}, headers=headers)

        await self._call("mkdir", {"path": path}, None, live, no_result)

    async def upload_tar(self, path: str, data: bytes) -> None:
        """Unpack a tar archive (bytes) into directory ``path`` inside the sandbox."""
        url = f"/v1/sandboxes/{self._id}/archive"

        async def live(headers: dict[str, str]) -> None:
            transport = self._transport()
            await transport.request("PUT", url, params={"path": path}, content=data, timeout=900, headers=headers)

        await self._call("upload", {"path": path}, data, live, no_result)

    async def download_tar(self, path: str) -> bytes:
        """A tar archive of directory ``path`` inside the sandbox."""
        url = f"/v1/sandboxes/{self._id}/archive"

        async def live(headers: dict[str, str]) -> bytes:
            reply = await self._transport().request("GET", url, params={"path": path}, timeout=900, headers=headers)
            return reply.content

        return await self._call("download", {"path": path}, None, live, recorded_bytes)

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


def _entries(rec: RecordedCall) -> list[FileEntry]:
    return FileList.model_validate(rec.result or {}).entries
