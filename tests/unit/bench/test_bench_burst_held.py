"""The burst bench's comparison of rates with sandboxes held."""

from __future__ import annotations

from dsec_bench.burst import Measured, held_targets


def level(rate: float | None) -> dict[str, Measured]:
    return {"individual": Measured([], [], {"creations_per_s": rate})}


def test_one_level_sets_no_target() -> None:
    assert held_targets({0: level(50.0)}, "individual") == {}


def test_the_most_held_is_compared_with_the_fewest() -> None:
    met = held_targets({0: level(50.0), 1000: level(10.0), 3000: level(41.0)}, "individual")
    assert met == {"rate with 3000 held >= 80% of the rate with 0 held": True}
    missed = held_targets({0: level(50.0), 3000: level(39.0)}, "individual")
    assert list(missed.values()) == [False]


def test_a_level_without_a_rate_misses() -> None:
    assert list(held_targets({0: level(None), 3000: level(41.0)}, "individual").values()) == [False]
    assert list(held_targets({0: level(50.0), 3000: level(None)}, "individual").values()) == [False]
