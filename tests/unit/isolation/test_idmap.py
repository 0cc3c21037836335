from __future__ import annotations

import pytest

from dsec.isolation.idmap import FIRST_BASE, RANGE, UidSlots


def test_slots_are_distinct_reused_and_marked() -> None:
    slots = UidSlots()
    a, b = slots.take(), slots.take()
    assert (a, b) == (FIRST_BASE, FIRST_BASE + RANGE)
    slots.release(a)
    assert slots.take() == a
    slots.mark(FIRST_BASE + 2 * RANGE)  # re-adopted after a restart
    assert slots.take() == FIRST_BASE + 3 * RANGE


def test_ranges_stay_below_2_32() -> None:
    slots = UidSlots()
    slots._taken = set(range(10**6))
    with pytest.raises(OSError):
        slots.take()
