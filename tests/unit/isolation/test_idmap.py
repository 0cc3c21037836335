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


def test_take_is_the_lowest_free_slot_after_any_sequence() -> None:
    import random

    rng = random.Random(7)
    slots, model = UidSlots(), set()
    for _ in range(3000):
        if model and rng.random() < 0.4:
            slot = rng.choice(sorted(model))
            model.discard(slot)
            slots.release(FIRST_BASE + slot * RANGE)
        elif rng.random() < 0.1:
            slot = rng.randrange(0, 400)
            model.add(slot)
            slots.mark(FIRST_BASE + slot * RANGE)
        else:
            expected = min(set(range(len(model) + 1)) - model)
            assert slots.take() == FIRST_BASE + expected * RANGE
            model.add(expected)
