"""inotify(7) for the daemon: one instance shared by every watch (the kernel allows a user 128
instances, and the daemon is one user), read on the event loop as events come.

A directory is watched through ``/proc/self/fd/N`` of an ``O_PATH`` descriptor that the caller resolved
(inside a sandbox's root, with openat2): the watch is on exactly that inode, whatever its path names.
The kernel gives one watch descriptor per inode and instance, so several subscribers of one directory
share it; it is removed when the last one leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import struct
from collections.abc import Callable

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

WATCHED = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len
READ_SIZE = 1 << 16

# wd, mask, cookie, name (b"" for the directory itself)
Sink = Callable[[int, int, int, bytes], None]

_libc = ctypes.CDLL(None, use_errno=True)
log = logging.getLogger("dsec.inotify")


def _check(rc: int) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


def parse(buf: bytes) -> list[tuple[int, int, int, bytes]]:
    """The events in one read(2) of an inotify descriptor."""
    out = []
    at = 0
    while at + _HEADER.size <= len(buf):
        wd, mask, cookie, size = _HEADER.unpack_from(buf, at)
        at += _HEADER.size
        name = buf[at : at + size].split(b"\0", 1)[0]
        at += size
        out.append((wd, mask, cookie, name))
    return out


class Hub:
    """The daemon's inotify instance. Used from the event loop's thread only."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[int, dict[int, Sink]] = {}  # wd -> subscriber id -> sink
        self._overflow: list[Callable[[], None]] = []
        self._reading = False  # in _readable: sinks may add and remove, the instance stays open

    def _open(self) -> int:
        if self._fd is None:
            self._fd = _check(_libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._fd, self._readable)
        return self._fd

    def add(self, dir_fd: int, subscriber: int, sink: Sink) -> int:
        """Watch the directory open as ``dir_fd`` (O_PATH is enough) for ``subscriber``; its wd."""
        fd = self._open()
        path = f"/proc/self/fd/{dir_fd}".encode()
        # every watch asks for the same events, so a directory watched already is asked for them again
        wd = _check(_libc.inotify_add_watch(fd, path, WATCHED | IN_ONLYDIR))
        self._sinks.setdefault(wd, {})[subscriber] = sink
        return wd

    def remove(self, wd: int, subscriber: int) -> None:
        sinks = self._sinks.get(wd)
        if sinks is None:
            return
        sinks.pop(subscriber, None)
        if not sinks:
            del self._sinks[wd]
            if self._fd is not None:
                _libc.inotify_rm_watch(self._fd, wd)  # EINVAL: the kernel removed it already
        self._idle()

    def _idle(self) -> None:
        """No directory watched: the instance is closed (made again by the next watch), so the daemon
        holds no inotify descriptor while nothing is watched."""
        if not self._sinks and not self._reading:
            self.close()

    def on_overflow(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` when the kernel's queue overflowed (events were lost); returns the undo."""
        self._overflow.append(callback)
        return lambda: self._overflow.remove(callback) if callback in self._overflow else None

    def _readable(self) -> None:
        self._reading = True
        try:
            self._read()
        finally:
            self._reading = False
        self._idle()

    def _read(self) -> None:
        for _ in range(64):  # then let the loop breathe; the reader is called again
            if self._fd is None:
                return
            try:
                buf = os.read(self._fd, READ_SIZE)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EINTR):
                    return
                raise
            for wd, mask, cookie, name in parse(buf):
                if mask & IN_Q_OVERFLOW:
                    for callback in list(self._overflow):
                        callback()
                    continue
                for sink in list(self._sinks.get(wd, {}).values()):
                    try:
                        sink(wd, mask, cookie, name)
                    except Exception:  # one subscriber's failure must not drop the others' events
                        log.exception("an inotify subscriber failed")
                if mask & IN_IGNORED:
                    self._sinks.pop(wd, None)

    def close(self) -> None:
        if self._fd is not None:
            if self._loop is not None and not self._loop.is_closed():
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
            self._sinks.clear()
