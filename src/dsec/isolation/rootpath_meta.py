"""What the file API tells about an entry beyond stat(2), from the host side and confined as
rootpath.py is: where a symlink points and what is there, and the file's user metadata (its
``user.e2b.*`` extended attributes, E2B's file metadata).

Extended attributes are read and written through ``/proc/self/fd/N`` of an ``O_PATH`` descriptor that
openat2 resolved inside the root: the attribute calls reach exactly that inode, and nothing is opened
for reading (a FIFO or a device in the sandbox is never opened).
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
from typing import Literal

from ..errors import DsecError, InvalidRequest
from ..protocol.sandbox import FileEntry
from .rootpath import RootFS, _fd, _translate, clean_path, openat2

PREFIX = "user.e2b."
MAX_KEYS = 64  # metadata keys one file may carry through the API
MAX_VALUE = 4096  # bytes of one value
KEY = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]{1,200}")  # an HTTP header token, lowercased (E2B's rule)
VALUE = re.compile(r"[\x20-\x7e]*")

LinkType = Literal["file", "dir", "other"]


def check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """Keys lowercased (as E2B stores them); refused: more than MAX_KEYS, a key that is not an HTTP
    token, a value that is not printable ASCII or is too long."""
    if len(metadata) > MAX_KEYS:
        raise InvalidRequest(f"at most {MAX_KEYS} metadata keys per file")
    out: dict[str, str] = {}
    for key, value in metadata.items():
        low = key.lower()
        if not KEY.fullmatch(low):
            raise InvalidRequest(f"metadata key {key[:64]!r} is not an HTTP header token")
        if len(value) > MAX_VALUE or not VALUE.fullmatch(value):
            raise InvalidRequest(f"metadata value of {key[:64]!r}: printable ASCII, at most {MAX_VALUE} bytes")
        out[low] = value
    return out


def _kind(mode: int) -> LinkType:
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "other"


def _read_metadata(inode: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        names = os.listxattr(inode)
    except OSError:
        return out  # a file system without user attributes has no metadata
    for name in sorted(names):
        if not name.startswith(PREFIX):
            continue
        try:
            value = os.getxattr(inode, name)
        except OSError:
            continue  # removed meanwhile
        out[name[len(PREFIX) :]] = value.decode(errors="replace")
        if len(out) >= MAX_KEYS:
            break
    return out


def describe(fs: RootFS, entry: FileEntry, inner: str) -> FileEntry:
    """``entry`` (at ``inner`` in ``fs``) with its metadata and, for a symlink, its target: the link as
    it says, absolute against the link's directory (``entry.path``'s), and the type of what it resolves
    to inside the root (None: nothing)."""
    rel = clean_path(inner)
    update: dict[str, object] = {}
    try:
        with fs._rootfd() as root:
            if entry.type == "symlink":
                parent, name = posixpath.split(rel)
                with _fd(openat2(root, parent or ".", os.O_PATH | os.O_DIRECTORY)) as pfd:
                    said = os.readlink(name, dir_fd=pfd)
                update["link_target"] = posixpath.normpath(posixpath.join(posixpath.dirname(entry.path), said))
            # a symlink's metadata is its target's, as a read of it is
            with _fd(openat2(root, rel, os.O_PATH)) as fd:
                st = os.fstat(fd)
                if entry.type == "symlink":
                    update["link_type"] = _kind(st.st_mode)
                if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                    update["metadata"] = _read_metadata(f"/proc/self/fd/{fd}")
    except OSError:
        pass  # gone, or a dangling or escaping link: the entry as stat saw it
    return entry.model_copy(update=update) if update else entry


def set_metadata(fs: RootFS, path: str, metadata: dict[str, str]) -> None:
    """The file's metadata becomes exactly ``metadata`` (checked with ``check_metadata``)."""
    wanted = check_metadata(metadata)
    rel = clean_path(path)
    try:
        with fs._rootfd() as root, _fd(openat2(root, rel, os.O_PATH)) as fd:
            st = os.fstat(fd)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise InvalidRequest(f"metadata is kept on files and directories only: {path}")
            inode = f"/proc/self/fd/{fd}"
            try:
                present = [n for n in os.listxattr(inode) if n.startswith(PREFIX)]
            except OSError as e:
                if e.errno != errno.ENOTSUP:
                    raise
                if wanted:
                    raise InvalidRequest(f"the file system of {path} keeps no user attributes (metadata)") from None
                return
            for name in present:
                if name[len(PREFIX) :] not in wanted:
                    os.removexattr(inode, name)
            for key, value in wanted.items():
                os.setxattr(inode, PREFIX + key, value.encode())
    except DsecError:
        raise
    except OSError as e:
        if e.errno == errno.ENOTSUP:
            raise InvalidRequest(f"the file system of {path} keeps no user attributes (metadata)") from None
        raise _translate(e, path, fs.place) from None
