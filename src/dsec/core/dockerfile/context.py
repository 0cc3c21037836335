"""What COPY and ADD copy: files picked from a tree (the build context, or a path in another stage),
placed under the destination as Docker places them, as one archive to unpack in the builder.

A tree is read from a tar archive into memory (a build context is uploaded as one; another stage's
files come from its sandbox as one). Names are cleaned; a member that names a path outside the tree, or
a device, is refused, as the image import refuses them.
"""

from __future__ import annotations

import fnmatch
import io
import posixpath
import tarfile
from dataclasses import dataclass

import blake3

from ...errors import InvalidRequest
from ...protocol import dockerignore
from .stage import Copy, is_glob

MAX_ENTRIES = 200_000
KINDS = {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE}


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the tree's root, clean, never "." or ".."-led
    info: tarfile.TarInfo
    data: bytes | None  # a regular file's bytes


def _clean(name: str) -> str | None:
    path = posixpath.normpath("/" + name).lstrip("/")
    return path or None


class Tree:
    """A file tree read from a tar archive; directories implied by deeper entries exist too."""

    def __init__(self, entries: dict[str, Entry]) -> None:
        self.entries = entries
        self.dirs = {posixpath.dirname(p) for p in entries} | {p for p, e in entries.items() if e.info.isdir()}
        for path in list(self.dirs):
            while path:
                path = posixpath.dirname(path)
                self.dirs.add(path)
        self.dirs.discard("")

    @classmethod
    def read(cls, data: bytes, what: str, ignore: bool = False) -> Tree:
        """The tree in ``data`` (a tar, maybe compressed); with ``ignore`` its own ``.dockerignore`` applies."""
        entries: dict[str, Entry] = {}
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                for info in tar:
                    if len(entries) >= MAX_ENTRIES:
                        raise InvalidRequest(f"{what} holds over {MAX_ENTRIES} files")
                    path = _clean(info.name)
                    if path is None:
                        continue
                    if info.type not in KINDS:
                        raise InvalidRequest(f"{what}: {info.name[:200]!r} is a device or special file; refused")
                    if info.islnk() and _clean(info.linkname) is None:
                        raise InvalidRequest(f"{what}: hard link {info.name[:200]!r} points nowhere")
                    body = tar.extractfile(info).read() if info.isreg() else None  # type: ignore[union-attr]
                    entries[path] = Entry(path, info, body)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise InvalidRequest(f"{what} is not a readable tar archive: {e}") from None
        tree = cls(entries)
        if ignore and ".dockerignore" in entries:
            ruleset = dockerignore.rules((entries[".dockerignore"].data or b"").decode(errors="replace"))
            kept = {p: e for p, e in entries.items() if not dockerignore.ignored(p, ruleset)}
            tree = cls(kept)
        return tree

    def exists(self, path: str) -> bool:
        return path in self.entries or self.isdir(path)

    def isdir(self, path: str) -> bool:
        return path == "" or path in self.dirs  # "": the root

    def match(self, pattern: str) -> list[str]:
        """The paths a source names: itself, or with wildcards whatever matches component by component."""
        parts = pattern.split("/")
        found = [p for p in (set(self.entries) | self.dirs) if p.count("/") == len(parts) - 1]
        return sorted(
            p for p in found if all(fnmatch.fnmatchcase(a, b) for a, b in zip(p.split("/"), parts, strict=True))
        )

    def under(self, root: str) -> list[Entry]:
        """What a directory holds (every depth): directories only implied by deeper entries first (as
        0755 directories), then the archive's entries in its order."""
        prefix = root + "/" if root else ""
        implied = [Entry(d, _directory(d), None) for d in sorted(self.dirs - set(self.entries)) if d.startswith(prefix)]
        return implied + [e for p, e in self.entries.items() if p.startswith(prefix)]


def _directory(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info


def source_path(src: str, what: str) -> str:
    """A source as a path relative to its tree's root (``..`` may not leave it)."""
    if "\0" in src:
        raise InvalidRequest(f"{what}: a NUL byte in {src[:80]!r}")
    path = posixpath.normpath(src.lstrip("/")) if src.strip("/") else "."
    if path == ".." or path.startswith("../"):
        raise InvalidRequest(f"{what}: {src[:200]!r} is outside the build context")
    return "" if path == "." else path


@dataclass(frozen=True)
class Placed:
    tar: bytes  # members named relative to /, to unpack at /
    key: str  # blake3 of what was placed (names, kinds, modes, owners, contents), not of when
    tops: list[str]  # the absolute paths written at the top (what --chown changes, recursively)


class Placer:
    """Writes one COPY's files under its destination."""

    def __init__(self, copy: Copy) -> None:
        self.copy = copy
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)
        self.hash = blake3.blake3()
        self.tops: list[str] = []

    def add(self, dest: str, entry: Entry, top: bool = False) -> None:
        info = tarfile.TarInfo(dest.lstrip("/"))
        info.type, info.mode, info.mtime = entry.info.type, entry.info.mode & 0o7777, entry.info.mtime
        if info.isdir() or info.isreg():
            info.mode = self.copy.chmod if self.copy.chmod is not None else info.mode
        info.uid = info.gid = 0  # the builder unpacks as root (--chown is applied after, by name or id)
        if entry.info.issym():
            info.linkname = entry.info.linkname
        data = entry.data if info.isreg() else None
        info.size = len(data) if data is not None else 0
        self.tar.addfile(info, io.BytesIO(data) if data is not None else None)
        self.hash.update(repr((info.name, info.type, info.mode, info.uid, info.gid, info.linkname)).encode())
        self.hash.update(blake3.blake3(data or b"").digest())
        if top:
            self.tops.append(dest)

    def link(self, dest: str, target: str) -> None:
        """A hard link whose target was placed in this archive too."""
        info = tarfile.TarInfo(dest.lstrip("/"))
        info.type, info.linkname = tarfile.LNKTYPE, target.lstrip("/")
        self.tar.addfile(info)
        self.hash.update(repr(("link", info.name, info.linkname)).encode())

    def done(self) -> Placed:
        self.tar.close()
        return Placed(tar=self.buf.getvalue(), key=self.hash.hexdigest(), tops=self.tops)


def place(copy: Copy, tree: Tree, what: str) -> Placed:
    """The archive of what ``copy`` takes from ``tree``, by Docker's rules: a directory's contents go into
    the destination; a file goes to the destination path, or into it when that is a directory (a trailing
    ``/``, several sources, or a wildcard); with ADD a local tar archive is unpacked into it."""
    placer = Placer(copy)
    for src in copy.sources:
        pattern = source_path(src, what)
        matched = tree.match(pattern) if is_glob(pattern) else ([pattern] if tree.exists(pattern) else [])
        if not matched:
            raise InvalidRequest(f"{copy.inst.where()}: {src[:200]!r} not found in {what}")
        for path in matched:
            _place_one(placer, copy, tree, path, what)
    return placer.done()


def _place_one(placer: Placer, copy: Copy, tree: Tree, path: str, what: str) -> None:
    dest = copy.dest.rstrip("/") or "/"
    if tree.isdir(path):
        placed_links: dict[str, str] = {}
        for entry in tree.under(path):
            rel = entry.path[len(path) + 1 :] if path else entry.path
            target = posixpath.join(dest, rel)
            if entry.info.islnk():
                _hard_link(placer, entry, path, target, placed_links)
                continue
            placer.add(target, entry, top="/" not in rel)
            placed_links[entry.path] = target
        return
    entry = tree.entries[path]
    if copy.add and entry.data is not None and _unpack(placer, entry, dest, what):
        return
    target = posixpath.join(dest, posixpath.basename(path)) if copy.into_directory else dest
    if entry.info.islnk():
        # a hard link copied alone is a copy of its target's bytes
        linked = tree.entries.get(_clean(entry.info.linkname) or "")
        if linked is None or linked.data is None:
            raise InvalidRequest(f"{what}: hard link {path[:200]!r} points to what is not in it")
        entry = linked
    placer.add(target, entry, top=True)


def _hard_link(placer: Placer, entry: Entry, root: str, target: str, placed: dict[str, str]) -> None:
    linked = _clean(entry.info.linkname) or ""
    if linked in placed:
        placer.link(target, placed[linked])
        return
    raise InvalidRequest(f"hard link {entry.path[:200]!r} points outside {root or 'the context'!r}")


def _unpack(placer: Placer, entry: Entry, dest: str, what: str) -> bool:
    """ADD of a local tar archive (plain, gzip, bzip2 or xz): its contents go into the destination.
    False: the file is not one (it is copied as it is)."""
    assert entry.data is not None
    try:
        with tarfile.open(fileobj=io.BytesIO(entry.data), mode="r:*") as probe:
            probe.next()
    except (tarfile.TarError, EOFError, OSError):
        return False
    inner = Tree.read(entry.data, f"{entry.path} (in {what})")
    placed: dict[str, str] = {}
    for item in inner.entries.values():
        target = posixpath.join(dest, item.path)
        if item.info.islnk():
            _hard_link(placer, item, "", target, placed)
            continue
        # an archive's own owners are kept by Docker; dsec unpacks as the builder, owned by root
        placer.add(target, item, top="/" not in item.path)
        placed[item.path] = target
    return True
