"""Canary residue scanner: an image must never carry its own answer key.

Scrub rules (scrub.py) drop residue whose *location* is known. Canaries catch residue by *content*: a
task author plants unique strings in the answer key, tests or solution, and every image publish searches
each layer of the new version for them, refusing the publish on a hit.

Each layer is scanned on its own, as its EROFS image shows it when mounted alone (not through the
overlay stack), so a file a later layer deletes (a whiteout) or hides (an opaque directory) is still
found in the layer that holds it. What is searched, byte for byte: file contents, every path (names of
files, directories, whiteouts), symlink targets, and extended attribute names and values.

Known partial: contents are searched as stored, not decoded. A canary inside a compressed file (gzip,
zip, a wheel, an xz'd tarball) or an encoded one (base64, UTF-16, hex) is not found; neither is one
split across files, or across path components (names are searched one component at a time).
Canaries shorter than ``MIN_CANARY`` characters are refused: they would match by chance.

Verdicts are cached per (layer digest, canary set): layers are immutable, so a base layer shared by
many images is scanned once per canary set. The cache key is a keyed hash, so the cache on disk does
not let anyone test guesses of a canary offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from ..errors import BackendError, InvalidRequest, ResidueFound
from ..protocol.residue import check_canaries

if TYPE_CHECKING:
    from .layers import NodeLayers
    from .model import ImageVersion

log = logging.getLogger("dsec.images")

BLOCK = 1 << 20
MAX_REPORTED = 20  # paths named in an error; the count says how many more
REDACTED = "<canary>"

# A call's own canaries (SnapshotRequest.canaries, BuildRequest.canaries, ImportRequest.canaries), set
# around the call by ``call_canaries`` and read where every publish passes (ResidueGuard), so no publish
# path can forget them; tasks and threads started inside the call inherit them.
CALL_CANARIES: ContextVar[tuple[str, ...]] = ContextVar("dsec_call_canaries", default=())


@contextlib.contextmanager
def call_canaries(values: Iterable[str]) -> Iterator[None]:
    token = CALL_CANARIES.set((*CALL_CANARIES.get(), *values))
    try:
        yield
    finally:
        CALL_CANARIES.reset(token)


@dataclass(frozen=True)
class CanarySet:
    values: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, *groups: Iterable[str]) -> CanarySet:
        merged = check_canaries(v for g in groups for v in g)
        return cls(tuple(sorted(v.encode() for v in merged)))

    def __bool__(self) -> bool:
        return bool(self.values)

    @property
    def longest(self) -> int:
        return max((len(v) for v in self.values), default=0)

    def found_in(self, data: bytes) -> bool:
        # one bytes.find per canary: CPython's search is vectorised, and sets are small
        return any(v in data for v in self.values)

    def key(self, secret: bytes) -> str:
        framed = b"".join(len(v).to_bytes(4, "big") + v for v in self.values)
        return hmac.new(secret, framed, sha256).hexdigest()[:32]

    def redact(self, path: str) -> str:
        """``path`` with every canary in it replaced, so an error never echoes one."""
        raw = path.encode(errors="surrogateescape")
        for v in sorted(self.values, key=len, reverse=True):
            raw = raw.replace(v, REDACTED.encode())
        return raw.decode(errors="replace")


@dataclass
class Hit:
    path: str  # redacted, relative to the layer root, with a leading "/"
    where: str  # "content", "name", "symlink", "xattr"


@dataclass
class ScanReport:
    hits: list[Hit] = field(default_factory=list)
    files: int = 0
    bytes: int = 0


def stream_has(fd: int, canaries: CanarySet, block: int = BLOCK) -> tuple[bool, int]:
    """Whether any canary occurs in the file's bytes; (found, bytes read).

    The last ``longest - 1`` bytes of each block are kept in front of the next one, so a canary that
    crosses a read boundary is still seen (and no match is counted twice: a hit ends the search).
    """
    keep = canaries.longest - 1
    tail = b""
    total = 0
    while chunk := os.read(fd, block):
        total += len(chunk)
        window = tail + chunk
        if canaries.found_in(window):
            return True, total
        tail = window[-keep:] if keep else b""
    return False, total


def _xattrs_hit(path: str, canaries: CanarySet) -> bool:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return False
    for name in names:
        if canaries.found_in(name.encode(errors="surrogateescape")):
            return True
        with contextlib.suppress(OSError):
            if canaries.found_in(os.getxattr(path, name, follow_symlinks=False)):
                return True
    return False


def scan_tree(root: Path, canaries: CanarySet, *, block: int = BLOCK) -> ScanReport:
    """Search one layer's tree for canaries (see the module docstring); never follows a link.

    Hard links are read once. Sockets, fifos and device nodes (whiteouts) have no contents; their names
    and xattrs are searched like every other entry's.
    """
    report = ScanReport()
    seen: set[tuple[int, int]] = set()
    stack = [b""]
    base = os.fsencode(root)

    def hit(rel: bytes, where: str) -> None:
        report.hits.append(Hit(canaries.redact("/" + os.fsdecode(rel)), where))

    if _xattrs_hit(os.fsdecode(base), canaries):
        hit(b"", "xattr")
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(base + b"/" + rel if rel else base))
        except OSError as e:
            raise BackendError(f"cannot read /{os.fsdecode(rel)} while scanning for canaries: {e}") from e
        for entry in entries:
            path = rel + b"/" + entry.name if rel else entry.name
            if canaries.found_in(entry.name):
                hit(path, "name")
            st = entry.stat(follow_symlinks=False)
            if _xattrs_hit(os.fsdecode(entry.path), canaries):
                hit(path, "xattr")
            if stat.S_ISDIR(st.st_mode):
                stack.append(path)
            elif stat.S_ISLNK(st.st_mode):
                if canaries.found_in(os.readlink(entry.path)):
                    hit(path, "symlink")
            elif stat.S_ISREG(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                if st.st_nlink > 1:
                    seen.add((st.st_dev, st.st_ino))
                report.files += 1
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOATIME)
                try:
                    found, n = stream_has(fd, canaries, block)
                finally:
                    os.close(fd)
                report.bytes += n
                if found:
                    hit(path, "content")
    report.hits.sort(key=lambda h: (h.path, h.where))
    return report


def residue_error(layer: str, hits: list[Hit], what: str = "layer") -> ResidueFound:
    shown = [f"{h.path} ({h.where})" for h in hits[:MAX_REPORTED]]
    more = f" and {len(hits) - MAX_REPORTED} more" if len(hits) > MAX_REPORTED else ""
    return ResidueFound(
        f"a canary string was found in {what} {layer} at {', '.join(shown)}{more}; refusing to publish "
        "(remove the residue, or scrub where it lands)",
        detail={"layer": layer, "paths": [h.path for h in hits[:MAX_REPORTED]], "count": len(hits)},
    )


class VerdictCache:
    """Scan verdicts per (layer digest, canary set), in memory and under ``root`` on the node's disk."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.secret = self._secret()
        self._mem: dict[tuple[str, str], list[Hit]] = {}

    def _secret(self) -> bytes:
        path = self.root / "key"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            if e.errno != errno.EEXIST:
                raise
            return path.read_bytes()
        with os.fdopen(fd, "wb") as f:
            key = secrets.token_bytes(32)
            f.write(key)
        return key

    def _file(self, digest: str, key: str) -> Path:
        if not digest or not all(c in "0123456789abcdef" for c in digest):
            raise InvalidRequest(f"not a layer digest: {digest!r}")
        return self.root / f"{digest}.{key}.json"

    def get(self, digest: str, canaries: CanarySet) -> list[Hit] | None:
        key = canaries.key(self.secret)
        if (digest, key) in self._mem:
            return self._mem[(digest, key)]
        try:
            data = json.loads(self._file(digest, key).read_text())
            hits = [Hit(str(h["path"]), str(h["where"])) for h in data["hits"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._mem[(digest, key)] = hits
        return hits

    def put(self, digest: str, canaries: CanarySet, hits: list[Hit]) -> None:
        key = canaries.key(self.secret)
        self._mem[(digest, key)] = hits
        path = self._file(digest, key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"hits": [{"path": h.path, "where": h.where} for h in hits]}))
        os.rename(tmp, path)


def _file_digest(path: Path) -> str:
    h = blake3.blake3()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


class ResidueGuard:
    """The check every image publish passes: each layer of the new version searched for canaries.

    ``ImageStore`` calls ``check`` with a staged layer (its EROFS file) before uploading it, and with
    every layer of a version right before the version is published, so a refused publish leaves no
    image version and, for new layers, no chunk in the repository.
    """

    def __init__(self, layers: NodeLayers, canaries: Iterable[str] = (), *, shared_mounts: bool = True) -> None:
        self.layers = layers
        self.canaries = tuple(check_canaries(canaries))  # the node's (``dsec serve --canary``)
        self.shared_mounts = shared_mounts  # False: layers are not mounted on this node (unit tests)
        self._verdicts: VerdictCache | None = None

    @property
    def verdicts(self) -> VerdictCache:
        if self._verdicts is None:
            self._verdicts = VerdictCache(self.layers.root / "canary")
        return self._verdicts

    def canary_set(self) -> CanarySet:
        """The node's canaries and the current call's."""
        return CanarySet.of(self.canaries, CALL_CANARIES.get())

    async def check_staged(self, blob: Path) -> None:
        """Before a packed layer is uploaded."""
        await self.check([blob], self.canary_set())

    async def check_version(self, version: ImageVersion) -> None:
        """Right before a version is published (``Catalog.publish`` calls this): every layer, the parents'
        included, each on its own."""
        await self.check([ref.digest for ref in version.layers], self.canary_set())

    async def check(self, layers: Sequence[str | Path], canaries: CanarySet) -> None:
        """Raise ``ResidueFound`` naming the first layer holding a canary; each item a layer digest or a
        staged EROFS file. Nothing to do without canaries."""
        if not canaries:
            return
        for layer in layers:
            digest = await asyncio.to_thread(_file_digest, layer) if isinstance(layer, Path) else layer
            hits = self.verdicts.get(digest, canaries)
            if hits is None:
                started = time.monotonic()
                async with self._tree(layer) as tree:
                    report = await asyncio.to_thread(scan_tree, tree, canaries)
                hits = report.hits
                self.verdicts.put(digest, canaries, hits)
                log.info(
                    "canary scan of layer %s: %d files, %d bytes, %d hits in %.2fs",
                    digest[:12],
                    report.files,
                    report.bytes,
                    len(hits),
                    time.monotonic() - started,
                )
            if hits:
                raise residue_error(digest, hits)

    @contextlib.asynccontextmanager
    async def _tree(self, layer: str | Path) -> AsyncIterator[Path]:
        """The layer's own tree (not the overlay stack): the node's shared mount, or a private one."""
        from ..isolation.mounts import umount
        from .lazy import mount_layer

        if isinstance(layer, str) and self.shared_mounts:
            yield await self.layers.mount(layer)
            return
        if isinstance(layer, Path):
            source = layer
        else:
            source = self.layers.file(layer)
            if not source.exists():
                source = await self.layers.fetch_full(layer)
        target = self.layers.tmp / f"scan-{secrets.token_hex(6)}"
        target.mkdir()
        try:
            await asyncio.to_thread(mount_layer, source, target)
            try:
                yield target
            finally:
                await asyncio.to_thread(umount, target, lazy=True)
        finally:
            with contextlib.suppress(OSError):
                target.rmdir()
