"""A sandbox's file entries as envd describes them (``EntryInfo``): owner and group by name, from the
sandbox's own /etc/passwd and /etc/group; a symlink by what it points to (its ``type`` is the target's,
``symlink_target`` the absolute target, ``is_symlink`` set), as envd reports it."""

from __future__ import annotations

import stat as st
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..core.manager import SandboxManager
from ..errors import DsecError, LimitExceeded
from ..protocol.sandbox import FileEntry
from ..tenancy import Caller
from . import envd_models as pm

MAX_CACHED = 1024  # sandboxes whose names are kept

_TYPES = {"file": pm.FileType.FILE_TYPE_FILE, "dir": pm.FileType.FILE_TYPE_DIRECTORY}
_TYPE_BITS = {"file": st.S_IFREG, "dir": st.S_IFDIR, "symlink": st.S_IFLNK}


@dataclass
class Names:
    users: dict[int, str] = field(default_factory=dict)
    groups: dict[int, str] = field(default_factory=dict)

    def user(self, uid: int | None) -> str:
        return "" if uid is None else self.users.get(uid, str(uid))

    def group(self, gid: int | None) -> str:
        return "" if gid is None else self.groups.get(gid, str(gid))


def parse_ids(text: str) -> dict[int, str]:
    """name by id, of an /etc/passwd or /etc/group text (the first name of an id wins, as getpwuid's)."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[0] and parts[2].isdigit():
            out.setdefault(int(parts[2]), parts[0])
    return out


_cache: OrderedDict[str, tuple[tuple[object, ...], Names]] = OrderedDict()
_TABLES = ("/etc/passwd", "/etc/group")


async def _version(mgr: SandboxManager, sandbox_id: str, caller: Caller) -> tuple[object, ...]:
    """What changes when the sandbox changes its account files (useradd replaces them)."""
    out: list[object] = []
    for path in _TABLES:
        try:
            e = await mgr.stat(sandbox_id, path, caller=caller)
            out += [e.mtime, e.size]
        except DsecError:
            out += [None, None]
    return tuple(out)


async def names(mgr: SandboxManager, sandbox_id: str, caller: Caller) -> Names:
    """The sandbox's account names, read again when its /etc/passwd or /etc/group changed."""
    version = await _version(mgr, sandbox_id, caller)
    hit = _cache.get(sandbox_id)
    if hit is not None and hit[0] == version:
        return hit[1]
    found = Names()
    for path, table in zip(_TABLES, (found.users, found.groups), strict=True):
        try:
            text = (await mgr.read_file(sandbox_id, path, caller=caller)).decode(errors="replace")
        except DsecError:
            continue  # no such file: ids are given as numbers
        table.update(parse_ids(text))
    _cache[sandbox_id] = (version, found)
    _cache.move_to_end(sandbox_id)
    while len(_cache) > MAX_CACHED:
        _cache.popitem(last=False)
    return found


async def depth_first(
    listed: Callable[[str], Awaitable[list[FileEntry]]], root: str, depth: int, limit: int
) -> list[FileEntry]:
    """What ``root`` holds to ``depth`` levels (1: its own entries), depth first as envd walks: each
    directory's entries by name, a directory followed by what it holds. Symlinks to directories are
    listed, not entered. More than ``limit`` entries is refused."""

    def by_name(entries: list[FileEntry]) -> list[FileEntry]:
        return sorted(entries, key=lambda e: e.name)

    found: list[FileEntry] = []
    # (a directory's entries, the next one to take, its level): a loop, not recursion, so a deep tree
    # cannot exhaust the stack
    stack = [(by_name(await listed(root)), 0, 1)]
    while stack:
        entries, at, level = stack[-1]
        if at == len(entries):
            stack.pop()
            continue
        stack[-1] = (entries, at + 1, level)
        e = entries[at]
        found.append(e)
        if len(found) > limit:
            raise LimitExceeded(f"{root} holds more than {limit} entries to depth {depth}")
        if e.type == "dir" and level < depth:
            stack.append((by_name(await listed(e.path)), 0, level + 1))
    return found


def entry_info(e: FileEntry, who: Names | None = None) -> pm.EntryInfo:
    link = e.type == "symlink"
    kind = e.link_type if link and e.link_type is not None else e.type
    return pm.EntryInfo(
        name=e.name,
        type=pm.FileType.FILE_TYPE_SYMLINK
        if kind == "symlink"
        else _TYPES.get(kind, pm.FileType.FILE_TYPE_UNSPECIFIED),
        path=e.path,
        size=e.size,
        mode=e.mode,
        permissions=st.filemode(_TYPE_BITS.get(e.type, 0) | e.mode),
        owner=who.user(e.uid) if who is not None else "",
        group=who.group(e.gid) if who is not None else "",
        modified_time=datetime.fromtimestamp(e.mtime, UTC),
        symlink_target=e.link_target if link else None,
        metadata=dict(e.metadata),
        is_symlink=link,
    )
