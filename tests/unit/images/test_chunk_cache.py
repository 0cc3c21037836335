"""ChunkCache: single-flight fetches, LRU cap, restart survival, verification, retries and timeouts."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from dsec.errors import BackendError
from dsec.images.cache import ChunkCache
from dsec.images.chunks import ChunkStore, CorruptChunk, chunk_key, digest
from dsec.images.repository import LocalRepository


class CountingRepo(LocalRepository):
    """A local repository that counts gets, and can be made slow or failing."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gets: list[str] = []
        self.delay = 0.0
        self.fail = 0  # how many of the next gets fail

    async def get(self, key: str) -> bytes:
        self.gets.append(key)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            self.fail -= 1
            raise BackendError("repository unavailable")
        return await super().get(key)


async def put_chunks(repo: CountingRepo, n: int, size: int = 1000) -> list[str]:
    store = ChunkStore(repo)
    digests = []
    for i in range(n):
        d, _ = await store.put_chunk(bytes([i]) * size)
        digests.append(d)
    return digests


def new_cache(tmp_path: Path, repo: CountingRepo, max_bytes: int = 1 << 20, **kw: float) -> ChunkCache:
    return ChunkCache(tmp_path / "cache", ChunkStore(repo), max_bytes, **kw)


@pytest.fixture
def repo(tmp_path: Path) -> CountingRepo:
    return CountingRepo(tmp_path / "repo")


async def test_hit_after_miss_and_ranges(tmp_path: Path, repo: CountingRepo) -> None:
    (d,) = await put_chunks(repo, 1)
    cache = new_cache(tmp_path, repo)
    first = await cache.read(d, 10, 20)
    assert (first.data, first.hit, first.fetched_bytes) == (b"\0" * 20, False, 1000)
    second = await cache.read(d, 990, 10)
    assert (second.data, second.hit, second.fetched_bytes) == (b"\0" * 10, True, 0)
    assert await cache.get(d) == b"\0" * 1000
    assert len(repo.gets) == 1
    assert cache.path(d).read_bytes() == b"\0" * 1000
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["fetches"]) == (2, 1, 1)
    assert stats["fetched_bytes"] == stats["written_bytes"] == stats["bytes"] == 1000


async def test_concurrent_misses_share_one_fetch(tmp_path: Path, repo: CountingRepo) -> None:
    d1, d2 = await put_chunks(repo, 2)
    cache = new_cache(tmp_path, repo)
    repo.delay = 0.05
    reads = await asyncio.gather(*(cache.read(d, 0, 1000) for d in [d1] * 20 + [d2] * 5))
    assert sorted(repo.gets) == sorted([chunk_key(d1), chunk_key(d2)])
    assert all(r.data == bytes([0]) * 1000 for r in reads[:20])
    assert all(r.data == bytes([1]) * 1000 for r in reads[20:])
    # exactly one reader per chunk ran the fetch; the others joined it and waited
    assert sum(r.fetched_bytes > 0 for r in reads) == 2
    assert all(not r.hit and r.waited > 0.03 for r in reads)
    assert cache.stats()["misses"] == 25 and cache.stats()["fetches"] == 2


async def test_a_cancelled_reader_does_not_cancel_the_shared_fetch(tmp_path: Path, repo: CountingRepo) -> None:
    (d,) = await put_chunks(repo, 1)
    cache = new_cache(tmp_path, repo)
    repo.delay = 0.1
    first = asyncio.ensure_future(cache.read(d, 0, 10))
    second = asyncio.ensure_future(cache.read(d, 0, 10))
    await asyncio.sleep(0.02)
    first.cancel()
    assert (await second).data == b"\0" * 10
    assert first.cancelled() and len(repo.gets) == 1 and d in cache


async def test_lru_keeps_total_under_the_cap(tmp_path: Path, repo: CountingRepo) -> None:
    d = await put_chunks(repo, 5)
    cache = new_cache(tmp_path, repo, max_bytes=3500)
    for x in d[:3]:
        await cache.get(x)
    await cache.get(d[0])  # d[0] is now the most recent, so d[1] is the oldest
    await cache.get(d[3])
    assert [x in cache for x in d[:4]] == [True, False, True, True]
    assert not cache.path(d[1]).exists()
    await cache.get(d[4])
    assert [x in cache for x in d] == [True, False, False, True, True]
    stats = cache.stats()
    assert stats["bytes"] == 3000 and stats["evictions"] == 2
    assert sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file()) <= 3500
    # an evicted chunk is fetched again, and still correct
    gets = len(repo.gets)
    assert await cache.get(d[1]) == bytes([1]) * 1000
    assert len(repo.gets) == gets + 1


async def test_a_chunk_bigger_than_the_cap_is_served_but_not_kept(tmp_path: Path, repo: CountingRepo) -> None:
    (d,) = await put_chunks(repo, 1, size=5000)
    cache = new_cache(tmp_path, repo, max_bytes=4000)
    assert await cache.get(d) == b"\0" * 5000
    assert d not in cache and cache.stats()["bytes"] == 0


async def test_chunks_survive_a_restart_in_lru_order(tmp_path: Path, repo: CountingRepo) -> None:
    d = await put_chunks(repo, 3)
    cache = new_cache(tmp_path, repo)
    for x in d:
        await cache.get(x)
    # recency as a restarted cache sees it: d[2] oldest, then d[0], then d[1]
    now = time.time()
    for x, age in zip(d, [200, 100, 300], strict=True):
        os.utime(cache.path(x), (now - age, now - age))
    # leftovers of an interrupted write are removed, never served
    (cache.path(d[0]).parent / f".{d[0]}.123.0").write_bytes(b"partial")
    repo.gets.clear()
    again = new_cache(tmp_path, repo, max_bytes=2500)  # a smaller cap: the oldest must go
    assert [x in again for x in d] == [True, True, False]
    assert not list((tmp_path / "cache").rglob(".*"))
    assert await again.get(d[0]) == bytes([0]) * 1000 and await again.get(d[1]) == bytes([1]) * 1000
    assert repo.gets == [] and again.stats()["hits"] == 2


async def test_truncated_cached_chunk_is_fetched_again(tmp_path: Path, repo: CountingRepo) -> None:
    (d,) = await put_chunks(repo, 1)
    cache = new_cache(tmp_path, repo)
    await cache.get(d)
    cache.path(d).write_bytes(b"\0" * 100)  # what a crash before writeback can leave
    assert (await cache.read(d, 500, 500)).data == b"\0" * 500
    assert len(repo.gets) == 2 and cache.path(d).stat().st_size == 1000


async def test_corrupt_chunk_is_refused_and_not_cached(tmp_path: Path, repo: CountingRepo) -> None:
    (d,) = await put_chunks(repo, 1)
    (repo.root / chunk_key(d)).write_bytes(b"\1" * 1000)
    cache = new_cache(tmp_path, repo)
    with pytest.raises(CorruptChunk):
        await cache.read(d, 0, 10)
    assert d not in cache and not cache.path(d).exists()
    assert cache.stats()["errors"] == 1 and cache.stats()["fetches"] == 0


async def test_failure_is_not_cached_and_the_next_read_retries(tmp_path: Path, repo: CountingRepo) -> None:
    (d,) = await put_chunks(repo, 1)
    cache = new_cache(tmp_path, repo)
    repo.fail = 1
    repo.delay = 0.02
    results = await asyncio.gather(cache.read(d, 0, 10), cache.read(d, 0, 10), return_exceptions=True)
    assert all(isinstance(r, BackendError) for r in results)  # both waiters see the one failure
    assert len(repo.gets) == 1 and cache.stats()["errors"] == 1
    assert (await cache.read(d, 0, 10)).data == b"\0" * 10
    assert len(repo.gets) == 2 and d in cache


async def test_a_hung_repository_times_out(tmp_path: Path, repo: CountingRepo) -> None:
    (d,) = await put_chunks(repo, 1)
    cache = new_cache(tmp_path, repo, fetch_timeout=0.1)
    repo.delay = 30
    started = time.monotonic()
    with pytest.raises(BackendError, match="timed out"):
        await cache.read(d, 0, 10)
    assert time.monotonic() - started < 2
    assert cache.stats()["errors"] == 1
    repo.delay = 0
    assert (await cache.read(d, 0, 10)).data == b"\0" * 10


async def test_prefetch_ensure(tmp_path: Path, repo: CountingRepo) -> None:
    (d,) = await put_chunks(repo, 1)
    cache = new_cache(tmp_path, repo)
    assert await cache.ensure(d) == 1000
    assert await cache.ensure(d) == 0
    assert (await cache.read(d, 0, 5)).hit and len(repo.gets) == 1


def test_rejects_bad_input(tmp_path: Path, repo: CountingRepo) -> None:
    with pytest.raises(ValueError):
        new_cache(tmp_path, repo, max_bytes=0)
    cache = new_cache(tmp_path, repo)
    with pytest.raises(ValueError):
        cache.path("../../etc/passwd")
    assert digest(b"") not in cache
