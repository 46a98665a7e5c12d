"""A wait's parts (router.scheduling.history.WaitParts): the stretches of one reason per model, cut per waiter."""

from __future__ import annotations

from router.admin.activity import held_parts
from router.scheduling.history import WaitParts


def test_a_waiters_parts_are_the_stretches_of_its_own_wait_and_a_reason_is_noted_once_per_stretch():
    parts = WaitParts()
    parts.arrived("b", 10.0, first=True)
    assert parts.note("b", "min_active", 10.01) is True
    assert parts.note("b", "min_active", 10.5) is False  # the next look of the loop: the same hold, said once
    parts.arrived("b", 11.0, first=False)  # a second waiter joins during the hold
    assert parts.note("b", "swap", 11.8) is True
    swap, held, held_s = parts.parts("b", 10.0, 11.9)
    assert round(swap, 3) == 0.1 and held == "queue=0.010,min_active=1.790" and round(held_s, 3) == 1.8
    swap, held, held_s = parts.parts("b", 11.0, 11.9)  # the later waiter: only its own share of the hold
    assert round(swap, 3) == 0.1 and held == "min_active=0.800"
    assert held_parts(held) == {"min_active": 0.8} and held_parts(None) is None


def test_a_new_wait_does_not_inherit_the_reasons_of_the_last_one():
    parts = WaitParts()
    parts.arrived("b", 0.0, first=True)
    parts.note("b", "max_hold", 0.0)
    parts.note("b", "swap", 5.0)
    parts.arrived("b", 100.0, first=True)  # the queue had emptied
    parts.note("b", "swap", 100.002)
    swap, held, held_s = parts.parts("b", 100.0, 100.5)
    assert round(swap, 3) == 0.498 and held is None and held_s == 0.0  # the 2 ms before its first look: loop latency


def test_a_wait_that_begins_while_its_own_engine_wakes_or_parks_says_so_from_its_first_moment():
    parts = WaitParts()
    parts.arrived("b", 0.0, first=True, doing="wake")  # woken ahead: the loop does not look at it until the wake ends
    assert parts.parts("b", 0.0, 0.4) == (0.4, None, 0.0)
    parts.arrived("b", 10.0, first=True, doing="park")
    parts.note("b", "swap", 10.3)
    swap, held, _ = parts.parts("b", 10.0, 10.5)
    assert held == "parking=0.300" and round(swap, 3) == 0.2
    assert parts.now("b") == {"reason": "swap", "why": ""}
