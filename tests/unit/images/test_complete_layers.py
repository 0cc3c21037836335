"""A complete layer's local file (complete.py): written from the chunk cache only as the whole, verified
layer, and its chunks released from the cache afterwards, except those another layer holds."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from dsec.images.cache import ChunkCache
from dsec.images.chunks import ChunkStore, digest
from dsec.images.complete import CompleteLayers
from dsec.images.model import LayerManifest
from dsec.images.repository import LocalRepository

CHUNK = 64 << 10


async def published(repo: LocalRepository, blob: bytes) -> LayerManifest:
    m, _ = await ChunkStore(repo).put_blob(blob, CHUNK)
    return LayerManifest(digest=digest(blob), size=m.size, chunk_size=m.chunk_size, chunks=m.chunks)


def test_the_file_is_the_layer_and_its_chunks_leave_the_cache_except_shared_ones(tmp_path: Path) -> None:
    async def scenario() -> None:
        repo = LocalRepository(tmp_path / "repo")
        blob = os.urandom(5 * CHUNK + 123)
        manifest = await published(repo, blob)
        cache = ChunkCache(tmp_path / "cache", ChunkStore(repo), 64 << 20)
        done = CompleteLayers(tmp_path / "complete", cache)
        assert not done.ready(manifest)
        for chunk in manifest.chunks[:-1]:
            await cache.get(chunk)
        assert not done.ready(manifest)  # one chunk short
        await cache.get(manifest.chunks[-1])
        assert done.ready(manifest)
        assert await done.write(manifest) is True
        assert done.path(manifest.digest).read_bytes() == blob
        assert await done.read(manifest.digest, CHUNK - 10, 20) == blob[CHUNK - 10 : CHUNK + 10]
        assert await done.write(manifest) is False  # there already
        assert [p.name for p in (tmp_path / "complete").iterdir()] == [manifest.digest]
        done.release(manifest, shared={manifest.chunks[0]})
        assert [c in cache for c in manifest.chunks] == [True] + [False] * 5
        assert done.released == 5
        done.path(manifest.digest).unlink()
        assert await done.read(manifest.digest, 0, 10) is None  # gone (gc): the caller goes back to chunks

    asyncio.run(scenario())


def test_a_cached_chunk_damaged_on_disk_leaves_no_file(tmp_path: Path) -> None:
    async def scenario() -> None:
        repo = LocalRepository(tmp_path / "repo")
        blob = os.urandom(3 * CHUNK)
        manifest = await published(repo, blob)
        cache = ChunkCache(tmp_path / "cache", ChunkStore(repo), 64 << 20)
        for chunk in manifest.chunks:
            await cache.get(chunk)
        victim = cache.path(manifest.chunks[1])
        victim.write_bytes(b"\0" * victim.stat().st_size)  # the same size: only the hash can tell
        done = CompleteLayers(tmp_path / "complete", cache)
        assert await done.write(manifest) is False
        assert list((tmp_path / "complete").iterdir()) == []  # nor a temporary file
        assert all(c in cache for c in manifest.chunks)  # nothing released either

    asyncio.run(scenario())
