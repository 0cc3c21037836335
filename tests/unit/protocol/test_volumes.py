"""The volume models: names, sizes, mount paths, and the schema that states the same rules."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from dsec.errors import InvalidRequest
from dsec.protocol.sandbox import CreateSandbox, SandboxSpec
from dsec.protocol.volumes import (
    MAX_VOLUMES,
    MOUNT_PATH,
    RESERVED_PATTERN,
    VOLUME_NAME,
    VOLUMES_SCHEMA,
    VolumeCreate,
    check_mount_path,
    check_volume_name,
    mode_of,
)


def create(volumes: object) -> CreateSandbox:
    return CreateSandbox.model_validate({"volumes": volumes})


@pytest.mark.parametrize("name", ["a", "data", "my-cache.v2", "x_1", "0" * 63])
def test_good_names(name: str) -> None:
    assert check_volume_name(name) == name
    assert re.fullmatch(VOLUME_NAME, name)


@pytest.mark.parametrize("name", ["", "A", "-a", ".", "..", "a/b", "a b", "0" * 64, "é", 7])
def test_bad_names(name: object) -> None:
    with pytest.raises(InvalidRequest, match="invalid volume name"):
        check_volume_name(name)
    assert not (isinstance(name, str) and re.fullmatch(VOLUME_NAME, name))


def test_sizes() -> None:
    assert VolumeCreate(name="v").size == 1 << 30
    assert VolumeCreate.model_validate({"name": "v", "size": "64Mi"}).size == 64 << 20
    for bad in (0, (16 << 20) - 1, "17Ti", "lots", -1):
        with pytest.raises(ValidationError):
            VolumeCreate.model_validate({"name": "v", "size": bad})
    with pytest.raises(ValidationError):
        VolumeCreate.model_validate({"name": "v", "extra": 1})


GOOD_PATHS = ["/data", "/a/b/c", "/.cache", "/..x", "/x..", "/devices", "/system", "/procfs", "/home/u/.dsec"]
BAD_PATHS = [
    "/",
    "",
    "data",
    "//data",
    "/data/",
    "/a/./b",
    "/a/../b",
    "/..",
    "/.",
    "/proc",
    "/proc/x",
    "/sys/fs/cgroup",
    "/dev",
    "/dev/shm",
    "/.dsec",
    "/.dsec/agent",
    "/a\x00b",
    "/" + "a" * 4096,
]


@pytest.mark.parametrize("path", GOOD_PATHS)
def test_good_mount_paths(path: str) -> None:
    assert check_mount_path(path) == path
    assert create({path: "v"}).volumes == {path: "v"}


@pytest.mark.parametrize("path", BAD_PATHS)
def test_bad_mount_paths(path: str) -> None:
    with pytest.raises(ValueError):
        check_mount_path(path)
    with pytest.raises(ValidationError):
        create({path: "v"})


@pytest.mark.parametrize("path", GOOD_PATHS + BAD_PATHS)
def test_the_schema_states_the_path_rule(path: str) -> None:
    names = VOLUMES_SCHEMA["propertyNames"]
    by_schema = (
        names["minLength"] <= len(path) <= names["maxLength"]
        and re.fullmatch(MOUNT_PATH, path) is not None
        and re.match(RESERVED_PATTERN, path) is None
    )
    assert by_schema == (path in GOOD_PATHS)


def test_modes_and_their_forms() -> None:
    got = create({"/a": "x", "/b": ["y", "ro"], "/c": ("z", "rw")}).volumes
    assert got == {"/a": "x", "/b": ("y", "ro"), "/c": ("z", "rw")}
    assert [mode_of(ref) for ref in got.values()] == [("x", "rw"), ("y", "ro"), ("z", "rw")]
    for bad in (["y"], ["y", "rx"], ["y", "ro", "x"], ["Y", "ro"], 3, None):
        with pytest.raises(ValidationError):
            create({"/b": bad})


def test_rules_across_mounts() -> None:
    with pytest.raises(ValidationError, match="one is inside the other"):
        create({"/a": "x", "/a-b": "y", "/a/b": "z"})
    with pytest.raises(ValidationError, match="mounted twice"):
        create({"/a": "x", "/b": ["x", "ro"]})
    with pytest.raises(ValidationError, match=f"at most {MAX_VOLUMES}"):
        create({f"/v{i}": f"v{i}" for i in range(MAX_VOLUMES + 1)})
    assert len(create({f"/v{i}": f"v{i}" for i in range(MAX_VOLUMES)}).volumes) == MAX_VOLUMES


def test_batches_and_single_creations_take_them_alike() -> None:
    assert SandboxSpec.model_validate({"volumes": {"/d": ["v", "ro"]}}).volumes == {"/d": ("v", "ro")}
    assert CreateSandbox().volumes == {}
