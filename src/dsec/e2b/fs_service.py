"""envd's ``filesystem.Filesystem`` service (the SDK's ``sbx.files`` beyond reads and writes) on the
core's file API, which each kind carries out from the host side (containers: openat2-confined on the
host; VMs: the guest's read-only busybox). Watches poll the directory through the same API."""

from __future__ import annotations

import asyncio
import stat as st
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from ..core.watch import POLL_INTERVAL, Change, DirWatch
from ..errors import FileNotFoundInSandbox, InvalidRequest, LimitExceeded
from ..protocol.sandbox import FileEntry
from . import envd_models as pm
from .connect import RpcError
from .envd import Call, server_stream, unary

MAX_LIST_ENTRIES = 20_000  # a deep list_dir is refused past this

_TYPES = {"file": pm.FileType.FILE_TYPE_FILE, "dir": pm.FileType.FILE_TYPE_DIRECTORY}
_TYPE_BITS = {"file": st.S_IFREG, "dir": st.S_IFDIR, "symlink": st.S_IFLNK}
_EVENTS = {
    "create": pm.EventType.EVENT_TYPE_CREATE,
    "write": pm.EventType.EVENT_TYPE_WRITE,
    "remove": pm.EventType.EVENT_TYPE_REMOVE,
    "chmod": pm.EventType.EVENT_TYPE_CHMOD,
}


def entry_info(e: FileEntry) -> pm.EntryInfo:
    link = e.type == "symlink"
    return pm.EntryInfo(
        name=e.name,
        type=pm.FileType.FILE_TYPE_SYMLINK if link else _TYPES.get(e.type, pm.FileType.FILE_TYPE_UNSPECIFIED),
        path=e.path,
        size=e.size,
        mode=e.mode,
        permissions=st.filemode(_TYPE_BITS.get(e.type, 0) | e.mode),
        modified_time=datetime.fromtimestamp(e.mtime, UTC),
        is_symlink=link,
    )


async def _path(call: Call, path: str) -> str:
    acct = await call.svc.account(call.rec, call.basic_user(), call.caller)
    return call.svc.absolute(path, acct.home)


async def _stat(call: Call, path: str) -> FileEntry:
    entry: FileEntry = await call.svc.call(call.rec, "stat", {"path": path}, caller=call.caller)
    return entry


@unary("/filesystem.Filesystem/Stat", pm.StatRequest)
async def stat(call: Call, req: pm.StatRequest) -> pm.StatResponse:
    return pm.StatResponse(entry=entry_info(await _stat(call, await _path(call, req.path))))


@unary("/filesystem.Filesystem/ListDir", pm.ListDirRequest)
async def list_dir(call: Call, req: pm.ListDirRequest) -> pm.ListDirResponse:
    root = await _path(call, req.path)
    depth = max(1, req.depth)
    out: list[pm.EntryInfo] = []
    level = [root]
    for _ in range(depth):
        below: list[str] = []
        for directory in level:
            entries: list[FileEntry] = await call.svc.call(call.rec, "list", {"path": directory}, caller=call.caller)
            for e in entries:
                out.append(entry_info(e))
                if e.type == "dir":
                    below.append(e.path)
            if len(out) > MAX_LIST_ENTRIES:
                raise LimitExceeded(f"{root} holds more than {MAX_LIST_ENTRIES} entries to depth {depth}")
        level = below
    return pm.ListDirResponse(entries=out)


@unary("/filesystem.Filesystem/MakeDir", pm.MakeDirRequest)
async def make_dir(call: Call, req: pm.MakeDirRequest) -> pm.MakeDirResponse:
    path = await _path(call, req.path)
    try:
        existing = await _stat(call, path)
    except FileNotFoundInSandbox:
        existing = None
    if existing is not None:
        if existing.type == "dir":
            raise RpcError("already_exists", f"directory {path} already exists")
        raise InvalidRequest(f"{path} exists and is not a directory")
    await call.svc.call(call.rec, "mkdir", {"path": path}, caller=call.caller)
    return pm.MakeDirResponse(entry=entry_info(await _stat(call, path)))


@unary("/filesystem.Filesystem/Move", pm.MoveRequest)
async def move(call: Call, req: pm.MoveRequest) -> pm.MoveResponse:
    source, destination = await _path(call, req.source), await _path(call, req.destination)
    await call.svc.call(call.rec, "move", {"source": source, "destination": destination}, caller=call.caller)
    return pm.MoveResponse(entry=entry_info(await _stat(call, destination)))


@unary("/filesystem.Filesystem/Remove", pm.RemoveRequest)
async def remove(call: Call, req: pm.RemoveRequest) -> pm.RemoveResponse:
    path = await _path(call, req.path)
    await call.svc.call(call.rec, "remove", {"path": path, "recursive": True}, caller=call.caller)
    return pm.RemoveResponse()


def _event(change: Change, include_entry: bool) -> pm.FilesystemEvent:
    entry = entry_info(change.entry) if include_entry and change.entry is not None else None
    return pm.FilesystemEvent(name=change.name, type=_EVENTS[change.type], entry=entry)


@server_stream("/filesystem.Filesystem/WatchDir", pm.WatchDirRequest)
async def watch_dir(call: Call, req: pm.WatchDirRequest) -> AsyncIterator[pm.WatchDirResponse]:
    watch = DirWatch(
        call.svc.mgr, call.sandbox_id, await _path(call, req.path), recursive=req.recursive, caller=call.caller
    )
    await watch.start()
    yield pm.WatchDirResponse(start=pm.WatchDirStart())
    quiet, keepalive = 0.0, call.keepalive()
    while True:
        await asyncio.sleep(POLL_INTERVAL)
        changes = await watch.changes()
        for change in changes:
            yield pm.WatchDirResponse(filesystem=_event(change, req.include_entry))
        quiet = 0.0 if changes else quiet + POLL_INTERVAL
        if quiet >= keepalive:
            quiet = 0.0
            yield pm.WatchDirResponse(keepalive=pm.KeepAlive())


@unary("/filesystem.Filesystem/CreateWatcher", pm.CreateWatcherRequest)
async def create_watcher(call: Call, req: pm.CreateWatcherRequest) -> pm.CreateWatcherResponse:
    watch = DirWatch(
        call.svc.mgr, call.sandbox_id, await _path(call, req.path), recursive=req.recursive, caller=call.caller
    )
    await watch.start()
    return pm.CreateWatcherResponse(watcher_id=call.svc.add_watcher(call.sandbox_id, watch, req.include_entry))


@unary("/filesystem.Filesystem/GetWatcherEvents", pm.GetWatcherEventsRequest)
async def watcher_events(call: Call, req: pm.GetWatcherEventsRequest) -> pm.GetWatcherEventsResponse:
    """What changed since the previous call: the look is taken now, so nothing is lost between polls
    except what was created and removed in between."""
    w = call.svc.watcher(call.sandbox_id, req.watcher_id)
    return pm.GetWatcherEventsResponse(events=[_event(c, w.include_entry) for c in await w.watch.changes()])


@unary("/filesystem.Filesystem/RemoveWatcher", pm.RemoveWatcherRequest)
async def remove_watcher(call: Call, req: pm.RemoveWatcherRequest) -> pm.RemoveWatcherResponse:
    call.svc.remove_watcher(call.sandbox_id, req.watcher_id)
    return pm.RemoveWatcherResponse()
