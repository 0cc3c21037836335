"""Where an imported image's files are read from: a directory, or an outer tar (plain or gzip) read in
place by offset. Every open is confined to the source: a symlinked or special file cannot make the
import read a host file or wait on a FIFO."""

from __future__ import annotations

import errno
import gzip
import io
import os
import posixpath
import stat
import tarfile
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import BackendError, InvalidRequest
from ..isolation.rootpath import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, openat2
from .layer_stream import CHUNK, READ_ERRORS, read_failure

# what the source's own shape causes when a name is opened in it: a symlink loop, a file where its path
# needs a directory, a name too long: the source's fault, not the host's
SOURCE_ERRNOS = {errno.ELOOP, errno.ENOTDIR, errno.ENAMETOOLONG}


class Slice(io.RawIOBase):
    """``length`` bytes of ``f`` from ``offset``: one member of an uncompressed-in-place outer tar."""

    def __init__(self, f: io.BufferedIOBase, offset: int, length: int) -> None:
        super().__init__()
        f.seek(offset)
        self._f = f
        self._left = length

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        data = self._f.read(min(len(view), self._left))
        view[: len(data)] = data
        self._left -= len(data)
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()


class Store:
    label: str

    def open(self, name: str) -> BinaryIO:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        try:
            self.open(name).close()
        except InvalidRequest:
            return False
        return True


class DirStore(Store):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.label = str(root)

    def open(self, name: str) -> BinaryIO:
        try:
            rootfd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                # confined to the source directory: a symlinked blob cannot make us read a host file;
                # O_NONBLOCK: opening a FIFO put in the layout's place of a file would wait for a writer
                flags = os.O_RDONLY | os.O_NONBLOCK
                fd = openat2(rootfd, name, flags, resolve=RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
            finally:
                os.close(rootfd)
        except FileNotFoundError:
            raise InvalidRequest(f"{name} is missing from {self.label}") from None
        except OSError as e:
            if e.errno in SOURCE_ERRNOS:
                raise InvalidRequest(f"cannot open {name} in {self.label}: {e.strerror}") from None
            raise BackendError(f"cannot open {name} in {self.label}: {e.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise InvalidRequest(f"{name} in {self.label} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")


class TarStore(Store):
    """The files of an outer archive, found by one scan; each is reopened by offset, so nothing is copied."""

    def __init__(self, path: Path, gz: bool) -> None:
        self.path = path
        self.gz = gz
        self.label = str(path)
        self.files: dict[str, tuple[int, int]] = {}
        self.links: dict[str, str] = {}
        try:
            with self._raw() as f, tarfile.open(fileobj=f, mode="r:", encoding="utf-8", errors="surrogateescape") as tf:
                for m in tf:
                    name = norm(m.name)
                    if m.isreg() and not m.issparse():
                        self.files[name] = (m.offset_data, m.size)
                    elif m.issym():  # legacy docker save links a repeated layer.tar to its first copy
                        self.links[name] = norm(posixpath.join(posixpath.dirname(name), m.linkname))
                    elif m.islnk():
                        self.links[name] = norm(m.linkname)
        except READ_ERRORS as e:
            err = read_failure(e, str(path))
            if isinstance(err, InvalidRequest):
                raise InvalidRequest(f"{path} is neither a directory nor a readable tar archive ({e})") from None
            raise err from None

    def _raw(self) -> io.BufferedIOBase:
        return gzip.open(self.path, "rb") if self.gz else open(self.path, "rb")

    def _find(self, name: str) -> str | None:
        name = norm(name)
        for _ in range(16):
            if name not in self.links:
                break
            name = self.links[name]
        return name if name in self.files else None

    def has(self, name: str) -> bool:
        return self._find(name) is not None

    def open(self, name: str) -> BinaryIO:
        found = self._find(name)
        if found is None:
            raise InvalidRequest(f"{name} is missing from {self.label}")
        offset, size = self.files[found]
        try:
            # seeking a gzip stream decompresses up to the offset: slow, but still streaming
            return io.BufferedReader(Slice(self._raw(), offset, size), CHUNK)
        except READ_ERRORS as e:
            raise read_failure(e, self.label) from None


def norm(name: str) -> str:
    return posixpath.normpath("/" + name).lstrip("/")
