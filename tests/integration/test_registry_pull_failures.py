"""Pulls that must fail, or must keep only what is safe, and leave nothing half-made: a missing tag, a wrong
pinned digest, a blob damaged in the registry's storage, hostile layers (path traversal, an absolute
symlink, a device node, a 10 GB sparse bomb), the registry killed in the middle of a layer, and a node whose
layer cache is full. After each failure the repository holds exactly the keys it held before (no tag, no
version, no layer, no record), and the node's temporary directory is empty."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.errors import BackendError, DigestMismatch, ImageExists, ImageNotFound, InvalidRequest, RegistryUnreachable
from dsec.images import pull_progress
from dsec.images.model import ImageVersion
from dsec.images.pull_progress import PullProgress
from dsec.images.registry import RetryPolicy, parse_reference
from dsec.images.store import ImageStore

from .pull_images import M, files_layer, gnu_sparse, make_layer, mounted, new_store, residue, tar_of
from .registry import OciLayout, Registry, layer, push, start_registry

BIG = 24 << 20


@pytest.fixture(autouse=True)
def _env() -> None:
    """Replaces the suite's fixture of this name (conftest.py), which starts a dsec daemon: nothing here
    needs one."""


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-pull-fail-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def registry(workdir: Path) -> Iterator[Registry]:
    found = start_registry(workdir / "registry")
    try:
        layout = OciLayout(workdir / "layout")
        layout.name(layout.image([files_layer({"etc/ok": b"ok\n"})]), "ok")
        layout.name(layout.image([files_layer({"etc/victim": b"to be damaged\n" * 50})]), "victim")
        hostile = {
            "traversal": [M("etc/", kind=tarfile.DIRTYPE, mode=0o755), M("../../escaped", b"x")],
            "absolute-name": [M("/etc/escaped", b"x")],
            "through-symlink": [M("etc", kind=tarfile.SYMTYPE, link="/etc"), M("etc/escaped", b"x")],
            "kept": [
                M("etc/shadow-link", kind=tarfile.SYMTYPE, link="/etc/shadow"),
                M("dev/null", kind=tarfile.CHRTYPE),
                M("etc/fine", b"fine\n"),
            ],
        }
        for name, members in hostile.items():
            layout.name(layout.image([make_layer(tar_of(members))]), name)
        layout.name(layout.image([make_layer(gnu_sparse("var/log/lastlog", 10 << 30))]), "sparse")
        layout.name(layout.image([files_layer({"data/big": os.urandom(16 << 20)})]), "fat")
        for ref in ("ok", "victim", *hostile, "sparse", "fat"):
            push(layout, ref, found, f"bad/{ref}:1")
        yield found
    finally:
        found.stop()


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return new_store(tmp_path / "node")


async def test_a_missing_tag_and_a_wrong_pin_leave_nothing(registry: Registry, store: ImageStore) -> None:
    before = await residue(store)
    with pytest.raises(ImageNotFound, match="has no tag nope in repository bad/ok"):
        await store.pull(f"{registry.host}/bad/ok:nope")
    with pytest.raises(ImageNotFound, match=r"has no repository|has no tag"):
        await store.pull(f"{registry.host}/nothing/here:1")
    with pytest.raises(ImageNotFound, match=f"has no digest sha256:{'0' * 64}"):
        await store.pull(f"{registry.host}/bad/ok@sha256:{'0' * 64}")
    assert await residue(store) == before
    assert store.pulling(f"{registry.host}/bad/ok:nope") is None


async def test_a_blob_damaged_in_the_registry_is_refused(registry: Registry, store: ImageStore) -> None:
    client = store.puller.client()
    image = await client.resolve(parse_reference(f"{registry.host}/bad/victim:1"))
    stored = registry.blob_file(image.manifest.layers[0].digest)
    data = bytearray(stored.read_bytes())
    data[-30] ^= 0xFF  # the same size, other bytes: only the digest can tell
    stored.write_bytes(bytes(data))
    before = await residue(store)
    with pytest.raises(DigestMismatch, match=f"blob {image.manifest.layers[0].digest}"):
        await store.pull(f"{registry.host}/bad/victim:1")
    assert await residue(store) == before


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("traversal", r"member '../../escaped' has a '..' component"),
        ("absolute-name", r"member '/etc/escaped' is an absolute path"),
        ("through-symlink", r"member 'etc/escaped': etc is a symlink"),
        ("sparse", r"sparse files claim 10737418240 bytes with their holes, over the limit of 1073741824"),
    ],
)
async def test_hostile_layers_are_refused_whole(registry: Registry, store: ImageStore, ref: str, message: str) -> None:
    before = await residue(store)
    with pytest.raises(InvalidRequest, match=message):
        await store.pull(f"{registry.host}/bad/{ref}:1")
    assert await residue(store) == before


async def test_links_and_devices_get_what_imports_give(registry: Registry, store: ImageStore, tmp_path: Path) -> None:
    info = await store.pull(f"{registry.host}/bad/kept:1")
    async with mounted(store, info.layers[0].digest, tmp_path / "m") as tree:
        # an absolute symlink is stored as written: it resolves inside the sandbox, never on the host
        assert os.readlink(tree / "etc/shadow-link") == "/etc/shadow"
        assert not (tree / "dev/null").exists()  # device nodes are not extracted (a sandbox has its own /dev)
        assert (tree / "etc/fine").read_bytes() == b"fine\n"


async def test_a_pulled_name_never_replaces_a_local_image(registry: Registry, store: ImageStore) -> None:
    info = await store.pull(f"{registry.host}/bad/ok:1")
    local = ImageVersion(
        name=f"{registry.host}/bad/mine:1", layers=(await store.catalog.version(info.digest or "")).layers
    )
    async with store.catalog.publishing():
        await store.catalog.publish(local)
    assert (await store.pull(f"{registry.host}/bad/mine:1")).digest == local.digest  # present: used as is
    with pytest.raises(ImageExists, match="was not pulled from a registry"):
        await store.pull(f"{registry.host}/bad/mine:1", policy="always")


async def test_a_registry_killed_mid_layer(workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every byte count reported: over loopback the whole layer could arrive within one reporting interval
    monkeypatch.setattr(pull_progress, "MIN_INTERVAL", 0.0)
    flaky = start_registry(workdir / "flaky")
    try:
        layout = OciLayout(workdir / "big")
        # incompressible and stored (gzip level 0): big on the wire, cheap to make
        layout.name(layout.image([layer({"data/blob.bin": os.urandom(BIG)}, gzipped=True, level=0)]), "big")
        push(layout, "big", flaky, "big:1")
        store = new_store(tmp_path / "node", retry=RetryPolicy(attempts=2, base_delay=0.05, max_delay=0.1))
        before = await residue(store)
        killed: list[int] = []

        def kill(p: PullProgress) -> None:
            if not killed and p.bytes_fetched > 0:
                killed.append(p.bytes_fetched)
                flaky.kill()

        with pytest.raises(RegistryUnreachable, match=flaky.host):
            await store.pull(f"{flaky.host}/big:1", progress=kill)
        assert killed and killed[0] < BIG
        assert await residue(store) == before
        flaky.start()  # back: the next pull starts the layer afresh and finishes
        info = await store.pull(f"{flaky.host}/big:1")
        assert len(info.layers) == 1
    finally:
        flaky.stop()


async def test_a_full_layer_cache(registry: Registry, tmp_path: Path) -> None:
    node = tmp_path / "node"
    node.mkdir()
    # the node's layer cache on a 4 MiB file system; the repository elsewhere
    await asyncio.to_thread(subprocess.run, ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(node)], check=True)
    try:
        store = new_store(node, tmp_path / "repository")
        before = await residue(store)
        with pytest.raises(BackendError, match="No space left on device"):
            await store.pull(f"{registry.host}/bad/fat:1")
        assert await residue(store) == before
        assert shutil.disk_usage(node).used < 1 << 20  # nothing of the layer kept on the node
        info = await store.pull(f"{registry.host}/bad/ok:1")  # a layer that fits still goes in
        assert stat.S_ISREG((store.layers.blobs / info.layers[0].digest).stat().st_mode)
    finally:
        await asyncio.to_thread(subprocess.run, ["umount", str(node)], check=True)
