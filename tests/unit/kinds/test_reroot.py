"""The pure parts of a container's rollback in place (kinds/container/reroot.py): mount points read back
from a mount table, and the clean-up that may race a background one."""

from __future__ import annotations

from pathlib import Path

from dsec.kinds.container import reroot


def test_mount_points_are_unescaped_as_mountinfo_writes_them() -> None:
    assert reroot._unescape(r"/data/my\040dir") == "/data/my dir"
    assert reroot._unescape(r"/a\011b\012c\134d") == "/a\tb\nc\\d"
    assert reroot._unescape("/plain/été") == "/plain/été"  # bytes above ASCII are written as they are


def test_clean_up_of_what_is_gone_already_is_quiet(tmp_path: Path) -> None:
    # a background unmount and the next rollback's sweep may both reach one old root
    reroot.drop_old(tmp_path / "old-gone")
    reroot._remove_dirs(tmp_path / "missing")


def test_removing_mount_points_never_deletes_through_them(tmp_path: Path) -> None:
    old = tmp_path / "old-1"
    for name in ("rootfs", "disk", "stack-0"):
        (old / name).mkdir(parents=True)
    (old / "disk" / "upper").mkdir()  # a mount that is still there shows its files: they must stay
    (old / "disk" / "upper" / "file").write_text("kept")
    reroot._remove_dirs(old)
    assert sorted(p.name for p in old.iterdir()) == ["disk"]
    assert (old / "disk" / "upper" / "file").read_text() == "kept"
