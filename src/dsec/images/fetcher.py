"""The lazy-layer fetcher: a long-lived process serving every published layer as a file over FUSE.

``python -m dsec.images.fetcher --root DIR --repository SPEC --cache-max BYTES``

It outlives restarts of the dsec daemon, whose running sandboxes keep reading their layers through
it. Under DIR:

- ``mnt/``: the FUSE mount; ``mnt/<digest>`` is the layer's EROFS image, fetched chunk by chunk on read;
- ``cache/``: the chunk cache (cache.py); ``manifests/``: layer manifests already seen;
- ``--complete-dir`` (default ``complete/``): layers whose every chunk is here, each as one verified
  file (complete.py); the daemon mounts those directly, and this process serves their FUSE file from it;
- ``fetcher.sock``: control socket (JSON lines: ping, stats, save_trace, forget);
- ``fetcher.pid``: the process id, flock-ed for the process's life so a second fetcher refuses to start;
- ``stats.json``: per-layer counters and access traces, so they survive a restart.

A name is looked up in the repository the first time it is asked for, so any published layer can be
read without registering it. A failed fetch fails the read with EIO; nothing is ever served as zeros.
Every fetch is bounded by --fetch-timeout, and the kernel is told to give up on any request left
unanswered for max(60 s, 4 x that) (FUSE request timeout): a wedged fetcher fails reads, it does not
hang them. SIGTERM unmounts and exits 0; layer mounts still using the files then fail their reads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import BackendError, DsecError, InvalidRequest
from ..units import parse_size
from .cache import DEFAULT_FETCH_TIMEOUT, ChunkCache
from .chunks import ChunkStore
from .complete import CompleteLayers
from .fuse import FlatDirectory, FuseServer, clear_stale_mount
from .model import LayerManifest, layer_key, trace_key
from .repository import LayerRepository, ObjectNotFound, open_repository

log = logging.getLogger("dsec.fetcher")

DIGEST = re.compile(r"^[0-9a-f]{64}$")
STATS_EVERY = 10.0  # seconds between saves of stats.json (when something changed)
PREFETCH_PARALLEL = 4  # below the store's parallelism, so reads always find free fetch slots
STORE_PARALLEL = 16
_MAX_REQUEST = 1 << 16


@dataclass
class LayerStats:
    size: int = 0
    read_bytes: int = 0
    fetched_bytes: int = 0  # fetched from the repository on this layer's behalf (reads and prefetch)
    chunks_fetched: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    fetch_wait_seconds: float = 0.0
    errors: int = 0  # failed reads
    prefetched: int = 0  # chunks the prefetch fetched (included in chunks_fetched)
    prefetch_errors: int = 0
    complete: bool = False  # the layer has its complete local file (complete.py)


@dataclass
class LayerRecord:
    """What is known about a layer besides its manifest: counters and the order chunks were first read."""

    stats: LayerStats = field(default_factory=LayerStats)
    trace: list[int] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)

    def to_json(self) -> dict[str, Any]:
        return {"stats": asdict(self.stats), "trace": self.trace}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LayerRecord:
        known = {f.name for f in fields(LayerStats)}
        stats = LayerStats(**{k: v for k, v in raw.get("stats", {}).items() if k in known})
        trace = [int(i) for i in raw.get("trace", [])]
        return cls(stats, trace, set(trace))


class Layers(FlatDirectory):
    """The directory the FUSE server shows: every layer of the repository, by digest."""

    def __init__(
        self, root: Path, repo: LayerRepository, cache: ChunkCache, *, timeout: float, complete_dir: Path | None = None
    ) -> None:
        self.repo = repo
        self.cache = cache
        self.complete = CompleteLayers(complete_dir or root / "complete", cache)
        self._completing: dict[str, asyncio.Task[None]] = {}
        self.timeout = timeout
        self.manifest_dir = root / "manifests"
        self.manifest_dir.mkdir(parents=True, exist_ok=True)
        self.manifests: dict[str, LayerManifest] = {}
        self.records: dict[str, LayerRecord] = {}
        self.dirty = False
        self.reading = 0  # READs being served now (kernel readahead keeps some coming after a reader returns)
        self._loading: dict[str, asyncio.Task[LayerManifest | None]] = {}
        self._prefetch: dict[str, asyncio.Task[None]] = {}

    def names(self) -> list[str]:
        return list(self.manifests)

    async def lookup(self, name: str) -> int | None:
        manifest = await self.manifest(name)
        return None if manifest is None else manifest.size

    def record(self, digest: str) -> LayerRecord:
        rec = self.records.get(digest)
        if rec is None:
            rec = self.records[digest] = LayerRecord()
        return rec

    # -- manifests

    async def manifest(self, name: str) -> LayerManifest | None:
        if not DIGEST.match(name):
            return None
        found = self.manifests.get(name)
        if found is not None:
            return found
        task = self._loading.get(name)
        if task is None:  # one load however many lookups race for a new layer
            task = asyncio.ensure_future(self._load(name))
            self._loading[name] = task
            task.add_done_callback(functools.partial(self._loaded, name))
        return await asyncio.shield(task)  # a lookup the kernel interrupts must not cancel the others' load

    def _loaded(self, name: str, task: asyncio.Task[LayerManifest | None]) -> None:
        self._loading.pop(name, None)
        if not task.cancelled():
            task.exception()  # the lookups that waited on it may all be gone; it was logged

    async def _load(self, digest: str) -> LayerManifest | None:
        local = self.manifest_dir / f"{digest}.json"
        manifest = None
        with contextlib.suppress(OSError, ValidationError, ValueError):
            manifest = self._check(digest, LayerManifest.model_validate_json(await asyncio.to_thread(local.read_bytes)))
        if manifest is None:
            try:
                raw = await asyncio.wait_for(self.repo.get(layer_key(digest)), self.timeout)
            except ObjectNotFound:
                return None
            except Exception as e:
                # the repository is down, not the layer missing: say so instead of "no such file"
                log.warning("loading the manifest of layer %s failed: %s", digest, e)
                raise OSError(errno.EIO, f"cannot load layer {digest}: {e}") from e
            try:
                manifest = self._check(digest, LayerManifest.model_validate_json(raw))
            except (ValidationError, ValueError) as e:
                log.error("the manifest of layer %s is invalid: %s", digest, e)
                raise OSError(errno.EIO, f"invalid manifest for layer {digest}") from e
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_write_atomic, local, raw)
        self.manifests[digest] = manifest
        self.record(digest).stats.size = manifest.size
        self.record(digest).stats.complete = await asyncio.to_thread(self.complete.exists, digest)
        self._maybe_complete(manifest)  # its chunks may all be here already (read before a restart, say)
        if digest not in self._prefetch:
            task = asyncio.ensure_future(self._run_prefetch(manifest))
            self._prefetch[digest] = task
        return manifest

    @staticmethod
    def _check(digest: str, manifest: LayerManifest) -> LayerManifest:
        expected = -(-manifest.size // manifest.chunk_size)
        if manifest.digest != digest or len(manifest.chunks) != expected:
            raise ValueError(f"manifest of {digest} names {manifest.digest} with {len(manifest.chunks)} chunks")
        return manifest

    # -- reads

    async def read(self, name: str, offset: int, size: int) -> bytes:
        self.reading += 1
        try:
            return await self._read(name, offset, size)
        finally:
            self.reading -= 1

    async def _read(self, name: str, offset: int, size: int) -> bytes:
        manifest = await self.manifest(name)
        if manifest is None:
            raise OSError(errno.ENOENT, name)
        end = min(offset + size, manifest.size)
        if offset >= end:
            return b""
        rec = self.record(name)
        if rec.stats.complete:
            whole = await self.complete.read(name, offset, end - offset)
            if whole is not None and len(whole) == end - offset:
                rec.stats.read_bytes += len(whole)
                return whole
            rec.stats.complete = False  # its file is gone (gc) or cut short: back to the chunks
        cs = manifest.chunk_size
        spans = []
        for index in range(offset // cs, (end - 1) // cs + 1):
            lo = max(offset, index * cs)
            spans.append((manifest.chunks[index], lo - index * cs, min(end, (index + 1) * cs) - lo))
            if index not in rec.seen:
                rec.seen.add(index)
                rec.trace.append(index)
        self.dirty = True
        try:
            parts = await asyncio.gather(*(self.cache.read(d, lo, n) for d, lo, n in spans))
        except Exception as e:
            rec.stats.errors += 1
            raise OSError(errno.EIO, f"reading layer {name} at {offset}: {e}") from e
        data = b"".join(p.data for p in parts)
        if len(data) != end - offset:
            rec.stats.errors += 1  # a chunk shorter than its manifest says: never pad it with zeros
            raise OSError(errno.EIO, f"layer {name}: short chunk at {offset}")
        st = rec.stats
        st.read_bytes += len(data)
        for p in parts:
            st.chunk_hits += p.hit
            st.chunk_misses += not p.hit
            st.fetch_wait_seconds += p.waited
            if p.fetched_bytes:
                st.chunks_fetched += 1
                st.fetched_bytes += p.fetched_bytes
        if not all(p.hit for p in parts):
            self._maybe_complete(manifest)
        return data

    # -- complete layers

    def _maybe_complete(self, manifest: LayerManifest) -> None:
        """Write the layer's complete file in the background once all its chunks are in the cache."""
        digest = manifest.digest
        if self.record(digest).stats.complete or digest in self._completing or not self.complete.ready(manifest):
            return
        task = asyncio.ensure_future(self._write_complete(manifest))
        self._completing[digest] = task
        task.add_done_callback(lambda _: self._completing.pop(digest, None))

    async def _write_complete(self, manifest: LayerManifest) -> None:
        try:
            await self.complete.write(manifest)
        except Exception as e:  # the layer stays served from its chunks; the next fetch for it tries again
            log.warning("writing the complete file of layer %s failed: %s", manifest.digest, e)
            return
        if not await asyncio.to_thread(self.complete.exists, manifest.digest):
            return  # it did not hash right (logged): the layer stays lazy
        # reads of the layer go to its file from now on, before its chunks leave the cache
        self.record(manifest.digest).stats.complete = True
        self.dirty = True
        # chunks another layer still reads through the cache stay there
        shared = {
            c for d, m in self.manifests.items() if d != manifest.digest and not self._is_complete(d) for c in m.chunks
        }
        self.complete.release(manifest, shared)

    def _is_complete(self, digest: str) -> bool:
        rec = self.records.get(digest)
        return rec is not None and rec.stats.complete

    # -- prefetch

    async def _run_prefetch(self, manifest: LayerManifest) -> None:
        """Fetch the chunks a recorded trace lists, in its order, sharing fetches with concurrent reads."""
        try:
            raw = await asyncio.wait_for(self.repo.get(trace_key(manifest.digest)), self.timeout)
            listed = json.loads(raw)["chunks"]
        except ObjectNotFound:
            return
        except Exception as e:
            log.warning("no prefetch for layer %s: cannot load its trace: %s", manifest.digest, e)
            return
        order = list(dict.fromkeys(i for i in listed if isinstance(i, int) and 0 <= i < len(manifest.chunks)))
        rec = self.record(manifest.digest)
        pending = iter(order)

        async def worker() -> None:
            for index in pending:
                try:
                    fetched = await self.cache.ensure(manifest.chunks[index])
                except Exception:
                    rec.stats.prefetch_errors += 1  # the read of this chunk will retry (and report) it
                    continue
                if fetched:
                    rec.stats.chunks_fetched += 1
                    rec.stats.fetched_bytes += fetched
                    rec.stats.prefetched += 1
                    self.dirty = True
                    self._maybe_complete(manifest)

        await asyncio.gather(*(worker() for _ in range(PREFETCH_PARALLEL)))
        log.info(
            "prefetched layer %s: %d of %d traced chunks fetched", manifest.digest, rec.stats.prefetched, len(order)
        )

    def forget(self, digest: str) -> bool:
        task = self._prefetch.pop(digest, None)
        if task is not None:
            task.cancel()
        known = self.manifests.pop(digest, None) is not None
        known = self.records.pop(digest, None) is not None or known
        self.dirty = True
        return known

    async def close(self) -> None:
        tasks = [*self._prefetch.values(), *self._completing.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class FetcherProcess:
    def __init__(
        self, root: Path, repository: str, cache_max: int, fetch_timeout: float, complete_dir: Path | None = None
    ) -> None:
        self.root = root
        self.repository = repository
        self.cache_max = cache_max
        self.fetch_timeout = fetch_timeout
        self.repo = open_repository(repository)
        self.cache = ChunkCache(
            root / "cache", ChunkStore(self.repo, STORE_PARALLEL), cache_max, fetch_timeout=fetch_timeout
        )
        self.layers = Layers(root, self.repo, self.cache, timeout=fetch_timeout, complete_dir=complete_dir)
        self.stats_path = root / "stats.json"
        self.sock_path = root / "fetcher.sock"
        self.stop = asyncio.Event()
        self._load_stats()

    def _load_stats(self) -> None:
        try:
            saved = json.loads(self.stats_path.read_text())
            for digest, raw in saved.get("layers", {}).items():
                if DIGEST.match(digest):
                    self.layers.records[digest] = LayerRecord.from_json(raw)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("ignoring unreadable %s: %s", self.stats_path, e)

    def save_stats(self) -> None:
        body = {"saved_at": time.time(), "layers": {d: r.to_json() for d, r in self.layers.records.items()}}
        _write_atomic(self.stats_path, json.dumps(body).encode())
        self.layers.dirty = False

    async def run(self) -> None:
        mnt = self.root / "mnt"
        mnt.mkdir(exist_ok=True)
        clear_stale_mount(mnt)  # left by a fetcher that was killed
        # every reply comes within a fetch timeout or two; a wedged fetcher then fails reads instead of hanging them
        server = FuseServer(self.layers, mnt, request_timeout=int(max(60.0, 4 * self.fetch_timeout)))
        await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        with contextlib.suppress(FileNotFoundError):
            self.sock_path.unlink()
        old = os.umask(0o177)  # the socket is born 0600: there is no window where others could connect
        try:
            control = await asyncio.start_unix_server(self._client, path=str(self.sock_path), limit=_MAX_REQUEST)
        finally:
            os.umask(old)
        log.info("serving layers of %s at %s (cache %d bytes)", self.repository, mnt, self.cache_max)
        saver = asyncio.ensure_future(self._save_periodically())
        closed = asyncio.ensure_future(server.closed.wait())
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({closed, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not self.stop.is_set():
                # unmounted by someone else, or aborted by the kernel (fusectl, a request timeout)
                raise BackendError(f"the FUSE mount at {mnt} went away")
        finally:
            for task in (saver, closed, stopping):
                task.cancel()
            control.close()
            with contextlib.suppress(FileNotFoundError):
                self.sock_path.unlink()
            await server.stop()
            await self.layers.close()
            self.cache.close()
            self.save_stats()
            log.info("stopped")

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(STATS_EVERY)
            if self.layers.dirty:
                try:
                    await asyncio.to_thread(self.save_stats)
                except OSError as e:
                    log.warning("saving %s failed: %s", self.stats_path, e)

    # -- control socket

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # longer than the limit
                    writer.write(b'{"ok":false,"error":"request too long"}\n')
                    break
                if not line:
                    break
                reply = await self.handle(line)
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line)
            if not isinstance(request, dict) or not isinstance(request.get("op"), str):
                raise InvalidRequest('a request is a JSON object with a string "op"')
            return {"ok": True, **await self._op(request["op"], request)}
        except ValueError as e:  # JSONDecodeError and InvalidRequest
            return {"ok": False, "error": f"bad request: {e}"}
        except DsecError as e:
            return {"ok": False, "error": str(e)}
        except Exception as e:  # a bug in one request must not take the node's layers down
            log.exception("control request failed")
            return {"ok": False, "error": f"internal error: {e}"}

    async def _op(self, op: str, request: dict[str, Any]) -> dict[str, Any]:
        if op == "ping":
            mnt, complete = str(self.root / "mnt"), str(self.layers.complete.dir)
            return {"pid": os.getpid(), "repository": self.repository, "mountpoint": mnt, "complete_dir": complete}
        if op == "stats":
            layers = {d: asdict(r.stats) for d, r in self.layers.records.items()}
            cache = {**self.cache.stats(), "complete_written": self.layers.complete.written,
                     "complete_released": self.layers.complete.released}  # fmt: skip
            return {"pid": os.getpid(), "layers": layers, "cache": cache, "reads_in_flight": self.layers.reading}
        digest = request.get("layer")
        if not isinstance(digest, str) or not DIGEST.match(digest):
            raise InvalidRequest(f'{op} needs "layer": a 64-hex layer digest')
        if op == "save_trace":
            return await self._save_trace(digest)
        if op == "forget":
            return {"forgotten": self.layers.forget(digest)}
        raise InvalidRequest(f"unknown op {op!r} (known: ping, stats, save_trace, forget)")

    async def _save_trace(self, digest: str) -> dict[str, Any]:
        rec = self.layers.records.get(digest)
        if rec is None or not rec.trace:
            return {"written": False, "chunks": 0}  # never read here (a layer hidden by upper ones, say)
        key = trace_key(digest)
        try:
            if await asyncio.wait_for(self.repo.exists(key), self.fetch_timeout):
                return {"written": False, "chunks": len(rec.trace)}
            body = json.dumps({"chunks": rec.trace}).encode()
            await asyncio.wait_for(self.repo.put(key, body), self.fetch_timeout)
        except TimeoutError:
            raise BackendError(f"saving the trace of {digest}: the repository did not answer") from None
        return {"written": True, "chunks": len(rec.trace)}


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.rename(tmp, path)


def _lock_pid_file(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BackendError(f"another fetcher is running on {path.parent} (pid file {path} is locked)") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd  # held open: the lock lasts exactly as long as this process


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dsec.images.fetcher", description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, type=Path, help="state directory (mount, cache, socket)")
    parser.add_argument("--repository", required=True, help="layer repository: a directory or s3://bucket/prefix")
    parser.add_argument("--cache-max", required=True, help="chunk cache size cap: bytes or e.g. 20Gi")
    parser.add_argument("--fetch-timeout", type=float, default=DEFAULT_FETCH_TIMEOUT, help="seconds per fetch")
    parser.add_argument("--complete-dir", type=Path, help="where complete layer files go (default ROOT/complete)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    try:
        args.cache_max = parse_size(args.cache_max)
    except ValueError as e:
        parser.error(f"--cache-max: {e}")
    if args.cache_max <= 0:
        parser.error("--cache-max must be positive")
    if not args.fetch_timeout > 0:
        parser.error("--fetch-timeout must be positive")
    try:
        open_repository(args.repository)
    except DsecError as e:
        parser.error(f"--repository: {e}")
    args.root = args.root.resolve()
    if args.complete_dir is not None:
        args.complete_dir = args.complete_dir.resolve()
    if len(str(args.root / "fetcher.sock").encode()) > 107:
        parser.error(f"--root {args.root} is too long for a unix socket path under it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    os.chdir("/")  # long-lived: it must not keep the daemon's working directory (or a mount under it) busy
    try:
        args.root.mkdir(parents=True, exist_ok=True)
        _lock_pid_file(args.root / "fetcher.pid")
        proc = FetcherProcess(args.root, args.repository, args.cache_max, args.fetch_timeout, args.complete_dir)
        asyncio.run(proc.run())
    except DsecError as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
