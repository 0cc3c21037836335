"""Pulling registry images into the layer store (ImageStore.pull) from a real Distribution registry
(Debian's docker-registry on loopback, with its access log on so every request can be counted), images
written as OCI layouts and pushed with skopeo: a two-layer image (plain and gzip), a family of task images
sharing two base layers, a tag that moves, a multi-arch index, a zstd layer. No daemon is started: the
store runs in the test's process, with layers handed out as files and read back with fsck.erofs."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.errors import RegistryAuthFailed
from dsec.images.model import REGISTRY_LAYERS
from dsec.images.pull_progress import PullProgress
from dsec.images.registry import parse_reference
from dsec.images.store import ImageStore

from .pull_images import (
    M,
    blob_gets,
    files_layer,
    make_layer,
    manifest_gets,
    mounted,
    new_store,
    tar_of,
)
from .registry import Layer, OciLayout, Registry, htpasswd, make_tls, push, start_registry

FAMILY = 20


@pytest.fixture(autouse=True)
def _env() -> None:
    """Replaces the suite's fixture of this name (conftest.py), which starts a dsec daemon: nothing here
    needs one."""


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-pull-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def registry(workdir: Path) -> Iterator[Registry]:
    found = start_registry(workdir / "registry", access_log=True)
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return new_store(tmp_path / "node")


def _records(keys: frozenset[str] | list[str]) -> list[str]:
    return [k for k in keys if k.startswith(REGISTRY_LAYERS)]


# ---- one image, two layers ---------------------------------------------------------------------------------

BASE = [
    M("bin/", kind=tarfile.DIRTYPE, mode=0o755),
    M("bin/tool", b"\x7fELF" + bytes(3000), mode=0o755),
    M("bin/su", b"setuid\n", mode=0o4755),
    M("bin/sh", kind=tarfile.SYMTYPE, link="tool"),
    M("bin/tool2", kind=tarfile.LNKTYPE, link="bin/tool"),
    M("etc/os-release", b"ID=base\n"),
    M("opt/gone", b"old\n"),
    M("root/.bash_history", b"secret history\n"),  # residue: scrubbed
]
TOP = [M("etc/os-release", b"ID=top\n"), M("opt/.wh.gone"), M("work/task.txt", b"the task\n")]


async def test_pull_converts_both_layers_and_maps_the_config(
    registry: Registry, workdir: Path, store: ImageStore, tmp_path: Path
) -> None:
    layout = OciLayout(workdir / "two")
    base, top = make_layer(tar_of(BASE), "none"), make_layer(tar_of(TOP), "gzip")
    layout.name(layout.image([base, top]), "v1")
    push(layout, "v1", registry, "org/app:v1")
    seen: list[PullProgress] = []
    info = await store.pull(f"{registry.host}/org/app:v1", progress=seen.append)

    assert info.name == f"{registry.host}/org/app:v1" and len(info.layers) == 2
    assert info.description.startswith(f"pulled from {registry.host}/org/app@sha256:")
    version = await store.catalog.version(info.digest or "")
    assert version.source is not None and version.source.digest == version.source.manifest
    assert version.config.env == {"PATH": "/usr/bin:/bin"} and version.config.workdir == "/work"
    assert (version.config.entrypoint, version.config.cmd) == (None, ["/bin/sh"]) and version.config.user == "root"
    assert version.scrubbed == ["root/.bash_history"]

    async with mounted(store, info.layers[0].digest, tmp_path / "l0") as lower:
        assert (lower / "bin/tool").read_bytes() == b"\x7fELF" + bytes(3000)
        assert stat.S_IMODE((lower / "bin/su").stat().st_mode) == 0o4755  # setuid kept
        assert os.readlink(lower / "bin/sh") == "tool"
        assert (lower / "bin/tool2").stat().st_ino == (lower / "bin/tool").stat().st_ino  # a hardlink still
        assert not (lower / "root/.bash_history").exists()
    async with mounted(store, info.layers[1].digest, tmp_path / "l1") as upper:
        assert (upper / "etc/os-release").read_bytes() == b"ID=top\n"
        gone = (upper / "opt/gone").lstat()  # the whiteout, in overlayfs's form
        assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0

    phases = [p.phase for p in seen]
    assert phases[0] == "resolving" and phases[-1] == "done" and "publishing" in phases
    last = seen[-1]
    assert (last.layers_total, last.layers_done, last.layers_reused) == (2, 2, 0)
    assert last.bytes_fetched == last.bytes_total == len(base.blob) + len(top.blob)
    assert len(_records(await store.catalog.repo.list(REGISTRY_LAYERS))) == 2
    ref = await store.resolve(info.name, build=False)  # what a sandbox would start on
    assert ref.layer_digests == tuple(x.digest for x in info.layers) and ref.workdir == "/work"


async def test_pulling_says_what_it_waits_for(registry: Registry, workdir: Path, store: ImageStore) -> None:
    layout = OciLayout(workdir / "waiting")
    layout.name(layout.image([files_layer({"data/x": os.urandom(3 << 20)})]), "w")
    push(layout, "w", registry, "org/waiting:1")
    name = f"{registry.host}/org/waiting:1"
    said: list[str] = []

    def watch(_: PullProgress) -> None:
        now = store.pulling(name)
        if now is not None:
            said.append(now.waiting_for())

    await store.pull(name, progress=watch)
    assert said[0] == f"pulling {name}: resolving its manifest"
    assert any("0/1 layers ready (0 reused)" in s and "fetching" in s for s in said), said
    assert store.pulling(name) is None  # over


# ---- a family of task images sharing two base layers --------------------------------------------------------


def _family(workdir: Path) -> tuple[OciLayout, Layer, Layer, list[Layer]]:
    layout = OciLayout(workdir / "family")
    os_layer = files_layer({"etc/os-release": b"ID=family\n", "usr/lib/libc.so": os.urandom(200_000)})
    tools = files_layer({"usr/bin/python": os.urandom(100_000)}, "none")
    tasks = [files_layer({"testbed/task.txt": f"task {i}\n".encode()}) for i in range(FAMILY)]
    for i, task in enumerate(tasks):
        layout.name(layout.image([os_layer, tools, task]), f"t{i}")
    return layout, os_layer, tools, tasks


async def test_a_family_shares_its_base_layers_and_the_policies(
    registry: Registry, workdir: Path, store: ImageStore, tmp_path: Path
) -> None:
    layout, os_layer, tools, tasks = _family(workdir)
    for i in range(FAMILY):
        push(layout, f"t{i}", registry, f"bench/task-{i}:latest")
    names = [f"{registry.host}/bench/task-{i}" for i in range(FAMILY)]
    before = len(registry.requests())
    # all at once: the base layers are fetched and converted once, by whichever pull asked first
    infos = await asyncio.gather(*(store.pull(n) for n in names))
    requests = registry.requests()[before:]
    assert blob_gets(requests, os_layer.digest) == 1 and blob_gets(requests, tools.digest) == 1
    assert all(blob_gets(requests, t.digest) == 1 for t in tasks)
    assert len(_records(await store.catalog.repo.list(REGISTRY_LAYERS))) == FAMILY + 2
    assert len(await store.catalog.repo.list("layers/")) == FAMILY + 2
    assert len({i.layers[0].digest for i in infos}) == 1 and len({i.layers[1].digest for i in infos}) == 1
    async with mounted(store, infos[7].layers[2].digest, tmp_path / "t7") as task:
        assert (task / "testbed/task.txt").read_bytes() == b"task 7\n"

    # if-not-present: the names are there, the registry is not asked anything
    before = len(registry.requests())
    again = await asyncio.gather(*(store.pull(n) for n in names))
    assert [a.digest for a in again] == [i.digest for i in infos]
    assert registry.requests()[before:] == []

    # always: one manifest request per name; only the tag that moved is pulled, and only its new layer
    moved = files_layer({"testbed/task.txt": b"task 3, fixed\n"})
    layout.name(layout.image([os_layer, tools, moved]), "t3-fixed")
    push(layout, "t3-fixed", registry, "bench/task-3:latest")
    before = len(registry.requests())
    fresh = [await store.pull(n, policy="always") for n in names]
    requests = registry.requests()[before:]
    assert manifest_gets(requests) == FAMILY
    assert [r for r in requests if "/blobs/" in r and "/manifests/" not in r] != []
    assert blob_gets(requests, moved.digest) == 1 and blob_gets(requests, os_layer.digest) == 0
    assert sum(1 for r in requests if "/blobs/" in r) == 2  # the moved image's config and its new layer
    assert [f.digest for i, f in enumerate(fresh) if i != 3] == [x.digest for i, x in enumerate(infos) if i != 3]
    assert fresh[3].digest != infos[3].digest and fresh[3].layers[:2] == infos[3].layers[:2]
    ref = await store.resolve(names[3] + ":latest", build=False)
    assert ref.digest == fresh[3].digest  # the name moved; the old version stays for sandboxes that run on it

    # a second node on the same repository: nothing fetched, no layer converted again
    other = new_store(tmp_path / "node2", store.catalog.repo.root)  # type: ignore[attr-defined]
    before = len(registry.requests())
    theirs = await other.pull(f"{registry.host}/bench/task-11:latest", policy="always")
    assert [x.digest for x in theirs.layers] == [x.digest for x in infos[11].layers]
    assert sum(1 for r in registry.requests()[before:] if "/blobs/" in r) == 0  # the tag unchanged: manifest only


async def test_a_digest_pin_and_a_multi_arch_index(registry: Registry, workdir: Path, store: ImageStore) -> None:
    layout = OciLayout(workdir / "multi")
    amd = layout.image([files_layer({"etc/arch": b"amd64\n"})])
    arm = layout.image([files_layer({"etc/arch": b"arm64\n"})], architecture="arm64")
    index = layout.index([arm, amd])
    layout.name(index, "multi")
    push(layout, "multi", registry, "org/multi:1", multi=True)

    info = await store.pull(f"{registry.host}/org/multi:1")
    version = await store.catalog.version(info.digest or "")
    assert version.source is not None
    assert (version.source.digest, version.source.manifest) == (index["digest"], amd["digest"])
    assert len(info.layers) == 1

    pinned = f"{registry.host}/org/multi@{amd['digest']}"
    by_digest = await store.pull(pinned)
    assert by_digest.name == pinned and by_digest.layers == info.layers  # the same layer, not converted again
    assert len(_records(await store.catalog.repo.list(REGISTRY_LAYERS))) == 1


async def test_a_zstd_layer(registry: Registry, workdir: Path, store: ImageStore, tmp_path: Path) -> None:
    pytest.importorskip("zstandard")  # a dependency of dsec: under CI this must not skip
    layout = OciLayout(workdir / "zstd")
    zstd = make_layer(tar_of([M("etc/zstd.txt", b"squeezed\n" * 1000)]), "zstd")
    layout.name(layout.image([files_layer({"etc/base": b"base\n"}), zstd]), "z")
    push(layout, "z", registry, "org/zstd:1")
    info = await store.pull(parse_reference(f"{registry.host}/org/zstd:1"))
    async with mounted(store, info.layers[1].digest, tmp_path / "z") as tree:
        assert (tree / "etc/zstd.txt").read_bytes() == b"squeezed\n" * 1000


async def test_tls_and_credentials_from_the_nodes_options(workdir: Path, tmp_path: Path) -> None:
    tls = make_tls(workdir / "tls")
    users = htpasswd(workdir, {"alice": "correct horse"})
    secure = start_registry(workdir / "secure", tls=tls, auth={"htpasswd": {"realm": "dsec", "path": str(users)}})
    try:
        layout = OciLayout(workdir / "secure-layout")
        layout.name(layout.image([files_layer({"etc/secret": b"private\n"})]), "s")
        push(layout, "s", secure, "private/app:1", creds="alice:correct horse")
        name = f"{secure.host}/private/app:1"
        store = new_store(
            tmp_path / "node", ca_files={secure.host: tls.ca}, credentials={secure.host: "alice:correct horse"}
        )
        info = await store.pull(name)
        assert len(info.layers) == 1
        anonymous = new_store(tmp_path / "anonymous", ca_files={secure.host: tls.ca})
        with pytest.raises(RegistryAuthFailed, match=f"registry {secure.host} requires credentials"):
            await anonymous.pull(name)
        assert await anonymous.catalog.tags() == []
    finally:
        secure.stop()


async def test_docker_hub_names_are_canonical(store: ImageStore) -> None:
    # no network: the names are only read (a pull of them would go to Docker Hub)
    assert store.pulling("python:3.11") is None and store.pulling("Not A Reference") is None
    assert str(parse_reference("python:3.11")) == "docker.io/library/python:3.11"
    assert str(parse_reference("swebench/sweb.eval.x86_64.x")) == "docker.io/swebench/sweb.eval.x86_64.x:latest"
