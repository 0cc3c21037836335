"""The image model over a real local repository: names, versions, immutability, lineage, gc, scrub, packing."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dsec.errors import ImageExists, ImageInUse, ImageNotFound, InvalidRequest
from dsec.images import erofs
from dsec.images.builtin import builtin_names
from dsec.images.chunks import chunk_key
from dsec.images.model import ImageVersion, image_key, layer_key, tag_key
from dsec.images.oci import read_image
from dsec.images.scrub import DEFAULT_RULES, ScrubRules
from dsec.images.store import ImageRef, ImageStore, normalize
from dsec.protocol.build import LayerRole
from dsec.protocol.names import MAX_REFERENCE, MAX_STORED

from ...fakes.backend import make_image


@pytest.mark.parametrize(
    ("name", "norm"),
    [
        ("dsec/debian:12", "dsec/debian:12"),
        ("dsec/busybox", "dsec/busybox:latest"),
        ("alpine", "alpine:latest"),
        ("a/b/c", "a/b/c:latest"),
        ("my-org/my_img.v2:Tag_1.0-rc", "my-org/my_img.v2:Tag_1.0-rc"),
        ("x:latest", "x:latest"),
        # a registry's (issue 21): a host with a port first, a digest last
        ("host:5000/img", "host:5000/img:latest"),
        ("registry.example/org/task:v1", "registry.example/org/task:v1"),
        ("busybox@sha256:" + "a" * 64, "busybox@sha256:" + "a" * 64),
    ],
)
def test_normalize(name: str, norm: str) -> None:
    assert normalize(name) == norm


@pytest.mark.parametrize(
    "name",
    [
        "",
        "Ubuntu",
        "dsec/Debian:12",
        "with space",
        "dsec/debian :12",
        "..",
        "../etc",
        "dsec/../etc",
        "dsec/..:1",
        "/abs",
        "trailing/",
        "a//b",
        "x:",
        "x:.hidden",
        "x:-dash",
        "x:tag:again",
        "x:" + "t" * 129,
        "a" * (MAX_STORED + 1),
        "x\0y",
        "org/host:5000/img",  # a port only on the first component, which then is a host
        "x@sha256:abc",
        "x@sha512:" + "a" * 128,
    ],
)
def test_normalize_rejects(name: str) -> None:
    with pytest.raises(InvalidRequest, match="invalid image name"):
        normalize(name)


def store_at(root: Path) -> ImageStore:
    return ImageStore(root, lazy=False, mount=False)


async def test_an_empty_store_lists_builtins_not_ready(tmp_path: Path) -> None:
    images = await store_at(tmp_path).list()
    assert {i.name for i in images} == set(builtin_names())
    assert all(not i.ready and i.size == 0 and i.description for i in images)


async def test_published_image_resolves_to_its_layers_and_config(tmp_path: Path) -> None:
    info = make_image(tmp_path, "test/img:1", env={"PATH": "/bin", "LANG": "C.UTF-8"}, workdir="/work")
    store = store_at(tmp_path)
    ref = await store.resolve("test/img:1", build=False)
    assert ref.digest == info.digest
    assert ref.env == {"PATH": "/bin", "LANG": "C.UTF-8"}
    assert ref.workdir == "/work"
    assert len(ref.layers) == 1 and ref.layers[0] == tmp_path / "blobs" / ref.layer_digests[0]
    assert ref.layers[0].read_bytes()[1024:1028] == b"\xe2\xe1\xf5\xe0"  # the EROFS superblock magic
    listed = {i.name: i for i in await store.list()}
    assert listed["test/img:1"].ready and listed["test/img:1"].layers[0].role == "base"
    assert not listed["dsec/debian:12"].ready


async def test_a_ref_made_while_the_fetcher_was_replaced_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replaced fetcher's layer mounts are detached: a ref whose layers were mounted across the
    replacement is neither handed out nor cached (the next creation would get an empty rootfs)."""
    make_image(tmp_path, "test/img:1")
    store = store_at(tmp_path)
    real, made = store._ref, []

    async def ref_across_a_replacement(norm: str, digest: str, owner: str | None) -> ImageRef:
        made.append(norm)
        ref = await real(norm, digest, owner)
        if len(made) == 1:
            store.layers.generation += 1  # what _check_fetcher does when another creation finds the fetcher dead
        return ref

    monkeypatch.setattr(store, "_ref", ref_across_a_replacement)
    await store.resolve("test/img:1", build=False)
    assert made == ["test/img:1", "test/img:1"]  # made again, after the replacement
    await store.resolve("test/img:1", build=False)
    assert len(made) == 2  # and cached from then on


async def test_unknown_images(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    with pytest.raises(ImageNotFound, match="not found"):
        await store.resolve("nobody/nothing:1")
    with pytest.raises(ImageNotFound, match="not built yet"):
        await store.resolve("dsec/debian:12", build=False)
    with pytest.raises(ImageNotFound):
        await store.ensure("nobody/nothing")
    with pytest.raises(InvalidRequest):
        await store.resolve("Bad Name")


@pytest.mark.parametrize(
    "name",
    [
        "a" * MAX_REFERENCE,  # no tag: stored as NAME:latest, past the bound by the suffix
        "r/" + "p" * (MAX_REFERENCE - 2 - 1 - 128) + ":" + "t" * 128,
        "x" * 125 + ":1",  # just past what one file name holds (250 hex characters)
        "x" * 122 + ":1",  # just within it: the key of every name allowed before keeps its place
    ],
)
async def test_the_longest_names_are_published_listed_and_removed(tmp_path: Path, name: str) -> None:
    """Every name the rule allows has a tag in a local repository (whose file names hold 255 bytes)."""
    make_image(tmp_path, name)
    store = store_at(tmp_path)
    norm = normalize(name)
    assert (await store.resolve(name, build=False)).name == norm
    assert norm in {i.name for i in await store.list()}
    assert [i.name for i in await store.history(name)] == [norm]
    key = tag_key(norm)
    assert (tmp_path / "repository" / key).is_file() and all(len(p) <= 255 for p in key.split("/"))
    await store.remove(name, in_use=set())
    with pytest.raises(ImageNotFound):
        await store.info(name)


def test_tag_keys_of_short_names_are_unchanged() -> None:
    assert tag_key("dsec/debian:12") == "tags/647365632f64656269616e3a3132.json"
    assert tag_key("x" * 125).count("/") == 1 and tag_key("x" * 126).count("/") == 2


async def test_a_published_name_is_immutable(tmp_path: Path) -> None:
    make_image(tmp_path, "test/img:1", files={"a": b"one"})
    with pytest.raises(ImageExists, match="immutable"):
        make_image(tmp_path, "test/img:1", files={"a": b"two"})
    store = store_at(tmp_path)
    await store.remove("test/img:1", in_use=set())
    make_image(tmp_path, "test/img:1", files={"a": b"two"})  # a freed name can be reused


async def test_versions_are_content_addressed_and_verified(tmp_path: Path) -> None:
    info = make_image(tmp_path, "test/img:1")
    assert info.digest is not None
    store = store_at(tmp_path)
    path = tmp_path / "repository" / image_key(info.digest)
    version = ImageVersion.model_validate_json(path.read_bytes())
    assert version.digest == info.digest
    path.write_bytes(version.model_copy(update={"description": "tampered"}).canonical())
    store.catalog._versions.clear()
    with pytest.raises(Exception, match="does not hash to its name"):
        await store.catalog.version(info.digest)


async def test_snapshot_lineage_and_history(tmp_path: Path) -> None:
    make_image(tmp_path, "test/base:1", files={"etc/os": b"base"})
    store = store_at(tmp_path)
    parent = await store.resolve("test/base:1")
    upper = tmp_path / "upper"
    (upper / "work").mkdir(parents=True)
    (upper / "work/answer.txt").write_text("42")
    (upper / "tmp").mkdir()
    (upper / "tmp/scratch").write_text("residue")
    staged = await store.pack(upper, ScrubRules())
    assert staged.scan.scrubbed == ["tmp/scratch"]
    child = await store.publish_diff(staged, name="test/child:1", parent=parent, source_sandbox="sb-1")
    assert child.parent == parent.digest and child.source_sandbox == "sb-1"
    assert [layer.role for layer in child.layers] == ["base", "diff"]
    assert child.layers[0].digest == parent.layer_digests[0]  # the parent's layer is shared, not copied
    assert child.scrubbed == ["tmp/scratch"]
    history = await store.history("test/child:1")
    assert [h.digest for h in history] == [child.digest, parent.digest]
    with pytest.raises(ImageExists):
        await store.check_free("test/child:1")


async def test_an_unchanged_sandbox_snapshots_to_the_same_layers(tmp_path: Path) -> None:
    make_image(tmp_path, "test/base:1")
    store = store_at(tmp_path)
    parent = await store.resolve("test/base:1")
    (tmp_path / "empty").mkdir()
    staged = await store.pack(tmp_path / "empty", ScrubRules())
    child = await store.publish_diff(staged, name="test/same:1", parent=parent, source_sandbox="sb-2")
    assert [layer.digest for layer in child.layers] == list(parent.layer_digests)
    assert not staged.blob.exists()


async def test_gc_keeps_what_is_referenced_and_in_use(tmp_path: Path) -> None:
    keep = make_image(tmp_path, "test/keep:1", files={"k": os.urandom(3 << 20)})
    drop = make_image(tmp_path, "test/drop:1", files={"d": os.urandom(3 << 20)})
    used = make_image(tmp_path, "test/used:1", files={"u": os.urandom(3 << 20)})
    assert keep.digest and drop.digest and used.digest
    store = store_at(tmp_path)
    with pytest.raises(ImageInUse):
        await store.remove("test/used:1", in_use={used.digest})
    await store.remove("test/drop:1", in_use=set())
    repo = tmp_path / "repository"
    await store.catalog.repo.delete(tag_key("test/used:1"))  # untagged behind the node's back, yet in use
    result = await store.gc({used.digest})
    assert result.images_deleted == 1 and result.layers_deleted == 1
    assert result.chunks_deleted >= 3 and result.bytes_freed >= 3 << 20
    assert not (repo / layer_key(drop.layers[0].digest)).exists()
    for info in (keep, used):
        manifest = await store.catalog.layer(info.layers[0].digest)
        assert all((repo / chunk_key(c)).exists() for c in manifest.chunks)
    assert (await store.resolve("test/keep:1")).digest == keep.digest
    again = await store.gc({used.digest})
    assert again.images_deleted == again.layers_deleted == again.chunks_deleted == 0


async def test_layers_shared_by_images_dedupe_in_the_repository(tmp_path: Path) -> None:
    payload = {"big": os.urandom(4 << 20)}
    a = make_image(tmp_path, "test/a:1", files=payload)
    b = make_image(tmp_path, "test/b:1", files=payload)
    store = store_at(tmp_path)
    ca = (await store.catalog.layer(a.layers[0].digest)).chunks
    cb = (await store.catalog.layer(b.layers[0].digest)).chunks
    assert len(set(ca) & set(cb)) >= 3  # the file's data chunks, stored once for both layers
    chunks = [c for c in (tmp_path / "repository" / "chunks").rglob("*") if c.is_file()]
    assert len(chunks) == len(set(ca) | set(cb)) < len(ca) + len(cb)


async def test_eager_fetch_verifies_the_whole_layer(tmp_path: Path) -> None:
    info = make_image(tmp_path, "test/img:1", files={"f": os.urandom(2 << 20)})
    digest = info.layers[0].digest
    other = ImageStore(tmp_path / "node2", tmp_path / "repository", lazy=False, mount=False)  # a second node
    blob = await other.layers.fetch_full(digest)
    assert blob.read_bytes() == (tmp_path / "blobs" / digest).read_bytes()
    assert other.layers.eager_bytes_fetched == info.layers[0].size


def test_scrub_rules_match_relative_globs() -> None:
    rules = ScrubRules()
    for hit in ("tmp/x", "root/.bash_history", "home/a/.git-credentials", "root/.cache/pip", ".dsec", "var/tmp/y"):
        assert rules.matches(hit), hit
    for miss in ("tmp", "etc/passwd", "root/.bashrc", "home/a/tmp/x", "usr/lib/python3/tmp/x"):
        assert not rules.matches(miss), miss
    extra = ScrubRules.of(["work/answers/*"], defaults=False)
    assert extra.matches("work/answers/key.txt") and not extra.matches("tmp/x")
    assert ScrubRules.of(["a"]).patterns[: len(DEFAULT_RULES)] == DEFAULT_RULES
    for bad in ("/abs", "", "x\0y"):
        with pytest.raises(InvalidRequest):
            ScrubRules.of([bad])


def test_scan_refuses_device_nodes_and_sees_whiteouts(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making device nodes needs root")
    os.mknod(tmp_path / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    (tmp_path / "sparse").write_bytes(b"")
    os.truncate(tmp_path / "sparse", 1 << 30)
    scanned = erofs.scan(tmp_path, ScrubRules())
    assert scanned.whiteouts == 1 and scanned.sparse_files == 1
    assert "--chunksize=4096" in erofs.mkfs_argv(tmp_path, tmp_path / "out", scanned)
    os.mknod(tmp_path / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    with pytest.raises(InvalidRequest, match="device node /null"):
        erofs.scan(tmp_path, ScrubRules())


async def test_packing_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    with pytest.raises(Exception, match="cannot read"):
        await store.pack(tmp_path / "nope", ScrubRules())
    assert LayerRole.diff.value == "diff"


def test_node_rules_extend_the_defaults_and_calls_extend_the_node() -> None:
    node = ScrubRules.of(["srv/keys/*"])
    assert node.matches("srv/keys/k") and node.matches("tmp/x")
    call = node.plus(["work/answers/*"])
    assert call.matches("srv/keys/k") and call.matches("work/answers/a") and call.matches("tmp/x")
    only = node.plus(["work/answers/*"], defaults=False)
    assert only.patterns == ("work/answers/*",) and not only.matches("tmp/x")


@pytest.mark.parametrize("where", ["x" * 300, "file/below"])
async def test_a_path_that_names_no_readable_file_is_the_callers_error(tmp_path: Path, where: str) -> None:
    """A name longer than a file name, a file where a directory should be: 400s, not OSErrors (500s)."""
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(InvalidRequest, match="cannot read"):
        read_image(tmp_path / where)
    store = store_at(tmp_path / "images")
    with pytest.raises(InvalidRequest):
        await store.import_image(str(tmp_path / where), "test/imported:1")
