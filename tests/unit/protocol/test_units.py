from __future__ import annotations

import pytest

from dsec.units import format_size, parse_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (1, 1),
        (4096, 4096),
        ("0", 0),
        ("123", 123),
        ("123b", 123),
        ("512Mi", 512 << 20),
        ("512mi", 512 << 20),
        ("512MiB", 512 << 20),
        ("2G", 2_000_000_000),
        ("2GB", 2_000_000_000),
        ("2Gi", 2 << 30),
        ("1k", 1000),
        ("1Ki", 1024),
        ("1KiB", 1024),
        ("3M", 3_000_000),
        ("1T", 1000**4),
        ("1Ti", 1 << 40),
        ("1.5Ki", 1536),
        ("0.5Gi", 512 << 20),
        ("  64 Mi  ", 64 << 20),
    ],
)
def test_parse_size_accepts(value: int | str, expected: int) -> None:
    assert parse_size(value) == expected
    assert isinstance(parse_size(value), int)


@pytest.mark.parametrize(
    "value",
    [
        -1,
        True,
        False,
        "",
        "   ",
        "-1",
        "-5Mi",
        "Mi",
        "abc",
        "12 34",
        "1.2.3M",
        "5 Xi",
        "5Zi",
        "5 megabytes",
        "1e3",
        "0x10",
    ],
)
def test_parse_size_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_size(value)  # type: ignore[arg-type]


def test_parse_size_messages_name_the_problem() -> None:
    with pytest.raises(ValueError, match="negative"):
        parse_size(-3)
    with pytest.raises(ValueError, match="unknown size unit 'Xi'"):
        parse_size("5Xi")
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size("lots")


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0"),
        (1, "1"),
        (1000, "1000"),
        (1023, "1023"),
        (1024, "1Ki"),
        (1536, "1536"),
        (3 * 1024, "3Ki"),
        (512 << 20, "512Mi"),
        ((1 << 20) + 1024, "1025Ki"),
        (1 << 30, "1Gi"),
        (5 << 30, "5Gi"),
        (1 << 40, "1024Gi"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1536, 512 << 20, (1 << 20) + 1024, 7 << 30])
def test_format_then_parse_round_trips(n: int) -> None:
    assert parse_size(format_size(n)) == n
