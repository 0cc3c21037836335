"""Where image layers live: one small interface over a local directory and an S3-compatible store.

The local directory is the embedded default and also serves any shared file system mounted on every
node (NFS, CephFS, JuiceFS, 3FS). S3 goes through obstore. Keys are relative paths such as
``chunks/ab/abcdef…``; values are immutable once written (content addressing makes rewrites idempotent).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from ..errors import BackendError, InvalidRequest, NotFound

T = TypeVar("T")
_KEY = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


class ObjectNotFound(NotFound):
    """No object under this key in the layer repository."""

    code = "object_not_found"


def check_key(key: str) -> str:
    if not _KEY.match(key) or any(part in (".", "..") for part in key.split("/")) or len(key) > 1024:
        raise InvalidRequest(f"invalid repository key {key!r}")
    return key


class LayerRepository(ABC):
    """get a byte range, put, exists, list, delete."""

    @abstractmethod
    async def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (fewer only at the end of the object)."""

    @abstractmethod
    async def get(self, key: str) -> bytes: ...

    @abstractmethod
    async def put(self, key: str, data: bytes) -> None:
        """Store atomically: a reader never sees a partial object."""

    @abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abstractmethod
    async def size(self, key: str) -> int: ...

    @abstractmethod
    async def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix``, sorted."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove; a missing key is not an error."""


class LocalRepository(LayerRepository):
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise InvalidRequest("byte range must not be negative")
        return await asyncio.to_thread(self._read, key, start, length)

    def _read(self, key: str, start: int, length: int | None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read() if length is None else f.read(length)
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.root}") from None

    async def get(self, key: str) -> bytes:
        return await asyncio.to_thread(self._read, key, 0, None)

    async def put(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(self._write, key, data)

    def _write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(data)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # durable before it becomes visible under its name
            os.rename(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise BackendError(f"cannot write {key!r} to {self.root}: {e}") from e

    async def exists(self, key: str) -> bool:
        return await asyncio.to_thread(self._path(key).is_file)

    async def size(self, key: str) -> int:
        try:
            return (await asyncio.to_thread(self._path(key).stat)).st_size
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.root}") from None

    async def list(self, prefix: str = "") -> list[str]:
        return await asyncio.to_thread(self._list, prefix)

    def _list(self, prefix: str) -> builtins.list[str]:
        keys = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith("."):
                    continue  # in-flight temporary files
                key = os.path.relpath(os.path.join(dirpath, name), self.root)
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    async def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self._path(key).unlink)


class S3Repository(LayerRepository):
    """Any S3-compatible store (AWS, MinIO, SeaweedFS, Ceph RGW) through obstore."""

    def __init__(
        self,
        bucket: str,
        *,
        endpoint: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        region: str = "us-east-1",
        prefix: str = "",
    ) -> None:
        from obstore.store import S3Store

        config: dict[str, str] = {"region": region}
        if endpoint:
            config["endpoint"] = endpoint
            config["virtual_hosted_style_request"] = "false"
            if endpoint.startswith("http://"):
                config["allow_http"] = "true"
        if access_key_id:
            config["access_key_id"] = access_key_id
        if secret_access_key:
            config["secret_access_key"] = secret_access_key
        self.prefix = prefix.strip("/")
        self.bucket = bucket
        self._store = S3Store(bucket, prefix=self.prefix or None, config=config)  # type: ignore[arg-type]

    async def _call(self, doing: str, key: str, op: Awaitable[T]) -> T:
        """obstore's exceptions as dsec's: a missing object is ObjectNotFound, anything else BackendError."""
        try:
            return await op
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in s3://{self.bucket}") from None
        except Exception as e:
            raise BackendError(f"{doing} {key!r} in s3://{self.bucket} failed: {e}") from e

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        import obstore

        key = check_key(key)  # a bad key is the caller's error, not the store's
        if start < 0 or length < 0:
            raise InvalidRequest("byte range must not be negative")
        length = min(length, max(0, await self.size(key) - start))
        if length == 0:
            return b""
        data = await self._call("reading", key, obstore.get_range_async(self._store, key, start=start, length=length))
        return bytes(data)

    async def get(self, key: str) -> bytes:
        import obstore

        async def fetch() -> bytes:
            result = await obstore.get_async(self._store, key)
            return bytes(await result.bytes_async())

        key = check_key(key)
        return await self._call("reading", key, fetch())

    async def put(self, key: str, data: bytes) -> None:
        import obstore

        key = check_key(key)
        await self._call("writing", key, obstore.put_async(self._store, key, data))  # one PUT is atomic in S3

    async def exists(self, key: str) -> bool:
        try:
            await self.size(key)
            return True
        except ObjectNotFound:
            return False

    async def size(self, key: str) -> int:
        import obstore

        key = check_key(key)
        meta = await self._call("looking up", key, obstore.head_async(self._store, key))
        return int(meta["size"])

    async def list(self, prefix: str = "") -> list[str]:
        import obstore

        async def collect() -> builtins.list[str]:
            keys: builtins.list[str] = []
            async for batch in obstore.list(self._store, prefix=prefix or None):
                keys.extend(str(m["path"]) for m in batch)
            return sorted(keys)

        return await self._call("listing", prefix or "/", collect())

    async def delete(self, key: str) -> None:
        import obstore

        key = check_key(key)
        with contextlib.suppress(ObjectNotFound):  # deleting what is not there is fine
            await self._call("deleting", key, obstore.delete_async(self._store, key))
