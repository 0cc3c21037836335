"""Symlink targets and user metadata (``user.e2b.*`` extended attributes) of a root's entries, on a
real directory: confined to the root as the rest of rootpath.py is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.errors import FileNotFoundInSandbox, InvalidRequest
from dsec.isolation import rootpath_meta
from dsec.isolation.rootpath import RootFS


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    (r / "home" / "d").mkdir(parents=True)
    return r


def _xattrs_work(path: Path) -> bool:
    probe = path / ".probe"
    probe.write_text("")
    try:
        os.setxattr(probe, "user.probe", b"1")
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def test_symlinks_name_their_target_absolutely_and_what_is_there(root: Path, tmp_path: Path) -> None:
    fs = RootFS(str(root))
    (root / "home" / "d" / "t.txt").write_text("t")
    os.symlink("t.txt", root / "home" / "d" / "rel")
    os.symlink("/home/d", root / "home" / "abs")
    os.symlink("../nowhere", root / "home" / "d" / "dangling")
    (tmp_path / "host-secret").write_text("s")
    os.symlink(str(tmp_path / "host-secret"), root / "home" / "escape")  # a host path, resolved in the root
    entries = {e.name: e for e in fs.list("/home/d") + fs.list("/home")}
    described = {n: rootpath_meta.describe(fs, e, e.path) for n, e in entries.items()}
    assert (described["rel"].link_target, described["rel"].link_type) == ("/home/d/t.txt", "file")
    assert (described["abs"].link_target, described["abs"].link_type) == ("/home/d", "dir")
    assert (described["dangling"].link_target, described["dangling"].link_type) == ("/home/nowhere", None)
    # the target is what the link says; what it resolves to is looked up in the root, where it is not
    assert described["escape"].link_target == str(tmp_path / "host-secret")
    assert described["escape"].link_type is None
    assert described["t.txt"].link_target is None and described["d"].link_type is None


def test_metadata_is_set_replaced_cleared_and_confined(root: Path, tmp_path: Path) -> None:
    if not _xattrs_work(tmp_path):
        pytest.skip("this file system keeps no user extended attributes")
    fs = RootFS(str(root))
    fs.write("/home/f.txt", b"x")
    rootpath_meta.set_metadata(fs, "/home/f.txt", {"Author": "me", "purpose": "test"})
    assert os.getxattr(root / "home" / "f.txt", "user.e2b.author") == b"me"  # keys are lowercased
    entry = rootpath_meta.describe(fs, fs.stat("/home/f.txt"), "/home/f.txt")
    assert entry.metadata == {"author": "me", "purpose": "test"}
    os.setxattr(root / "home" / "f.txt", "user.other", b"kept")  # not E2B's: left alone
    rootpath_meta.set_metadata(fs, "/home/f.txt", {"purpose": "again"})
    assert rootpath_meta.describe(fs, fs.stat("/home/f.txt"), "/home/f.txt").metadata == {"purpose": "again"}
    rootpath_meta.set_metadata(fs, "/home/f.txt", {})
    assert rootpath_meta.describe(fs, fs.stat("/home/f.txt"), "/home/f.txt").metadata == {}
    assert os.getxattr(root / "home" / "f.txt", "user.other") == b"kept"
    # a symlink to a host file is resolved in the root: the host file never gets an attribute
    host = tmp_path / "host.txt"
    host.write_text("h")
    os.symlink(str(host), root / "home" / "out")
    with pytest.raises(FileNotFoundInSandbox):
        rootpath_meta.set_metadata(fs, "/home/out", {"k": "v"})
    assert os.listxattr(host) == []


def test_metadata_keys_and_values_are_checked() -> None:
    assert rootpath_meta.check_metadata({"A-b.c": "v v"}) == {"a-b.c": "v v"}
    for bad in ({"": "v"}, {"a b": "v"}, {"k": "line\n"}, {"k": "é"}, {"k": "x" * 5000}):
        with pytest.raises(InvalidRequest):
            rootpath_meta.check_metadata(bad)
    with pytest.raises(InvalidRequest, match="at most"):
        rootpath_meta.check_metadata({f"k{n}": "v" for n in range(rootpath_meta.MAX_KEYS + 1)})


def test_metadata_is_kept_on_files_and_directories_only(root: Path) -> None:
    fs = RootFS(str(root))
    os.mkfifo(root / "home" / "fifo")
    with pytest.raises(InvalidRequest, match="files and directories"):
        rootpath_meta.set_metadata(fs, "/home/fifo", {"k": "v"})
