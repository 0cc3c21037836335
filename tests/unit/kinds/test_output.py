from __future__ import annotations

import random

import pytest

from dsec.kinds.output import CappedBuffer, StreamForwarder


def expected(data: bytes, limit: int) -> bytes:
    """What a CappedBuffer of ``limit`` must return after seeing ``data``."""
    if len(data) <= limit:
        return data
    head = limit // 2
    tail = limit - head
    dropped = len(data) - head - tail
    marker = f"\n[... {dropped} bytes truncated by dsec ...]\n".encode()
    return data[:head] + marker + (data[-tail:] if tail else b"")


def fed(limit: int, *chunks: bytes) -> CappedBuffer:
    buf = CappedBuffer(limit)
    for c in chunks:
        buf.feed(c)
    return buf


# ---- CappedBuffer ------------------------------------------------------------------------------------


def test_empty_buffer() -> None:
    buf = CappedBuffer(10)
    assert buf.getvalue() == b""
    assert buf.text() == ""
    assert buf.total == 0
    assert not buf.truncated


def test_under_limit_keeps_everything_without_marker() -> None:
    buf = fed(10, b"abc", b"", b"de")
    assert buf.getvalue() == b"abcde"
    assert buf.total == 5
    assert not buf.truncated
    assert b"truncated" not in buf.getvalue()


def test_exactly_at_limit_is_not_truncated() -> None:
    buf = fed(10, b"0123456789")
    assert buf.getvalue() == b"0123456789"
    assert buf.total == 10
    assert not buf.truncated
    assert b"truncated" not in buf.getvalue()


def test_exactly_at_limit_in_small_pieces() -> None:
    buf = fed(10, *[bytes([c]) for c in b"0123456789"])
    assert buf.getvalue() == b"0123456789"
    assert not buf.truncated


def test_one_over_limit_drops_one_byte_from_the_middle() -> None:
    buf = fed(10, b"0123456789A")
    assert buf.truncated
    assert buf.total == 11
    assert bytes(buf.head) == b"01234"
    assert bytes(buf.tail) == b"6789A"
    assert buf.getvalue() == b"01234\n[... 1 bytes truncated by dsec ...]\n6789A"


def test_head_and_tail_kept_middle_counted() -> None:
    data = b"H" * 100 + b"m" * 10_000 + b"T" * 100
    buf = fed(200, data)
    value = buf.getvalue()
    assert value.startswith(b"H" * 100 + b"\n[... ")
    assert value.endswith(b" ...]\n" + b"T" * 100)
    assert b"[... 10000 bytes truncated by dsec ...]" in value
    assert buf.total == len(data)
    assert buf.truncated


def test_odd_limit_gives_the_extra_byte_to_the_tail() -> None:
    buf = fed(11, b"abcdefghijklmnop")
    assert len(buf.head) == 5
    assert len(buf.tail) == 6
    assert buf.getvalue() == expected(b"abcdefghijklmnop", 11)


def test_limit_one_keeps_only_the_last_byte() -> None:
    buf = fed(1, b"abc", b"d")
    assert buf.getvalue() == b"\n[... 3 bytes truncated by dsec ...]\nd"


def test_chunk_larger_than_tail_replaces_the_tail() -> None:
    buf = fed(10, b"01234", b"abc", b"XXXXXXXXXXYYYYY")
    assert bytes(buf.head) == b"01234"
    assert bytes(buf.tail) == b"YYYYY"
    assert buf.total == 23


def test_chunk_straddling_head_and_tail() -> None:
    buf = fed(10, b"012", b"3456789AB")
    assert bytes(buf.head) == b"01234"
    assert bytes(buf.tail) == b"789AB"
    assert buf.getvalue() == expected(b"0123456789AB", 10)


@pytest.mark.parametrize("limit", [1, 2, 3, 10, 11, 64, 1024])
@pytest.mark.parametrize("size", [0, 1, 5, 10, 11, 63, 64, 65, 1000, 5000])
def test_any_chunking_gives_the_same_result(limit: int, size: int) -> None:
    rng = random.Random(limit * 10_007 + size)
    data = bytes(rng.randrange(256) for _ in range(size))
    chunks = []
    i = 0
    while i < len(data):
        n = rng.randint(1, 50)
        chunks.append(data[i : i + n])
        i += n
    buf = fed(limit, *chunks)
    assert buf.getvalue() == expected(data, limit)
    assert buf.total == size
    assert buf.truncated == (size > limit)
    assert (b"bytes truncated by dsec" in buf.getvalue()) == (size > limit)


def test_text_decodes_with_replacement() -> None:
    buf = fed(100, "héllo ".encode(), b"\xff")
    assert buf.text() == "héllo \ufffd"


def test_zero_limit_keeps_nothing_but_the_marker() -> None:
    buf = fed(0, b"abc")
    assert buf.getvalue() == b"\n[... 3 bytes truncated by dsec ...]\n"


# ---- StreamForwarder ---------------------------------------------------------------------------------


def test_forwarder_passes_text_through() -> None:
    fw = StreamForwarder(100)
    assert fw.take(b"hello ") == "hello "
    assert fw.take(b"world") == "world"
    assert fw.sent == 11


def test_forwarder_empty_chunk_is_none() -> None:
    assert StreamForwarder(10).take(b"") is None


def test_forwarder_budget_cuts_and_then_stops() -> None:
    fw = StreamForwarder(5)
    assert fw.take(b"hello world") == "hello"
    assert fw.sent == 5
    assert fw.take(b"more") is None
    assert fw.sent == 5


def test_forwarder_budget_across_chunks() -> None:
    fw = StreamForwarder(8)
    assert fw.take(b"abcde") == "abcde"
    assert fw.take(b"fghij") == "fgh"
    assert fw.take(b"k") is None


def test_forwarder_two_byte_char_split_across_chunks() -> None:
    fw = StreamForwarder(100)
    assert fw.take(b"a\xc3") == "a"
    assert fw.take(b"\xa9b") == "éb"


@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_forwarder_multibyte_char_one_byte_at_a_time(char: str) -> None:
    fw = StreamForwarder(100)
    raw = char.encode()
    pieces = [fw.take(raw[i : i + 1]) for i in range(len(raw))]
    assert pieces[:-1] == [None] * (len(raw) - 1)
    assert pieces[-1] == char


def test_forwarder_arbitrary_splits_reassemble() -> None:
    text = "naïve café — 日本語 😀 done"
    raw = text.encode()
    rng = random.Random(7)
    for _ in range(20):
        fw = StreamForwarder(1 << 20)
        out = []
        i = 0
        while i < len(raw):
            n = rng.randint(1, 4)
            piece = fw.take(raw[i : i + n])
            if piece is not None:
                out.append(piece)
            i += n
        assert "".join(out) == text


def test_forwarder_budget_counts_bytes_not_characters() -> None:
    fw = StreamForwarder(4)
    assert fw.take("ééé".encode()) == "éé"
    assert fw.take("é".encode()) is None


def test_forwarder_budget_ending_mid_character_never_emits_half_a_character() -> None:
    fw = StreamForwarder(2)
    assert fw.take("a€".encode()) == "a"
    assert fw.take(b"zzz") is None


def test_forwarder_invalid_utf8_is_replaced() -> None:
    fw = StreamForwarder(100)
    assert fw.take(b"ok\xffok") == "ok\ufffdok"
