"""Host-side validation of uploaded archives (isolation/tarcheck.py): hostile archives first."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from dsec.errors import InvalidRequest, LimitExceeded
from dsec.isolation import tarcheck
from dsec.isolation.tarcheck import check_tar, check_upload

MiB = 1 << 20


def _tar(*members: tuple[tarfile.TarInfo, bytes | None], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _entry(name: str, kind: bytes, link: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info, None


def _raw_header(name: bytes, kind: bytes = b"0", size: int = 0, link: bytes = b"") -> bytes:
    """A ustar header written by hand, for what tarfile refuses to write."""
    h = bytearray(512)
    h[0 : len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = f"{size:011o}\0".encode()
    h[136:148] = b"00000000000\0"
    h[156:157] = kind
    h[157 : 157 + len(link)] = link
    h[257:263] = b"ustar\0"
    h[263:265] = b"00"
    h[148:156] = b" " * 8
    h[148:156] = f"{sum(h):06o}\0 ".encode()
    return bytes(h)


def _raw_archive(*headers_and_data: bytes) -> bytes:
    return b"".join(headers_and_data) + b"\0" * 1024


def test_an_ordinary_archive_passes_unchanged() -> None:
    data = _tar(
        _entry("./", tarfile.DIRTYPE),
        _entry("./src", tarfile.DIRTYPE),
        _file("./src/a.py", b"print(1)\n"),
        _entry("./src/link", tarfile.SYMTYPE, "a.py"),
        _entry("./src/up", tarfile.SYMTYPE, "../src/a.py"),
        _entry("./hard", tarfile.LNKTYPE, "src/a.py"),
        _file("x" * 150 + "/long-name", b"y" * 1000),  # GNU long name
    )
    assert check_upload(data, 10 * MiB) is data
    summary = check_tar(data, 10 * MiB)
    assert summary.entries == 7 and summary.file_bytes == 1009


def test_pax_archives_pass() -> None:
    data = _tar(_file("d/" + "é" * 120, b"z"), fmt=tarfile.PAX_FORMAT)
    assert check_tar(data, MiB).entries == 1


@pytest.mark.parametrize(
    ("member", "words"),
    [
        (_file("/etc/passwd"), "absolute path"),
        (_file("../escape"), r"'\.\.'"),
        (_file("a/../../escape"), r"'\.\.'"),
        (_file("ok/../x"), r"'\.\.'"),
        (_entry("dev", tarfile.CHRTYPE), "character device"),
        (_entry("blk", tarfile.BLKTYPE), "block device"),
        (_entry("fifo", tarfile.FIFOTYPE), "FIFO"),
        (_entry("l", tarfile.SYMTYPE, "/etc"), "leaves the destination"),
        (_entry("l", tarfile.SYMTYPE, ".."), "leaves the destination"),
        (_entry("a/b/l", tarfile.SYMTYPE, "../../../x"), "leaves the destination"),
        (_entry("l", tarfile.SYMTYPE, ""), "without a target"),
        (_entry("h", tarfile.LNKTYPE, "/etc/shadow"), "leaves the destination"),
        (_entry("h", tarfile.LNKTYPE, "../../etc/shadow"), "leaves the destination"),
        (_entry("s", b"S"), "not accepted"),
        (_file("./"), "destination itself"),
    ],
)
def test_hostile_entries_are_refused_by_name(member: tuple[tarfile.TarInfo, bytes | None], words: str) -> None:
    data = _tar(_file("fine"), member)
    with pytest.raises(InvalidRequest, match=words) as exc:
        check_upload(data, MiB)
    assert not isinstance(exc.value, LimitExceeded)
    assert repr(member[0].name)[:30] in str(exc.value) or member[0].name == "./"


def test_writing_through_an_archived_symlink_is_refused() -> None:
    # each entry is harmless on its own; together "d/l/l2 -> .." would land above the destination
    data = _tar(
        _entry("d", tarfile.DIRTYPE),
        _entry("d/l", tarfile.SYMTYPE, ".."),
        _entry("d/l/l2", tarfile.SYMTYPE, ".."),
    )
    with pytest.raises(InvalidRequest, match="through a symlink"):
        check_tar(data, MiB)
    replace = _tar(_entry("l", tarfile.SYMTYPE, "sub"), _file("l", b"over"))
    with pytest.raises(InvalidRequest, match="replaces a symlink"):
        check_tar(replace, MiB)


def test_nul_bytes_inside_names_are_refused() -> None:
    # "safe\0/../../etc/x": readers that stop at the NUL and readers that do not disagree
    data = _raw_archive(_raw_header(b"safe\0/../../etc/x", size=0))
    with pytest.raises(InvalidRequest, match="NUL byte"):
        check_tar(data, MiB)
    link = _raw_archive(_raw_header(b"l", kind=b"2", link=b"ok\0/etc/shadow"))
    with pytest.raises(InvalidRequest, match="NUL byte"):
        check_tar(link, MiB)
    long_name = tarfile.TarInfo("././@LongLink")
    long_name.type = tarfile.GNUTYPE_LONGNAME
    payload = b"a\0../../../etc/x\0"
    long_name.size = len(payload)
    with pytest.raises(InvalidRequest, match="NUL byte"):
        check_tar(_tar((long_name, payload), _file("short")), MiB)


def test_pax_paths_are_checked_not_the_ustar_name() -> None:
    info = tarfile.TarInfo("x")
    info.pax_headers = {"path": "../../outside"}
    with pytest.raises(InvalidRequest, match=r"'\.\.'"):
        check_tar(_tar((info, None), fmt=tarfile.PAX_FORMAT), MiB)


def test_links_and_directories_with_data_are_refused() -> None:
    data = _raw_archive(_raw_header(b"d/", kind=b"5", size=512), b"\0" * 512)
    with pytest.raises(InvalidRequest, match="with a size"):
        check_tar(data, MiB)


def test_garbage_and_truncation_are_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"checksum|truncated"):
        check_upload(b"this is not a tar archive" * 40, MiB)
    with pytest.raises(InvalidRequest, match="truncated"):
        check_upload(b"abc", MiB)
    whole = _tar(_file("big", b"q" * 5000))
    with pytest.raises(InvalidRequest, match="ends inside"):
        check_tar(whole[:2048], MiB)
    corrupt = bytearray(whole)
    corrupt[10] ^= 0xFF
    with pytest.raises(InvalidRequest, match="checksum"):
        check_tar(bytes(corrupt), MiB)


def test_total_size_is_bounded_by_the_disk_limit() -> None:
    data = _tar(_file("a", b"x" * 600_000), _file("b", b"x" * 600_000))
    assert check_tar(data, 2 * MiB).file_bytes == 1_200_000
    with pytest.raises(LimitExceeded, match="disk limit") as exc:
        check_upload(data, MiB)
    assert "'b'" in str(exc.value)


def test_a_lying_size_field_cannot_claim_more_than_the_disk() -> None:
    # a header claiming 1 TiB of data (base-256) without carrying it: refused for the size before the data
    h = bytearray(_raw_header(b"huge", size=0))
    h[124:136] = b"\x80" + (1 << 40).to_bytes(11, "big")
    h[148:156] = b" " * 8
    h[148:156] = f"{sum(h):06o}\0 ".encode()
    with pytest.raises(LimitExceeded):
        check_tar(_raw_archive(bytes(h)), 16 * MiB)


def test_entry_count_is_bounded() -> None:
    data = _tar(*(_entry(f"d{i}", tarfile.DIRTYPE) for i in range(50)))
    assert check_tar(data, MiB, max_entries=50).entries == 50
    with pytest.raises(LimitExceeded, match="more than 49 entries"):
        check_upload(data, MiB, max_entries=49)


def test_gzip_is_unpacked_and_checked() -> None:
    plain = _tar(_file("a.txt", b"hello"))
    assert check_upload(gzip.compress(plain), MiB) == plain
    # two concatenated members are one archive, as gzip -d reads them
    two = gzip.compress(plain[:1024]) + gzip.compress(plain[1024:])
    assert check_upload(two, MiB) == plain
    hostile = gzip.compress(_tar(_file("../x")))
    with pytest.raises(InvalidRequest, match=r"'\.\.'"):
        check_upload(hostile, MiB)
    with pytest.raises(InvalidRequest, match=r"truncated|corrupt"):
        check_upload(gzip.compress(plain)[:-12], MiB)


def test_a_gzip_bomb_is_refused_by_its_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tarcheck, "RATIO_FLOOR", 1 << 16)
    bomb = gzip.compress(_tar(_file("zeros", b"\0" * (8 * MiB))), compresslevel=9)
    assert len(bomb) < 64 << 10
    with pytest.raises(LimitExceeded, match="unpacks to more than"):
        check_upload(bomb, 1 << 30)


def test_other_compressions_are_refused_clearly() -> None:
    import bz2
    import lzma

    plain = _tar(_file("a"))
    for packed, name in ((bz2.compress(plain), "bzip2"), (lzma.compress(plain), "xz")):
        with pytest.raises(InvalidRequest, match=name):
            check_upload(packed, MiB)


def test_long_names_are_truncated_in_messages() -> None:
    data = _tar(_file("/" + "a" * 5000))
    with pytest.raises(InvalidRequest) as exc:
        check_upload(data, MiB)
    assert len(str(exc.value)) < 400
