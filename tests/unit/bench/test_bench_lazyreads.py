"""`dsec bench lazy-reads`' pure parts: the layer tree it generates, and the figures and target its JSON
carries (ratios within a round, so a noisy neighbour slowing one round does not move the figure)."""

from __future__ import annotations

import json
from pathlib import Path

from dsec_bench.lazyreads import BIG_SHARE, PATHS, make_tree, summarize_rounds, verdict


def test_the_tree_has_the_size_asked_for_in_big_and_small_files(tmp_path: Path) -> None:
    files = make_tree(tmp_path / "a", 3 * 10**6)
    sizes = {p: p.stat().st_size for p in (tmp_path / "a").rglob("*") if p.is_file()}
    assert len(sizes) == files and sum(sizes.values()) == 3 * 10**6
    big = sum(s for p, s in sizes.items() if "big" in p.parts)
    assert big == int(3 * 10**6 * BIG_SHARE)
    assert max(s for p, s in sizes.items() if "small" in p.parts) <= 64 << 10
    make_tree(tmp_path / "b", 3 * 10**6)  # the same seed: the same bytes
    assert (tmp_path / "a/big/f00000").read_bytes() == (tmp_path / "b/big/f00000").read_bytes()


def test_the_summary_has_medians_and_per_round_ratios_to_local() -> None:
    rounds = [
        {"lazy": 900.0, "local": 1000.0, "fuse": 400.0, "local_again": 1000.0},
        {"lazy": 450.0, "local": 500.0, "fuse": 250.0, "local_again": 600.0},  # a slow round: all slower
        {"lazy": 1100.0, "local": 1000.0, "fuse": 500.0, "local_again": 900.0},
    ]
    s = summarize_rounds(rounds)
    assert s["rounds"] == 3 and set(s["mb_s"]) == set(PATHS)
    assert s["mb_s"]["local"] == {"median": 1000.0, "min": 500.0, "max": 1000.0}
    assert s["ratios"]["lazy_over_local_per_round"] == [0.9, 0.9, 1.1]
    assert s["ratios"]["lazy_over_local"] == 0.9
    assert s["ratios"]["lazy_over_local_of_medians"] == 0.9
    assert s["ratios"]["fuse_over_local"] == 0.5
    assert s["ratios"]["local_again_over_local_per_round"] == [1.0, 1.2, 0.9]
    assert "local_over_local" not in s["ratios"]
    assert verdict(s) == {"cold lazy reads >= 0.9x local EROFS": True}
    json.dumps(s)  # what the bench writes


def test_the_target_is_missed_below_nine_tenths_and_without_a_lazy_figure() -> None:
    slow = summarize_rounds([{"lazy": 400.0, "local": 1000.0, "fuse": 300.0}])
    assert verdict(slow) == {"cold lazy reads >= 0.9x local EROFS": False}
    no_lazy = summarize_rounds([{"local": 1000.0, "fuse": 300.0}])
    assert set(no_lazy["mb_s"]) == {"local", "fuse"}
    assert verdict(no_lazy) == {"cold lazy reads >= 0.9x local EROFS": False}
