"""envd's ``filesystem.Filesystem`` service (the SDK's ``sbx.files`` beyond reads and writes) on the
core's file API, which each kind carries out from the host side (containers: openat2-confined on the
host; VMs: the guest's read-only busybox). Watches are core/watch.py's: the kind's exact events where
it has them (inotify, for containers and function workers), a comparison of looks elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
from collections.abc import AsyncIterator

from ..core.watch import Change, DirWatch
from ..errors import FileNotFoundInSandbox, InvalidRequest
from ..protocol.sandbox import FileEntry
from . import envd_models as pm
from .connect import RpcError
from .envd import Call, server_stream, unary
from .fs_entries import depth_first, entry_info, names

MAX_LIST_ENTRIES = 20_000  # a deep list_dir is refused past this
STREAM_CHECK = 1.0  # seconds a quiet watch stream waits before it checks its sandbox and keepalive

_EVENTS = {
    "create": pm.EventType.EVENT_TYPE_CREATE,
    "write": pm.EventType.EVENT_TYPE_WRITE,
    "remove": pm.EventType.EVENT_TYPE_REMOVE,
    "rename": pm.EventType.EVENT_TYPE_RENAME,
    "chmod": pm.EventType.EVENT_TYPE_CHMOD,
}


async def _info(call: Call, e: FileEntry) -> pm.EntryInfo:
    return entry_info(e, await names(call.svc.mgr, call.sandbox_id, call.caller))


async def _path(call: Call, path: str) -> str:
    acct = await call.svc.account(call.rec, call.basic_user(), call.caller)
    return call.svc.absolute(path, acct.home)


async def _stat(call: Call, path: str) -> FileEntry:
    entry: FileEntry = await call.svc.call(call.rec, "stat", {"path": path}, caller=call.caller)
    return entry


@unary("/filesystem.Filesystem/Stat", pm.StatRequest)
async def stat(call: Call, req: pm.StatRequest) -> pm.StatResponse:
    return pm.StatResponse(entry=await _info(call, await _stat(call, await _path(call, req.path))))


@unary("/filesystem.Filesystem/ListDir", pm.ListDirRequest)
async def list_dir(call: Call, req: pm.ListDirRequest) -> pm.ListDirResponse:
    """Depth first, as envd walks (fs_entries.depth_first)."""
    root = await _path(call, req.path)

    async def listed(directory: str) -> list[FileEntry]:
        entries: list[FileEntry] = await call.svc.call(call.rec, "list", {"path": directory}, caller=call.caller)
        return entries

    found = await depth_first(listed, root, max(1, req.depth), MAX_LIST_ENTRIES)
    who = await names(call.svc.mgr, call.sandbox_id, call.caller)
    return pm.ListDirResponse(entries=[entry_info(e, who) for e in found])


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
    return pm.MakeDirResponse(entry=await _info(call, await _stat(call, path)))


@unary("/filesystem.Filesystem/Move", pm.MoveRequest)
async def move(call: Call, req: pm.MoveRequest) -> pm.MoveResponse:
    source, destination = await _path(call, req.source), await _path(call, req.destination)
    await call.svc.call(call.rec, "move", {"source": source, "destination": destination}, caller=call.caller)
    return pm.MoveResponse(entry=await _info(call, await _stat(call, destination)))


@unary("/filesystem.Filesystem/Remove", pm.RemoveRequest)
async def remove(call: Call, req: pm.RemoveRequest) -> pm.RemoveResponse:
    path = await _path(call, req.path)
    with contextlib.suppress(FileNotFoundInSandbox):  # envd: removing what is not there succeeds
        await call.svc.call(call.rec, "remove", {"path": path, "recursive": True}, caller=call.caller)
    return pm.RemoveResponse()


async def _event(call: Call, root: str, change: Change, include_entry: bool) -> pm.FilesystemEvent:
    """envd's event; with ``include_entry``, the entry where the path still is (best effort, as envd)."""
    info = None
    if include_entry and change.type not in ("remove", "rename"):
        entry = change.entry
        if entry is None:
            with contextlib.suppress(FileNotFoundInSandbox, InvalidRequest):
                entry = await _stat(call, posixpath.join(root, change.name))
        info = await _info(call, entry) if entry is not None else None
    return pm.FilesystemEvent(name=change.name, type=_EVENTS[change.type], entry=info)


async def _watch(call: Call, path: str, recursive: bool) -> DirWatch:
    watch = DirWatch(call.svc.mgr, call.sandbox_id, await _path(call, path), recursive=recursive, caller=call.caller)
    await watch.start()
    return watch


@server_stream("/filesystem.Filesystem/WatchDir", pm.WatchDirRequest)
async def watch_dir(call: Call, req: pm.WatchDirRequest) -> AsyncIterator[pm.WatchDirResponse]:
    watch = await _watch(call, req.path, req.recursive)
    try:
        yield pm.WatchDirResponse(start=pm.WatchDirStart())
        keepalive = call.keepalive()
        clock = asyncio.get_running_loop().time
        due = clock() + keepalive
        while True:
            await watch.wait(STREAM_CHECK)
            changes = await watch.changes()
            for change in changes:
                yield pm.WatchDirResponse(filesystem=await _event(call, watch.path, change, req.include_entry))
            if changes:
                due = clock() + keepalive
            elif clock() >= due:
                due = clock() + keepalive
                yield pm.WatchDirResponse(keepalive=pm.KeepAlive())
    finally:
        watch.close()


@unary("/filesystem.Filesystem/CreateWatcher", pm.CreateWatcherRequest)
async def create_watcher(call: Call, req: pm.CreateWatcherRequest) -> pm.CreateWatcherResponse:
    watch = await _watch(call, req.path, req.recursive)
    try:
        watcher_id = call.svc.add_watcher(call.sandbox_id, watch, req.include_entry)
    except BaseException:
        watch.close()
        raise
    return pm.CreateWatcherResponse(watcher_id=watcher_id)


@unary("/filesystem.Filesystem/GetWatcherEvents", pm.GetWatcherEventsRequest)
async def watcher_events(call: Call, req: pm.GetWatcherEventsRequest) -> pm.GetWatcherEventsResponse:
    """What changed since the previous call: exact events where the kind watches itself; elsewhere the
    look is taken now, so nothing is lost between polls except what was created and removed in between."""
    w = call.svc.watcher(call.sandbox_id, req.watcher_id)
    changes = await w.watch.changes()
    return pm.GetWatcherEventsResponse(events=[await _event(call, w.watch.path, c, w.include_entry) for c in changes])


@unary("/filesystem.Filesystem/RemoveWatcher", pm.RemoveWatcherRequest)
async def remove_watcher(call: Call, req: pm.RemoveWatcherRequest) -> pm.RemoveWatcherResponse:
    call.svc.remove_watcher(call.sandbox_id, req.watcher_id)
    return pm.RemoveWatcherResponse()
