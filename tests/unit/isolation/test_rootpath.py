from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.errors import DsecError, FileNotFoundInSandbox, InvalidRequest, LimitExceeded
from dsec.isolation.rootpath import MAX_PATH, RootFS, clean_path

BINARY = bytes(range(256)) * 7 + b"\0\r\n\xff"
BIG = 1 << 20


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    o = tmp_path / "outside"
    o.mkdir()
    return o


@pytest.fixture
def fs(root: Path) -> RootFS:
    return RootFS(str(root))


# ---- round trips -----------------------------------------------------------------------------------


def test_write_read_binary(fs: RootFS, root: Path) -> None:
    fs.write("/data.bin", BINARY)
    assert fs.read("/data.bin", BIG) == BINARY
    assert (root / "data.bin").read_bytes() == BINARY


def test_write_creates_parents_and_sets_mode(fs: RootFS, root: Path) -> None:
    fs.write("/a/b/c/run.sh", b"#!/bin/sh\n", mode=0o755)
    assert (root / "a/b/c/run.sh").read_bytes() == b"#!/bin/sh\n"
    assert (root / "a/b/c").is_dir()
    assert (root / "a/b/c/run.sh").stat().st_mode & 0o777 == 0o755


def test_write_truncates(fs: RootFS) -> None:
    fs.write("/f", b"a long first version")
    fs.write("/f", b"short")
    assert fs.read("/f", BIG) == b"short"


def test_write_empty_file(fs: RootFS) -> None:
    fs.write("/empty", b"")
    assert fs.read("/empty", 0) == b""


def test_read_exactly_at_the_limit(fs: RootFS) -> None:
    fs.write("/f", b"x" * 100)
    assert fs.read("/f", 100) == b"x" * 100


def test_list(fs: RootFS) -> None:
    fs.write("/d/file.txt", b"12345")
    fs.mkdir("/d/sub")
    os.symlink("file.txt", fs.root + "/d/link")
    entries = fs.list("/d")
    assert [e.name for e in entries] == ["file.txt", "link", "sub"]
    by_name = {e.name: e for e in entries}
    assert by_name["file.txt"].type == "file"
    assert by_name["file.txt"].size == 5
    assert by_name["file.txt"].path == "/d/file.txt"
    assert by_name["sub"].type == "dir"
    assert by_name["link"].type == "symlink"


def test_list_root(fs: RootFS) -> None:
    fs.write("/top", b"")
    assert [(e.name, e.path) for e in fs.list("/")] == [("top", "/top")]


def test_list_a_file_is_invalid(fs: RootFS) -> None:
    fs.write("/f", b"")
    with pytest.raises(InvalidRequest, match="not a directory"):
        fs.list("/f")


def test_mkdir_nested_and_idempotent(fs: RootFS, root: Path) -> None:
    fs.mkdir("/x/y/z")
    fs.mkdir("/x/y/z")
    fs.mkdir("/")
    assert (root / "x/y/z").is_dir()


def test_mkdir_over_a_file_is_invalid(fs: RootFS) -> None:
    fs.write("/f", b"")
    with pytest.raises(InvalidRequest):
        fs.mkdir("/f/sub")


def test_remove_file(fs: RootFS, root: Path) -> None:
    fs.write("/f", b"x")
    fs.remove("/f")
    assert not (root / "f").exists()
    with pytest.raises(FileNotFoundInSandbox):
        fs.read("/f", BIG)


def test_remove_empty_dir(fs: RootFS, root: Path) -> None:
    fs.mkdir("/d")
    fs.remove("/d")
    assert not (root / "d").exists()


def test_remove_non_empty_dir_needs_recursive(fs: RootFS, root: Path) -> None:
    fs.write("/d/e/f", b"x")
    with pytest.raises(InvalidRequest, match="recursive"):
        fs.remove("/d")
    assert (root / "d/e/f").exists()
    fs.remove("/d", recursive=True)
    assert not (root / "d").exists()


@pytest.mark.parametrize("path", ["/", "//", "/.", "/..", "/a/.."])
def test_remove_root_is_refused(fs: RootFS, root: Path, path: str) -> None:
    fs.write("/keep", b"x")
    with pytest.raises(InvalidRequest):
        fs.remove(path, recursive=True)
    assert (root / "keep").exists()


def test_remove_missing(fs: RootFS) -> None:
    with pytest.raises(FileNotFoundInSandbox):
        fs.remove("/nope")


def test_remove_symlink_removes_the_link_not_the_target(fs: RootFS, root: Path, outside: Path) -> None:
    (outside / "precious").write_text("keep me")
    os.symlink(str(outside), root / "link")
    fs.remove("/link", recursive=True)
    assert not (root / "link").is_symlink()
    assert (outside / "precious").read_text() == "keep me"


# ---- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["relative", "a/b", "./x", ""])
def test_relative_or_empty_path_is_invalid(fs: RootFS, path: str) -> None:
    for op in (lambda: fs.read(path, BIG), lambda: fs.write(path, b""), lambda: fs.list(path)):
        with pytest.raises(InvalidRequest):
            op()


def test_nul_in_path_is_invalid(fs: RootFS) -> None:
    with pytest.raises(InvalidRequest, match="NUL"):
        fs.write("/a\0b", b"x")
    with pytest.raises(InvalidRequest, match="NUL"):
        fs.read("/a\0b", BIG)


def test_over_long_path_is_invalid(fs: RootFS) -> None:
    with pytest.raises(InvalidRequest, match="too long"):
        fs.read("/" + "a" * MAX_PATH, BIG)
    with pytest.raises(InvalidRequest, match="too long"):
        fs.mkdir("/" + "a/" * (MAX_PATH // 2 + 1))


def test_read_a_directory_is_invalid(fs: RootFS) -> None:
    fs.mkdir("/d")
    with pytest.raises(InvalidRequest, match="directory"):
        fs.read("/d", BIG)


def test_write_to_root_is_invalid(fs: RootFS) -> None:
    with pytest.raises(InvalidRequest):
        fs.write("/", b"x")


def test_write_onto_a_directory_is_invalid(fs: RootFS) -> None:
    fs.mkdir("/d")
    with pytest.raises(InvalidRequest):
        fs.write("/d", b"x")


def test_read_missing(fs: RootFS) -> None:
    with pytest.raises(FileNotFoundInSandbox) as info:
        fs.read("/no/such/file", BIG)
    assert isinstance(info.value, FileNotFoundError)


def test_list_missing(fs: RootFS) -> None:
    with pytest.raises(FileNotFoundInSandbox):
        fs.list("/nope")


def test_read_a_fifo_is_invalid(fs: RootFS, root: Path) -> None:
    os.mkfifo(root / "pipe")
    with pytest.raises(InvalidRequest, match="not a regular file"):
        fs.read("/pipe", BIG)


def test_read_over_the_limit_is_refused(fs: RootFS) -> None:
    fs.write("/big", b"x" * 101)
    with pytest.raises(DsecError):
        fs.read("/big", 100)


def test_read_over_the_limit_is_limit_exceeded(fs: RootFS) -> None:
    fs.write("/big", b"x" * 101)
    with pytest.raises(LimitExceeded):
        fs.read("/big", 100)


def test_clean_path() -> None:
    assert clean_path("/") == "."
    assert clean_path("/a//b/./c/") == "a/b/c"
    assert clean_path("/../../x") == "x"
    assert clean_path("/a/../../b") == "b"


# ---- confinement ---------------------------------------------------------------------------------------


def test_dotdot_stays_inside(fs: RootFS, root: Path, tmp_path: Path) -> None:
    fs.write("/../../x", b"inside")
    assert (root / "x").read_bytes() == b"inside"
    assert not (tmp_path / "x").exists()
    assert fs.read("/../../../../x", BIG) == b"inside"


def test_relative_symlink_escaping_upwards_stays_inside(fs: RootFS, root: Path, outside: Path) -> None:
    (outside / "secret").write_text("host secret")
    os.symlink("../../outside/secret", root / "up")
    with pytest.raises(FileNotFoundInSandbox):
        fs.read("/up", BIG)
    # ".." at the root stays at the root: the link means root/outside/secret
    (root / "outside").mkdir()
    fs.write("/up", b"from the sandbox")
    assert (root / "outside" / "secret").read_bytes() == b"from the sandbox"
    assert fs.read("/up", BIG) == b"from the sandbox"
    assert (outside / "secret").read_text() == "host secret"


def test_absolute_file_symlink_resolves_inside_the_root(fs: RootFS, root: Path, outside: Path) -> None:
    (outside / "secret").write_text("host secret")
    os.symlink(str(outside / "secret"), root / "evil")
    with pytest.raises(FileNotFoundInSandbox):
        fs.read("/evil", BIG)
    with pytest.raises(DsecError):
        fs.write("/evil", b"pwned")
    assert (outside / "secret").read_text() == "host secret"


def test_writing_through_an_absolute_dir_symlink_never_touches_the_host(fs: RootFS, root: Path, outside: Path) -> None:
    os.symlink(str(outside), root / "out")
    with pytest.raises(DsecError):
        fs.write("/out/planted", b"pwned")
    with pytest.raises(DsecError):
        fs.mkdir("/out/newdir")
    assert list(outside.iterdir()) == []


def test_absolute_dir_symlink_follows_the_root_copy(fs: RootFS, root: Path, outside: Path) -> None:
    # the same absolute path exists inside the root: the link must land there, not on the host
    (outside / "f").write_text("host")
    inner = root / str(outside).lstrip("/")
    inner.mkdir(parents=True)
    (inner / "f").write_text("sandbox")
    os.symlink(str(outside), root / "out")
    assert fs.read("/out/f", BIG) == b"sandbox"
    fs.write("/out/new", b"n")
    assert (inner / "new").read_bytes() == b"n"
    assert not (outside / "new").exists()
    assert (outside / "f").read_text() == "host"


def test_symlink_to_etc_reads_the_root_copy(fs: RootFS, root: Path) -> None:
    fs.write("/etc/hostname", b"sandbox\n")
    os.symlink("/etc", root / "hostetc")
    assert fs.read("/hostetc/hostname", BIG) == b"sandbox\n"


def test_etc_itself_a_symlink_to_host_etc_never_reads_the_host(fs: RootFS, root: Path) -> None:
    os.symlink("/etc", root / "etc")
    host = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else None
    try:
        data = fs.read("/etc/hostname", BIG)
    except DsecError:
        return
    assert data != host


def test_list_through_a_symlink_to_host_dir_stays_inside(fs: RootFS, root: Path, outside: Path) -> None:
    (outside / "secret").write_text("x")
    os.symlink(str(outside), root / "out")
    with pytest.raises(FileNotFoundInSandbox):
        fs.list("/out")


def test_remove_through_a_symlinked_parent_never_touches_the_host(fs: RootFS, root: Path, outside: Path) -> None:
    (outside / "victim").write_text("x")
    os.symlink(str(outside), root / "out")
    with pytest.raises(FileNotFoundInSandbox):
        fs.remove("/out/victim")
    assert (outside / "victim").exists()


def test_proc_magic_links_are_not_followed(fs: RootFS, root: Path) -> None:
    os.symlink("/proc/self/root", root / "selfroot")
    with pytest.raises(DsecError):
        fs.read("/selfroot/etc/hostname", BIG)


# ---- stat and rename (the E2B files API's get_info and rename) ---------------------------------------


def test_stat_file_dir_root_and_symlink(fs: RootFS, root: Path) -> None:
    fs.write("/d/f.txt", b"hello", 0o640)
    f = fs.stat("/d/f.txt")
    assert (f.name, f.path, f.type, f.size, f.mode) == ("f.txt", "/d/f.txt", "file", 5, 0o640)
    assert fs.stat("/d").type == "dir"
    assert fs.stat("/").type == "dir" and fs.stat("/").path == "/"
    os.symlink("/etc/passwd", root / "link")
    assert fs.stat("/link").type == "symlink"  # the link itself, not (the host's) /etc/passwd


def test_stat_missing_and_through_a_symlink_to_the_host(fs: RootFS, root: Path, outside: Path) -> None:
    (outside / "secret").write_text("x")
    os.symlink(str(outside), root / "out")
    with pytest.raises(FileNotFoundInSandbox):
        fs.stat("/nope")
    with pytest.raises(FileNotFoundInSandbox):
        fs.stat("/out/secret")  # /out resolves inside the root, where there is no /tmp/.../secret


def test_rename_moves_and_makes_parents(fs: RootFS, root: Path) -> None:
    fs.write("/a.txt", BINARY)
    fs.rename("/a.txt", "/x/y/b.txt")
    assert fs.read("/x/y/b.txt", BIG) == BINARY
    assert not (root / "a.txt").exists()


def test_rename_replaces_a_file_and_an_empty_dir_but_not_a_full_one(fs: RootFS) -> None:
    fs.write("/a", b"new")
    fs.write("/b", b"old")
    fs.rename("/a", "/b")
    assert fs.read("/b", BIG) == b"new"
    fs.mkdir("/d1")
    fs.mkdir("/d2")
    fs.rename("/d1", "/d2")
    assert fs.stat("/d2").type == "dir"
    fs.mkdir("/d3")
    fs.write("/d2/keep", b"k")
    with pytest.raises(InvalidRequest, match="not empty"):
        fs.rename("/d3", "/d2")


def test_rename_missing_source_root_and_into_itself(fs: RootFS) -> None:
    with pytest.raises(FileNotFoundInSandbox, match="/missing"):
        fs.rename("/missing", "/x")
    fs.mkdir("/d")
    with pytest.raises(InvalidRequest, match="into itself"):
        fs.rename("/d", "/d/sub")
    with pytest.raises(InvalidRequest):
        fs.rename("/", "/x")
    with pytest.raises(InvalidRequest):
        fs.rename("/d", "/")


def test_rename_moves_a_symlink_as_a_link(fs: RootFS, root: Path, outside: Path) -> None:
    (outside / "target").write_text("host file")
    os.symlink(str(outside / "target"), root / "link")
    fs.rename("/link", "/moved")
    assert os.readlink(root / "moved") == str(outside / "target")
    assert (outside / "target").read_text() == "host file"


def test_rename_through_a_symlinked_parent_never_touches_the_host(fs: RootFS, root: Path, outside: Path) -> None:
    (outside / "victim").write_text("x")
    os.symlink(str(outside), root / "out")
    fs.write("/mine", b"m")
    with pytest.raises(FileNotFoundInSandbox):
        fs.rename("/out/victim", "/stolen")
    with pytest.raises(DsecError):  # /out names a directory the root does not have
        fs.rename("/mine", "/out/planted")
    assert (outside / "victim").read_text() == "x"
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert fs.read("/mine", BIG) == b"m"
