"""One registry layer streamed into a directory: download → decompress → extract, without staging the blob.

The blob's chunks arrive on the event loop (``RegistryClient.blob_chunks``, which resumes dropped
connections and checks the digest at the end); the extraction (tar_extract.py, the same safe extractor as
imports) is blocking work in a thread. A ``ByteBridge`` hands the chunks over with a bound on the bytes in
between, so a fast registry waits for a slow disk instead of filling memory, and either side stopping
stops the other: a hostile member ends the download, a dropped registry ends the extraction.

The tree is only good once both ends agree: the blob matched its digest (checked by the client after its
last chunk) and the uncompressed tar matched its diff_id (checked here after the end-of-archive padding).
On any failure the caller throws the directory away.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

from ..errors import DsecError, InvalidRequest
from .layer_stream import READ_ERRORS, HashingReader, check_compression, decompress, read_failure, sniff
from .registry import Descriptor, Reference, RegistryClient
from .tar_extract import ExtractStats, extract_tar

__all__ = ["ByteBridge", "stream_layer"]

BRIDGE_LIMIT = 8 << 20  # bytes between the download and the extraction


class _Stopped(Exception):
    """The other side of the bridge gave up; its own error is the one reported."""


class ByteBridge:
    """Bytes from the event loop (``put``) to one reader thread (``read``), at most ``limit`` in between."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = BRIDGE_LIMIT) -> None:
        self._loop = loop
        self._limit = limit
        self._cond = threading.Condition()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._eof = False
        self._aborted = False  # the writer failed: the reader stops at its next read
        self._reader_gone = False  # the reader stopped: further bytes are not wanted
        self._writer_waiting = False  # put() waits for room: the reader wakes it once there is some
        self._space = asyncio.Event()
        self._space.set()

    # ---- the event loop's side ----

    async def put(self, chunk: bytes) -> bool:
        """Hand ``chunk`` on, waiting for room; False once the reader has stopped (its error tells why)."""
        while True:
            with self._cond:
                if self._reader_gone:
                    return False
                if self._buffered < self._limit:
                    self._chunks.append(chunk)
                    self._buffered += len(chunk)
                    self._cond.notify()
                    return True
                self._space.clear()
                self._writer_waiting = True
            await self._space.wait()

    def finish(self) -> None:
        """Every byte was put: the reader sees the end."""
        with self._cond:
            self._eof = True
            self._cond.notify()

    def abort(self) -> None:
        """The writer failed: the reader raises at its next read instead of waiting for bytes."""
        with self._cond:
            self._aborted = True
            self._cond.notify()

    # ---- the reader thread's side ----

    def read(self, size: int = -1, /) -> bytes:
        with self._cond:
            while not self._chunks and not self._eof and not self._aborted:
                self._cond.wait()
            if self._aborted:
                raise _Stopped("the download stopped")
            if not self._chunks:
                return b""
            out = self._take(size)
            if self._writer_waiting and self._buffered < self._limit:
                self._writer_waiting = False  # one wake-up per wait, not one callback per read
                self._loop.call_soon_threadsafe(self._space.set)
            return out

    def _take(self, size: int) -> bytes:
        first = self._chunks.popleft()
        if 0 <= size < len(first):
            self._chunks.appendleft(first[size:])
            first = first[:size]
        self._buffered -= len(first)
        return first

    def reader_gone(self) -> None:
        with self._cond:
            self._reader_gone = True
            self._chunks.clear()
            self._buffered = 0
        self._loop.call_soon_threadsafe(self._space.set)


class _Prefixed:
    """A reader with bytes already read put back in front (the sniffed magic number)."""

    def __init__(self, head: bytes, src: ByteBridge) -> None:
        self.head = head
        self.src = src

    def read(self, size: int = -1, /) -> bytes:
        if self.head:
            n = len(self.head) if size < 0 else min(size, len(self.head))
            out, self.head = self.head[:n], self.head[n:]
            return out
        return self.src.read(size)


def _extract(bridge: ByteBridge, dest: Path, diff_id: str | None, label: str) -> ExtractStats:
    """The reader thread: sniff the compression (the bytes decide, not the media type), extract, verify."""
    try:
        head = b""
        while len(head) < 4 and (more := bridge.read(4 - len(head))):
            head += more
        compression = sniff(head)
        check_compression(compression, label)
        try:
            # (the blob's own digest is the client's to check; this hash of it goes unused)
            tar_in = HashingReader(decompress(HashingReader(_Prefixed(head, bridge)), compression))
            stats = extract_tar(tar_in, dest, label=label)
            tar_in.drain()  # the end-of-archive padding is part of the diff_id too
        except DsecError:
            raise
        except READ_ERRORS as e:
            raise read_failure(e, label) from None
        if diff_id is not None and tar_in.digest != diff_id:
            raise InvalidRequest(f"{label}: uncompressed content {tar_in.digest} does not match diff_id {diff_id}")
        return stats
    finally:
        bridge.reader_gone()


async def stream_layer(
    client: RegistryClient,
    ref: Reference,
    desc: Descriptor,
    diff_id: str | None,
    dest: Path,
    *,
    label: str,
    on_bytes: Callable[[int, int], None] | None = None,
) -> ExtractStats:
    """Blob ``desc`` of ``ref``'s repository extracted into the new directory ``dest`` (overlayfs format).

    Raises the registry's error (RegistryUnreachable, DigestMismatch, ...) if the transfer fails, else the
    extraction's (InvalidRequest for a hostile or damaged layer or a wrong diff_id, BackendError or
    StorageFull when the node's disk fails). Returns only once the extracting thread has ended."""
    bridge = ByteBridge(asyncio.get_running_loop())
    worker = asyncio.ensure_future(asyncio.to_thread(_extract, bridge, dest, diff_id, label))
    try:
        try:
            async with contextlib.aclosing(client.blob_chunks(ref, desc, progress=on_bytes)) as chunks:
                async for chunk in chunks:
                    if not await bridge.put(chunk):
                        break  # the extraction ended early: its error is the one to raise
        except BaseException:
            bridge.abort()
            raise
        bridge.finish()
        return await asyncio.shield(worker)
    finally:
        bridge.abort()
        # the directory is the caller's to remove: not while the thread may still write into it
        with contextlib.suppress(BaseException):
            await asyncio.shield(worker)
