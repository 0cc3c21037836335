"""Squashing a build's step layers: residue a later step deleted is gone, the stacked view is unchanged."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dsec.images.squash import OPAQUE_XATTR, shadowed, squash

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts (0/0 devices) and trusted.* xattrs need root")


def whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, 0)


def layer(root: Path, files: dict[str, str | None], opaque: tuple[str, ...] = ()) -> Path:
    """None: a whiteout."""
    root.mkdir()
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            whiteout(p)
        else:
            p.write_text(text)
    for rel in opaque:
        (root / rel).mkdir(parents=True, exist_ok=True)
        os.setxattr(root / rel, OPAQUE_XATTR, b"y")
    return root


def tree(root: Path) -> dict[str, str]:
    out = {}
    for top, _dirs, files in os.walk(root):
        for name in files:
            p = Path(top) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "-> " + os.readlink(p)
            else:
                out[rel] = "<whiteout>" if stat.S_ISCHR(st.st_mode) else p.read_text()
    return out


def test_a_deleted_answer_leaves_no_bytes_only_a_whiteout(tmp_path: Path) -> None:
    one = layer(tmp_path / "1", {"work/answer.txt": "ANSWER", "work/keep.py": "code", "etc/conf": "a"})
    two = layer(tmp_path / "2", {"work/answer.txt": None, "etc/conf": "b", "etc/motd": None})
    # etc/conf's first version is replaced; etc/motd is the base's (not residue of these layers)
    assert shadowed([one, two]) == ["etc/conf", "work/answer.txt"]
    out = tmp_path / "out"
    out.mkdir()
    squash([one, two], out)
    assert tree(out) == {
        "work/answer.txt": "<whiteout>",  # still hides a base file of that name, holds no data
        "work/keep.py": "code",
        "etc/conf": "b",
        "etc/motd": "<whiteout>",
    }
    assert b"ANSWER" not in b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())


def test_an_opaque_directory_hides_what_earlier_steps_put_under_it(tmp_path: Path) -> None:
    one = layer(tmp_path / "1", {"data/old/secret": "S", "data/x": "x"})
    two = layer(tmp_path / "2", {"data/new": "n"}, opaque=("data",))
    assert shadowed([one, two]) == ["data/old", "data/old/secret", "data/x"]
    out = tmp_path / "out"
    out.mkdir()
    squash([one, two], out)
    assert tree(out) == {"data/new": "n"}
    assert os.getxattr(out / "data", OPAQUE_XATTR) == b"y"


def test_recreated_over_a_deletion_and_types_replaced(tmp_path: Path) -> None:
    one = layer(tmp_path / "1", {"a/f": "1", "b": "file"})
    two = layer(tmp_path / "2", {"a": None})
    three = layer(tmp_path / "3", {"a/g": "2", "b/inner": "dir now"})
    (tmp_path / "3" / "link").symlink_to("/etc/passwd")
    os.lchown(tmp_path / "3" / "a" / "g", 1000, 1001)
    assert shadowed([one, two, three]) == ["a", "a/f", "b"]
    out = tmp_path / "out"
    out.mkdir()
    squash([one, two, three], out)
    assert tree(out) == {"a/g": "2", "b/inner": "dir now", "link": "-> /etc/passwd"}
    assert os.getxattr(out / "a", OPAQUE_XATTR) == b"y"  # the deletion of a/ still hides the base's a/
    st = os.lstat(out / "a" / "g")
    assert (st.st_uid, st.st_gid) == (1000, 1001)


def test_layers_that_shadow_nothing_need_no_squash(tmp_path: Path) -> None:
    one = layer(tmp_path / "1", {"a": "1"})
    two = layer(tmp_path / "2", {"b": "2", "c": None})
    assert shadowed([one, two]) == []
