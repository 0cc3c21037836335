"""Hostile tar archives for the fuzz targets: member recipes drawn by Hypothesis, built with tarfile,
then mutated at the byte level (truncated, fields overwritten with their checksums fixed so the
damage reaches the parser, garbage appended).

Absolute names and link targets never point at the real host: they start with ``TOP``, which
:func:`build` replaces with the fuzz root (a scratch directory whose every file the test watches),
so an extractor that followed one would write where the test looks.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass, field

from hypothesis import strategies as st

TOP = "@TOP@"
BLOCK = tarfile.BLOCKSIZE

# plain names are drawn most often: the extractor stops at the first member it refuses, so an archive
# must mostly hold acceptable members for the later ones (links through links, whiteouts over
# directories) to be reached
COMPONENTS = st.sampled_from(
    ["a", "b", "d"] * 6
    + [".wh.a", ".wh.d", ".wh..wh..opq", "é", "\udcff", "x" * 150, ".", ""] * 2
    + ["..", ".wh.", ".wh..", ".wh..wh.plnk", "a\0b", " "]
)
KINDS = st.sampled_from(
    [
        *(tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE),
        *(tarfile.BLKTYPE, tarfile.FIFOTYPE, tarfile.CONTTYPE, tarfile.GNUTYPE_SPARSE, b"Z"),
    ]
)
IDS = st.sampled_from([0, 1, 1000, 65534, 2**21 - 1, 2**32 - 2, 2**32 - 1, 2**40])
PAX_KEYS = st.sampled_from(
    [f"SCHILY.xattr.{n}" for n in ("user.a", "trusted.overlay.opaque", "security.capability", "security.selinux")]
    + [f"SCHILY.xattr.{n}" for n in ("user.", "", "system.posix_acl_access", "user." + "x" * 300)]
    + ["path", "linkpath", "size", "uid", "gid", "mtime", "uname", "GNU.sparse.map", "GNU.sparse.size", "comment"]
)
PAX_VALUES = st.one_of(
    st.sampled_from(["", "y", "-1", "1e999", "nan", "inf", "-inf", "abc", "9" * 30, "0", "1.5", "../x", TOP + "/x"]),
    st.text(max_size=12),
)
RAW_FIELDS = {  # (offset, length) in a ustar header
    "name": (0, 100),
    "mode": (100, 8),
    "uid": (108, 8),
    "gid": (116, 8),
    "size": (124, 12),
    "mtime": (136, 12),
    "type": (156, 1),
    "linkname": (157, 100),
    "magic": (257, 8),
    "devmajor": (329, 8),
    "prefix": (345, 155),
}
RAW_VALUES = st.one_of(
    st.sampled_from(
        [
            *(b"77777777777\0", b"\x80" + b"\xff" * 11, b"\xff" * 12, b"-1", b"", b"../../x", b"/", b"0000644\0"),
            *(b"ustar\x0000", b"ustar  \0", b"x\0y", b"\0\0\0\0"),
        ]
    ),
    st.binary(max_size=16),
)


@dataclass(frozen=True)
class Member:
    kind: bytes
    name: str
    linkname: str = ""
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int | float = 1_600_000_000
    pax: dict[str, str] = field(default_factory=dict)
    dev: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Recipe:
    members: list[Member]
    format: int = tarfile.PAX_FORMAT
    mutations: list[tuple[object, ...]] = field(default_factory=list)


PLAIN_COMPONENTS = st.sampled_from(["a", "b", "d", ".wh.a", ".wh.d", ".wh..wh..opq", "é"])


@st.composite
def paths(draw: st.DrawFn, *, plain: bool = False) -> str:
    body = "/".join(draw(st.lists(PLAIN_COMPONENTS if plain else COMPONENTS, min_size=1, max_size=4)))
    prefixes = ["", "", "", "./", "./"] + ([] if plain else [TOP + "/"])
    return draw(st.sampled_from(prefixes)) + body + draw(st.sampled_from(["", "", "/"]))


@st.composite
def link_targets(draw: st.DrawFn, *, plain: bool = False) -> str:
    up = draw(st.sampled_from(["", "", "../", "../../", "../../../../"]))
    return up + draw(paths(plain=plain))


@st.composite
def members(draw: st.DrawFn) -> Member:
    """Mostly plain members (the extractor stops at the first it refuses, so the later ones must be
    reached: links through links, whiteouts over what an earlier member made), some hostile in every
    field."""
    if draw(st.integers(0, 9)) < 7:
        kind = draw(st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE]))
        return Member(
            kind=kind,
            name=draw(paths(plain=True)),
            linkname=draw(link_targets(plain=True)) if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else "",
            data=draw(st.binary(max_size=64)) if kind == tarfile.REGTYPE else b"",
            mode=draw(st.sampled_from([0o644, 0o755, 0o4755, 0o000])),
            uid=draw(st.sampled_from([0, 1000])),
        )
    kind = draw(KINDS)
    data = draw(st.binary(max_size=64)) if kind in tarfile.REGULAR_TYPES else b""
    mtime = draw(
        st.one_of(
            st.just(1_600_000_000),
            st.integers(-(2**40), 2**40),
            st.floats(min_value=-1e20, max_value=1e20, allow_nan=False),
        )
    )
    return Member(
        kind=kind,
        name=draw(paths()),
        linkname=draw(link_targets()) if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else "",
        data=data,
        mode=draw(st.one_of(st.sampled_from([0o644, 0o755, 0o4755, 0o000, 0o7777]), st.integers(0, 0o7777777))),
        uid=draw(IDS),
        gid=draw(IDS),
        mtime=mtime,
        pax=draw(st.dictionaries(PAX_KEYS, PAX_VALUES, max_size=2)),
        dev=draw(st.sampled_from([(0, 0), (1, 3), (2**21 - 1, 0)])),
    )


MUTATIONS = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("field"), st.floats(0, 1), st.sampled_from(sorted(RAW_FIELDS)), RAW_VALUES),
    st.tuples(st.just("byte"), st.floats(0, 1), st.integers(0, 255)),
    st.tuples(st.just("append"), st.binary(max_size=1100)),
    st.tuples(
        st.just("drop-end"),
    ),
)


def recipes(max_members: int = 10, mutations: int = 2) -> st.SearchStrategy[Recipe]:
    return st.builds(
        Recipe,
        members=st.lists(members(), max_size=max_members),
        format=st.sampled_from([tarfile.PAX_FORMAT, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]),
        mutations=st.lists(MUTATIONS, max_size=mutations),
    )


def _tarinfo(m: Member, top: str) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(m.name.replace(TOP, top))
    ti.type = m.kind
    ti.linkname = m.linkname.replace(TOP, top)
    ti.size = len(m.data) if m.kind in tarfile.REGULAR_TYPES else 0
    ti.mode, ti.uid, ti.gid, ti.mtime = m.mode, m.uid, m.gid, m.mtime
    ti.devmajor, ti.devminor = m.dev
    ti.pax_headers = {k: v.replace(TOP, top) for k, v in m.pax.items()}
    return ti


def build(recipe: Recipe, top: str) -> bytes:
    """The archive's bytes; members tarfile cannot write in the recipe's format are left out."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=recipe.format, encoding="utf-8", errors="surrogateescape") as tf:
        for m in recipe.members:
            ti = _tarinfo(m, top)
            try:
                header = ti.tobuf(tf.format, tf.encoding, tf.errors)
            except (ValueError, OverflowError, UnicodeError):
                continue  # too long, too big or unencodable for this format: tarfile refuses to write it
            tf.fileobj.write(header)
            tf.offset += len(header)
            if ti.size:
                tf.fileobj.write(m.data + bytes(-len(m.data) % BLOCK))
                tf.offset += len(m.data) + (-len(m.data) % BLOCK)
    return mutate(buf.getvalue(), recipe.mutations)


def checksums(block: bytes) -> tuple[int, int]:
    """A ustar header's checksum, unsigned and signed (old tars summed signed chars): the sum of its
    bytes with the checksum field read as spaces."""
    rest = block[:148] + block[156:BLOCK]
    return sum(rest) + 8 * 32, sum(b - 256 if b > 127 else b for b in rest) + 8 * 32


def _headers(data: bytes) -> list[int]:
    """Offsets of the blocks whose checksum is right: the headers, whatever members they begin."""
    found = []
    for off in range(0, len(data) - BLOCK + 1, BLOCK):
        block = data[off : off + BLOCK]
        try:
            stored = int(block[148:156].split(b"\0", 1)[0].strip(b" ") or b"-1", 8)
        except ValueError:
            continue
        if block.count(0) != BLOCK and stored in checksums(block):
            found.append(off)
    return found


def fix_checksum(data: bytearray, off: int = 0) -> None:
    data[off + 148 : off + 156] = b"%06o\0 " % checksums(bytes(data[off : off + BLOCK]))[0]


def mutate(raw: bytes, mutations: list[tuple[object, ...]]) -> bytes:
    data = bytearray(raw)
    for op, *args in mutations:
        headers = _headers(bytes(data))
        if op == "truncate":
            assert isinstance(args[0], float)
            del data[int(len(data) * args[0]) :]
        elif op == "field" and headers:
            where, name, value = args
            assert isinstance(where, float) and isinstance(name, str) and isinstance(value, bytes)
            off = headers[min(int(len(headers) * where), len(headers) - 1)]
            start, size = RAW_FIELDS[name]
            data[off + start : off + start + size] = value[:size].ljust(size, b"\0")
            fix_checksum(data, off)
        elif op == "byte" and data:
            where, value = args
            assert isinstance(where, float) and isinstance(value, int)
            pos = min(int(len(data) * where), len(data) - 1)
            data[pos] = value
            if pos - pos % BLOCK in headers and not 148 <= pos % BLOCK < 156:
                fix_checksum(data, pos - pos % BLOCK)
        elif op == "append":
            assert isinstance(args[0], bytes)
            data += args[0]
        elif op == "drop-end":
            while len(data) >= BLOCK and not any(data[-BLOCK:]):
                del data[-BLOCK:]
    return bytes(data)
