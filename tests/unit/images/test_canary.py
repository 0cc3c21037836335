"""The canary residue scanner on synthetic trees (no mounts, no daemon)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dsec.errors import InvalidRequest
from dsec.images.canary import REDACTED, CanarySet, VerdictCache, residue_error, scan_tree, stream_has
from dsec.protocol.residue import check_canaries

CANARY = "CANARY-7f3a9c1e"


def _scan(root: Path, *canaries: str, block: int = 1 << 20) -> list[tuple[str, str]]:
    report = scan_tree(root, CanarySet.of(canaries or (CANARY,)), block=block)
    return [(h.path, h.where) for h in report.hits]


def test_clean_tree_has_no_hits(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f.txt").write_text("nothing to see " * 1000)
    os.symlink("/usr/bin/python3", tmp_path / "link")
    assert _scan(tmp_path) == []


def test_found_in_contents_names_symlinks_and_xattrs(tmp_path: Path) -> None:
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "deep" / "er" / "answers.txt").write_bytes(b"x" * 5000 + CANARY.encode() + b"y")
    (tmp_path / f"key-{CANARY}").write_text("harmless")
    os.symlink(f"/opt/{CANARY}", tmp_path / "pointer")
    (tmp_path / "attr").write_text("harmless")
    os.setxattr(tmp_path / "attr", "user.note", CANARY.encode())
    hits = _scan(tmp_path)
    assert ("/deep/er/answers.txt", "content") in hits
    assert (f"/key-{REDACTED}", "name") in hits
    assert ("/pointer", "symlink") in hits
    assert ("/attr", "xattr") in hits
    assert len(hits) == 4
    assert not any(CANARY in p for p, _ in hits), "a report must never echo the canary"


@pytest.mark.parametrize("offset", [0, 1, 5, 9, 14, 15])
def test_match_across_a_read_boundary(tmp_path: Path, offset: int) -> None:
    """Blocks of 16 bytes: the canary starts anywhere in a block and crosses into the next."""
    data = b"a" * (16 * 3 + offset) + CANARY.encode() + b"b" * 40
    (tmp_path / "f").write_bytes(data)
    assert _scan(tmp_path, block=16) == [("/f", "content")]
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert stream_has(fd, CanarySet.of([CANARY]), block=7)[0]
    finally:
        os.close(fd)


def test_near_miss_is_not_a_hit(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"z" * 31 + CANARY[:-1].encode() + b"z" * 31)
    assert _scan(tmp_path, block=16) == []


def test_whiteout_name_and_several_canaries(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a whiteout (character device 0/0) needs root")
    os.mknod(tmp_path / f"gone-{CANARY}", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    (tmp_path / "other").write_text("second-canary-value")
    hits = _scan(tmp_path, CANARY, "second-canary-value")
    assert hits == [(f"/gone-{REDACTED}", "name"), ("/other", "content")]


def test_hard_links_are_read_once(tmp_path: Path) -> None:
    (tmp_path / "a").write_text(CANARY)
    os.link(tmp_path / "a", tmp_path / "b")
    report = scan_tree(tmp_path, CanarySet.of([CANARY]))
    assert report.files == 1 and len(report.hits) == 1


def test_canary_validation() -> None:
    assert check_canaries(["abcdefgh", "abcdefgh"]) == ["abcdefgh"]
    for bad in (["short"], [""], ["x" * 5000], ["with\0nul"]):
        with pytest.raises(InvalidRequest):
            check_canaries(bad)
    with pytest.raises(InvalidRequest):
        check_canaries([f"canary-{i:04d}" for i in range(300)])


def test_error_names_layer_and_paths_not_the_canary(tmp_path: Path) -> None:
    (tmp_path / f"{CANARY}.txt").write_text(CANARY)
    report = scan_tree(tmp_path, CanarySet.of([CANARY]))
    err = residue_error("ab" * 32, report.hits)
    assert "ab" * 32 in err.message and REDACTED in err.message
    assert CANARY not in err.message and CANARY not in str(err.detail)
    assert err.http_status == 422


def test_verdict_cache_is_keyed_by_canary_set_and_survives_restart(tmp_path: Path) -> None:
    digest = "0f" * 32
    one, two = CanarySet.of(["canary-one-1"]), CanarySet.of(["canary-two-2"])
    cache = VerdictCache(tmp_path / "c")
    assert cache.get(digest, one) is None
    cache.put(digest, one, [])
    assert cache.get(digest, one) == [] and cache.get(digest, two) is None
    again = VerdictCache(tmp_path / "c")
    assert again.get(digest, one) == []
    assert not any("canary-one-1" in p.read_text(errors="replace") for p in (tmp_path / "c").iterdir())
    assert not any(b"canary-one-1" in p.name.encode() for p in (tmp_path / "c").iterdir())
    assert cache.get("../../etc/passwd", one) is None
    with pytest.raises(InvalidRequest):
        cache.put("../../etc/passwd", one, [])
