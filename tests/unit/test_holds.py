"""A model held for a trial (router.keys.Holds): only its token passes, a renewal keeps it, and it lapses by itself."""

import pytest

from router.keys import HeldElsewhere, Holds
from tests.unit.test_scheduler import Clock


def test_a_hold_lets_only_its_token_through_until_it_lapses_unless_renewed():
    clock = Clock()
    holds = Holds(clock)
    token = holds.take("chat", 60)
    assert holds.remaining("chat") == 60 and holds.remaining("chat", "guess") == 60
    assert holds.remaining("chat", token) is None and holds.remaining("other") is None
    with pytest.raises(HeldElsewhere, match="held by another trial for 60 s more"):
        holds.take("chat", 60)
    clock.now += 50
    assert holds.take("chat", 60, token) == token  # renewed: 60 s from now
    clock.now += 59
    assert holds.remaining("chat") == pytest.approx(1)
    clock.now += 1
    assert holds.remaining("chat") is None  # lapsed: its holder stopped renewing it


def test_a_hold_is_released_only_by_its_token():
    holds = Holds(Clock())
    token = holds.take("chat", 60)
    assert not holds.release("chat", "guess") and holds.remaining("chat") is not None
    assert holds.release("chat", token) and holds.remaining("chat") is None
