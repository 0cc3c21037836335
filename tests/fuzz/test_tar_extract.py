"""Fuzzing the layer extractor (images/tar_extract.py): whatever the archive, it extracts or raises
InvalidRequest, writes nothing outside its destination, leaves only what overlayfs understands, and
takes no more disk than the archive holds data (a page per entry aside)."""

from __future__ import annotations

import io
import os
import re
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dsec.errors import InvalidRequest
from dsec.images import tar_extract
from dsec.images.tar_extract import MAX_SKIPPED, ExtractStats, extract_tar

from .archives import Member, Recipe, build, fix_checksum, recipes
from .budget import bounded_file_size, bounded_memory, fuzz, outcome
from .fsguard import allocated, fuzz_root, snapshot, strange_entries

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="extraction needs root: mknod whiteouts, chown, xattrs")
PAGE = 4096


def extract_contained(archive: Callable[[Path], bytes]) -> ExtractStats | None:
    """Extract ``archive(root)`` in a watched scratch tree; the stats, or None if it was refused."""
    with fuzz_root() as (top, dest):
        data = archive(top)
        before = snapshot(top, skip=dest)
        stats: ExtractStats | None = None
        try:
            with bounded_memory(), bounded_file_size():
                stats = extract_tar(io.BytesIO(data), dest, label="layer 1")
            outcome(f"extracted {stats.files + stats.dirs + stats.symlinks + stats.hardlinks + stats.whiteouts}")
        except InvalidRequest as e:
            outcome("refused: " + re.sub(r"'.*'|\d+", "_", str(e).partition(": ")[2])[:50])
        assert snapshot(top, skip=dest) == before, "the extraction changed something outside its destination"
        assert strange_entries(dest) == []
        used, entries = allocated(dest)
        assert used <= len(data) + PAGE * (entries + 1), f"{used} bytes of disk from a {len(data)}-byte archive"
    check_stats(stats)
    return stats


def check_stats(stats: ExtractStats | None) -> None:
    if stats is None:
        return
    counts = (stats.files, stats.dirs, stats.symlinks, stats.hardlinks, stats.whiteouts, stats.opaque_dirs)
    assert min(counts) >= 0 and stats.bytes >= 0
    assert len(stats.skipped) <= MAX_SKIPPED + 1


def gnu_sparse(realsize: int, *, extended: bool = False) -> bytes:
    """A GNU sparse member with no data regions: ``realsize`` bytes of hole; ``extended`` says an
    extension block of the map follows (none does)."""
    ti = tarfile.TarInfo("f")
    ti.type = tarfile.GNUTYPE_SPARSE
    header = bytearray(ti.tobuf(tarfile.GNU_FORMAT))
    header[482] = extended
    header[483:495] = b"%011o\0" % realsize
    fix_checksum(header)
    return bytes(header) + bytes(1024)


MTIME_INF = Recipe([Member(tarfile.REGTYPE, "f", pax={"mtime": "inf"})])
MTIME_NAN_DIR = Recipe([Member(tarfile.DIRTYPE, "d", pax={"mtime": "nan"})])


@fuzz(800)
@given(recipe=recipes())
# a PAX mtime of inf or nan escaped as OverflowError / ValueError from setting the times
@example(recipe=MTIME_INF)
@example(recipe=MTIME_NAN_DIR)
def test_any_archive_is_extracted_inside_its_destination_or_refused(recipe: Recipe) -> None:
    extract_contained(lambda top: build(recipe, str(top)))


@fuzz(150)
@given(data=st.binary(max_size=4096))
# a GNU sparse header whose map continues in an extension block the archive ends before: tarfile's
# IndexError escaped
@example(data=gnu_sparse(4096, extended=True)[:512])
# 1.5 KB claiming an 8 GiB file of holes: every hole was written out as zeros
@example(data=gnu_sparse(8 << 30))
def test_arbitrary_bytes_are_extracted_or_refused(data: bytes) -> None:
    extract_contained(lambda _: data)


def test_a_sparse_file_is_extracted_sparse() -> None:
    stats = extract_contained(lambda _: gnu_sparse(128 << 20))
    assert stats is not None and stats.files == 1 and stats.bytes == 0


class Endless:
    """A tar stream: ``head``, then ``filler`` repeated up to ``total`` bytes."""

    def __init__(self, head: bytes, filler: bytes, total: int) -> None:
        self.buf = io.BytesIO(head)
        self.filler = filler
        self.left = total - len(head)

    def read(self, size: int = -1, /) -> bytes:
        data = self.buf.read(size)
        if data or self.left <= 0:
            return data
        n = min(size, self.left) // len(self.filler) + 1
        self.left -= n * len(self.filler)
        return self.filler * n


def test_a_sparse_map_longer_than_the_header_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # GNU sparse 1.0 keeps the map in the member's data, as many lines as its first line says; tarfile
    # reads them all into a list before the member is returned: 16 MiB of gzip-compressed layer made
    # it read gigabytes of lines into memory
    monkeypatch.setattr(tar_extract, "MAX_READ", 1 << 20)
    ti = tarfile.TarInfo("f")
    ti.size = 1 << 30
    ti.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": "10"}
    head = ti.tobuf(tarfile.PAX_FORMAT) + b"999999999\n"
    with fuzz_root() as (_, dest), bounded_memory(256 << 20):
        with pytest.raises(InvalidRequest, match="headers are over"):
            extract_tar(Endless(head, b"1\n", 4 << 20), dest, label="layer 1")
