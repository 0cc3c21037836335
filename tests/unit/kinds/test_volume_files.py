"""The container kind's file API in named volumes, on plain directories standing in for the overlay and
the volumes' host mounts: paths route by their mount path, read-only mounts refuse writes, and
symlinks in a volume resolve inside that volume."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsec.errors import FileNotFoundInSandbox, InvalidRequest
from dsec.kinds.base import Backend
from dsec.kinds.container.files import ContainerFiles
from dsec.kinds.function.backend import FunctionBackend
from dsec.kinds.microvm.backend import MicroVMBackend
from dsec.kinds.vm.backend import VMBackend
from dsec.protocol.sandbox import Limits, State
from dsec.store.records import SandboxRecord, VolumeMount


class Files(ContainerFiles):
    def __init__(self, bundle: Path) -> None:
        self.bundle = bundle

    def bundle_dir(self, rec: SandboxRecord) -> Path:
        return self.bundle


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Files, SandboxRecord, Path, Path]:
    (tmp_path / "rootfs" / "data").mkdir(parents=True)  # the overlay's directory under the mount point
    rw, ro = tmp_path / "vol-rw", tmp_path / "vol-ro"
    rw.mkdir()
    ro.mkdir()
    (ro / "kept.txt").write_bytes(b"kept")
    rec = SandboxRecord("sb-1", "container", "img", State.running, 0.0, 1.0, Limits())
    rec.volumes = [VolumeMount("/data", "w", False, str(rw)), VolumeMount("/srv/ro", "r", True, str(ro))]
    return Files(tmp_path), rec, rw, ro


async def test_paths_in_a_volume_reach_its_host_mount(setup: tuple[Files, SandboxRecord, Path, Path]) -> None:
    files, rec, rw, _ = setup
    await files.write_file(rec, "/data/sub/x.txt", b"hello")
    assert (rw / "sub" / "x.txt").read_bytes() == b"hello"
    assert not (files.bundle / "rootfs" / "data" / "sub").exists()  # not the overlay's hidden directory
    assert await files.read_file(rec, "/data/sub/x.txt") == b"hello"
    assert [e.path for e in await files.list_dir(rec, "/data/sub")] == ["/data/sub/x.txt"]
    assert [e.path for e in await files.list_dir(rec, "/data/")] == ["/data/sub"]
    entry = await files.stat(rec, "/data/sub")
    assert (entry.name, entry.path, entry.type) == ("sub", "/data/sub", "dir")
    await files.write_file(rec, "/database", b"root")  # a longer name is not under /data
    assert (files.bundle / "rootfs" / "database").read_bytes() == b"root"
    await files.rename(rec, "/data/sub/x.txt", "/data/y.txt")
    assert (rw / "y.txt").exists()


async def test_read_only_mounts_refuse_every_write(setup: tuple[Files, SandboxRecord, Path, Path]) -> None:
    files, rec, _, ro = setup
    assert await files.read_file(rec, "/srv/ro/kept.txt") == b"kept"
    for attempt in (
        files.write_file(rec, "/srv/ro/kept.txt", b"changed"),
        files.write_file(rec, "/srv/ro/new", b"x"),
        files.mkdir(rec, "/srv/ro/d"),
        files.remove(rec, "/srv/ro/kept.txt"),
        files.rename(rec, "/srv/ro/kept.txt", "/srv/ro/moved"),
        files.rename(rec, "/data/none", "/srv/ro/into"),
    ):
        with pytest.raises(InvalidRequest, match="read-only"):
            await attempt
    assert sorted(os.listdir(ro)) == ["kept.txt"] and (ro / "kept.txt").read_bytes() == b"kept"


async def test_mount_points_and_crossings(setup: tuple[Files, SandboxRecord, Path, Path]) -> None:
    files, rec, _, _ = setup
    with pytest.raises(InvalidRequest, match="where volume 'w' is mounted"):
        await files.remove(rec, "/data", recursive=True)
    with pytest.raises(InvalidRequest, match="mounted"):
        await files.rename(rec, "/data", "/elsewhere")
    await files.write_file(rec, "/data/f", b"x")
    with pytest.raises(InvalidRequest, match="different file systems"):
        await files.rename(rec, "/data/f", "/f")


async def test_symlinks_in_a_volume_stay_in_it(setup: tuple[Files, SandboxRecord, Path, Path], tmp_path: Path) -> None:
    files, rec, rw, _ = setup
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"host")
    os.symlink(str(outside), rw / "abs")
    os.symlink("../../../../../..", rw / "up")
    os.symlink("/", rw / "root")
    for path in ("/data/abs", f"/data/up{outside}", f"/data/root{outside}", "/data/../outside.txt"):
        with pytest.raises(FileNotFoundInSandbox):
            await files.read_file(rec, path)
    (rw / "inner.txt").write_bytes(b"in")
    assert await files.read_file(rec, "/data/up/inner.txt") == b"in"  # '..' stops at the volume's root
    await files.write_file(rec, "/data/root/made.txt", b"m")
    assert (rw / "made.txt").read_bytes() == b"m" and outside.read_bytes() == b"host"


REFUSING = [(MicroVMBackend, "microvm"), (VMBackend, "vm")]


@pytest.mark.parametrize(("cls", "kind"), REFUSING)
def test_kinds_without_volumes_say_why(cls: type[Backend], kind: str) -> None:
    fake = SimpleNamespace(kind=kind, volumes_unsupported=cls.volumes_unsupported)
    with pytest.raises(
        InvalidRequest, match=f"not supported for {kind} sandboxes: .*use kind='container' or 'function'"
    ):
        Backend.check_volumes(fake, {"/data": "v"})  # type: ignore[arg-type]
    Backend.check_volumes(fake, {})  # type: ignore[arg-type]


def test_the_function_kind_takes_volumes() -> None:
    fake = SimpleNamespace(kind="function", volumes_unsupported=FunctionBackend.volumes_unsupported)
    Backend.check_volumes(fake, {"/data": "v"})  # type: ignore[arg-type]
