"""The VM kinds' file scripts (run by the guest's busybox) for stat and move, run here by the host's
busybox on a scratch directory: the same scripts, the same busybox version the guests carry."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from dsec.errors import FileNotFoundInSandbox, InvalidRequest
from dsec.kinds.microvm.files import BUSYBOX, GuestFiles

BB = shutil.which("busybox")
pytestmark = pytest.mark.skipif(BB is None, reason="busybox is not installed (apt-get install busybox-static)")


def _files() -> GuestFiles:
    async def run(argv: list[str], stdin: bytes | None, timeout: float) -> tuple[int, bytes, str]:
        assert argv[0] == BUSYBOX and BB is not None
        proc = await asyncio.create_subprocess_exec(
            BB,
            *argv[1:],
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate(stdin)
        assert proc.returncode is not None
        return proc.returncode, out, err.decode()

    return GuestFiles(run)


async def test_stat_file_dir_and_symlink(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_bytes(b"hello")
    os.chmod(tmp_path / "f.txt", 0o640)
    os.symlink("/nowhere", tmp_path / "link")
    files = _files()
    f = await files.stat(str(tmp_path / "f.txt"))
    assert (f.name, f.path, f.type, f.size, f.mode) == ("f.txt", str(tmp_path / "f.txt"), "file", 5, 0o640)
    assert (await files.stat(str(tmp_path))).type == "dir"
    assert (await files.stat(str(tmp_path / "link"))).type == "symlink"  # a dangling link still exists
    with pytest.raises(FileNotFoundInSandbox):
        await files.stat(str(tmp_path / "missing"))


async def test_move_renames_makes_parents_and_replaces(tmp_path: Path) -> None:
    files = _files()
    (tmp_path / "a").write_text("A")
    await files.move(str(tmp_path / "a"), str(tmp_path / "x" / "y" / "b"))
    assert (tmp_path / "x" / "y" / "b").read_text() == "A"
    assert not (tmp_path / "a").exists()
    (tmp_path / "c").write_text("C")
    await files.move(str(tmp_path / "c"), str(tmp_path / "x" / "y" / "b"))
    assert (tmp_path / "x" / "y" / "b").read_text() == "C"
    # a directory onto an empty directory replaces it (rename(2)), it is not moved into it
    (tmp_path / "d1").mkdir()
    (tmp_path / "d1" / "inner").write_text("i")
    (tmp_path / "d2").mkdir()
    await files.move(str(tmp_path / "d1"), str(tmp_path / "d2"))
    assert (tmp_path / "d2" / "inner").read_text() == "i"


async def test_move_refusals(tmp_path: Path) -> None:
    files = _files()
    (tmp_path / "d").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("k")
    with pytest.raises(FileNotFoundInSandbox):
        await files.move(str(tmp_path / "missing"), str(tmp_path / "x"))
    with pytest.raises(InvalidRequest, match="not empty"):
        await files.move(str(tmp_path / "d"), str(tmp_path / "full"))
    with pytest.raises(InvalidRequest, match="into itself"):
        await files.move(str(tmp_path / "d"), str(tmp_path / "d" / "sub"))
    with pytest.raises(InvalidRequest):
        await files.move("/", str(tmp_path / "x"))
    assert (tmp_path / "full" / "keep").read_text() == "k"


async def test_entries_carry_owner_and_where_symlinks_point(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_bytes(b"hello")
    (tmp_path / "sub").mkdir()
    os.symlink("f.txt", tmp_path / "to-file")
    os.symlink("sub", tmp_path / "to-dir")
    os.symlink("/nowhere/at/all", tmp_path / "dangling")
    os.symlink("x|y\n>|directory|/etc", tmp_path / "odd")  # a target that looks like the format's own lines
    files = _files()
    listed = {e.name: e for e in await files.list(str(tmp_path))}
    assert (listed["f.txt"].uid, listed["f.txt"].gid) == (os.getuid(), os.getgid())
    assert listed["f.txt"].link_target is None and listed["sub"].link_type is None
    to_file, to_dir = listed["to-file"], listed["to-dir"]
    assert (to_file.type, to_file.link_type, to_file.link_target) == ("symlink", "file", str(tmp_path / "f.txt"))
    assert (to_dir.type, to_dir.link_type, to_dir.link_target) == ("symlink", "dir", str(tmp_path / "sub"))
    assert (listed["dangling"].link_type, listed["dangling"].link_target) == (None, "/nowhere/at/all")
    # the odd target's second line is taken for nothing: the entry after a symlink keeps its own fields
    assert listed["odd"].type == "symlink" and listed["odd"].link_type is None
    stat = await files.stat(str(tmp_path / "to-dir"))
    assert (stat.name, stat.link_type, stat.link_target) == ("to-dir", "dir", str(tmp_path / "sub"))
    plain = await files.stat(str(tmp_path / "f.txt"))
    assert (plain.uid, plain.link_target) == (os.getuid(), None)
