"""File access confined to a sandbox's root directory (or a named volume's), from the host side.

Every path is resolved with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV): the
kernel treats the sandbox root as "/" for ``..`` and absolute symlinks, refuses /proc magic links and
never crosses into another mount, so no path or symlink planted by the workload reaches host files,
and there is no check-then-use race. The last component of a path is only ever used through a
directory fd so resolved (``dir_fd``, ``follow_symlinks=False``, O_EXCL), never as a host path.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import posixpath
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import DsecError, FileNotFoundInSandbox, InvalidRequest, LimitExceeded
from ..protocol.sandbox import FileEntry

_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
MAX_PATH = 4096


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = _RESOLVE) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    while True:
        fd = _libc.syscall(_SYS_OPENAT2, dirfd, path.encode(), ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.EINTR):  # EAGAIN: a concurrent rename raced the lookup; retry
            continue
        raise OSError(err, os.strerror(err), path)


def clean_path(path: str) -> str:
    """Validate an API path: absolute, no NUL, bounded; returns it normalised (relative to the root)."""
    if not isinstance(path, str) or not path:
        raise InvalidRequest("path is empty")
    if "\0" in path:
        raise InvalidRequest("path contains a NUL byte")
    if len(path) > MAX_PATH:
        raise InvalidRequest("path is too long")
    if not path.startswith("/"):
        raise InvalidRequest(f"path must be absolute: {path!r}")
    norm = posixpath.normpath(path).lstrip("/")
    return norm or "."


@dataclass(frozen=True)
class Place:
    """What errors call the root a path is in: ``name`` ("the sandbox"), and what a full disk is there."""

    name: str
    full: str


SANDBOX = Place("the sandbox", "the sandbox's disk is full")


def _translate(e: OSError, path: str, place: Place = SANDBOX) -> Exception:
    if e.errno == errno.ENOENT:
        return FileNotFoundInSandbox(f"no such file or directory in {place.name}: {path}")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return LimitExceeded(f"{place.full} while writing {path}")
    if e.errno == errno.EFBIG:
        return LimitExceeded(f"file too large: {path}")
    if e.errno == errno.EISDIR:
        return InvalidRequest(f"is a directory: {path}")
    if e.errno == errno.ENOTDIR:
        return InvalidRequest(f"not a directory: {path}")
    if e.errno == errno.ENOTEMPTY:
        return InvalidRequest(f"directory not empty (remove it with recursive=True): {path}")
    if e.errno == errno.EXDEV:
        return InvalidRequest(f"path crosses a mount point the file API does not follow: {path}")
    if e.errno == errno.ELOOP:
        return InvalidRequest(f"too many levels of symbolic links: {path}")
    if e.errno == errno.EEXIST:
        return InvalidRequest(f"already exists: {path}")
    return InvalidRequest(f"{path}: {e.strerror}")


def _entry(name: str, path: str, st: os.stat_result) -> FileEntry:
    if stat.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat.S_ISREG(st.st_mode):
        kind = "file"
    elif stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    return FileEntry(
        name=name,
        path=path,
        type=kind,
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        mtime=st.st_mtime,
        uid=st.st_uid,
        gid=st.st_gid,
    )


@contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


class RootFS:
    """The file API over one sandbox's root directory on the host."""

    def __init__(self, root: str, owner: tuple[int, int] | None = None, place: Place = SANDBOX) -> None:
        """``owner``: host uid and gid of the sandbox's root, given to what the API creates (user namespaces);
        ``place``: what errors call the root."""
        self.root = root
        self.owner = owner
        self.place = place

    @contextmanager
    def _rootfd(self) -> Iterator[int]:
        with _fd(os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)) as fd:
            yield fd

    def open_file(self, path: str) -> int:
        """An fd reading the regular file at ``path`` (the caller closes it)."""
        rel = clean_path(path)
        try:
            with self._rootfd() as root:
                fd = openat2(root, rel, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise _translate(e, path, self.place) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise InvalidRequest(f"{'is a directory' if stat.S_ISDIR(st.st_mode) else 'not a regular file'}: {path}")
        return fd

    def read(self, path: str, max_bytes: int) -> bytes:
        with _fd(self.open_file(path)) as fd:
            try:
                size = os.fstat(fd).st_size
                if size > max_bytes:
                    raise LimitExceeded(f"{path} is {size} bytes, over the read limit of {max_bytes}")
                chunks = []
                total = 0
                while chunk := os.read(fd, 1 << 20):
                    total += len(chunk)
                    if total > max_bytes:
                        raise LimitExceeded(f"{path} grew over the read limit of {max_bytes} bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
            except DsecError:  # LimitExceeded is an OSError too
                raise
            except OSError as e:
                raise _translate(e, path, self.place) from None

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        rel = clean_path(path)
        if rel == ".":
            raise InvalidRequest("cannot write to /")
        try:
            with self._rootfd() as root:
                self._make_parents(root, posixpath.dirname(rel))
                with _fd(self._open_for_write(root, rel, mode & 0o7777)) as fd:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise InvalidRequest(f"not a regular file: {path}")
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
        except DsecError:
            raise
        except OSError as e:
            raise _translate(e, path, self.place) from None

    def _open_for_write(self, root: int, rel: str, mode: int) -> int:
        fd = openat2(root, rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, mode)
        if self.owner is not None:
            st = os.fstat(fd)
            # With a user namespace nothing of the sandbox's own is owned by host root: a file that is
            # was just created by us (a symlink may have named it), and becomes the sandbox root's.
            if st.st_uid == 0 and st.st_gid == 0:
                os.fchown(fd, *self.owner)
        return fd

    def mkdir(self, path: str) -> None:
        rel = clean_path(path)
        try:
            with self._rootfd() as root:
                self._make_parents(root, rel)
        except DsecError:
            raise
        except OSError as e:
            raise _translate(e, path, self.place) from None

    def _make_parents(self, root: int, rel: str) -> None:
        if rel in ("", "."):
            return
        parts = rel.split("/")
        for i in range(len(parts)):
            sub = "/".join(parts[: i + 1])
            try:
                os.close(openat2(root, sub, os.O_PATH | os.O_DIRECTORY))
                continue
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
            parent = "/".join(parts[:i]) or "."
            with _fd(openat2(root, parent, os.O_PATH | os.O_DIRECTORY)) as pfd:
                try:
                    os.mkdir(parts[i], 0o755, dir_fd=pfd)
                    if self.owner is not None:
                        os.chown(parts[i], *self.owner, dir_fd=pfd, follow_symlinks=False)
                except FileExistsError:
                    pass

    def make_dir(self, path: str, *, parents: bool, mode: int = 0o755) -> None:
        """mkdir(2): the parent must exist and the directory must not; with ``parents`` both are made as
        needed and a directory already there is left as it is (``mkdir -p``). Made ``mode`` exactly,
        and the owner's."""
        rel = clean_path(path)
        if rel == ".":
            if parents:
                return
            raise InvalidRequest("already exists: /")
        parent, name = posixpath.split(rel)
        try:
            with self._rootfd() as root:
                if parents:
                    self._make_parents(root, parent)
                with _fd(openat2(root, parent or ".", os.O_PATH | os.O_DIRECTORY)) as pfd:
                    try:
                        os.mkdir(name, 0o700, dir_fd=pfd)  # nobody else's until it has its mode
                    except FileExistsError:
                        if parents and stat.S_ISDIR(os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode):
                            return
                        raise
                    with _fd(openat2(pfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)) as fd:
                        os.fchmod(fd, mode)
                        if self.owner is not None:
                            os.fchown(fd, *self.owner)
        except DsecError:
            raise
        except OSError as e:
            raise _translate(e, path, self.place) from None

    def set_attributes(
        self, path: str, uid: int | None = None, gid: int | None = None, mode: int | None = None
    ) -> None:
        """chown and chmod what ``path`` names (a symlink is followed, inside the root)."""
        try:
            with self._rootfd() as root, _fd(openat2(root, clean_path(path), os.O_PATH)) as fd:
                # an O_PATH fd takes no fchmod; its /proc link names exactly the inode resolved above
                inode = f"/proc/self/fd/{fd}"
                if uid is not None or gid is not None:
                    os.chown(inode, -1 if uid is None else uid, -1 if gid is None else gid)
                if mode is not None:  # after chown, which clears set-id bits
                    os.chmod(inode, mode)
        except OSError as e:
            raise _translate(e, path, self.place) from None

    def upload(self, path: str, mode: int = 0o644) -> Upload:
        """A file to write in parts (``Upload``); its parents are made now."""
        return Upload(self, path, mode)

    def walk(self, path: str, depth: int, limit: int) -> list[tuple[str, os.stat_result, str | None]]:
        """What the directory at ``path`` holds, ``depth`` levels down (1: its own entries), as (path, stat,
        symlink target) in path order. Symlinks are listed, never followed; an entry that goes away while
        it is listed is left out; more than ``limit`` entries is refused."""
        rel = clean_path(path)
        found: list[tuple[str, os.stat_result, str | None]] = []
        try:
            with self._rootfd() as root, _fd(openat2(root, rel, os.O_RDONLY | os.O_DIRECTORY)) as fd:
                self._walk(fd, "/" + rel if rel != "." else "", depth, limit, found)
        except DsecError:
            raise
        except OSError as e:
            raise _translate(e, path, self.place) from None
        return sorted(found, key=lambda f: f[0])

    def _walk(
        self, fd: int, base: str, depth: int, limit: int, found: list[tuple[str, os.stat_result, str | None]]
    ) -> None:
        with os.scandir(fd) as it:
            names = [entry.name for entry in it]
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                target = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
            except FileNotFoundError:
                continue
            found.append((f"{base}/{name}", st, target))
            if len(found) > limit:
                raise InvalidRequest(f"more than {limit} entries: list a smaller directory, or fewer levels")
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                try:
                    sub = openat2(fd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                except FileNotFoundError:
                    continue
                with _fd(sub):
                    self._walk(sub, f"{base}/{name}", depth - 1, limit, found)

    def list(self, path: str) -> list[FileEntry]:
        rel = clean_path(path)
        base = "/" + rel if rel != "." else "/"
        entries: list[FileEntry] = []
        try:
            with self._rootfd() as root, _fd(openat2(root, rel, os.O_RDONLY | os.O_DIRECTORY)) as fd:
                with os.scandir(fd) as it:
                    for ent in it:
                        st = ent.stat(follow_symlinks=False)
                        entries.append(_entry(ent.name, posixpath.join(base, ent.name), st))
        except DsecError:
            raise
        except OSError as e:
            raise _translate(e, path, self.place) from None
        return sorted(entries, key=lambda e: e.name)

    def stat(self, path: str) -> FileEntry:
        """The entry at ``path`` itself (a symlink is reported as one, not followed)."""
        st, _ = self.lstat(path)
        rel = clean_path(path)
        return _entry(posixpath.basename(rel) if rel != "." else "/", "/" + rel if rel != "." else "/", st)

    def lstat(self, path: str) -> tuple[os.stat_result, str | None]:
        """The entry at ``path`` itself and, for a symlink, what it says (never followed)."""
        rel = clean_path(path)
        try:
            with self._rootfd() as root:
                if rel == ".":
                    return os.stat(root), None
                parent, name = posixpath.split(rel)
                with _fd(openat2(root, parent or ".", os.O_PATH | os.O_DIRECTORY)) as pfd:
                    st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                    return st, os.readlink(name, dir_fd=pfd) if stat.S_ISLNK(st.st_mode) else None
        except OSError as e:
            raise _translate(e, path, self.place) from None

    def rename(self, source: str, destination: str) -> None:
        """rename(2) inside the root: the last component of each path is an entry of its (resolved)
        parent, so a symlink is moved as a link; the destination's parents are created."""
        src, dst = clean_path(source), clean_path(destination)
        if "." in (src, dst):
            raise InvalidRequest("cannot move / or move something onto /")
        if dst == src or dst.startswith(src + "/"):
            raise InvalidRequest(f"cannot move {source} into itself")
        sparent, sname = posixpath.split(src)
        dparent, dname = posixpath.split(dst)
        try:
            with self._rootfd() as root:
                with _fd(openat2(root, sparent or ".", os.O_PATH | os.O_DIRECTORY)) as sfd:
                    os.stat(sname, dir_fd=sfd, follow_symlinks=False)  # a missing source names the source
                    self._make_parents(root, dparent)
                    with _fd(openat2(root, dparent or ".", os.O_PATH | os.O_DIRECTORY)) as dfd:
                        try:
                            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
                        except OSError as e:
                            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                                why = f"cannot move onto {destination}: a directory that is not empty"
                                raise InvalidRequest(why) from None
                            raise _translate(e, destination, self.place) from None
        except DsecError:
            raise
        except OSError as e:
            raise _translate(e, source, self.place) from None

    def remove(self, path: str, recursive: bool = False) -> None:
        rel = clean_path(path)
        if rel == ".":
            raise InvalidRequest("refusing to remove /")
        parent, name = posixpath.split(rel)
        try:
            with (
                self._rootfd() as root,
                _fd(openat2(root, parent or ".", os.O_RDONLY | os.O_DIRECTORY)) as pfd,
            ):
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    if recursive:
                        shutil.rmtree(name, dir_fd=pfd)
                    else:
                        os.rmdir(name, dir_fd=pfd)
                else:
                    os.unlink(name, dir_fd=pfd)
        except DsecError:
            raise
        except OSError as e:
            raise _translate(e, path, self.place) from None


class Upload:
    """A file written in parts under a temporary name beside its destination, renamed over it by
    ``commit``: a reader never sees half of it, and a write that fails (a full disk, a client gone) leaves
    the old file as it was and, after ``abort``, no temporary file behind."""

    def __init__(self, fs: RootFS, path: str, mode: int) -> None:
        self.fs, self.path, self.mode = fs, path, mode
        rel = clean_path(path)
        if rel == ".":
            raise InvalidRequest("cannot write to /")
        parent, self._name = posixpath.split(rel)
        self._tmp = f".{self._name[:200]}.dsec-{secrets.token_hex(6)}"
        try:
            with fs._rootfd() as root:
                fs._make_parents(root, parent)
                self._dir = openat2(root, parent or ".", os.O_PATH | os.O_DIRECTORY)
        except DsecError:
            raise
        except OSError as e:
            raise _translate(e, path, fs.place) from None
        try:
            # one new name in a resolved directory: O_EXCL follows no symlink
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd: int | None = os.open(self._tmp, flags, 0o600, dir_fd=self._dir)
        except OSError as e:
            os.close(self._dir)
            raise _translate(e, path, fs.place) from None

    def write(self, data: bytes) -> None:
        assert self._fd is not None, "the upload is closed"
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            raise _translate(e, self.path, self.fs.place) from None

    def commit(self) -> None:
        """The file takes its mode and the root's owner (if any) and replaces the destination."""
        assert self._fd is not None, "the upload is closed"
        try:
            os.fchmod(self._fd, self.mode)
            if self.fs.owner is not None:
                os.fchown(self._fd, *self.fs.owner)
            os.close(self._fd)
            self._fd = None
            os.rename(self._tmp, self._name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except OSError as e:
            self.abort()
            if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise InvalidRequest(f"is a directory: {self.path}") from None
            raise _translate(e, self.path, self.fs.place) from None
        os.close(self._dir)
        self._dir = -1

    def abort(self) -> None:
        """Drop what was written (nothing, after a commit)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._dir >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp, dir_fd=self._dir)
            os.close(self._dir)
            self._dir = -1
