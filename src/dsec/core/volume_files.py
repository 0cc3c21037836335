"""A named volume's files, read and written with no sandbox (the E2B layer's volume content API).

Each call borrows the volume for as long as it runs (``Volumes.lend``): mounted on the host if no
sandbox uses it, unmounted after if none does then. A write is refused while a sandbox mounts the
volume read-write, as a second sandbox asking to write would be; a read is not (it sees the file system
as a read-only sandbox would). Paths are resolved as the sandbox file API resolves them
(isolation/rootpath.py: openat2 rooted at the volume), so ``..`` stops at the volume's root and a
symlink a sandbox planted, absolute or relative, resolves inside the volume, never outside it.

Files and directories made here belong to root as the sandboxes see it (uid 0 in the volume: its
mounts are idmapped), or to the uid and gid asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidRequest
from ..isolation.rootpath import Place, RootFS, clean_path
from ..protocol.volumes import Mode
from ..tenancy import Caller
from .volumes import Volumes

MAX_ID = (1 << 32) - 2  # (uid_t)-1 means "unchanged" to chown
MAX_DEPTH = 64
MAX_LISTED = 100_000
CHUNK = 1 << 20
EntryType = Literal["file", "directory", "symlink", "unknown"]


@dataclass(frozen=True)
class VolumeEntry:
    path: str  # from the volume's root, "/" itself
    name: str
    type: EntryType
    size: int
    mode: int  # permission bits (and set-id, sticky)
    uid: int
    gid: int
    atime: float
    mtime: float
    ctime: float
    target: str | None = None  # a symlink's, as it is written


def entry(path: str, st: os.stat_result, target: str | None) -> VolumeEntry:
    kinds: dict[int, EntryType] = {stat.S_IFDIR: "directory", stat.S_IFREG: "file", stat.S_IFLNK: "symlink"}
    return VolumeEntry(
        path=path,
        name=posixpath.basename(path) or "/",
        type=kinds.get(stat.S_IFMT(st.st_mode), "unknown"),
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        atime=st.st_atime,
        mtime=st.st_mtime,
        ctime=st.st_ctime,
        target=target,
    )


def inside(path: str) -> str:
    """A content-API path as the volume's own: relative ones are from its root; clean, or refused."""
    if not isinstance(path, str) or not path:
        raise InvalidRequest("path is empty")
    rel = clean_path(path if path.startswith("/") else "/" + path)
    return "/" if rel == "." else "/" + rel


def owner_of(uid: int | None, gid: int | None) -> tuple[int, int] | None:
    """What new files and directories are given: root's (None) unless a uid or gid is asked for."""
    for value, what in ((uid, "uid"), (gid, "gid")):
        if value is not None and not 0 <= value <= MAX_ID:
            raise InvalidRequest(f"{what} must be 0 to {MAX_ID}, not {value}")
    return None if uid is None and gid is None else (uid or 0, gid or 0)


def checked_mode(mode: int | None, default: int) -> int:
    if mode is None:
        return default
    if not 0 <= mode <= 0o7777:
        raise InvalidRequest(f"mode must be 0 to 0o7777 (permission, set-id and sticky bits), not {mode:#o}")
    return mode


class VolumeFiles:
    def __init__(self, volumes: Volumes) -> None:
        self.volumes = volumes

    @contextlib.asynccontextmanager
    async def _fs(
        self, name: str, caller: Caller, mode: Mode, owner: tuple[int, int] | None = None
    ) -> AsyncIterator[RootFS]:
        where = f"volume {name!r}"
        async with self.volumes.lend(name, caller, mode) as root:
            yield RootFS(str(root), owner=owner, place=Place(where, f"{where} is full (its size is its quota)"))

    async def stat(self, name: str, path: str, *, caller: Caller) -> VolumeEntry:
        """The entry at ``path`` itself (a symlink as one, with its target)."""
        path = inside(path)
        async with self._fs(name, caller, "ro") as fs:
            st, target = await asyncio.to_thread(fs.lstat, path)
        return entry(path, st, target)

    async def list(self, name: str, path: str, depth: int = 1, *, caller: Caller) -> list[VolumeEntry]:
        """What the directory at ``path`` holds, ``depth`` levels down; symlinks listed, not followed."""
        path = inside(path)
        if not 1 <= depth <= MAX_DEPTH:
            raise InvalidRequest(f"depth must be 1 to {MAX_DEPTH}, not {depth}")
        async with self._fs(name, caller, "ro") as fs:
            found = await asyncio.to_thread(fs.walk, path, depth, MAX_LISTED)
        return [entry(p, st, target) for p, st, target in found]

    @contextlib.asynccontextmanager
    async def reading(self, name: str, path: str, *, caller: Caller) -> AsyncIterator[AsyncIterator[bytes]]:
        """The regular file at ``path``, opened: its contents as they are read, in chunks. The volume stays
        borrowed until the context ends, so a reader that stops early must leave it."""
        path = inside(path)
        async with self._fs(name, caller, "ro") as fs:
            fd = await asyncio.to_thread(fs.open_file, path)
            try:
                yield _chunks(fd)
            finally:
                os.close(fd)

    async def write(
        self,
        name: str,
        path: str,
        chunks: AsyncIterator[bytes],
        *,
        uid: int | None = None,
        gid: int | None = None,
        mode: int | None = None,
        caller: Caller,
    ) -> VolumeEntry:
        """Make or replace the file at ``path`` with what ``chunks`` yields, its parents made as needed. It
        replaces the old file only once whole: a write cut short (the quota, the client gone) leaves the
        old one as it was."""
        path, owner, file_mode = inside(path), owner_of(uid, gid), checked_mode(mode, 0o644)
        async with self._fs(name, caller, "rw", owner) as fs:
            upload = await asyncio.to_thread(fs.upload, path, file_mode)
            try:
                pending: list[bytes] = []
                size = 0
                async for chunk in chunks:
                    pending.append(chunk)
                    size += len(chunk)
                    if size >= CHUNK:
                        await asyncio.to_thread(upload.write, b"".join(pending))
                        pending, size = [], 0
                await asyncio.to_thread(upload.write, b"".join(pending))
                await asyncio.to_thread(upload.commit)
            except BaseException:
                upload.abort()  # a few syscalls: done even when the call is being cancelled
                raise
            st, target = await asyncio.to_thread(fs.lstat, path)
        return entry(path, st, target)

    async def mkdir(
        self,
        name: str,
        path: str,
        *,
        parents: bool = False,
        uid: int | None = None,
        gid: int | None = None,
        mode: int | None = None,
        caller: Caller,
    ) -> VolumeEntry:
        """A new directory at ``path``; ``parents``: its parents made as needed, and one already there
        kept (``mkdir -p``)."""
        path, owner, dir_mode = inside(path), owner_of(uid, gid), checked_mode(mode, 0o755)
        async with self._fs(name, caller, "rw", owner) as fs:
            await asyncio.to_thread(lambda: fs.make_dir(path, parents=parents, mode=dir_mode))
            st, target = await asyncio.to_thread(fs.lstat, path)
        return entry(path, st, target)

    async def set_attributes(
        self,
        name: str,
        path: str,
        *,
        uid: int | None = None,
        gid: int | None = None,
        mode: int | None = None,
        caller: Caller,
    ) -> VolumeEntry:
        """chown and chmod ``path`` (a symlink is followed, inside the volume); its entry after."""
        path = inside(path)
        owner_of(uid, gid)  # the bounds
        new_mode = None if mode is None else checked_mode(mode, 0)
        async with self._fs(name, caller, "rw") as fs:
            await asyncio.to_thread(fs.set_attributes, path, uid, gid, new_mode)
            st, target = await asyncio.to_thread(fs.lstat, path)
        return entry(path, st, target)

    async def remove(self, name: str, path: str, *, caller: Caller) -> None:
        """Remove the file, symlink or directory (with what it holds) at ``path``; never the root."""
        path = inside(path)
        if path == "/":
            raise InvalidRequest("refusing to remove the volume's root: remove the volume, or what it holds")
        async with self._fs(name, caller, "rw") as fs:
            await asyncio.to_thread(fs.remove, path, True)


async def _chunks(fd: int) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(os.read, fd, CHUNK):
        yield chunk
