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
import secrets
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
        # not named after the object: a name of 255 bytes (a long tag key's part) leaves no room for a suffix
        tmp = path.with_name(f".{secrets.token_hex(8)}.tmp")
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


class ThrottledRepository(LayerRepository):
    """Another repository behind a simulated network link: a fixed latency per request and a shared
    bandwidth cap. For benchmarks (`dsec bench images`), so that lazy and eager fetching are compared
    over a link slower than the local disk, as a node's link to S3 or a shared file system is."""

    def __init__(self, inner: LayerRepository, latency_s: float, bytes_per_s: float) -> None:
        self.inner = inner
        self.latency_s = latency_s
        self.bytes_per_s = bytes_per_s
        self._link_free_at = 0.0  # when the shared link has sent everything queued on it
        self.requests = 0
        self.bytes = 0

    async def _transfer(self, size: int) -> None:
        loop = asyncio.get_running_loop()
        self.requests += 1
        self.bytes += size
        now = loop.time()
        start = max(now + self.latency_s, self._link_free_at)
        self._link_free_at = start + size / self.bytes_per_s
        await asyncio.sleep(self._link_free_at - now)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        data = await self.inner.get_range(key, start, length)
        await self._transfer(len(data))
        return data

    async def get(self, key: str) -> bytes:
        data = await self.inner.get(key)
        await self._transfer(len(data))
        return data

    async def put(self, key: str, data: bytes) -> None:
        await self._transfer(len(data))
        await self.inner.put(key, data)

    async def exists(self, key: str) -> bool:
        await self._transfer(0)
        return await self.inner.exists(key)

    async def size(self, key: str) -> int:
        await self._transfer(0)
        return await self.inner.size(key)

    async def list(self, prefix: str = "") -> builtins.list[str]:
        await self._transfer(0)
        return await self.inner.list(prefix)

    async def delete(self, key: str) -> None:
        await self._transfer(0)
        await self.inner.delete(key)


def open_repository(spec: str | Path) -> LayerRepository:
    """A repository from its spec: a directory path, or ``s3://bucket[/prefix][?endpoint=URL&region=R]``,
    or either behind a simulated link: ``throttle:LATENCY_MS:MBYTES_PER_S:SPEC`` (benchmarks).

    S3 credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, never from the spec (it is logged).
    """
    text = str(spec)
    if text.startswith("throttle:"):
        try:
            _, latency_ms, mbps, inner = text.split(":", 3)
            latency, rate = float(latency_ms) / 1000, float(mbps) * 1e6
        except ValueError:
            raise InvalidRequest(f"repository {text!r}: expected throttle:LATENCY_MS:MBYTES_PER_S:SPEC") from None
        if latency < 0 or rate <= 0:
            raise InvalidRequest(f"repository {text!r}: latency must be >= 0 and bandwidth > 0")
        return ThrottledRepository(open_repository(inner), latency, rate)
    if not text.startswith("s3://"):
        if "://" in text:
            raise InvalidRequest(f"unsupported repository {text!r}: expected a directory or s3://bucket[/prefix]")
        return LocalRepository(Path(text))
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(text)
    if not parts.netloc:
        raise InvalidRequest(f"repository {text!r} names no bucket")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"endpoint", "region"}
    if unknown:
        raise InvalidRequest(f"unknown repository options {sorted(unknown)} in {text!r} (known: endpoint, region)")
    return S3Repository(
        parts.netloc,
        endpoint=query.get("endpoint"),
        region=query.get("region", "us-east-1"),
        prefix=parts.path.strip("/"),
        access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
        secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
    )
