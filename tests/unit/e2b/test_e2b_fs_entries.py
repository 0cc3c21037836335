"""envd's view of file entries: the depth-first listing, account names, symlinks as envd reports them."""

from __future__ import annotations

import posixpath

import pytest

from dsec.e2b import envd_models as pm
from dsec.e2b.fs_entries import Names, depth_first, entry_info, parse_ids
from dsec.errors import LimitExceeded
from dsec.protocol.sandbox import FileEntry

TREE = {
    "/r": ["subdir2", "file1.txt", "subdir1", "link"],
    "/r/subdir1": ["subdir1_2", "subdir1_1"],
    "/r/subdir2": ["subdir2_1"],
    "/r/subdir1/subdir1_1": ["deep"],
    "/r/subdir1/subdir1_2": [],
    "/r/subdir2/subdir2_1": [],
    "/r/subdir1/subdir1_1/deep": [],
}


def _entry(path: str) -> FileEntry:
    kind = "dir" if path in TREE else "symlink" if path.endswith("link") else "file"
    return FileEntry(name=posixpath.basename(path), path=path, type=kind, size=0, mode=0o755, mtime=0.0)


async def _listed(directory: str) -> list[FileEntry]:
    return [_entry(posixpath.join(directory, name)) for name in TREE[directory]]


async def test_a_deep_list_walks_depth_first_by_name() -> None:
    one = [e.path for e in await depth_first(_listed, "/r", 1, 100)]
    assert one == ["/r/file1.txt", "/r/link", "/r/subdir1", "/r/subdir2"]
    two = [e.name for e in await depth_first(_listed, "/r", 2, 100)]
    assert two == ["file1.txt", "link", "subdir1", "subdir1_1", "subdir1_2", "subdir2", "subdir2_1"]
    three = [e.name for e in await depth_first(_listed, "/r", 3, 100)]
    assert three == ["file1.txt", "link", "subdir1", "subdir1_1", "deep", "subdir1_2", "subdir2", "subdir2_1"]
    with pytest.raises(LimitExceeded):
        await depth_first(_listed, "/r", 3, 5)


async def test_a_deep_tree_does_not_exhaust_the_stack() -> None:
    async def chain(directory: str) -> list[FileEntry]:
        level = directory.count("/")
        if level > 3000:
            return []
        child = posixpath.join(directory, "d")
        return [FileEntry(name="d", path=child, type="dir", size=0, mode=0o755, mtime=0.0)]

    assert len(await depth_first(chain, "/", 5000, 10_000)) == 3001  # /d, /d/d, ...: 3001 levels


def test_account_names_come_from_the_sandboxs_files() -> None:
    users = parse_ids(
        "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/sh\nalias:x:1000:9::/:\nbad\n"
    )
    assert users == {0: "root", 1000: "user"}  # the first name of an id, as getpwuid gives
    who = Names(users, parse_ids("root:x:0:\nstaff:x:50:user\n"))
    assert (who.user(1000), who.group(50), who.user(4242), who.group(None)) == ("user", "staff", "4242", "")


def test_a_symlink_reports_its_targets_type_and_absolute_target() -> None:
    link = FileEntry(
        name="l", path="/h/l", type="symlink", size=5, mode=0o777, mtime=1.0, uid=0, gid=0,
        link_target="/h/t.txt", link_type="file",
    )  # fmt: skip
    info = entry_info(link, Names({0: "root"}, {0: "root"}))
    assert (info.type, info.is_symlink, info.symlink_target) == (pm.FileType.FILE_TYPE_FILE, True, "/h/t.txt")
    assert (info.owner, info.group, info.permissions) == ("root", "root", "lrwxrwxrwx")
    dangling = entry_info(link.model_copy(update={"link_type": None, "link_target": "/nowhere"}))
    assert (dangling.type, dangling.symlink_target) == (pm.FileType.FILE_TYPE_SYMLINK, "/nowhere")
    plain = entry_info(FileEntry(name="d", path="/d", type="dir", size=0, mode=0o755, mtime=0.0, metadata={"k": "v"}))
    assert (plain.type, plain.is_symlink, plain.symlink_target, plain.metadata) == (
        pm.FileType.FILE_TYPE_DIRECTORY,
        False,
        None,
        {"k": "v"},
    )
    assert plain.permissions == "drwxr-xr-x"
