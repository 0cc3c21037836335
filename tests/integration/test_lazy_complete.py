"""Lazy layers that become complete: the fetcher writes the layer's local file, the node's mount of the
layer switches to it in place, and sandboxes built before and after keep reading the right bytes.

Real fetcher process, FUSE, EROFS, and the container kind's overlay (mount_rootfs) on top. Needs root,
/dev/fuse, EROFS and mkfs.erofs, like test_lazy_layers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsec.images.catalog import Catalog
from dsec.images.chunks import ChunkStore, digest
from dsec.images.layers import NodeLayers
from dsec.images.lazy import Fetcher, mount_layer, replace_mount
from dsec.images.model import LayerManifest, layer_key
from dsec.images.repository import LocalRepository, open_repository
from dsec.isolation.mounts import mount, umount, unmount_under
from dsec.kinds.container.rootfs import mount_rootfs, unmount_rootfs

from .test_lazy_layers import _missing, read_or_error

pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")

CHUNK = 256 << 10


@pytest.fixture(autouse=True)
def _env() -> None:
    """No dsec daemon: these tests drive the fetcher and the node's layer mounts directly."""


@dataclass
class Layer:
    repo: Path
    digest: str
    src: Path
    blob: bytes
    files: list[Path]


@pytest.fixture(scope="module")
def layer() -> Iterator[Layer]:
    base = Path(tempfile.mkdtemp(prefix="dsec-complete-layer-"))
    src = base / "src"
    rng = random.Random(11)
    (src / "big").mkdir(parents=True)
    for i in range(3):
        (src / "big" / f"blob{i}").write_bytes(rng.randbytes(1_200_000 + i * 500_000))
    for d in range(10):
        (src / "small" / f"d{d}").mkdir(parents=True)
        for n in range(20):
            (src / "small" / f"d{d}" / f"f{n}").write_bytes(rng.randbytes(rng.randint(1, 6000)))
    image = base / "layer.erofs"
    subprocess.run(["mkfs.erofs", "-x-1", "--all-root", "-T0", "--quiet", str(image), str(src)], check=True)
    blob = image.read_bytes()
    repo = LocalRepository(base / "repo")

    async def publish() -> str:
        m, _ = await ChunkStore(repo).put_blob(blob, CHUNK)
        lm = LayerManifest(digest=digest(blob), size=m.size, chunk_size=m.chunk_size, chunks=m.chunks)
        await repo.put(layer_key(lm.digest), lm.model_dump_json().encode())
        return lm.digest

    layer_digest = asyncio.run(publish())
    files = sorted((p.relative_to(src) for p in src.rglob("*") if p.is_file()), key=str)
    yield Layer(base / "repo", layer_digest, src, blob, files)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="dsec-cmp-"))  # short: the fetcher's socket lives under it
    try:
        yield base
    finally:
        unmount_under(base)
        pid_file = base / "fetcher" / "fetcher.pid"
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        time.sleep(0.2)
        unmount_under(base)
        shutil.rmtree(base, ignore_errors=True)


async def node(root: Path, layer: Layer) -> tuple[Fetcher, NodeLayers]:
    """A node's image side as ImageStore wires it: the fetcher writes complete layers into blobs/."""
    f = Fetcher(root / "fetcher", str(layer.repo), 64 << 20, complete_dir=root / "blobs")
    await f.start()
    layers = NodeLayers(root, Catalog(open_repository(str(layer.repo))), f)
    await layers.start(fetcher_restarted=False)
    return f, layers


def source_of(mountpoint: Path) -> str | None:
    """The source of the topmost mount at ``mountpoint`` (EROFS file-backed: the file it was mounted from):
    of the mounts there, the one no other is mounted on."""
    here: dict[str, tuple[str, str]] = {}  # mount id -> (parent id, source)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if fields[4] == str(mountpoint):
                here[fields[0]] = (fields[1], right.split()[1])
    parents = {parent for parent, _ in here.values()}
    top = [source for mid, (_, source) in here.items() if mid not in parents]
    assert len(top) <= 1, here
    return top[0] if top else None


def read_all(root: Path, layer: Layer) -> None:
    for rel in layer.files:
        assert (root / rel).read_bytes() == (layer.src / rel).read_bytes(), rel


async def wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(path.exists):
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout:g}s"
        await asyncio.sleep(0.05)


async def quiet(f: Fetcher, timeout: float = 10.0) -> dict[str, Any]:
    """Fetcher stats once the kernel's readahead stopped sending READs."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        now: dict[str, Any] = {**(await f.stats()), "cache": await f.cache_stats()}
        if now == last and now["cache"]["reads_in_flight"] == 0:
            return now
        last = now
        await asyncio.sleep(0.2)
    pytest.fail(f"the fetcher did not go idle: {last}")


def sandbox(bundle: Path, layer_dir: Path) -> Path:
    """A container sandbox's root file system on the layer, made by the container kind's own code."""
    return mount_rootfs(bundle, [layer_dir], 16 << 20, None, None)


@pytest.mark.timeout(120)
def test_a_fully_read_layer_gets_its_verified_file_and_its_chunks_leave_the_cache(root: Path, layer: Layer) -> None:
    async def scenario() -> None:
        f, layers = await node(root, layer)
        path = await layers.mount(layer.digest)
        assert source_of(path) == str(f.path(layer.digest))
        await asyncio.to_thread(read_all, path, layer)
        await wait_for(root / "blobs" / layer.digest)
        assert (root / "blobs" / layer.digest).read_bytes() == layer.blob
        s = await quiet(f)
        stats, cache = s[layer.digest], s["cache"]
        assert stats["complete"] is True and cache["complete_written"] == 1
        # the node keeps the layer's bytes once: in its file, no longer also as chunks
        assert cache["chunks"] == 0 and cache["bytes"] == 0, cache
        assert cache["complete_released"] == cache["fetches"] > 0  # each distinct chunk, fetched once
        # the fetcher's own file of the layer (what older mounts read) is served from the complete file
        fetches = cache["fetches"]
        assert await asyncio.to_thread(f.path(layer.digest).read_bytes) == layer.blob
        assert (await f.cache_stats())["fetches"] == fetches
        assert not list((root / "blobs").glob(".*")), "a temporary file was left behind"
        # the next time the layer is asked for, its mount switches to the local file (in the background)
        assert await layers.mount(layer.digest) == path
        deadline = time.monotonic() + 10
        while source_of(path) != str(root / "blobs" / layer.digest):
            assert time.monotonic() < deadline, f"the mount did not switch: {source_of(path)}"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(read_all, path, layer)

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_partly_read_layer_stays_lazy_and_never_reads_zeros(root: Path, layer: Layer) -> None:
    async def scenario() -> None:
        f, layers = await node(root, layer)
        path = await layers.mount(layer.digest)
        first = layer.files[0]
        assert (path / first).read_bytes() == (layer.src / first).read_bytes()
        await quiet(f)
        assert await layers.switch_all() == []
        assert not (root / "blobs" / layer.digest).exists()
        assert source_of(path) == str(f.path(layer.digest))
        # what was not fetched yet is not on this node: with the repository away, reads fail, not zeros
        chunks = layer.repo / "chunks"
        away = layer.repo / "chunks-away"
        chunks.rename(away)
        try:
            unread = next(rel for rel in reversed(layer.files) if "big" in str(rel))
            result = await asyncio.to_thread(read_or_error, path / unread)
            assert isinstance(result, OSError) and result.errno == errno.EIO, result
        finally:
            away.rename(chunks)
        await asyncio.to_thread(read_all, path, layer)  # and once it is back, everything reads right

    asyncio.run(scenario())


@pytest.mark.timeout(180)
def test_the_mount_switches_under_a_running_sandbox_and_survives_restarts(root: Path, layer: Layer) -> None:
    async def scenario() -> None:
        f, layers = await node(root, layer)
        path = await layers.mount(layer.digest)
        running = sandbox(root / "sb-before", path)
        held = os.open(running / layer.files[-1], os.O_RDONLY)  # a file the sandbox has open across the switch
        try:
            await asyncio.to_thread(read_all, running, layer)
            await wait_for(root / "blobs" / layer.digest)
            await quiet(f)
            dev = os.stat(path).st_dev
            assert await layers.switch_all() == [layer.digest]
            assert os.stat(path).st_dev != dev, "the path still shows the lazy mount"
            assert source_of(path) == str(root / "blobs" / layer.digest)
            assert not list(layers.mnt.glob(".*")), "the staging mount was left behind"
            # the running sandbox: its open file and new opens still read the right bytes
            expected = (layer.src / layer.files[-1]).read_bytes()
            assert os.pread(held, len(expected) + 1, 0) == expected
            await asyncio.to_thread(read_all, running, layer)
            # a new sandbox stacks its overlay on the local mount, and the fetcher is off its path
            before = (await quiet(f))[layer.digest]
            fresh = sandbox(root / "sb-after", path)
            await asyncio.to_thread(read_all, fresh, layer)
            after = (await quiet(f))[layer.digest]
            assert after["read_bytes"] == before["read_bytes"], "a read of the switched layer went through FUSE"
        finally:
            os.close(held)
        unmount_rootfs(root / "sb-before")

        # the fetcher dies and is replaced: the local mount does not depend on it and stays
        assert f.pid is not None
        os.kill(f.pid, signal.SIGKILL)
        for _ in range(200):
            if await f.ping() is None:
                break
            await asyncio.sleep(0.05)
        again = Fetcher(root / "fetcher", str(layer.repo), 64 << 20, complete_dir=root / "blobs")
        await again.start()
        layers.fetcher = again
        await layers.start(fetcher_restarted=True)
        assert source_of(path) == str(root / "blobs" / layer.digest)
        assert await layers.mount(layer.digest) == path
        await asyncio.to_thread(read_all, fresh, layer)
        # a restarted daemon adopts the mount as a local one; the new fetcher serves the layer from its file
        adopted = NodeLayers(root, Catalog(open_repository(str(layer.repo))), again)
        await adopted.start(fetcher_restarted=False)
        assert await adopted.switch_all() == []
        assert await asyncio.to_thread(again.path(layer.digest).read_bytes) == layer.blob
        assert (await again.cache_stats())["fetches"] == 0
        unmount_rootfs(root / "sb-after")
        umount(path)

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_the_switch_works_under_a_shared_parent_mount(root: Path, layer: Layer) -> None:
    """Under systemd / is a shared mount, and a mount whose parent is shared cannot be moved: the
    replacement is cloned off its staging mount first. Its peer sees the new mount too."""
    ms_shared, ms_bind, ms_rec = 1 << 20, 4096, 16384
    image = root / "layer.erofs"
    image.write_bytes(layer.blob)
    shared, peer = root / "shared", root / "peer"
    shared.mkdir()
    peer.mkdir()
    mount("tmpfs", shared, "tmpfs", 0, "size=1m")
    mount("none", shared, "", ms_shared)
    mount(str(shared), peer, "", ms_bind | ms_rec)
    (shared / "L").mkdir()
    mount_layer(image, shared / "L")
    held = os.open(shared / "L" / layer.files[0], os.O_RDONLY)
    dev = os.stat(shared / "L").st_dev
    try:
        replace_mount(image, shared / "L", shared / ".L.local")
        assert os.stat(shared / "L").st_dev != dev
        assert os.stat(peer / "L").st_dev == os.stat(shared / "L").st_dev
        assert not (shared / ".L.local").exists()
        read_all(shared / "L", layer)
        expected = (layer.src / layer.files[0]).read_bytes()
        assert os.pread(held, len(expected) + 1, 0) == expected  # a file open on the old mount reads on
    finally:
        os.close(held)
