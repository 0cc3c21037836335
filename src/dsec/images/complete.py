"""A lazy layer whose every chunk is on this node becomes one local file, so it can be read without the fetcher.

Reads through the fetcher's FUSE file cost a round trip through Python for every page the kernel does
not have cached. Once all of a layer's chunks are in the chunk cache, the fetcher writes them, in order,
to ``<dir>/<digest>``: written under a temporary name, checked to hash to the layer's digest (as an eager
fetch is), fsynced, then renamed, so a file under its final name is always the whole, verified layer.
The daemon then mounts the layer from that file (layers.py), and the fetcher serves its own FUSE file
of the layer from it too, for mounts made before.

The layer's chunks are then released from the chunk cache (except those another incomplete layer also
holds): the node keeps a complete layer's bytes once, in its file, not twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import blake3

from .cache import ChunkCache
from .model import LayerManifest

log = logging.getLogger(__name__)


class CompleteLayers:
    def __init__(self, directory: Path, cache: ChunkCache) -> None:
        self.dir = directory
        self.cache = cache
        self.dir.mkdir(parents=True, exist_ok=True)
        self.written = 0  # layers this process wrote
        self.released = 0  # chunks dropped from the cache because their layer now has its file
        self._seq = 0

    def path(self, digest: str) -> Path:
        return self.dir / digest

    def exists(self, digest: str) -> bool:
        return self.path(digest).exists()

    def ready(self, manifest: LayerManifest) -> bool:
        """Whether every chunk of the layer is in the cache (so writing its file fetches nothing)."""
        return all(c in self.cache for c in manifest.chunks)

    async def write(self, manifest: LayerManifest) -> bool:
        """Write the layer's file from the cache (a chunk evicted meanwhile is fetched again); True if
        written."""
        final = self.path(manifest.digest)
        if final.exists():
            return False
        self._seq += 1
        tmp = self.dir / f".{manifest.digest}.{os.getpid()}.{self._seq}"
        whole = blake3.blake3()
        try:
            f = await asyncio.to_thread(open, tmp, "wb")
            with f:
                for chunk in manifest.chunks:
                    data = await self.cache.get(chunk)
                    await asyncio.to_thread(_append, f, whole, data)
                await asyncio.to_thread(os.fsync, f.fileno())
            if whole.hexdigest() != manifest.digest:
                log.error("layer %s assembled from the chunk cache does not hash to its name", manifest.digest)
                return False
            await asyncio.to_thread(os.rename, tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self.written += 1
        log.info("layer %s is complete on this node: %s (%d bytes)", manifest.digest, final, manifest.size)
        return True

    def release(self, manifest: LayerManifest, shared: Iterable[str] = ()) -> None:
        """Drop the layer's chunks from the cache, except ``shared`` ones: its file holds them now."""
        keep = set(shared)
        for chunk in dict.fromkeys(manifest.chunks):
            if chunk not in keep and self.cache.release(chunk):
                self.released += 1

    async def read(self, digest: str, offset: int, size: int) -> bytes | None:
        """Bytes of the layer's file, or None if it has none (removed by gc, say)."""
        try:
            return await asyncio.to_thread(_pread, self.path(digest), offset, size)
        except FileNotFoundError:
            return None


def _append(f: BinaryIO, whole: blake3.blake3, data: bytes) -> None:
    whole.update(data)
    f.write(data)


def _pread(path: Path, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)
