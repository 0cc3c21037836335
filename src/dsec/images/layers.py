"""Layers on this node: each layer's EROFS mounted once, read-only, and shared by every sandbox using it.

A layer is mounted from one of two sources:

- a complete local copy in ``blobs/<digest>`` (a layer packed on this node, or fetched eagerly), or
- the lazy fetcher's file for it (chunks fetched on first read, cached on local disk).

Mounts live in the host's mount namespace under ``mnt/<digest>`` and outlive a daemon restart, as the
sandboxes using them do. Lazy mounts depend on the fetcher that served them: when a new fetcher had to
be started, mounts of the old one are detached so that new sandboxes get working ones.

A lazy layer whose chunks have all been fetched gets a complete local copy in ``blobs/<digest>``,
written by the fetcher (complete.py). The next time the layer is asked for, its mount is replaced in
place by one of that copy (``switch_complete``): the path never shows anything else, new sandboxes
read the layer as fast as any local EROFS, and running ones keep the lazy mount they were built on
(served by the fetcher from the same copy). A mount of a local copy outlives fetcher restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from pathlib import Path

import blake3

from ..errors import BackendError
from ..isolation.mounts import is_mountpoint, umount
from .catalog import Catalog
from .lazy import Fetcher, mount_layer, replace_mount

log = logging.getLogger("dsec.images")


def _mount_sources() -> dict[str, str]:
    """Mount point → source, from this process's mount table."""
    found = {}
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) > 4 and len(rfields) > 1:
                found[fields[4].replace("\\040", " ")] = rfields[1]
    return found


class NodeLayers:
    def __init__(self, root: Path, catalog: Catalog, fetcher: Fetcher | None) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.mnt = root / "mnt"
        self.tmp = root / "tmp"
        for d in (self.blobs, self.mnt, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.catalog = catalog
        self.fetcher = fetcher  # None: eager, every layer fetched whole before it is mounted
        self._locks: dict[str, asyncio.Lock] = {}
        self._mounted: set[str] = set()
        self._lazy: set[str] = set()  # mounted from the fetcher's FUSE file: switched once a local copy exists
        self._switching: dict[str, asyncio.Task[bool]] = {}
        self.generation = 0  # fetchers replaced so far (start): a mount found or made across one is made again
        self.eager_bytes_fetched = 0

    async def start(self, fetcher_restarted: bool) -> None:
        """Adopt the layer mounts a previous daemon left; detach lazy ones whose fetcher is gone."""
        if fetcher_restarted:
            self.generation += 1
        sources = await asyncio.to_thread(_mount_sources)
        lazy_root = str(self.root / "fetcher") + "/"
        for d in self.mnt.iterdir():
            source = sources.get(str(d))
            if d.name.startswith("."):  # a replacement mount a crash left half made (replace_mount)
                if source is not None:
                    await asyncio.to_thread(umount, d, lazy=True)
                with contextlib.suppress(OSError):
                    d.rmdir()
                continue
            if source is None:
                continue
            lazy = source.startswith(lazy_root)
            if lazy and (fetcher_restarted or self.fetcher is None):
                log.info("detaching layer mount %s of a fetcher that is gone", d.name)
                await asyncio.to_thread(umount, d, lazy=True)
                self._mounted.discard(d.name)
                self._lazy.discard(d.name)
            else:
                self._mounted.add(d.name)
                if lazy:
                    self._lazy.add(d.name)

    def path(self, digest: str) -> Path:
        return self.mnt / digest

    def file(self, digest: str) -> Path:
        """The layer's EROFS image as a file: the node's complete copy, else the fetcher's lazy file."""
        blob = self.blobs / digest
        if blob.exists() or self.fetcher is None:
            return blob
        return self.fetcher.path(digest)

    async def mount(self, digest: str) -> Path:
        """The layer's mounted directory, mounting it on first use. A fetcher replaced meanwhile (start)
        detaches its mounts: what was found or made across that is the dead fetcher's, and made again."""
        target = self.mnt / digest
        for _ in range(3):
            if digest in self._mounted:
                self.switch_complete((digest,))
                return target
            generation = self.generation
            async with self._locks.setdefault(digest, asyncio.Lock()):
                if digest in self._mounted:
                    return target
                if not await asyncio.to_thread(is_mountpoint, target):
                    await self._mount(digest, target)
                if generation == self.generation:
                    self._mounted.add(digest)
                    return target
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(umount, target, lazy=True)
        raise BackendError(f"the layer fetcher was replaced three times while layer {digest[:16]} was mounted")

    async def _mount(self, digest: str, target: Path) -> None:
        blob = self.blobs / digest
        lazy = False
        if not blob.exists():
            if self.fetcher is not None:
                await self.catalog.layer(digest)  # a missing layer is ImageNotFound, not a mount error
                blob, lazy = self.fetcher.path(digest), True
            else:
                await self.fetch_full(digest)
        await asyncio.to_thread(target.mkdir, exist_ok=True)
        await asyncio.to_thread(mount_layer, blob, target)
        if lazy:
            self._lazy.add(digest)
        else:
            self._lazy.discard(digest)

    # -- lazy layers that became complete

    def switch_complete(self, digests: tuple[str, ...] | list[str]) -> None:
        """Start replacing the lazy mounts of these layers that now have a local copy (a stat each)."""
        for digest in digests:
            if digest in self._lazy and digest not in self._switching and (self.blobs / digest).exists():
                task = asyncio.ensure_future(self._switch(digest))
                self._switching[digest] = task
                task.add_done_callback(functools.partial(self._switched, digest))

    def _switched(self, digest: str, task: asyncio.Task[bool]) -> None:
        self._switching.pop(digest, None)

    async def switch_all(self) -> list[str]:
        """Replace every lazy mount whose layer has a local copy now, and wait; returns the layers switched."""
        self.switch_complete(sorted(self._lazy))
        pending = dict(self._switching)
        done = await asyncio.gather(*pending.values())
        return [d for d, switched in zip(pending, done, strict=True) if switched]

    async def _switch(self, digest: str) -> bool:
        target, blob = self.mnt / digest, self.blobs / digest
        async with self._locks.setdefault(digest, asyncio.Lock()):
            if digest not in self._lazy or not blob.exists():
                return False
            try:
                await asyncio.to_thread(replace_mount, blob, target, self.mnt / f".{digest}.local")
            except (BackendError, OSError) as e:
                # the lazy mount stays, as correct as before; not tried again while it lasts
                log.warning("layer %s keeps its lazy mount: %s", digest[:16], e)
                self._lazy.discard(digest)
                return False
            self._lazy.discard(digest)
            log.info("layer %s now mounted from its local copy", digest[:16])
            return True

    async def fetch_full(self, digest: str) -> Path:
        """Fetch every chunk of a layer into ``blobs/<digest>``, verified as a whole (the eager path)."""
        final = self.blobs / digest
        if final.exists():
            return final
        manifest = await self.catalog.layer(digest)
        tmp = self.tmp / f"{digest}.{os.getpid()}.{time.monotonic_ns()}"
        gate = asyncio.Semaphore(8)
        whole = blake3.blake3()

        async def get(d: str) -> bytes:
            async with gate:
                return await self.catalog.chunks.get_chunk(d)

        try:
            f = await asyncio.to_thread(open, tmp, "wb")
            with f:
                window = 16
                for start in range(0, len(manifest.chunks), window):
                    parts = await asyncio.gather(*(get(d) for d in manifest.chunks[start : start + window]))
                    for part in parts:
                        whole.update(part)
                        await asyncio.to_thread(f.write, part)
                        self.eager_bytes_fetched += len(part)
                await asyncio.to_thread(os.fsync, f.fileno())
            if whole.hexdigest() != digest:
                raise BackendError(f"layer {digest} fetched from the repository does not hash to its name")
            os.rename(tmp, final)
        except OSError as e:
            raise BackendError(f"cannot store layer {digest} on this node: {e}") from e
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return final

    def adopt_blob(self, blob: Path, digest: str) -> None:
        """Keep a layer packed on this node as its local copy: sandboxes start on it without a fetch."""
        final = self.blobs / digest
        if final.exists():
            blob.unlink(missing_ok=True)
        else:
            os.rename(blob, final)

    async def detach_all(self) -> int:
        """Detach every layer mount (the daemon stops and no sandbox uses them); local copies stay."""
        detached = 0
        for d in list(self.mnt.iterdir()):
            if await asyncio.to_thread(is_mountpoint, d):
                await asyncio.to_thread(umount, d, lazy=True)
                detached += 1
            with contextlib.suppress(OSError):
                d.rmdir()
        self._mounted.clear()
        self._lazy.clear()
        return detached

    def _forget_lock(self, digest: str) -> None:
        # one lock per layer ever mounted would grow without end on a node that packs and gcs layers;
        # one held by a mount under way stays (a second lock would let two mounts of the layer race)
        lock = self._locks.get(digest)
        if lock is not None and not lock.locked():
            del self._locks[digest]

    async def unmount_unused(self, keep: set[str]) -> int:
        """Detach layer mounts not in ``keep`` and drop their local copies (gc)."""
        dropped = 0
        for d in list(self.mnt.iterdir()):
            if d.name in keep:
                continue
            await asyncio.to_thread(umount, d, lazy=True)
            with contextlib.suppress(OSError):
                d.rmdir()
            self._mounted.discard(d.name)
            self._lazy.discard(d.name)
            self._forget_lock(d.name)
            dropped += 1
        for blob in list(self.blobs.iterdir()):
            if blob.name not in keep:
                blob.unlink(missing_ok=True)
        return dropped
