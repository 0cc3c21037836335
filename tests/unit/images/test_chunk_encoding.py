"""Chunks are stored zstd-compressed when that pays, named by their raw bytes, and read back whichever way a
repository holds them: compressed, raw (written before compression), or raw bytes that look like zstd."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zstandard

from dsec.images.chunks import MAX_CHUNK, ChunkStore, CorruptChunk, chunk_key, decode, digest, encode
from dsec.images.repository import LocalRepository

TEXT = b"".join(b"line %d of a source file that compresses well\n" % i for i in range(30000))[: 1 << 20]


@pytest.fixture
def repo(tmp_path: Path) -> LocalRepository:
    return LocalRepository(tmp_path / "repo")


async def test_a_compressible_chunk_is_stored_compressed_and_read_back(repo: LocalRepository) -> None:
    store = ChunkStore(repo)
    d, uploaded = await store.put_chunk(TEXT)
    stored = (repo.root / chunk_key(d)).read_bytes()
    assert uploaded and d == digest(TEXT)
    assert len(stored) < len(TEXT) // 4, len(stored)
    assert await store.get_chunk(d) == TEXT


async def test_an_incompressible_chunk_is_stored_as_it_is(repo: LocalRepository) -> None:
    store = ChunkStore(repo)
    data = os.urandom(1 << 20)
    d, _ = await store.put_chunk(data)
    assert (repo.root / chunk_key(d)).read_bytes() == data
    assert await store.get_chunk(d) == data


async def test_raw_chunks_of_an_older_repository_are_still_read(repo: LocalRepository) -> None:
    # written before chunks were compressed: the raw bytes under their name
    zstd_looking = b"\x28\xb5\x2f\xfd" + os.urandom(4000)  # a raw chunk that begins like a zstd frame
    framed = zstandard.ZstdCompressor().compress(b"x" * 5000)  # a raw chunk that IS a zstd frame (a .zst file)
    store = ChunkStore(repo)
    for data in (TEXT, zstd_looking, framed):
        d = digest(data)
        path = repo.root / chunk_key(d)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        assert await store.get_chunk(d) == data


async def test_a_blob_of_mixed_chunks_round_trips(repo: LocalRepository, tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    data = TEXT + os.urandom(1 << 20) + TEXT + TEXT[:12345]
    blob.write_bytes(data)
    store = ChunkStore(repo)
    whole, manifest, stats = await store.put_file(blob)
    assert whole == digest(data) and stats.chunks == 4 and stats.uploaded == 3  # chunk 3 is chunk 1: stored once
    assert await store.read(manifest, 0, len(data)) == data
    assert await store.read(manifest, (1 << 20) - 7, 20) == data[(1 << 20) - 7 : (1 << 20) + 13]
    stored = sum(p.stat().st_size for p in (repo.root / "chunks").rglob("*") if p.is_file())
    assert stored < len(data) * 0.6, stored


def test_damaged_chunks_are_refused() -> None:
    packed = encode(TEXT)
    assert packed != TEXT
    flipped = bytearray(packed)
    flipped[len(flipped) // 2] ^= 0xFF
    with pytest.raises(CorruptChunk):
        decode(bytes(flipped), digest(TEXT))
    with pytest.raises(CorruptChunk):
        decode(packed[: len(packed) // 2], digest(TEXT))
    with pytest.raises(CorruptChunk):
        decode(packed, digest(b"something else"))


def test_a_frame_claiming_more_than_a_chunk_is_not_decompressed() -> None:
    # 200 MiB of zeros in a few KiB: refused from its header, never allocated
    bomb = zstandard.ZstdCompressor().compress(bytes(MAX_CHUNK * 3))
    assert len(bomb) < 1 << 20
    with pytest.raises(CorruptChunk):
        decode(bomb, digest(bytes(MAX_CHUNK * 3)[:10]))
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(MAX_CHUNK + 1))
    with pytest.raises(CorruptChunk):
        decode(unsized, digest(b""))
