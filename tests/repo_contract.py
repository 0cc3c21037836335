"""One behaviour for every layer repository: the same checks run against each implementation."""

from __future__ import annotations

import os

import pytest

from dsec.errors import InvalidRequest
from dsec.images.chunks import ChunkStore, CorruptChunk, chunk_key
from dsec.images.repository import LayerRepository, ObjectNotFound


async def check_objects(repo: LayerRepository) -> None:
    await repo.put("layers/a/blob", b"0123456789")
    assert await repo.exists("layers/a/blob")
    assert await repo.size("layers/a/blob") == 10
    assert await repo.get("layers/a/blob") == b"0123456789"
    assert await repo.get_range("layers/a/blob", 3, 4) == b"3456"
    assert await repo.get_range("layers/a/blob", 8, 100) == b"89"  # short only at the end
    assert await repo.get_range("layers/a/blob", 20, 5) == b""
    await repo.put("layers/b", b"x")
    assert await repo.list("layers/") == ["layers/a/blob", "layers/b"]
    await repo.delete("layers/b")
    await repo.delete("layers/b")  # twice is fine
    assert not await repo.exists("layers/b")
    with pytest.raises(ObjectNotFound):
        await repo.get("layers/missing")
    with pytest.raises(LookupError):  # ObjectNotFound is a NotFound, hence a LookupError
        await repo.get_range("layers/missing", 0, 1)
    for bad in ("../escape", "/abs", "a//b", "a/./b", ""):
        with pytest.raises(InvalidRequest):
            await repo.put(bad, b"x")


async def check_chunks(repo: LayerRepository) -> None:
    store = ChunkStore(repo)
    blob = os.urandom(300_000) + b"\0" * 200_000 + os.urandom(100_000)
    manifest, stats = await store.put_blob(blob, chunk_size=100_000)
    assert manifest.size == len(blob) and len(manifest.chunks) == 6
    assert stats.uploaded == 5  # two chunks of zeros are the same chunk: stored once
    # a second layer sharing most of the data uploads only what is new
    other = blob[:400_000] + os.urandom(50_000)
    _, stats2 = await store.put_blob(other, chunk_size=100_000)
    assert stats2.uploaded == 1 and stats2.uploaded_bytes == 50_000
    assert await store.read(manifest, 0, len(blob)) == blob
    assert await store.read(manifest, 99_990, 20) == blob[99_990:100_010]  # across a chunk boundary
    assert await store.read(manifest, 599_990, 100) == blob[599_990:]
    assert manifest.span(250_000, 1) == range(2, 3)
    # a corrupted chunk is detected by its hash and refused
    victim = manifest.chunks[0]
    await repo.put(chunk_key(victim), b"tampered")
    with pytest.raises(CorruptChunk):
        await store.read(manifest, 0, 10)
    # gc keeps what is referenced and deletes the rest
    keep = set(manifest.chunks)
    deleted = await store.gc(keep)
    assert deleted == 1  # the chunk only `other` used
    assert all([await repo.exists(chunk_key(d)) for d in keep])
