"""Host-side validation of an uploaded tar archive, before any kind unpacks it.

Every kind unpacks uploads inside the sandbox (a container's own namespaces, a VM's guest), so a hostile
archive could only ever reach the sandbox's own files. This check makes the upload's outcome independent
of what the unpacker tolerates, and bounds what unpacking can cost: it walks the archive's headers once
(no file data is copied) and refuses

- names that are absolute, contain a ``..`` component, hold a NUL byte (a field with bytes after its
  terminating NUL reads differently to different tar implementations), or pass through a symlink the
  archive itself made (``l -> sub`` then ``l/x``: where that lands depends on the link);
- symlinks whose target is absolute or climbs out of the destination, hardlinks whose target does;
- device nodes, FIFOs and any entry type other than files, directories and links;
- more unpacked bytes than the sandbox's disk limit, more than ``MAX_ENTRIES`` entries, and, for gzip
  (the one compression accepted; it is decompressed here and handed on as a plain tar), a ratio over
  ``MAX_RATIO`` beyond ``RATIO_FLOOR`` bytes, or more than ``MAX_PLAIN`` bytes in all.

Refusals are ``InvalidRequest`` (400) for malformed or unsafe entries and ``LimitExceeded`` (413) for
the bounds, each naming the offending entry (truncated).
"""

from __future__ import annotations

import posixpath
import zlib
from dataclasses import dataclass, field

from ..errors import InvalidRequest, LimitExceeded

BLOCK = 512
MAX_ENTRIES = 100_000
MAX_RATIO = 100
RATIO_FLOOR = 16 << 20
MAX_PLAIN = 512 << 20  # as the file API's archive bound (kinds.base.MAX_ARCHIVE)
MAX_META = 1 << 20  # a pax header or GNU long name this large is no honest archive's
_NAME_SHOWN = 200

_FILE_TYPES = {b"0", b"\0", b"7"}
_LINK, _SYMLINK, _DIR = b"1", b"2", b"5"
_META_TYPES = (b"L", b"K", b"x", b"g")  # GNU long name and link, pax (per entry and global): no entry of their own
_REFUSED_TYPES = {b"3": "a character device", b"4": "a block device", b"6": "a FIFO"}
_COMPRESSED = {
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"\x1f\x9d": "compress",
    b"\x04\x22\x4d\x18": "lz4",
}


@dataclass(frozen=True)
class TarSummary:
    entries: int
    file_bytes: int


def _shown(name: str) -> str:
    return repr(name if len(name) <= _NAME_SHOWN else name[:_NAME_SHOWN] + "...")


def check_upload(data: bytes, max_bytes: int, max_entries: int = MAX_ENTRIES) -> bytes:
    """The archive to hand to the unpacker (``data`` itself, or gzip's content); raises if refused."""
    plain = _gunzip(data) if data[:2] == b"\x1f\x8b" else data
    for magic, name in _COMPRESSED.items():
        if plain.startswith(magic):
            raise InvalidRequest(f"the archive is {name}-compressed; upload a plain or gzip-compressed tar")
    check_tar(plain, max_bytes, max_entries)
    return plain


def _gunzip(data: bytes) -> bytes:
    limit = min(MAX_PLAIN, max(RATIO_FLOOR, MAX_RATIO * len(data)))
    out = bytearray()
    rest = data
    # concatenated gzip members are one stream to gzip(1): decompress them all
    while rest:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            while rest:
                out += d.decompress(rest, limit + 1 - len(out))
                if len(out) > limit:
                    raise LimitExceeded(
                        f"the gzip archive unpacks to more than {limit} bytes "
                        f"(at most {MAX_RATIO}x its {len(data)} bytes, and {MAX_PLAIN} in all)"
                    )
                rest = d.unconsumed_tail
                if d.eof:
                    break
            if not d.eof:
                raise InvalidRequest("the gzip archive is truncated")
        except zlib.error as e:
            raise InvalidRequest(f"the gzip archive is corrupt: {e}") from None
        rest = d.unused_data
        if rest.strip(b"\0") == b"":  # padding after the last member, as tape tools leave
            break
    return bytes(out)


def _field(block: bytes, start: int, size: int, what: str, entry: str) -> bytes:
    raw = block[start : start + size]
    value, nul, after = raw.partition(b"\0")
    if nul and after.strip(b"\0"):
        raise InvalidRequest(f"tar entry {_shown(entry or value.decode(errors='replace'))}: NUL byte inside its {what}")
    return value


def _number(raw: bytes, what: str, entry: str) -> int:
    if raw and raw[0] & 0x80:  # GNU base-256
        if raw[0] & 0x40:
            raise InvalidRequest(f"tar entry {_shown(entry)}: negative {what}")
        return int.from_bytes(bytes([raw[0] & 0x3F]) + raw[1:], "big")
    text = raw.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise InvalidRequest(f"tar entry {_shown(entry)}: malformed {what} {text[:20]!r}") from None


def _pax(body: bytes, entry: str) -> dict[str, str]:
    records: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        if body[pos:].strip(b"\0") == b"":
            break
        space = body.find(b" ", pos)
        try:
            length = int(body[pos:space]) if space > pos else -1
        except ValueError:
            length = -1
        if length <= 0 or pos + length > len(body) or body[pos + length - 1 : pos + length] != b"\n":
            raise InvalidRequest(f"tar entry {_shown(entry)}: malformed pax header")
        key, eq, value = body[space + 1 : pos + length - 1].partition(b"=")
        if not eq:
            raise InvalidRequest(f"tar entry {_shown(entry)}: malformed pax record")
        if b"\0" in value:
            raise InvalidRequest(f"tar entry {_shown(entry)}: NUL byte in pax record {key.decode(errors='replace')}")
        records[key.decode(errors="replace")] = value.decode("utf-8", errors="surrogateescape")
        pos += length
    return records


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _check_name(name: str, symlinks: set[str]) -> str:
    """The entry's path relative to the destination (normalised), or a refusal."""
    if not name:
        raise InvalidRequest("tar entry with an empty name")
    if name.startswith("/"):
        raise InvalidRequest(f"tar entry {_shown(name)}: absolute path")
    parts = _parts(name)
    if ".." in parts:
        raise InvalidRequest(f"tar entry {_shown(name)}: '..' in its path")
    for i in range(1, len(parts)):
        if "/".join(parts[:i]) in symlinks:
            raise InvalidRequest(f"tar entry {_shown(name)}: its path goes through a symlink of the archive")
    return "/".join(parts)


def _inside(base: list[str], target: str) -> bool:
    """Whether ``target`` (relative to directory ``base``) stays inside the destination, lexically."""
    stack = list(base)
    for part in _parts(target):
        if part == "..":
            if not stack:
                return False
            stack.pop()
        else:
            stack.append(part)
    return True


@dataclass
class _Meta:
    """What the metadata headers before an entry (GNU long name and link, pax) say about it."""

    long_name: str | None = None
    long_link: str | None = None
    pax: dict[str, str] = field(default_factory=dict)


def check_tar(data: bytes, max_bytes: int, max_entries: int = MAX_ENTRIES) -> TarSummary:
    """Walk a plain tar's headers; raises InvalidRequest / LimitExceeded on the first refused entry."""
    view = memoryview(data)
    off = entries = total = 0
    meta = _Meta()
    symlinks: set[str] = set()
    while True:
        if off + BLOCK > len(data):
            if off == len(data) and off > 0:
                break  # no end-of-archive blocks: tar(1) accepts that too
            raise InvalidRequest("the archive is truncated (or not a tar archive)")
        block = bytes(view[off : off + BLOCK])
        if block == b"\0" * BLOCK:
            break
        entry = meta.pax.get("path") or meta.long_name or block[:100].split(b"\0", 1)[0].decode(errors="replace")
        _check_sum(block, off, entry)
        kind = block[156:157]
        size = _size(block, meta.pax, entry)
        body_at = off + BLOCK
        end = body_at + (size + BLOCK - 1) // BLOCK * BLOCK
        if kind in _META_TYPES:
            _read_meta(meta, kind, view, body_at, size, entry)
            off = end
            continue
        name, link = _names(block, meta, entry)
        meta = _Meta()
        entries += 1
        if entries > max_entries:
            raise LimitExceeded(f"the archive holds more than {max_entries} entries (at {_shown(name)})")
        path = _check_name(name, symlinks)
        total = _check_data(kind, name, size, total, max_bytes, body_at + size > len(data))
        _check_links(kind, name, path, link, symlinks)
        off = end
    return TarSummary(entries=entries, file_bytes=total)


def _check_sum(block: bytes, off: int, entry: str) -> None:
    stored = _number(block[148:156], "checksum", entry)
    computed = sum(block[:148]) + 8 * 32 + sum(block[156:])
    signed = sum(b - 256 if b > 127 else b for b in block[:148] + block[156:]) + 8 * 32
    if stored not in (computed, signed):
        raise InvalidRequest(f"tar header at byte {off} ({_shown(entry)}): bad checksum (not a tar archive?)")


def _size(block: bytes, pax: dict[str, str], entry: str) -> int:
    size = _number(block[124:136], "size", entry)
    if "size" in pax:
        try:
            size = int(pax["size"])
        except ValueError:
            raise InvalidRequest(f"tar entry {_shown(entry)}: malformed pax size") from None
    return size


def _read_meta(meta: _Meta, kind: bytes, view: memoryview, body_at: int, size: int, entry: str) -> None:
    """Take in a metadata header's body: it applies to the entry that follows."""
    if size > MAX_META:
        raise LimitExceeded(f"tar entry {_shown(entry)}: a {size}-byte metadata header")
    if body_at + size > len(view):
        raise InvalidRequest(f"tar entry {_shown(entry)}: the archive ends inside it")
    body = bytes(view[body_at : body_at + size])
    if kind in (b"L", b"K"):
        text = body.rstrip(b"\0")
        if b"\0" in text:
            raise InvalidRequest(f"tar entry {_shown(entry)}: NUL byte inside a GNU long name")
        if kind == b"L":
            meta.long_name = text.decode("utf-8", errors="surrogateescape")
        else:
            meta.long_link = text.decode("utf-8", errors="surrogateescape")
    elif kind == b"x":
        meta.pax = _pax(body, entry)
    else:
        _pax(body, entry)  # global records name no entry, but must be well formed


def _names(block: bytes, meta: _Meta, entry: str) -> tuple[str, str]:
    """The entry's name and link target: the metadata headers' if they gave them, else the header's own."""
    name_field = _field(block, 0, 100, "name", entry).decode("utf-8", errors="surrogateescape")
    link_field = _field(block, 157, 100, "link target", entry).decode("utf-8", errors="surrogateescape")
    prefix = b""
    if block[257:262] == b"ustar":
        prefix = _field(block, 345, 155, "name prefix", entry)
    name = meta.pax.get("path") or meta.long_name
    if name is None:
        name = (prefix.decode("utf-8", errors="surrogateescape") + "/" if prefix else "") + name_field
    link = meta.pax.get("linkpath") or meta.long_link or link_field
    return name, link


def _check_data(kind: bytes, name: str, size: int, total: int, max_bytes: int, ends_inside: bool) -> int:
    """The unpacked bytes so far, this entry's included; refuses device nodes and FIFOs, files past the
    disk limit or the archive's end, and data on any other entry."""
    if kind in _REFUSED_TYPES:
        raise InvalidRequest(f"tar entry {_shown(name)}: {_REFUSED_TYPES[kind]} is not accepted")
    if kind in _FILE_TYPES:
        total += size
        if total > max_bytes:
            raise LimitExceeded(
                f"the archive unpacks to more than the sandbox's disk limit of {max_bytes} bytes (at {_shown(name)})"
            )
        if ends_inside:
            raise InvalidRequest(f"tar entry {_shown(name)}: the archive ends inside it")
    elif size:
        # a link or directory with data: tar implementations disagree on whether to skip it
        raise InvalidRequest(f"tar entry {_shown(name)}: a {kind.decode(errors='replace')!r} entry with a size")
    return total


def _check_links(kind: bytes, name: str, path: str, link: str, symlinks: set[str]) -> None:
    """Where the entry lands and what it links to; a symlink is remembered so no later entry goes through it."""
    if not path and kind != _DIR:
        raise InvalidRequest(f"tar entry {_shown(name)}: names the destination itself")
    if path in symlinks:
        raise InvalidRequest(f"tar entry {_shown(name)}: replaces a symlink of the archive")
    if kind == _SYMLINK:
        if not link:
            raise InvalidRequest(f"tar entry {_shown(name)}: symlink without a target")
        if link.startswith("/") or not _inside(_parts(posixpath.dirname(path)), link):
            raise InvalidRequest(f"tar entry {_shown(name)}: symlink to {_shown(link)} leaves the destination")
        symlinks.add(path)
    elif kind == _LINK:
        if not link or link.startswith("/") or ".." in _parts(link):
            raise InvalidRequest(f"tar entry {_shown(name)}: hardlink to {_shown(link)} leaves the destination")
        _check_name(link, symlinks)
    elif kind != _DIR and kind not in _FILE_TYPES:
        raise InvalidRequest(f"tar entry {_shown(name)}: entry type {kind!r} is not accepted")
