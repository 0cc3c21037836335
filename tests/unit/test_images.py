from __future__ import annotations

from pathlib import Path

import pytest

from dsec.errors import ImageNotFound, InvalidRequest
from dsec.images.store import BUILTIN, DEFAULT_PATH, ImageStore, normalize

from .fakes import make_image


@pytest.mark.parametrize(
    ("name", "norm"),
    [
        ("dsec/debian:12", "dsec/debian:12"),
        ("dsec/busybox", "dsec/busybox:latest"),
        ("alpine", "alpine:latest"),
        ("a/b/c", "a/b/c:latest"),
        ("my-org/my_img.v2:Tag_1.0-rc", "my-org/my_img.v2:Tag_1.0-rc"),
        ("x:latest", "x:latest"),
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
        "a" * 257,
        "x\0y",
        "host:5000/img",
    ],
)
def test_normalize_rejects(name: str) -> None:
    with pytest.raises(InvalidRequest, match="invalid image name"):
        normalize(name)


def test_normalize_rejects_non_strings() -> None:
    with pytest.raises(InvalidRequest):
        normalize(None)  # type: ignore[arg-type]


def test_list_of_an_empty_store_shows_builtins_not_ready(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    images = store.list()
    assert {i.name for i in images} == set(BUILTIN)
    assert "dsec/debian:12" in {i.name for i in images}
    for info in images:
        assert not info.ready
        assert info.size == 0
        assert info.description


def test_list_shows_a_built_image_ready(tmp_path: Path) -> None:
    images = tmp_path / "images"
    make_image(images, "test/img:1")
    (images / ".build-tmp-junk").mkdir()
    store = ImageStore(images)
    by_name = {i.name: i for i in store.list()}
    assert by_name["test/img:1"].ready
    assert by_name["test/img:1"].size == 4096
    assert by_name["test/img:1"].created_at is not None
    assert not by_name["dsec/debian:12"].ready
    assert store.is_ready("test/img:1")
    assert not store.is_ready("dsec/debian")


def test_corrupt_image_json_is_not_ready(tmp_path: Path) -> None:
    images = tmp_path / "images"
    d = make_image(images, "test/img:1")
    (d / "image.json").write_text("{not json")
    store = ImageStore(images)
    assert not store.is_ready("test/img:1")
    assert "test/img:1" not in {i.name for i in store.list()}


async def test_resolve_unknown_image(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    with pytest.raises(ImageNotFound, match="not found"):
        await store.resolve("nobody/nothing:1")
    with pytest.raises(ImageNotFound):
        await store.resolve("nobody/nothing:1", build=False)


async def test_resolve_unbuilt_builtin_without_build(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    with pytest.raises(ImageNotFound, match="not built yet"):
        await store.resolve("dsec/debian:12", build=False)


async def test_resolve_bad_name(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        await ImageStore(tmp_path / "images").resolve("Bad Name")


async def test_ensure_unknown_image(tmp_path: Path) -> None:
    with pytest.raises(ImageNotFound):
        await ImageStore(tmp_path / "images").ensure("nobody/nothing")


async def test_resolve_a_built_image(tmp_path: Path) -> None:
    images = tmp_path / "images"
    d = make_image(images, "test/img:1", env={"PATH": "/bin", "LANG": "C.UTF-8"}, workdir="/work")
    ref = await ImageStore(images).resolve("test/img:1", build=False)
    assert ref.name == "test/img:1"
    assert ref.layers == (d / "rootfs",)
    assert ref.env == {"PATH": "/bin", "LANG": "C.UTF-8"}
    assert ref.workdir == "/work"


async def test_resolve_adds_latest(tmp_path: Path) -> None:
    images = tmp_path / "images"
    make_image(images, "test/img:latest")
    ref = await ImageStore(images).resolve("test/img")
    assert ref.name == "test/img:latest"


async def test_resolve_without_env_gets_the_default_path(tmp_path: Path) -> None:
    images = tmp_path / "images"
    d = make_image(images, "test/img:1")
    (d / "image.json").write_text('{"name": "test/img:1"}')
    ref = await ImageStore(images).resolve("test/img:1")
    assert ref.env == {"PATH": DEFAULT_PATH}
    assert ref.workdir == "/"


async def test_distinct_names_never_share_an_image(tmp_path: Path) -> None:
    images = tmp_path / "images"
    make_image(images, "a_b/c:1")
    store = ImageStore(images)
    assert not store.is_ready("a/b_c:1")
    with pytest.raises(ImageNotFound):
        await store.resolve("a/b_c:1", build=False)
