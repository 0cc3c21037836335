"""The root-confined operations the volume content API adds (isolation/rootpath.py): uploads written
whole or not at all, mkdir with and without parents, attributes, walks, lstat, and the same
confinement for each: a symlink the workload planted never leads out of the root."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from dsec.errors import FileNotFoundInSandbox, InvalidRequest, LimitExceeded
from dsec.isolation.rootpath import Place, RootFS, _translate


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    o = tmp_path / "outside"
    o.mkdir()
    (o / "secret").write_text("host secret")
    return o


@pytest.fixture
def fs(root: Path) -> RootFS:
    return RootFS(str(root), place=Place("volume 'v'", "volume 'v' is full"))


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".dsec-" in p.name)


def test_an_upload_replaces_the_file_only_when_committed(fs: RootFS, root: Path) -> None:
    (root / "f").write_bytes(b"old")
    up = fs.upload("/f", 0o640)
    up.write(b"new ")
    up.write(b"contents")
    assert (root / "f").read_bytes() == b"old"  # a reader meanwhile sees the whole old file
    up.commit()
    assert (root / "f").read_bytes() == b"new contents"
    assert stat.S_IMODE((root / "f").stat().st_mode) == 0o640  # exactly, whatever the umask
    assert _leftovers(root) == []


def test_an_aborted_upload_leaves_the_old_file_and_no_temporary(fs: RootFS, root: Path) -> None:
    (root / "d").mkdir()
    (root / "d/f").write_bytes(b"old")
    up = fs.upload("/d/f", 0o644)
    up.write(b"half")
    assert len(_leftovers(root / "d")) == 1
    up.abort()
    up.abort()  # twice is harmless
    assert (root / "d/f").read_bytes() == b"old" and _leftovers(root / "d") == []


def test_an_upload_makes_its_parents_and_refuses_a_directory(fs: RootFS, root: Path) -> None:
    up = fs.upload("/a/b/c.txt")
    up.commit()
    assert (root / "a/b/c.txt").read_bytes() == b""
    (root / "dir").mkdir()
    up = fs.upload("/dir")
    with pytest.raises(InvalidRequest, match="is a directory"):
        up.commit()
    assert (root / "dir").is_dir() and _leftovers(root) == []
    with pytest.raises(InvalidRequest, match="cannot write to /"):
        fs.upload("/")


def test_a_full_disk_names_the_place(fs: RootFS) -> None:
    e = _translate(OSError(errno.ENOSPC, "No space left on device"), "/big", fs.place)
    assert isinstance(e, LimitExceeded) and e.message == "volume 'v' is full while writing /big"
    missing = _translate(OSError(errno.ENOENT, "gone"), "/x", fs.place)
    assert isinstance(missing, FileNotFoundInSandbox) and "in volume 'v'" in missing.message


def test_uploads_through_planted_symlinks_stay_inside(fs: RootFS, root: Path, outside: Path) -> None:
    (root / "escape").symlink_to("/")
    (root / "up").symlink_to("../../..")
    (root / "link").symlink_to(outside / "secret")
    for path in ("/escape/pwned", "/up/pwned"):
        up = fs.upload(path)
        up.write(b"x")
        up.commit()
    assert (root / "pwned").read_bytes() == b"x"  # the root's "/", not the host's
    assert not Path("/pwned").exists() and not (outside / "pwned").exists()
    up = fs.upload("/link")  # the link itself is replaced; what it named is untouched
    up.write(b"y")
    up.commit()
    assert not (root / "link").is_symlink() and (outside / "secret").read_text() == "host secret"


def test_make_dir_with_and_without_parents(fs: RootFS, root: Path) -> None:
    with pytest.raises(FileNotFoundInSandbox):
        fs.make_dir("/a/b", parents=False)
    fs.make_dir("/a/b", parents=True, mode=0o700)
    assert stat.S_IMODE((root / "a/b").stat().st_mode) == 0o700 and (root / "a").is_dir()
    with pytest.raises(InvalidRequest, match="already exists"):
        fs.make_dir("/a/b", parents=False)
    fs.make_dir("/a/b", parents=True, mode=0o755)  # mkdir -p: kept as it was
    assert stat.S_IMODE((root / "a/b").stat().st_mode) == 0o700
    (root / "f").write_text("")
    with pytest.raises(InvalidRequest, match="already exists"):
        fs.make_dir("/f", parents=True)


def test_make_dir_through_a_planted_symlink_stays_inside(fs: RootFS, root: Path, outside: Path) -> None:
    (root / "out").symlink_to(outside)
    with pytest.raises(FileNotFoundInSandbox):  # it names the root's copy of that path, which is not there
        fs.make_dir("/out/evil", parents=True)
    assert not (outside / "evil").exists()
    (root / "up").symlink_to("../../..")
    fs.make_dir("/up/evil", parents=True)  # ".." stops at the root
    assert (root / "evil").is_dir() and not (outside.parent / "evil").exists()


def test_attributes_follow_a_symlink_inside_only(fs: RootFS, root: Path, outside: Path) -> None:
    (root / "f").write_text("")
    (root / "to-f").symlink_to("/f")
    fs.set_attributes("/to-f", mode=0o600)
    assert stat.S_IMODE((root / "f").stat().st_mode) == 0o600
    (root / "host").symlink_to(outside / "secret")
    before = (outside / "secret").stat()
    with pytest.raises(FileNotFoundInSandbox):
        fs.set_attributes("/host", uid=12345, mode=0o777)
    after = (outside / "secret").stat()
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)


def test_walk_lists_depth_levels_and_never_follows_symlinks(fs: RootFS, root: Path, outside: Path) -> None:
    (root / "a/b/c").mkdir(parents=True)
    (root / "a/b/c/deep").write_text("")
    (root / "a/f").write_text("12")
    (root / "a/out").symlink_to(outside)
    one = fs.walk("/a", 1, 100)
    assert [p for p, _, _ in one] == ["/a/b", "/a/f", "/a/out"]
    assert [t for p, _, t in one if p == "/a/out"] == [str(outside)]
    assert [p for p, _, _ in fs.walk("/", 3, 100)] == ["/a", "/a/b", "/a/b/c", "/a/f", "/a/out"]
    assert "/a/b/c/deep" in [p for p, _, _ in fs.walk("/", 4, 100)]
    with pytest.raises(InvalidRequest, match="more than 2 entries"):
        fs.walk("/", 4, 2)
    with pytest.raises(InvalidRequest, match="not a directory"):
        fs.walk("/a/f", 1, 100)


def test_walk_through_a_symlinked_start_stays_inside(fs: RootFS, root: Path, outside: Path) -> None:
    (root / "out").symlink_to(outside)
    with pytest.raises(FileNotFoundInSandbox):
        fs.walk("/out", 1, 100)  # the root's own copy of that path, which does not exist


def test_lstat_reports_a_symlink_and_its_target(fs: RootFS, root: Path) -> None:
    (root / "l").symlink_to("../../etc/passwd")
    st, target = fs.lstat("/l")
    assert stat.S_ISLNK(st.st_mode) and target == "../../etc/passwd"
    st, target = fs.lstat("/")
    assert stat.S_ISDIR(st.st_mode) and target is None
    with pytest.raises(FileNotFoundInSandbox):
        fs.open_file("/l")  # it names the root's /etc/passwd, which is not there yet
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("the root's own")
    fd = fs.open_file("/l")
    try:
        assert os.read(fd, 100) == b"the root's own"
    finally:
        os.close(fd)
