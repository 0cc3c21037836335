"""Lazy layers end to end: a real fetcher process, FUSE, and EROFS mounted from the FUSE file.

Needs root, /dev/fuse, EROFS and mkfs.erofs. The repository is a local directory holding one real
EROFS layer; tests that break it (moving its chunks away, adding a trace) put it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dsec.errors import BackendError
from dsec.images.chunks import ChunkStore, digest
from dsec.images.lazy import Fetcher, mount_layer, unmount_layer
from dsec.images.model import LayerManifest, layer_key, trace_key
from dsec.images.repository import LocalRepository
from dsec.isolation.mounts import is_mountpoint, umount


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if not shutil.which("mkfs.erofs"):
        return "no mkfs.erofs (erofs-utils)"
    if not _has_erofs():
        return "no EROFS in this kernel (neither built in nor loadable with modprobe erofs)"
    return None


def _has_erofs() -> bool:
    """EROFS built in, or a module the kernel loads on the first mount (a freshly booted Debian 12 has
    not loaded it yet, so /proc/filesystems alone would skip the module's tests): load it now."""

    def listed() -> bool:
        with open("/proc/filesystems") as f:
            return any(line.split()[-1] == "erofs" for line in f if line.strip())

    if listed():
        return True
    if shutil.which("modprobe"):
        subprocess.run(["modprobe", "-q", "erofs"], check=False, timeout=30)
    return listed()


pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")

CHUNK = 256 << 10  # small chunks, so that "only what was read" is visible on a small layer
READ_TIMEOUT = 30.0


@pytest.fixture(autouse=True)
def _env() -> None:
    """These tests talk to the fetcher, not to a dsec daemon: none is needed."""


@dataclass
class Layer:
    repo: Path
    digest: str
    src: Path
    blob: bytes
    manifest: LayerManifest
    files: list[Path]  # relative paths of the regular files, the big ones first


@pytest.fixture(scope="module")
def layer() -> Iterator[Layer]:
    base = Path(tempfile.mkdtemp(prefix="dsec-lazy-layer-"))
    src = base / "src"
    rng = random.Random(7)
    (src / "big").mkdir(parents=True)
    for i in range(4):  # a few MB of random data
        (src / "big" / f"blob{i}").write_bytes(rng.randbytes(1_500_000 + i * 700_000))
    for d in range(20):  # many small files
        sub = src / "small" / f"d{d:02}"
        sub.mkdir(parents=True)
        for n in range(25):
            (sub / f"f{n}.txt").write_bytes(rng.randbytes(rng.randint(0, 9000)))
    (src / "small" / "link").symlink_to("d00/f1.txt")
    blob_path = base / "layer.erofs"
    subprocess.run(["mkfs.erofs", "-x-1", "--all-root", "-T0", "--quiet", str(blob_path), str(src)], check=True)
    blob = blob_path.read_bytes()
    repo = LocalRepository(base / "repo")

    async def publish() -> LayerManifest:
        m, _ = await ChunkStore(repo).put_blob(blob, CHUNK)
        lm = LayerManifest(digest=digest(blob), size=m.size, chunk_size=m.chunk_size, chunks=m.chunks)
        await repo.put(layer_key(lm.digest), lm.model_dump_json().encode())
        return lm

    manifest = asyncio.run(publish())
    files = sorted((p.relative_to(src) for p in src.rglob("*") if p.is_file() and not p.is_symlink()), key=str)
    yield Layer(base / "repo", manifest.digest, src, blob, manifest, files)
    shutil.rmtree(base, ignore_errors=True)


@dataclass
class Node:
    """Fetcher roots and layer mounts made by one test, all undone at its end (even on failure)."""

    base: Path
    layer: Layer
    fetchers: list[Fetcher] = field(default_factory=list)
    mounts: list[Path] = field(default_factory=list)

    def fetcher(self, name: str = "node", repository: str | None = None) -> Fetcher:
        f = Fetcher(self.base / name, repository or str(self.layer.repo), 64 << 20)
        self.fetchers.append(f)
        asyncio.run(f.start())
        return f

    def mount(self, f: Fetcher, method: str = "auto") -> Path:
        target = self.base / f"layer{len(self.mounts)}"
        target.mkdir()
        assert mount_layer(f.path(self.layer.digest), target, method=method) in ("file", "loop")
        self.mounts.append(target)
        return target

    def cleanup(self) -> None:
        for target in reversed(self.mounts):
            with contextlib.suppress(BackendError):
                unmount_layer(target, lazy=True)
        for f in self.fetchers:
            with contextlib.suppress(BackendError):
                asyncio.run(f.stop())
            with contextlib.suppress(OSError):
                umount(f.mountpoint, lazy=True)
        if not any(is_mountpoint(p) for p in [*self.mounts, *(f.mountpoint for f in self.fetchers)]):
            shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def node(layer: Layer) -> Iterator[Node]:
    n = Node(Path(tempfile.mkdtemp(prefix="dsec-lazy-")), layer)  # short: the control socket lives under it
    try:
        yield n
    finally:
        n.cleanup()


def stats(f: Fetcher, digest: str) -> dict[str, Any]:
    return {**asyncio.run(f.stats())[digest], "cache": asyncio.run(f.cache_stats())}


def quiet_stats(f: Fetcher, digest: str, timeout: float = 10.0) -> dict[str, Any]:
    """Stats once the node is idle: the kernel's async readahead keeps sending READs for a while after a
    reader's own read returned (even after the layer is unmounted)."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        s = stats(f, digest)
        if s == last and s["cache"]["reads_in_flight"] == 0:
            return s
        last = s
        time.sleep(0.2)
    pytest.fail(f"the fetcher did not go idle within {timeout:g}s: {last}")


def read_or_error(path: Path, timeout: float = READ_TIMEOUT) -> bytes | OSError:
    """The file's bytes or the OSError reading it raised; fails the test if the read hangs."""
    result: list[bytes | OSError] = []

    def run() -> None:
        try:
            result.append(path.read_bytes())
        except OSError as e:
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        pytest.fail(f"reading {path} hung for {timeout:g}s")
    return result[0]


def control(f: Fetcher, raw: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(f.sock))
        s.sendall(raw)
        reply = s.makefile("rb").readline()
    parsed: dict[str, Any] = json.loads(reply)
    return parsed


def test_layer_reads_match_the_source_and_only_touched_chunks_are_fetched(node: Node, layer: Layer) -> None:
    f = node.fetcher()
    # the FUSE directory: any published digest resolves, anything else does not
    assert f.path(layer.digest).stat().st_size == len(layer.blob)
    assert os.listdir(f.mountpoint) == [layer.digest]
    for missing in ["0" * 64, "not-a-digest"]:
        with pytest.raises(FileNotFoundError):
            (f.mountpoint / missing).stat()
    with pytest.raises(OSError) as info:
        f.path(layer.digest).open("r+b").close()
    assert info.value.errno == errno.EROFS

    target = node.mount(f)
    small = layer.src / "small" / "d03" / "f7.txt"
    assert (target / "small" / "d03" / "f7.txt").read_bytes() == small.read_bytes()
    after_one = quiet_stats(f, layer.digest)
    assert 0 < after_one["fetched_bytes"] <= len(layer.blob) // 8, after_one
    assert after_one["errors"] == 0

    for rel in layer.files:
        assert (target / rel).read_bytes() == (layer.src / rel).read_bytes(), rel
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == sorted(
        str(p.relative_to(layer.src)) for p in layer.src.rglob("*")
    )
    assert os.readlink(target / "small" / "link") == "d00/f1.txt"
    # byte for byte through the FUSE file too, and no chunk was fetched twice
    assert f.path(layer.digest).read_bytes() == layer.blob
    s = quiet_stats(f, layer.digest)
    assert s["fetched_bytes"] == s["cache"]["fetched_bytes"] <= len(layer.blob)
    assert s["chunks_fetched"] == s["cache"]["fetches"] == len(set(layer.manifest.chunks))
    assert s["read_bytes"] >= len(layer.blob) and s["errors"] == 0


def test_a_loop_device_mount_works_too(node: Node, layer: Layer) -> None:
    f = node.fetcher()
    target = node.mount(f, method="loop")
    with open("/proc/self/mountinfo") as m:
        source = next(line.split(" - ")[1].split()[1] for line in m if f" {target} " in line)
    assert source.startswith("/dev/loop")
    rel = layer.files[0]
    assert (target / rel).read_bytes() == (layer.src / rel).read_bytes()
    unmount_layer(target)
    node.mounts.remove(target)
    backing = Path("/sys/block") / Path(source).name / "loop" / "backing_file"
    deadline = time.monotonic() + 5
    while backing.exists() and time.monotonic() < deadline:  # autoclear runs as the last user goes
        time.sleep(0.05)
    assert not backing.exists()


def test_concurrent_readers_of_a_cold_file_fetch_each_chunk_once(node: Node, layer: Layer) -> None:
    f = node.fetcher()
    target = node.mount(f)
    rel = layer.files[3]  # the biggest file
    expected = (layer.src / rel).read_bytes()
    block = 64 << 10
    offsets = list(range(0, len(expected), block))
    readers = 16
    start = threading.Barrier(readers)
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            order = offsets[k::readers] + offsets[:k:readers]  # each starts elsewhere in the same chunks
            order += [o for o in offsets if o not in order]
            start.wait()
            with open(target / rel, "rb") as fh:
                for o in order:
                    assert os.pread(fh.fileno(), block, o) == expected[o : o + block]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(READ_TIMEOUT)
    assert not errors, errors
    s = quiet_stats(f, layer.digest)
    on_disk = [p for p in (f.root / "cache").rglob("*") if p.is_file()]
    # every fetch left one distinct chunk on disk: no chunk was fetched twice
    assert s["cache"]["fetches"] == s["chunks_fetched"] == len(on_disk)
    assert s["chunks_fetched"] >= len(expected) // CHUNK
    assert s["chunk_misses"] > s["chunks_fetched"], "no read joined a fetch in flight: the test proved nothing"


def test_a_failing_repository_fails_reads_with_eio_and_recovers(node: Node, layer: Layer) -> None:
    f = node.fetcher()
    target = node.mount(f)
    rel = layer.files[2]
    chunks, away = layer.repo / "chunks", layer.repo / "chunks.away"
    chunks.rename(away)
    try:
        result = read_or_error(target / rel)
        assert isinstance(result, OSError) and result.errno == errno.EIO, result
        assert stats(f, layer.digest)["errors"] > 0
        assert asyncio.run(f.ping()) is not None  # the fetcher survives its repository failing
    finally:
        away.rename(chunks)
    assert read_or_error(target / rel) == (layer.src / rel).read_bytes()


def test_a_killed_fetcher_fails_reads_and_a_new_one_serves_new_mounts(node: Node, layer: Layer) -> None:
    f = node.fetcher()
    target = node.mount(f)
    warm, cold = layer.files[-1], layer.files[0]
    assert (target / warm).read_bytes() == (layer.src / warm).read_bytes()
    assert f.pid is not None
    os.kill(f.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while asyncio.run(f.ping()) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    result = read_or_error(target / cold)
    assert isinstance(result, OSError), "a dead fetcher's layer returned data"

    again = node.fetcher()  # same root: cleans the dead mount, reuses the cache
    assert again.pid != f.pid
    assert asyncio.run(again.cache_stats())["chunks"] > 0  # chunks fetched before the kill are still there
    fresh = node.mount(again)
    for rel in (warm, cold):
        assert (fresh / rel).read_bytes() == (layer.src / rel).read_bytes()


def test_a_restarted_daemon_adopts_the_fetcher_and_stats_survive_a_fetcher_restart(node: Node, layer: Layer) -> None:
    f = node.fetcher()
    target = node.mount(f)
    rel = layer.files[1]
    assert (target / rel).read_bytes() == (layer.src / rel).read_bytes()
    adopted = node.fetcher()
    assert adopted.pid == f.pid
    with pytest.raises(BackendError, match="serves"):
        node.fetcher(repository=str(layer.repo) + "-other")
    unmount_layer(target)
    node.mounts.remove(target)
    before = quiet_stats(f, layer.digest)
    asyncio.run(f.stop())
    assert not is_mountpoint(f.mountpoint)
    assert "stopped" in (f.root / "fetcher.log").read_text()
    saved = json.loads((f.root / "stats.json").read_text())["layers"][layer.digest]["stats"]
    restarted = node.fetcher()
    after = stats(restarted, layer.digest)
    assert after["read_bytes"] == saved["read_bytes"] == before["read_bytes"] > 0
    assert after["chunks_fetched"] == saved["chunks_fetched"] == before["chunks_fetched"]


def test_a_saved_trace_is_prefetched_by_a_fresh_node(node: Node, layer: Layer) -> None:
    first = node.fetcher("first")
    target = node.mount(first)
    some = [layer.files[0], *layer.files[10:15]]
    for rel in some:
        (target / rel).read_bytes()
    quiet_stats(first, layer.digest)  # the readahead these reads started belongs in the trace too
    try:
        assert asyncio.run(first.save_trace(layer.digest)) is True
        assert asyncio.run(first.save_trace(layer.digest)) is False  # one is stored already: kept
        traced = json.loads((layer.repo / trace_key(layer.digest)).read_text())["chunks"]
        assert traced and len(set(traced)) == len(traced)
        assert len(traced) < len(layer.manifest.chunks)
        distinct = {layer.manifest.chunks[i] for i in traced}

        second = node.fetcher("second")  # another node: an empty cache
        assert second.path(layer.digest).stat().st_size == len(layer.blob)  # the lookup starts the prefetch
        deadline = time.monotonic() + 20
        while (s := stats(second, layer.digest))["prefetched"] < len(distinct) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s["prefetched"] == s["chunks_fetched"] == len(distinct)
        assert s["read_bytes"] == 0 and s["prefetch_errors"] == 0
        mounted = node.mount(second)
        for rel in some:
            assert (mounted / rel).read_bytes() == (layer.src / rel).read_bytes()
        s = quiet_stats(second, layer.digest)
        assert s["chunk_hits"] > 0
        # reads fetched nothing the trace listed; the kernel's readahead (its window depends on timing)
        # may touch a chunk the first run did not, and only such chunks were fetched on demand
        cached = {p.name for p in (second.root / "cache").rglob("*") if p.is_file()}
        assert distinct <= cached
        assert s["chunks_fetched"] - s["prefetched"] == len(cached - distinct) <= 2
    finally:
        (layer.repo / trace_key(layer.digest)).unlink(missing_ok=True)


def test_control_socket_refuses_bad_requests_and_keeps_serving(node: Node, layer: Layer) -> None:
    f = node.fetcher()
    assert f.sock.stat().st_mode & 0o777 == 0o600
    for raw in [b"nonsense\n", b"[1]\n", b"{}\n", b'{"op":"nope"}\n', b'{"op":"forget","layer":"x"}\n']:
        reply = control(f, raw)
        assert reply["ok"] is False and reply["error"], raw
    assert control(f, b"x" * (1 << 17) + b"\n")["ok"] is False
    assert asyncio.run(f.save_trace(layer.digest)) is False  # nothing read yet: nothing to save
    assert not (layer.repo / trace_key(layer.digest)).exists()
    assert control(f, b'{"op":"ping"}\n') == {
        "ok": True,
        "pid": f.pid,
        "repository": str(layer.repo),
        "mountpoint": str(f.mountpoint),
        "complete_dir": str(f.complete_dir),
    }
    target = node.mount(f)
    assert layer.digest in asyncio.run(f.stats())
    assert asyncio.run(f.forget(layer.digest)) is True
    assert layer.digest not in asyncio.run(f.stats())
    rel = layer.files[5]
    assert (target / rel).read_bytes() == (layer.src / rel).read_bytes()  # reloaded on demand


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--root", "/tmp/x", "--repository", "/tmp/r"],
        ["--root", "/tmp/x", "--repository", "/tmp/r", "--cache-max", "lots"],
        ["--root", "/tmp/x", "--repository", "ftp://host/r", "--cache-max", "1Gi"],
        ["--root", "/tmp/x", "--repository", "/tmp/r", "--cache-max", "0"],
    ],
)
def test_bad_arguments_exit_2(args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dsec.images.fetcher", *args], capture_output=True, timeout=30, check=False
    )
    assert proc.returncode == 2, proc
    assert b"error" in proc.stderr
