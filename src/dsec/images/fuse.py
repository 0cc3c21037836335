"""A minimal read-only FUSE server spoken directly over /dev/fuse, on asyncio.

It serves one flat directory of regular files (the layer blobs of the fetcher). libfuse is not used:
the handful of requests a read-only flat directory sees is a few hundred lines of ``struct``, and it
keeps the process a plain asyncio program where every READ is a task, so one slow chunk fetch never
holds up reads of other chunks. Protocol reference: ``include/uapi/linux/fuse.h``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import stat
import struct
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..errors import BackendError
from ..isolation.mounts import MS_NODEV, MS_NOSUID, MS_RDONLY, is_mountpoint, mount, umount

log = logging.getLogger(__name__)

ROOT_ID = 1
MAX_READ = 1 << 20  # one request covers a whole default-sized chunk
_PAGE = 4096
_MAX_WRITE = _PAGE  # read-only: nothing is ever written through us
# a request is never bigger than its header plus the largest write, or a batch of forgets that fits
_READ_BUFFER = 1 << 17
_TTL = 3600  # names and sizes never change (a layer is immutable), so the kernel may cache them long

# opcodes
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE, STATFS, RELEASE = 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18
FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT = 20, 21, 22, 23, 24, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, ACCESS, CREATE, INTERRUPT, DESTROY = 27, 28, 29, 30, 34, 35, 36, 38
BATCH_FORGET, FALLOCATE, RENAME2, COPY_FILE_RANGE, TMPFILE, COPY_FILE_RANGE_64 = 42, 43, 45, 47, 51, 53
_WRITES = frozenset(
    {SETATTR, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, WRITE, SETXATTR, REMOVEXATTR, CREATE}
    | {FALLOCATE, RENAME2, COPY_FILE_RANGE, TMPFILE, COPY_FILE_RANGE_64}
)

# INIT flags (flags2 holds bits 32..63 shifted down)
ASYNC_READ = 1 << 0
ASYNC_DIO = 1 << 15
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
INIT_EXT = 1 << 30
REQUEST_TIMEOUT2 = 1 << (42 - 32)
FOPEN_KEEP_CACHE = 1 << 1

_IN_HEADER = struct.Struct("<IIQQIIIHH")
_OUT_HEADER = struct.Struct("<IiQ")
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_ENTRY_OUT = struct.Struct("<QQQQII")
_ATTR_OUT = struct.Struct("<QII")
_OPEN_OUT = struct.Struct("<QIi")
_READ_IN = struct.Struct("<QQII")
_INIT_IN = struct.Struct("<IIII")
_INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
_STATFS = struct.Struct("<QQQQQIIII24x")
_DIRENT = struct.Struct("<QQII")
_FORGET_ONE = struct.Struct("<QQ")
_U32 = struct.Struct("<I")


class FlatDirectory(ABC):
    """What the server exposes: named read-only regular files in one directory."""

    @abstractmethod
    async def lookup(self, name: str) -> int | None:
        """The file's size, or None if there is no such file."""

    @abstractmethod
    async def read(self, name: str, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes from ``offset`` (fewer only at the end); raise OSError(errno) to fail the read."""

    def names(self) -> list[str]:
        """Files to list in the directory; lookup may know more (they appear when first looked up)."""
        return []


def mount_fuse(mountpoint: Path, *, fsname: str = "dsec", max_read: int = MAX_READ) -> int:
    """Mount a FUSE file system at ``mountpoint``; returns the /dev/fuse fd that serves it (non-blocking)."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions,max_read={max_read}"
    try:
        mount(fsname, mountpoint, "fuse", MS_RDONLY | MS_NOSUID | MS_NODEV, opts)
    except OSError as e:
        os.close(fd)
        raise BackendError(f"cannot mount FUSE at {mountpoint}: {e}") from e
    return fd


class FuseServer:
    """Serves a FlatDirectory on a mounted /dev/fuse fd until unmounted or closed."""

    def __init__(
        self, fs: FlatDirectory, mountpoint: Path, *, request_timeout: int = 0, max_background: int = 64
    ) -> None:
        self.fs = fs
        self.mountpoint = mountpoint
        self.request_timeout = request_timeout  # seconds; 0 = the kernel waits forever on us
        self.max_background = max_background
        self.fd = -1
        self.closed = asyncio.Event()
        self._ino_by_name: dict[str, int] = {}
        self._name_by_ino: dict[int, str] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}  # by request id, so INTERRUPT can find them
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handlers: dict[int, Callable[[int, int, memoryview], Awaitable[None]]] = {
            LOOKUP: self._lookup,
            GETATTR: self._getattr,
            OPEN: self._open,
            READ: self._read,
            OPENDIR: self._opendir,
            READDIR: self._readdir,
            STATFS: self._statfs,
        }

    # -- lifecycle

    async def start(self) -> None:
        self.fd = mount_fuse(self.mountpoint)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.fd, self._on_readable)

    async def stop(self) -> None:
        """Unmount (lazily if a layer mount still holds a file open) and close the device."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            try:
                umount(self.mountpoint)
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                umount(self.mountpoint, lazy=True)
        self._close()
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _close(self) -> None:
        if self.fd < 0:
            return
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
        os.close(self.fd)
        self.fd = -1
        self.closed.set()

    # -- the device

    def _on_readable(self) -> None:
        # drain every queued request: each is one read(2), and each READ/LOOKUP becomes its own task
        while self.fd >= 0:
            try:
                buf = os.read(self.fd, _READ_BUFFER)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EINTR, errno.ENOENT):  # ENOENT: the request was interrupted before we read it
                    continue
                if e.errno != errno.ENODEV:  # ENODEV: unmounted
                    log.error("reading /dev/fuse failed: %s", e)
                self._close()
                return
            try:
                self._dispatch(memoryview(buf))
            except Exception:
                # a request we cannot decode still gets an answer, or its caller would wait forever
                log.exception("malformed FUSE request (%d bytes)", len(buf))
                if len(buf) >= _IN_HEADER.size:
                    self._error(_IN_HEADER.unpack_from(buf)[2], errno.EIO)

    def _dispatch(self, buf: memoryview) -> None:
        length, opcode, unique, nodeid, _uid, _gid, _pid, _extlen, _pad = _IN_HEADER.unpack_from(buf)
        body = buf[_IN_HEADER.size : length]
        if opcode == INIT:
            self._init(unique, body)
        elif opcode in (FORGET, BATCH_FORGET):
            pass  # inode numbers stay valid for the mount's life: a name always maps to the same file
        elif opcode == INTERRUPT:
            self._interrupt(unique)
        elif opcode == DESTROY:
            self._reply(unique)
            self._close()
        elif opcode in (RELEASE, RELEASEDIR, FLUSH, FSYNC, FSYNCDIR):
            self._reply(unique)
        elif opcode in _WRITES:
            self._error(unique, errno.EROFS)
        elif handler := self._handlers.get(opcode):
            task = asyncio.ensure_future(self._run(handler, unique, nodeid, bytes(body)))
            self._tasks[unique] = task
            task.add_done_callback(functools.partial(self._finished, unique))
        else:
            self._error(unique, errno.ENOSYS)  # xattrs, access, locks, ioctl, ...: the kernel stops asking

    async def _run(
        self, handler: Callable[[int, int, memoryview], Awaitable[None]], unique: int, nodeid: int, body: bytes
    ) -> None:
        try:
            if self.request_timeout:
                await self._within_deadline(handler, unique, nodeid, body)
            else:
                await handler(unique, nodeid, memoryview(body))
        except OSError as e:
            self._error(unique, e.errno or errno.EIO)
        except Exception:
            log.exception("FUSE request %d failed", unique)
            self._error(unique, errno.EIO)  # a bug must not leave the reader waiting forever

    async def _within_deadline(
        self, handler: Callable[[int, int, memoryview], Awaitable[None]], unique: int, nodeid: int, body: bytes
    ) -> None:
        """Answer EIO for a request still unanswered at three quarters of the kernel's request timeout:
        at the timeout itself the kernel aborts the whole connection, and every layer mounted from it
        fails at once. Where the request was waiting is logged: a wedged fetch is a bug to find."""
        inner = asyncio.ensure_future(handler(unique, nodeid, memoryview(body)))
        try:
            done, _ = await asyncio.wait({inner}, timeout=self.request_timeout * 0.75)
        except asyncio.CancelledError:
            inner.cancel()
            raise
        if done:
            inner.result()  # its exception, if it raised one
            return
        frames = inner.get_stack(limit=8)
        where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames)) or "?"
        name = self._name_by_ino.get(nodeid, f"inode {nodeid}")
        what = f"read {name} at {_READ_IN.unpack_from(body)[1]}" if handler == self._read else name
        log.error("FUSE request %d (%s) unanswered after %.0fs, failing it; it waits in %s", unique, what,
                  self.request_timeout * 0.75, where)  # fmt: skip
        inner.cancel()
        raise OSError(errno.EIO, "request timed out")

    def _interrupt(self, unique: int) -> None:
        """Decline interrupts: every request is answered in full (or failed at the deadline). A signal to
        the reader (a shell's SIGCHLD mid page fault, QEMU's thread kicks) must not fail its read: EROFS
        would turn that EINTR into an I/O error of the sandbox's file. ENOSYS tells the kernel to stop
        sending interrupts; from then on only a fatal signal ends a wait, and only for a request we
        have not read yet. (Cancelling the request's task instead lost requests: an INTERRUPT read in the
        same drain as its READ cancelled the task before it ran, nothing answered, and the reader hung
        in D state for good.)"""
        self._error(unique, errno.ENOSYS)  # the INTERRUPT's own id: the kernel takes it as the answer to it

    def _finished(self, unique: int, task: asyncio.Task[None]) -> None:
        self._tasks.pop(unique, None)
        if task.cancelled():
            # by stop(), before or while it ran (a task cancelled before its first step never enters
            # _run's handlers): a request left without an answer holds its reader forever
            self._error(unique, errno.EINTR)

    def _reply(self, unique: int, *payload: bytes | memoryview) -> None:
        size = _OUT_HEADER.size + sum(len(p) for p in payload)
        self._write([_OUT_HEADER.pack(size, 0, unique), *payload])

    def _error(self, unique: int, err: int) -> None:
        self._write([_OUT_HEADER.pack(_OUT_HEADER.size, -err, unique)])

    def _write(self, parts: list[bytes | memoryview]) -> None:
        if self.fd < 0:
            return
        try:
            os.writev(self.fd, parts)  # one write per reply: the device takes a reply whole or not at all
        except OSError as e:
            # ENOENT: the request was interrupted and answered already; ENODEV: unmounted meanwhile
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                log.error("replying on /dev/fuse failed: %s", e)

    # -- requests

    def _init(self, unique: int, body: memoryview) -> None:
        major, minor, max_readahead, flags = _INIT_IN.unpack_from(body)
        flags2 = _U32.unpack_from(body, _INIT_IN.size)[0] if flags & INIT_EXT and len(body) >= 20 else 0
        if major != 7:
            # the kernel retries INIT with our major if it supports it; otherwise the mount fails
            self._reply(unique, _INIT_OUT.pack(7, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
            return
        out_flags = flags & (ASYNC_READ | ASYNC_DIO | PARALLEL_DIROPS | MAX_PAGES | INIT_EXT)
        out_flags2 = flags2 & REQUEST_TIMEOUT2 if self.request_timeout else 0
        timeout = min(self.request_timeout, 0xFFFF) if out_flags2 else 0
        out = _INIT_OUT.pack(
            7,
            min(minor, 45),
            min(max_readahead, MAX_READ),
            out_flags,
            self.max_background,
            self.max_background * 3 // 4,
            _MAX_WRITE,
            1,  # time granularity (ns): times are whole seconds anyway
            MAX_READ // _PAGE,
            0,
            out_flags2,
            0,
            timeout,
        )
        self._reply(unique, out)
        # only now: the kernel applies INIT's max_readahead as a cap on the current value while taking the reply
        set_readahead(self.mountpoint, MAX_READ)

    def _attr(self, ino: int, size: int | None) -> bytes:
        if size is None:  # the root directory
            return _ATTR.pack(ino, 0, 0, 0, 0, 0, 0, 0, 0, stat.S_IFDIR | 0o555, 2, 0, 0, 0, _PAGE, 0)
        blocks = (size + 511) // 512
        return _ATTR.pack(ino, size, blocks, 0, 0, 0, 0, 0, 0, stat.S_IFREG | 0o444, 1, 0, 0, 0, _PAGE, 0)

    def _ino(self, name: str) -> int:
        ino = self._ino_by_name.get(name)
        if ino is None:
            ino = len(self._ino_by_name) + ROOT_ID + 1
            self._ino_by_name[name] = ino
            self._name_by_ino[ino] = name
        return ino

    async def _size(self, nodeid: int) -> tuple[str, int]:
        name = self._name_by_ino.get(nodeid)
        if name is None:
            raise OSError(errno.ENOENT, "unknown inode")
        size = await self.fs.lookup(name)
        if size is None:
            raise OSError(errno.ENOENT, name)
        return name, size

    async def _lookup(self, unique: int, nodeid: int, body: memoryview) -> None:
        name = bytes(body).split(b"\0", 1)[0].decode(errors="surrogateescape")
        if nodeid != ROOT_ID:
            raise OSError(errno.ENOTDIR, "not a directory")
        size = await self.fs.lookup(name)
        if size is None:
            raise OSError(errno.ENOENT, name)  # not cached by the kernel: a layer published later is found
        ino = self._ino(name)
        self._reply(unique, _ENTRY_OUT.pack(ino, 0, _TTL, _TTL, 0, 0), self._attr(ino, size))

    async def _getattr(self, unique: int, nodeid: int, body: memoryview) -> None:
        size = None if nodeid == ROOT_ID else (await self._size(nodeid))[1]
        self._reply(unique, _ATTR_OUT.pack(_TTL, 0, 0), self._attr(nodeid, size))

    async def _open(self, unique: int, nodeid: int, body: memoryview) -> None:
        flags = _U32.unpack_from(body)[0]
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, "read-only")
        await self._size(nodeid)
        # the content under a name never changes, so pages cached by an earlier open stay valid
        self._reply(unique, _OPEN_OUT.pack(0, FOPEN_KEEP_CACHE, 0))

    async def _read(self, unique: int, nodeid: int, body: memoryview) -> None:
        _fh, offset, size, _flags = _READ_IN.unpack_from(body)
        name = self._name_by_ino.get(nodeid)
        if name is None:
            raise OSError(errno.ENOENT, "unknown inode")
        data = await self.fs.read(name, offset, min(size, MAX_READ))
        self._reply(unique, data[:size])

    async def _opendir(self, unique: int, nodeid: int, body: memoryview) -> None:
        if nodeid != ROOT_ID:
            raise OSError(errno.ENOTDIR, "not a directory")
        self._reply(unique, _OPEN_OUT.pack(0, 0, 0))

    async def _readdir(self, unique: int, nodeid: int, body: memoryview) -> None:
        _fh, offset, size, _flags = _READ_IN.unpack_from(body)
        entries = [(".", ROOT_ID, stat.S_IFDIR), ("..", ROOT_ID, stat.S_IFDIR)]
        entries += [(n, self._ino(n), stat.S_IFREG) for n in sorted(self.fs.names())]
        out = bytearray()
        for index in range(offset, len(entries)):
            name, ino, mode = entries[index]
            raw = name.encode(errors="surrogateescape")
            record = _DIRENT.pack(ino, index + 1, len(raw), mode >> 12) + raw
            record += b"\0" * (-len(record) % 8)
            if len(out) + len(record) > size:
                break
            out += record
        self._reply(unique, bytes(out))

    async def _statfs(self, unique: int, nodeid: int, body: memoryview) -> None:
        sizes = [await self.fs.lookup(n) or 0 for n in self.fs.names()]
        blocks = sum((s + _PAGE - 1) // _PAGE for s in sizes)
        self._reply(unique, _STATFS.pack(blocks, 0, 0, len(sizes), 0, _PAGE, 255, _PAGE, 0))


def set_readahead(mountpoint: Path, size: int) -> None:
    """Let the kernel read ahead ``size`` bytes per request on this mount (best effort).

    A FUSE mount starts at 128 KiB and INIT can only lower it; measured here, 1 MiB requests read a
    layer through EROFS twice as fast as 128 KiB ones (each request costs a round trip through us).
    """
    # from mountinfo, not stat(2): the kernel would ask this very server, which is busy running this
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            dev = next(line.split()[2] for line in f if line.split()[4] == str(mountpoint))
        Path(f"/sys/class/bdi/{dev}/read_ahead_kb").write_text(str(size // 1024))
    except StopIteration:
        log.warning("%s is not in mountinfo: readahead stays at 128 KiB per request", mountpoint)
    except OSError as e:
        log.warning("cannot raise readahead on %s (%s): it stays at 128 KiB per request", mountpoint, e)


def clear_stale_mount(mountpoint: Path) -> None:
    """Detach whatever a dead server left mounted here (its reads fail with ENOTCONN)."""
    if is_mountpoint(mountpoint):
        umount(mountpoint, lazy=True)
