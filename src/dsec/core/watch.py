"""Watching a directory of a sandbox for changes.

Where the kind watches files itself (containers and function workers: inotify from the host, see
isolation/rootwatch.py), the events are exact and come as they happen. Elsewhere (a VM's files are only
reachable through its agent) the directory is listed again and again through the core's file API: that
needs nothing from inside the sandbox, but changes are seen at the polling interval, a file created and
removed between two looks is never seen, and a rename shows as a remove and a create.
"""

from __future__ import annotations

import asyncio
import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from ..errors import FileNotFoundInSandbox, InvalidRequest, LimitExceeded, SandboxGone
from ..kinds.base import FileWatch
from ..protocol.sandbox import FileEntry
from ..tenancy import Caller

if TYPE_CHECKING:
    from .manager import SandboxManager

POLL_INTERVAL = 0.5  # seconds between two looks
MAX_ENTRIES = 20_000  # entries one watch may hold (a recursive watch of a large tree is refused)
MAX_DIRS = 1_000  # directories one recursive look lists

ChangeType = Literal["create", "write", "remove", "rename", "chmod"]


@dataclass(frozen=True)
class Change:
    type: ChangeType
    name: str  # relative to the watched directory ("a.txt", "sub/b.txt")
    entry: FileEntry | None  # what is there now, when the look saw it (None: a removal, or not looked at)


class DirWatch:
    def __init__(self, mgr: SandboxManager, sandbox_id: str, path: str, *, recursive: bool, caller: Caller) -> None:
        if not path.startswith("/"):
            raise InvalidRequest(f"path must be absolute: {path!r}")
        self.mgr = mgr
        self.sandbox_id = sandbox_id
        self.path = posixpath.normpath(path)
        self.recursive = recursive
        self.caller = caller
        self._seen: dict[str, FileEntry] | None = None
        self._native: FileWatch | None = None

    @property
    def exact(self) -> bool:
        """Whether the events are the kind's own (as they happen) rather than a comparison of looks."""
        return self._native is not None

    async def start(self) -> None:
        """The directory must exist (and be a directory, or a symlink to one); nothing is reported for
        what is in it already."""
        entry = await self.mgr.stat(self.sandbox_id, self.path, caller=self.caller)
        if entry.type != "dir" and not (entry.type == "symlink" and entry.link_type == "dir"):
            raise InvalidRequest(f"not a directory: {self.path}")
        self._native = await self.mgr.files.watch(self.sandbox_id, self.path, self.recursive, caller=self.caller)
        if self._native is None:
            self._seen = await self._look()

    async def changes(self) -> list[Change]:
        """What changed since the previous call, in order for exact events; for looks, in a stable order
        (creations and writes by name, then removals)."""
        if self._native is not None:
            events = self._native.take()
            # checked after the take: what was taken happened while the sandbox was still this one (a
            # function sandbox's worker is lent to another sandbox once it ended)
            if not self.mgr.is_live(self.sandbox_id):
                self.close()
                raise SandboxGone(f"sandbox {self.sandbox_id} has ended")
            return [Change(cast(ChangeType, kind), name, None) for kind, name in events]
        if self._seen is None:
            await self.start()
            return []
        now = await self._look()
        before = self._seen
        self._seen = now
        out: list[Change] = []
        for name in sorted(now):
            new, old = now[name], before.get(name)
            if old is None:
                out.append(Change("create", name, new))
            elif old.type != new.type:
                out.append(Change("remove", name, None))
                out.append(Change("create", name, new))
            elif (old.size, old.mtime) != (new.size, new.mtime) and new.type != "dir":
                out.append(Change("write", name, new))
            elif old.mode != new.mode:
                out.append(Change("chmod", name, new))
        out += [Change("remove", name, None) for name in sorted(set(before) - set(now))]
        return out

    async def wait(self, timeout: float) -> None:
        """Until there may be changes: the kind's next event, or the next look."""
        if self._native is not None:
            await self._native.wait(timeout)
        else:
            await asyncio.sleep(min(POLL_INTERVAL, timeout))

    def close(self) -> None:
        if self._native is not None:
            self._native.close()
            self._native = None
            self._seen = {}  # closed: nothing more is reported

    async def _look(self) -> dict[str, FileEntry]:
        seen: dict[str, FileEntry] = {}
        pending = [""]
        dirs = 0
        while pending:
            rel = pending.pop()
            dirs += 1
            if dirs > MAX_DIRS:
                raise LimitExceeded(f"{self.path} holds more than {MAX_DIRS} directories: too many to watch")
            path = posixpath.join(self.path, rel) if rel else self.path
            try:
                entries = await self.mgr.list_dir(self.sandbox_id, path, caller=self.caller)
            except (FileNotFoundInSandbox, InvalidRequest):
                if not rel:
                    raise
                continue  # a subdirectory that went away (or became a file) since its parent was listed
            for entry in entries:
                name = posixpath.join(rel, entry.name) if rel else entry.name
                seen[name] = entry
                if len(seen) > MAX_ENTRIES:
                    raise LimitExceeded(f"{self.path} holds more than {MAX_ENTRIES} entries: too many to watch")
                if self.recursive and entry.type == "dir":
                    pending.append(name)
        return seen
