"""A node-local disk cache of verified chunks, with single-flight fetches and LRU eviction.

Files live at ``root/XX/<blake3>``; a chunk's name is its content, so a file there is always right
(it is written under a temporary name and renamed only after ChunkStore verified its hash), and the
cache needs no index of its own: a new ChunkCache over the same root finds the old chunks and rebuilds
the LRU order from their mtimes. Failures are never remembered, so the next read retries the fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import BackendError
from .chunks import ChunkStore, chunk_key

log = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT = 30.0
_TOUCH_EVERY = 60.0  # seconds; persisting recency costs a utime, so do it at most this often per chunk


@dataclass
class CacheStats:
    hits: int = 0  # reads of a chunk already on disk
    misses: int = 0  # reads that had to wait for a fetch (their own or one already in flight)
    fetches: int = 0  # repository fetches that succeeded
    fetched_bytes: int = 0
    written_bytes: int = 0
    wait_seconds: float = 0.0  # summed over readers waiting on fetches
    errors: int = 0  # failed fetches (each counted once, however many readers waited on it)
    evictions: int = 0
    chunks: int = 0  # now on disk
    bytes: int = 0
    max_bytes: int = 0


@dataclass(frozen=True)
class ChunkRead:
    """Bytes read from one chunk, and what it took: whether it was on disk, and the fetch this read did."""

    data: bytes
    hit: bool
    fetched_bytes: int  # non-zero only for the read that ran the fetch (not for those that joined it)
    waited: float


class ChunkCache:
    def __init__(
        self, root: Path, store: ChunkStore, max_bytes: int, *, fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    ) -> None:
        if max_bytes <= 0:
            raise ValueError("the chunk cache needs a positive size cap")
        self.root = root
        self.store = store
        self.max_bytes = max_bytes
        self.fetch_timeout = fetch_timeout
        self.counters = CacheStats(max_bytes=max_bytes)
        # digest -> (size, when last touched on disk); oldest first
        self._lru: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._total = 0
        self._inflight: dict[str, asyncio.Task[bytes]] = {}
        self._tmp_seq = itertools.count()
        # its own threads: a hung repository (whose local or NFS reads sit in the default executor) must not
        # hold up reads of chunks already on disk
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="chunk-cache")
        root.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        found: list[tuple[float, str, int]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub):
                if entry.name.startswith("."):  # a write a crash interrupted
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    continue
                st = entry.stat()
                if st.st_size == 0 and len(entry.name) == 64:
                    os.unlink(entry.path)  # no chunk is empty: a crash before the data reached the disk
                    continue
                found.append((st.st_mtime, entry.name, st.st_size))
        for mtime, name, size in sorted(found):
            self._lru[name] = (size, mtime)
            self._total += size
        self._evict()

    def close(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)

    def path(self, digest: str) -> Path:
        chunk_key(digest)  # refuses anything that is not a digest before it becomes a path
        return self.root / digest[:2] / digest

    def __contains__(self, digest: str) -> bool:
        return digest in self._lru

    def stats(self) -> dict[str, float | int]:
        self.counters.chunks = len(self._lru)
        self.counters.bytes = self._total
        return asdict(self.counters)

    async def get(self, digest: str) -> bytes:
        """The whole chunk."""
        return (await self.read(digest, 0, -1)).data

    async def read(self, digest: str, offset: int, length: int) -> ChunkRead:
        """``length`` bytes (-1: to the end) of a chunk from ``offset``, fetching it first if it is not on disk."""
        path = self.path(digest)
        if digest in self._lru:
            self._touch(digest)
            try:
                data = await asyncio.get_running_loop().run_in_executor(self._io, _pread, path, offset, length)
            except FileNotFoundError:
                # evicted (or removed by hand) between the lookup and the read: fetch it again below
                self._forget(digest)
            else:
                if length < 0 or len(data) == length:
                    self.counters.hits += 1
                    return ChunkRead(data, True, 0, 0.0)
                # callers ask only for bytes inside the chunk, so a short file was cut by a crash: replace it
                log.warning("cached chunk %s is truncated; fetching it again", digest)
                self._drop(digest)
        self.counters.misses += 1
        started = time.monotonic()
        data, fetched = await self._fetch(digest)
        waited = time.monotonic() - started
        self.counters.wait_seconds += waited
        end = len(data) if length < 0 else offset + length
        return ChunkRead(data[offset:end], False, len(data) if fetched else 0, waited)

    async def ensure(self, digest: str) -> int:
        """Make sure a chunk is on disk (prefetch); returns the bytes fetched for it (0 if it was there)."""
        if digest in self._lru:
            return 0
        data, fetched = await self._fetch(digest)
        return len(data) if fetched else 0

    async def _fetch(self, digest: str) -> tuple[bytes, bool]:
        """(data, whether this call started the fetch); concurrent callers share one fetch."""
        task = self._inflight.get(digest)
        leader = task is None
        if task is None:
            task = asyncio.ensure_future(self._fetch_and_store(digest))
            self._inflight[digest] = task
            task.add_done_callback(functools.partial(self._fetch_done, digest))
        # shielded: a reader that gives up (an interrupted read) must not cancel the others' fetch
        return await asyncio.shield(task), leader

    def _fetch_done(self, digest: str, task: asyncio.Task[bytes]) -> None:
        if self._inflight.get(digest) is task:
            del self._inflight[digest]
        if not task.cancelled():
            task.exception()  # every waiter may have gone away; the failure is counted and logged already

    async def _fetch_and_store(self, digest: str) -> bytes:
        try:
            data = await asyncio.wait_for(self.store.get_chunk(digest), self.fetch_timeout)
        except TimeoutError:
            self.counters.errors += 1
            log.warning("fetching chunk %s timed out after %.1fs", digest, self.fetch_timeout)
            raise BackendError(f"fetching chunk {digest} timed out after {self.fetch_timeout:g}s") from None
        except Exception as e:
            self.counters.errors += 1
            log.warning("fetching chunk %s failed: %s", digest, e)
            raise
        self.counters.fetches += 1
        self.counters.fetched_bytes += len(data)
        if len(data) > self.max_bytes:
            return data  # served from memory; keeping it would evict everything else and still exceed the cap
        try:
            await asyncio.get_running_loop().run_in_executor(self._io, self._write, digest, data)
        except OSError as e:
            # the reader still gets verified bytes; only the caching failed (a full disk, say)
            log.warning("caching chunk %s failed: %s", digest, e)
            return data
        self.counters.written_bytes += len(data)
        self._lru[digest] = (len(data), time.time())
        self._total += len(data)
        self._evict(keep=digest)
        return data

    def _write(self, digest: str, data: bytes) -> None:
        path = self.path(digest)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{digest}.{os.getpid()}.{next(self._tmp_seq)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.rename(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def release(self, digest: str) -> bool:
        """Drop a chunk whose bytes the node now keeps elsewhere (its layer's complete file); True if it was here."""
        if digest not in self._lru:
            return False
        self._drop(digest)
        return True

    def _touch(self, digest: str) -> None:
        self._lru.move_to_end(digest)
        size, touched = self._lru[digest]
        now = time.time()
        if now - touched > _TOUCH_EVERY:
            # the mtime is what a restarted cache orders by; a failure only costs recency
            with contextlib.suppress(OSError):
                os.utime(self.path(digest), (now, now))
            self._lru[digest] = (size, now)

    def _forget(self, digest: str) -> None:
        entry = self._lru.pop(digest, None)
        if entry is not None:
            self._total -= entry[0]

    def _evict(self, keep: str | None = None) -> None:
        while self._total > self.max_bytes and self._lru:
            digest = next(iter(self._lru))
            if digest == keep:  # the newest, so everything older is gone and it fits alone
                break
            self._drop(digest)
            self.counters.evictions += 1

    def _drop(self, digest: str) -> None:
        self._forget(digest)
        # an open reader keeps its bytes: unlinking only drops the name
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(digest))


def _pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if length < 0:
            length = os.fstat(fd).st_size - offset
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)
