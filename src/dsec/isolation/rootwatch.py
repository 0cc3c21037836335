"""Exact change events for a directory of a sandbox whose files the host can open (containers and
function workers): inotify on the directory (and, recursively, those under it), each opened with
openat2 inside the sandbox's root as rootpath.py does, so a symlink planted by the workload never puts
a host directory under watch.

inotify sees every change made through any mount of the sandbox's file system, the sandbox's own
processes' included, as it happens. A directory created in a recursive watch is watched as soon as its
creation is read; what was put in it before that is reported as created (and written, if not empty),
so nothing in it goes unreported. Events are what fsnotify (and so envd) reports: create (made or moved
in), write, chmod (attributes), remove, rename (moved away).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import posixpath
from collections import deque
from collections.abc import Iterator
from typing import Literal

from ..errors import DsecError, InvalidRequest, LimitExceeded
from . import inotify as ino
from .rootpath import RootFS, _fd, _translate, clean_path, openat2

EventType = Literal["create", "write", "remove", "rename", "chmod"]
MAX_DIRS = 1_000  # directories one recursive watch holds
MAX_SCAN = 50_000  # entries one descent looks at (a watch's start, or a directory moved in)
MAX_PENDING = 10_000  # events kept for a reader that does not read; past it they are lost (``lost``)
LIMITS = (errno.ENOSPC, errno.EMFILE, errno.ENFILE, errno.ENOMEM)  # inotify's: watches, instances, memory
_ids = itertools.count(1)


class RootWatch:
    def __init__(self, hub: ino.Hub, fs: RootFS, path: str, *, recursive: bool) -> None:
        self.hub = hub
        self.fs = fs
        self.path = path
        self.rel = clean_path(path)
        self.recursive = recursive
        self.lost = False  # some events were lost (the kernel's queue or ours overflowed)
        self._id = next(_ids)
        self._dirs: dict[int, str] = {}  # wd -> directory relative to the watched one ("" for it)
        self._pending: deque[tuple[EventType, str]] = deque()
        self._ready = asyncio.Event()
        self._undo_overflow = hub.on_overflow(self._overflowed)

    def start(self) -> None:
        """Watch the directory (and those under it, if recursive). Call on the event loop."""
        try:
            with self.fs._rootfd() as root, _fd(openat2(root, self.rel, os.O_PATH | os.O_DIRECTORY)) as fd:
                self._add(fd, "")
                if self.recursive:
                    self._descend(fd, "", report=False)
        except DsecError:
            self.close()
            raise
        except OSError as e:
            self.close()
            if e.errno in LIMITS:
                raise  # the host's inotify limits: the caller may watch some other way
            if e.errno == errno.ENOTDIR:
                raise InvalidRequest(f"not a directory: {self.path}") from None
            raise _translate(e, self.path, self.fs.place) from None

    def take(self) -> list[tuple[EventType, str]]:
        """The events since the last take, in order: (type, path relative to the watched directory)."""
        out = list(self._pending)
        self._pending.clear()
        self._ready.clear()
        return out

    async def wait(self, timeout: float) -> None:
        """Until there are events to take, or ``timeout`` seconds."""
        if self._pending:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)

    def close(self) -> None:
        for wd in list(self._dirs):
            self.hub.remove(wd, self._id)
        self._dirs.clear()
        self._undo_overflow()

    # ---- the watched tree ---------------------------------------------------------------------------

    def _add(self, dir_fd: int, rel: str) -> None:
        if len(self._dirs) >= MAX_DIRS:
            raise LimitExceeded(f"{self.path} holds more than {MAX_DIRS} directories: too many to watch")
        wd = self.hub.add(dir_fd, self._id, self._sink)
        self._dirs[wd] = rel

    def _descend(self, dir_fd: int, rel: str, *, report: bool, budget: list[int] | None = None) -> None:
        """Watch the directories under ``dir_fd`` (``rel``); ``report``: what is there is new. At most
        MAX_SCAN entries are looked at (``budget``, shared by the whole descent), on the event loop."""
        budget = [MAX_SCAN] if budget is None else budget
        for name, is_dir, is_file in self._entries(dir_fd, budget):
            sub = posixpath.join(rel, name) if rel else name
            if report:
                self._emit("create", sub)
                with contextlib.suppress(OSError):
                    if is_file and os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size > 0:
                        self._emit("write", sub)
            if is_dir:
                try:
                    child = openat2(dir_fd, name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
                except OSError:
                    continue  # gone, or replaced by something else, meanwhile
                with _fd(child):
                    self._add(child, sub)
                    self._descend(child, sub, report=report, budget=budget)

    def _entries(self, dir_fd: int, budget: list[int]) -> Iterator[tuple[str, bool, bool]]:
        """(name, a directory, a regular file) of what ``dir_fd`` holds, by name; types from the
        directory itself (no stat for each entry)."""
        found: list[tuple[str, bool, bool]] = []
        with _fd(openat2(dir_fd, ".", os.O_RDONLY | os.O_DIRECTORY)) as fd, os.scandir(fd) as it:
            for entry in it:
                if budget[0] <= 0:
                    self.lost = True  # more than a watch looks at: what is beyond goes unreported
                    break
                budget[0] -= 1
                with contextlib.suppress(OSError):
                    found.append(
                        (entry.name, entry.is_dir(follow_symlinks=False), entry.is_file(follow_symlinks=False))
                    )
        yield from sorted(found)

    def _watch_new(self, rel: str) -> None:
        """A directory made (or moved) into a recursive watch: watched, and what it holds reported."""
        try:
            with self.fs._rootfd() as root:
                inner = posixpath.join(self.rel, rel) if self.rel != "." else rel
                with _fd(openat2(root, inner, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)) as fd:
                    self._add(fd, rel)
                    self._descend(fd, rel, report=True)
        except (OSError, DsecError):
            self.lost = self.lost or len(self._dirs) >= MAX_DIRS  # gone meanwhile is not a loss

    def _forget_under(self, rel: str) -> None:
        """A directory moved out of the tree: its watches would name what is no longer here."""
        for wd, where in list(self._dirs.items()):
            if where == rel or where.startswith(rel + "/"):
                del self._dirs[wd]
                self.hub.remove(wd, self._id)

    # ---- events -------------------------------------------------------------------------------------

    def _emit(self, kind: EventType, rel: str) -> None:
        if len(self._pending) >= MAX_PENDING:
            self.lost = True
            return
        self._pending.append((kind, rel))
        self._ready.set()

    def _overflowed(self) -> None:
        self.lost = True
        self._ready.set()

    def _sink(self, wd: int, mask: int, cookie: int, name: bytes) -> None:
        base = self._dirs.get(wd)
        if base is None:
            return
        if mask & ino.IN_IGNORED:
            del self._dirs[wd]
            return
        if not name:
            return  # the directory itself (deleted or moved): its parent, if watched, reports it
        text = name.decode(errors="replace")
        rel = posixpath.join(base, text) if base else text
        is_dir = bool(mask & ino.IN_ISDIR)
        if mask & (ino.IN_CREATE | ino.IN_MOVED_TO):
            self._emit("create", rel)
            if self.recursive and is_dir:
                self._watch_new(rel)
        if mask & ino.IN_MODIFY:
            self._emit("write", rel)
        if mask & ino.IN_ATTRIB:
            self._emit("chmod", rel)
        if mask & ino.IN_DELETE:
            self._emit("remove", rel)
        if mask & ino.IN_MOVED_FROM:
            self._emit("rename", rel)
            if is_dir:
                self._forget_under(rel)
