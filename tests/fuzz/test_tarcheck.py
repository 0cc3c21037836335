"""Fuzzing the upload check (isolation/tarcheck.py): whatever the bytes, it hands on a tar or refuses
with InvalidRequest / LimitExceeded, and an archive it hands on, unpacked by the sandboxes' own
unpacker (busybox tar, as the container kind runs it), writes nothing outside the destination."""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.errors import InvalidRequest, LimitExceeded
from dsec.isolation.tarcheck import check_upload

from .archives import Recipe, build, recipes
from .budget import bounded_memory, fuzz, outcome
from .fsguard import fuzz_root, snapshot

BUSYBOX = shutil.which("busybox")
DISK = 1 << 20


def checked(data: bytes, max_bytes: int = DISK) -> bytes | None:
    try:
        with bounded_memory():
            plain = check_upload(data, max_bytes, max_entries=64)
    except (InvalidRequest, LimitExceeded) as e:
        outcome(f"{type(e).__name__}: " + re.sub(r"'.*'|\d+", "_", str(e))[:50])
        return None
    outcome("accepted")
    return plain


def unpack_contained(plain: bytes, top: Path, dest: Path) -> None:
    assert BUSYBOX is not None
    before = snapshot(top, skip=dest)
    subprocess.run(
        [BUSYBOX, "tar", "-x", "-o", "-f", "-", "-C", str(dest)], input=plain, capture_output=True, timeout=30
    )  # its exit status does not matter: where it wrote does
    assert snapshot(top, skip=dest) == before, "an accepted archive unpacked outside its destination"


@pytest.mark.skipif(BUSYBOX is None, reason="busybox (the sandboxes' unpacker) is not installed")
@fuzz(500)
@given(recipe=recipes(), compress=st.sampled_from(["none"] * 4 + ["gzip", "gzip", "gzip+junk"]))
def test_an_accepted_archive_unpacks_inside_its_destination(recipe: Recipe, compress: str) -> None:
    with fuzz_root() as (top, dest):
        data = build(recipe, str(top))
        if compress != "none":
            data = gzip.compress(data) + (b"\0" * 10 + b"junk" if compress == "gzip+junk" else b"")
        plain = checked(data)
        if plain is not None:
            assert not plain.startswith(b"\x1f\x8b")
            unpack_contained(plain, top, dest)


@fuzz(200)
@given(data=st.one_of(st.binary(max_size=2048), st.binary(max_size=512).map(gzip.compress)))
def test_arbitrary_bytes_are_accepted_or_refused(data: bytes) -> None:
    checked(data)


@fuzz(60)
@given(size=st.integers(0, 64 << 20), members=st.integers(1, 3))
def test_gzip_bombs_are_refused_within_bounds(size: int, members: int) -> None:
    # highly compressible input (zeros): the check decompresses with a bounded output size
    bomb = gzip.compress(bytes(size), compresslevel=1) * members
    plain = checked(bomb, max_bytes=1 << 40)
    assert plain is None or len(plain) <= max(16 << 20, 100 * len(bomb))
