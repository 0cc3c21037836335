"""Extract one image layer's tar into a directory in overlayfs's on-disk format, safely.

OCI layers mark deletions with ``.wh.NAME`` files and "replace this directory" with ``.wh..wh..opq``;
overlayfs wants a 0/0 character device named NAME and the ``trusted.overlay.opaque=y`` xattr instead.

The archive is hostile input. Every member is created relative to a directory file descriptor reached by
walking its parent components one at a time with O_NOFOLLOW, and created with O_EXCL / mkdirat /
symlinkat / linkat without AT_SYMLINK_FOLLOW, so a symlink the archive planted earlier is never followed
and nothing is written outside the destination. Data is streamed member by member.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import stat
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..errors import BackendError, DsecError, InvalidRequest
from .layer_stream import CHUNK, READ_ERRORS, Reader, read_failure

BLOCK = tarfile.BLOCKSIZE
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
MAX_READ = 16 << 20
# besides user.*: file capabilities (ping, ...) and POSIX ACLs matter inside the sandbox; SELinux labels and
# other security.* attributes are the host's business
_XATTRS_KEPT = ("security.capability", "system.posix_acl_access", "system.posix_acl_default")
MAX_SKIPPED = 1000  # a layer full of unsupported xattrs must not turn the report into megabytes

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ZERO_BLOCK = bytes(BLOCK)
_MAX_ID = 2**32 - 2  # (uid_t)-1 means "leave unchanged" to chown, so it is not a valid owner
_MAX_FILE = 2**63 - 1  # off_t
# errors a member's content causes (a bad name, a link in the way), as opposed to the local disk failing
_INPUT_ERRNOS: set[int] = {
    getattr(errno, n)
    for n in "ELOOP ENOTDIR ENAMETOOLONG EXDEV EISDIR EEXIST ENOENT EINVAL ENOTEMPTY EMLINK EFBIG".split()
}


@dataclass
class ExtractStats:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    skipped: list[str] = field(default_factory=list)  # "member: reason"
    bytes: int = 0
    sparse_bytes: int = 0  # the sizes sparse members claim, holes included (a bomb is small on the wire)


# ---- extraction ----------------------------------------------------------------------------------------


def member_path(name: str, label: str, what: str = "member") -> list[str]:
    """The components of an archive name, relative to the layer root; refuses names that could escape."""
    if "\0" in name:
        raise InvalidRequest(f"{label}: {what} {name!r} contains a NUL byte")
    if name.startswith("/"):
        raise InvalidRequest(f"{label}: {what} {name!r} is an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidRequest(f"{label}: {what} {name!r} has a '..' component")
    return parts


class _ForwardReader:
    """The tar stream as the seekable file tarfile's random-access mode wants, seeking forward only.

    tarfile only seeks forward when members are read in order. Its random-access mode (unlike stream
    mode) exposes where header parsing stopped, and keeping the last block read lets us tell a clean
    end-of-archive from a truncated or corrupt header, which tarfile silently treats as the end.

    Between :meth:`header` and :meth:`data`, reads are a member's headers, and tarfile keeps all of
    them in memory: a PAX record, a GNU long name, a GNU 1.0 sparse map (whose length the archive
    states, and which tarfile reads line by line into a list). Together they may be MAX_READ bytes."""

    def __init__(self, src: Reader, label: str) -> None:
        self.src = src
        self.label = label
        self.pos = 0
        self.tail = b""
        self.header_bytes: int | None = 0  # read for the current member's headers; None: reading data

    def header(self) -> None:
        self.header_bytes = 0

    def data(self) -> None:
        self.header_bytes = None

    def read(self, size: int = -1, /) -> bytes:
        # Member data is read in CHUNKs; only an extended (PAX, GNU long name) header asks for more, and
        # tarfile would buffer all of it: a hostile one could claim gigabytes.
        if not 0 <= size <= MAX_READ:
            raise InvalidRequest(f"{self.label}: a tar extended header of {size} bytes is over the limit")
        if self.header_bytes is not None:
            self.header_bytes += size
            if self.header_bytes > MAX_READ:
                raise InvalidRequest(f"{self.label}: a tar member's headers are over {MAX_READ} bytes")
        return self._pull(size)

    def _pull(self, size: int) -> bytes:
        parts = []
        got = 0
        while got < size and (chunk := self.src.read(min(size - got, CHUNK))):
            parts.append(chunk)
            got += len(chunk)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.pos += len(data)
        self.tail = data[-BLOCK:] if len(data) >= BLOCK else (self.tail + data)[-BLOCK:]
        return data

    def seek(self, pos: int, whence: int = os.SEEK_SET, /) -> int:
        target = pos if whence == os.SEEK_SET else self.pos + pos if whence == os.SEEK_CUR else -1
        if target < self.pos:
            raise OSError(errno.ESPIPE, "layer streams only seek forward")
        # skipped member data: not headers, and not kept
        while self.pos < target and self._pull(min(target - self.pos, CHUNK)):
            pass
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def write(self, data: bytes, /) -> int:
        raise OSError(errno.EBADF, "layer streams are read-only")

    def close(self) -> None:
        pass  # the caller owns the source stream


def extract_tar(stream: Reader, dest: Path, *, label: str) -> ExtractStats:
    """Extract the (decompressed) tar ``stream`` into the empty directory ``dest``.

    Raises InvalidRequest for a hostile or damaged archive, BackendError when local I/O fails. After an
    error ``dest`` holds a partial tree, for the caller to remove."""
    root = _open_dest(dest)
    ex = _Extractor(root, label)
    fwd = _ForwardReader(stream, label)
    try:
        try:
            tf = tarfile.open(fileobj=fwd, mode="r:", encoding="utf-8", errors="surrogateescape")
        except READ_ERRORS as e:
            raise read_failure(e, label) from None
        # tarfile keeps every member it has parsed; a layer can hold millions of files, so drop them
        parsed: list[tarfile.TarInfo] = vars(tf)["members"]
        while True:
            fwd.header()  # open() parsed the first member's headers in this mode too
            try:
                member = tf.next()
            except READ_ERRORS as e:
                raise read_failure(e, label) from None
            if member is None:
                break
            fwd.data()
            ex.member(tf, member)
            parsed.clear()
        stopped = fwd.pos - tf.offset
        # stopped == 0: the stream ended without end-of-archive blocks; tolerated, the digest vouches for it
        if stopped and (stopped != BLOCK or fwd.tail != _ZERO_BLOCK):
            raise InvalidRequest(f"{label}: corrupt or truncated tar: invalid header at offset {tf.offset}")
        ex.finish()
    finally:
        ex.close()
        os.close(root)
    return ex.stats


def _open_dest(dest: Path) -> int:
    try:
        dest.mkdir(exist_ok=True)
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise BackendError(f"cannot open extraction target {dest}: {e.strerror}") from None
    try:
        if os.listdir(fd):
            raise InvalidRequest(f"extraction target {dest} is not empty")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _ns(member: tarfile.TarInfo) -> int:
    mtime = member.mtime
    return mtime * 1_000_000_000 if isinstance(mtime, int) else round(mtime * 1e9)


class _Extractor:
    def __init__(self, root: int, label: str) -> None:
        self.root = root
        self.label = label
        self.stats = ExtractStats()
        self._cache: tuple[tuple[str, ...], int] | None = None  # the last parent directory reached
        self._dir_times: dict[tuple[str, ...], int] = {}
        self._opaque: set[tuple[str, ...]] = set()
        self._skipped_paths: set[tuple[str, ...]] = set()
        self._skipped_more = 0

    # ---- members ---------------------------------------------------------------------------------

    def member(self, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = member_path(m.name, self.label)
        if isinstance(m.mtime, float) and not math.isfinite(m.mtime):  # a PAX mtime of "inf" or "nan"
            raise InvalidRequest(f"{self.label}: member {m.name!r} has an invalid mtime {m.mtime}")
        try:
            self._member(tf, m, parts)
        except DsecError:
            raise
        except OSError as e:
            raise self._os_error(e, m.name) from None

    def _member(self, tf: tarfile.TarFile, m: tarfile.TarInfo, parts: list[str]) -> None:
        if not parts:  # "./": the layer root itself; overlayfs takes the root's attributes from it
            if not m.isdir():
                raise InvalidRequest(f"{self.label}: member {m.name!r} names the layer root but is not a directory")
            fd = os.open(".", _DIR_FLAGS, dir_fd=self.root)
            try:
                self._attrs(fd, m)
            finally:
                os.close(fd)
            self._dir_times[()] = _ns(m)
            return
        base = parts[-1]
        if base == OPAQUE_MARKER:
            self._set_opaque(self._parent(parts[:-1], m.name), ".", tuple(parts[:-1]))
        elif any(p.startswith(WHITEOUT_PREFIX + WHITEOUT_PREFIX) for p in parts):
            self._skip(m.name, "AUFS metadata, meaningless to overlayfs")
            self._skipped_paths.add(tuple(parts))
        elif base.startswith(WHITEOUT_PREFIX):
            self._whiteout(m, parts)
        elif m.isreg():
            self._file(tf, m, parts)
        elif m.isdir():
            self._dir(m, parts)
        elif m.issym():
            self._symlink(m, parts)
        elif m.islnk():
            self._hardlink(m, parts)
        else:
            kind = {tarfile.CHRTYPE: "character device", tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "FIFO"}
            self._skip(m.name, f"{kind.get(m.type, f'unsupported member type {m.type!r}')} not extracted")
            self._skipped_paths.add(tuple(parts))

    def _file(self, tf: tarfile.TarFile, m: tarfile.TarInfo, parts: list[str]) -> None:
        regions = _data_regions(m, self.label)
        pfd = self._parent(parts[:-1], m.name)
        self._clear(pfd, parts)
        fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
        try:
            src = tf.extractfile(m)
            if src is None:  # cannot happen for a regular member; guards the type
                raise InvalidRequest(f"{self.label}: member {m.name!r} has no data")
            for offset, size in regions:
                src.seek(offset)
                self._copy(src, fd, offset, size, m.name)
            if m.issparse():
                os.ftruncate(fd, m.size)  # the holes after the last data: a hole, never zeros written out
                self.stats.sparse_bytes += m.size
            self._attrs(fd, m)
            self._utime(m, fd)
        finally:
            os.close(fd)
        self.stats.files += 1

    def _copy(self, src: IO[bytes], fd: int, offset: int, size: int, name: str) -> None:
        pos, end = offset, offset + size
        while pos < end:
            try:
                chunk = src.read(min(CHUNK, end - pos))
            except READ_ERRORS as e:
                raise read_failure(e, f"{self.label}: member {name!r}") from None
            if not chunk:
                raise InvalidRequest(f"{self.label}: member {name!r}: the archive ends inside its data")
            view = memoryview(chunk)
            while view:
                written = os.pwrite(fd, view, pos)
                pos += written
                view = view[written:]
            self.stats.bytes += len(chunk)

    def _dir(self, m: tarfile.TarInfo, parts: list[str]) -> None:
        pfd = self._parent(parts[:-1], m.name)
        old = _lstat(pfd, parts[-1])
        if old is None or not stat.S_ISDIR(old.st_mode):
            self._clear(pfd, parts)
            os.mkdir(parts[-1], 0o700, dir_fd=pfd)
        if tuple(parts) not in self._dir_times:
            self.stats.dirs += 1
        fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=pfd)
        try:
            self._attrs(fd, m)
            if old is not None and _is_whiteout(old):
                # ".wh.d" then "d/" in one layer: the new directory must hide the lower layers' d
                self._set_opaque(fd, ".", tuple(parts))
        finally:
            os.close(fd)
        self._dir_times[tuple(parts)] = _ns(m)

    def _symlink(self, m: tarfile.TarInfo, parts: list[str]) -> None:
        if not m.linkname or "\0" in m.linkname:
            raise InvalidRequest(f"{self.label}: symlink {m.name!r} has an invalid target {m.linkname!r}")
        pfd = self._parent(parts[:-1], m.name)
        self._clear(pfd, parts)
        # the target is stored as is, absolute or not: it is resolved inside the sandbox, never here
        os.symlink(m.linkname, parts[-1], dir_fd=pfd)
        uid, gid = self._owner(m)
        os.chown(parts[-1], uid, gid, dir_fd=pfd, follow_symlinks=False)
        self._xattrs(f"/proc/self/fd/{pfd}/{parts[-1]}", m, follow=False)
        self._utime(m, parts[-1], pfd)
        self.stats.symlinks += 1

    def _hardlink(self, m: tarfile.TarInfo, parts: list[str]) -> None:
        target = member_path(m.linkname, self.label, what=f"hardlink {m.name!r} target")
        if not target:
            raise InvalidRequest(f"{self.label}: hardlink {m.name!r} points at the layer root")
        if target == parts:
            self._skip(m.name, "hardlink to itself")
            return
        if tuple(target) in self._skipped_paths:
            self._skip(m.name, f"hardlink to {m.linkname!r}, which was not extracted")
            self._skipped_paths.add(tuple(parts))
            return
        missing = InvalidRequest(
            f"{self.label}: hardlink {m.name!r} points at {m.linkname!r}, which is not a file extracted before it"
        )
        try:
            tfd = self._walk(target[:-1], m.name, create=False)
        except FileNotFoundError:
            raise missing from None
        try:
            st = _lstat(tfd, target[-1])
            if st is None or not stat.S_ISREG(st.st_mode):
                raise missing
            pfd = self._parent(parts[:-1], m.name)
            self._clear(pfd, parts)
            # linkat without AT_SYMLINK_FOLLOW: links the entry itself, never what a symlink names
            os.link(target[-1], parts[-1], src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(tfd)
        self.stats.hardlinks += 1

    def _whiteout(self, m: tarfile.TarInfo, parts: list[str]) -> None:
        name = parts[-1][len(WHITEOUT_PREFIX) :]
        if name in ("", ".", ".."):
            raise InvalidRequest(f"{self.label}: whiteout {m.name!r} names no entry")
        pfd = self._parent(parts[:-1], m.name)
        here = (*parts[:-1], name)
        old = _lstat(pfd, name)
        # A whiteout only hides lower layers. What this layer put at NAME stays; a directory it made
        # becomes opaque, so the lower layers' NAME is still hidden beneath it.
        if old is not None and stat.S_ISDIR(old.st_mode):
            self._set_opaque(pfd, name, here)
        elif old is None:
            try:
                os.mknod(name, stat.S_IFCHR, os.makedev(0, 0), dir_fd=pfd)
            except PermissionError:
                raise BackendError("creating overlayfs whiteouts (character devices) needs root (CAP_MKNOD)") from None
        self.stats.whiteouts += 1

    # ---- attributes ------------------------------------------------------------------------------

    def _owner(self, m: tarfile.TarInfo) -> tuple[int, int]:
        if not (0 <= m.uid <= _MAX_ID and 0 <= m.gid <= _MAX_ID):
            raise InvalidRequest(f"{self.label}: member {m.name!r} has an invalid owner {m.uid}:{m.gid}")
        return m.uid, m.gid

    def _attrs(self, fd: int, m: tarfile.TarInfo) -> None:
        # Order matters: chown clears setuid/setgid and security.capability, so mode and xattrs come after.
        os.fchown(fd, *self._owner(m))
        os.fchmod(fd, m.mode & 0o7777)
        self._xattrs(fd, m, follow=True)

    def _xattrs(self, target: int | str, m: tarfile.TarInfo, *, follow: bool) -> None:
        for key, value in _pax_xattrs(m):
            reason = _xattr_refused(key)
            if reason:
                self._skip(m.name, f"xattr {key!r} not applied: {reason}")
                continue
            try:
                os.setxattr(target, key, value, follow_symlinks=follow)
            except ValueError:
                self._skip(m.name, f"xattr {key!r} not applied: invalid name")
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS):
                    raise
                self._skip(m.name, f"xattr {key!r} not applied: {e.strerror}")

    def _utime(self, m: tarfile.TarInfo, target: int | str, dir_fd: int | None = None) -> None:
        ns = _ns(m)
        try:
            if isinstance(target, int):
                os.utime(target, ns=(ns, ns))
            else:
                os.utime(target, ns=(ns, ns), dir_fd=dir_fd, follow_symlinks=False)
        except OverflowError:
            self._skip(m.name, f"mtime {m.mtime} out of range, not applied")

    def _set_opaque(self, dir_fd: int, name: str, key: tuple[str, ...]) -> None:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        try:
            os.setxattr(fd, OPAQUE_XATTR, b"y")
        except OSError as e:
            if e.errno in (errno.EPERM, errno.ENOTSUP):
                raise BackendError(
                    f"cannot mark an opaque directory ({OPAQUE_XATTR}): {e.strerror}; this needs root "
                    "and a filesystem with trusted xattrs"
                ) from None
            raise
        finally:
            os.close(fd)
        if key not in self._opaque:
            self._opaque.add(key)
            self.stats.opaque_dirs += 1

    # ---- paths -----------------------------------------------------------------------------------

    def _parent(self, parts: Sequence[str], name: str) -> int:
        """A directory fd for ``parts`` (creating missing directories), cached: members come grouped."""
        key = tuple(parts)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        fd = self._walk(parts, name, create=True)
        self._drop_cache()
        self._cache = (key, fd)
        return fd

    def _walk(self, parts: Sequence[str], name: str, *, create: bool) -> int:
        fd = os.open(".", _DIR_FLAGS, dir_fd=self.root)
        try:
            for i, comp in enumerate(parts):
                try:
                    nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    nfd = _mkdir_implicit(fd, comp)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    st = _lstat(fd, comp)
                    if not (create and st is not None and _is_whiteout(st)):
                        kind = "a symlink" if st is not None and stat.S_ISLNK(st.st_mode) else "not a directory"
                        where = "/".join(parts[: i + 1])
                        raise InvalidRequest(
                            f"{self.label}: member {name!r}: {where} is {kind} (members are never created through one)"
                        ) from None
                    # ".wh.d" then "d/x" with no "d/": a new directory, which must hide the lower layers' d
                    os.unlink(comp, dir_fd=fd)
                    nfd = _mkdir_implicit(fd, comp)
                    self._set_opaque(nfd, ".", tuple(parts[: i + 1]))
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _clear(self, pfd: int, parts: Sequence[str]) -> None:
        """Remove what an earlier member put at ``parts``: within a layer, a later member wins."""
        old = _lstat(pfd, parts[-1])
        if old is None:
            return
        if stat.S_ISDIR(old.st_mode):
            if self._cache is not None and self._cache[0][: len(parts)] == tuple(parts):
                self._drop_cache()
            shutil.rmtree(parts[-1], dir_fd=pfd)
        else:
            os.unlink(parts[-1], dir_fd=pfd)

    def _drop_cache(self) -> None:
        if self._cache is not None:
            os.close(self._cache[1])
            self._cache = None

    # ---- end -------------------------------------------------------------------------------------

    def finish(self) -> None:
        """Directory mtimes, set last: creating each entry bumped its parent's."""
        self._drop_cache()
        try:
            for parts, ns in self._dir_times.items():
                try:  # O_NOFOLLOW at every step, so what a later member replaced is passed over
                    fd = self._walk(parts, "/".join(parts) or ".", create=False)
                except (FileNotFoundError, InvalidRequest):
                    continue
                try:
                    os.utime(fd, ns=(ns, ns))
                except OverflowError:
                    self._skip("/".join(parts) or ".", "mtime out of range, not applied")
                finally:
                    os.close(fd)
        except OSError as e:
            raise self._os_error(e, "(directory times)") from None
        if self._skipped_more:
            self.stats.skipped.append(f"... and {self._skipped_more} more skipped")

    def close(self) -> None:
        self._drop_cache()

    def _skip(self, name: str, reason: str) -> None:
        if len(self.stats.skipped) < MAX_SKIPPED:
            self.stats.skipped.append(f"{name}: {reason}")
        else:
            self._skipped_more += 1

    def _os_error(self, e: OSError, name: str) -> DsecError:
        if e.errno in _INPUT_ERRNOS:
            return InvalidRequest(f"{self.label}: member {name!r}: {e.strerror}")
        return BackendError(f"{self.label}: extracting {name!r} failed: {e.strerror}")


def _data_regions(m: tarfile.TarInfo, label: str) -> list[tuple[int, int]]:
    """(offset, length) of the bytes a regular member holds: all of it, or a sparse member's map.

    A sparse member's holes are never written (tarfile would read them as zeros): a few hundred bytes of
    GNU sparse header can claim an exabyte of them, and the layer becomes a sparse file instead."""
    if not m.issparse():
        return [(0, m.size)]
    if not 0 <= m.size <= _MAX_FILE:
        raise InvalidRequest(f"{label}: sparse member {m.name!r} claims an invalid size {m.size}")
    # empty regions carry nothing (GNU headers pad their map with them, and end it with one at the size)
    sparse: list[tuple[int, int]] = getattr(m, "sparse", None) or []
    regions = [(offset, size) for offset, size in sparse if size]
    end = 0
    for offset, size in regions:
        # in order and apart, so the stream is read front to back
        if offset < end or size < 0 or offset + size > m.size:
            raise InvalidRequest(f"{label}: sparse member {m.name!r} has an invalid map at offset {offset}")
        end = offset + size
    return regions


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _mkdir_implicit(dir_fd: int, name: str) -> int:
    # a parent the archive does not list, made as Docker makes them: root-owned, 0755 whatever the umask
    os.mkdir(name, 0o755, dir_fd=dir_fd)
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    os.fchmod(fd, 0o755)
    return fd


def _is_whiteout(st: os.stat_result) -> bool:
    # device members are never extracted, so a 0/0 character device here is a whiteout this layer made
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _pax_xattrs(m: tarfile.TarInfo) -> list[tuple[str, bytes]]:
    # Go's archive/tar (Docker, containerd, BuildKit) writes xattrs as SCHILY.xattr.NAME records. tarfile
    # decoded the raw value as UTF-8 with surrogateescape; encoding it back the same way recovers the bytes.
    prefix = "SCHILY.xattr."
    return [
        (k[len(prefix) :], v.encode("utf-8", "surrogateescape"))
        for k, v in m.pax_headers.items()
        if k.startswith(prefix)
    ]


def _xattr_refused(name: str) -> str | None:
    if name.startswith(("trusted.", "user.overlay.")):
        return "reserved (overlayfs reads these; an archive must not set them)"
    if name.startswith("user.") or name in _XATTRS_KEPT:
        return None
    return "namespace not carried into layers"
