"""HAProxy's agent-check replies (router.fleet.agent): ready where a model is awake, drain on the primary
line where it is not, a weight from the wake estimate on the backup line, down where it cannot serve."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engines.states import State
from router.fleet.agent import reply, wake_weight
from router.scheduling.estimates import WakeCosts


def node(agent_key=None, **engines: State) -> SimpleNamespace:
    costs = WakeCosts()
    costs.observe_boot("cold", 20.0)
    costs.observe_wake("cheap", 1, 0.25)
    costs.observe_wake("dear", 2, 9.0)
    by_name = {name: SimpleNamespace(name=name, state=state, retiring=False, sleep_level=2 if name == "dear" else 1)
               for name, state in engines.items()}
    return SimpleNamespace(by_name=by_name, virtuals=(), draining=False, placement=SimpleNamespace(costs=costs),
                           roster=SimpleNamespace(node=SimpleNamespace(agent_key=agent_key)))


def words(text: str) -> list[str]:
    return text.partition("#")[0].split()


def percent(text: str) -> int:
    return int(next(w for w in words(text) if w.endswith("%"))[:-1])


def test_an_awake_model_is_ready_on_both_lines():
    n = node(shared=State.AWAKE)
    assert words(reply(n, "shared")) == ["up", "ready", "100%"]
    assert words(reply(n, "shared backup\n")) == ["up", "ready", "100%"]


@pytest.mark.parametrize("state", [State.SLEEPING, State.WAKING, State.VERIFYING, State.DRAINING, State.BOOTING, State.COLD])
def test_a_model_not_awake_drains_its_primary_line_and_offers_its_backup_line(state):
    n = node(cheap=state)
    assert "drain" in words(reply(n, "cheap")) and "ready" not in words(reply(n, "cheap"))
    assert "ready" in words(reply(n, "cheap backup")) and 1 <= percent(reply(n, "cheap backup")) <= 100


def test_the_cheaper_wake_weighs_more_on_the_backup_line():
    n = node(cheap=State.SLEEPING, dear=State.SLEEPING, cold=State.COLD)
    cheap, dear, cold = (percent(reply(n, f"{m} backup")) for m in ("cheap", "dear", "cold"))
    assert cheap > dear > cold >= 1
    assert cheap >= 9 * dear // 2  # 0.25 s against 9 s: far apart, not a coin toss


@pytest.mark.parametrize("line", ["nobody", "nobody backup", "", "shared backup extra", "shared primary", "x" * 600])
def test_a_model_not_served_here_or_a_line_not_understood_is_down(line):
    assert words(reply(node(shared=State.AWAKE), line))[0] == "down"


def test_a_failed_or_retiring_model_is_down_and_a_draining_node_drains():
    n = node(broken=State.FAILED, gone=State.AWAKE, shared=State.AWAKE)
    n.by_name["gone"].retiring = True
    assert words(reply(n, "broken backup")) == ["down"] and words(reply(n, "gone")) == ["down"]
    n.draining = True
    assert words(reply(n, "shared")) == ["drain"] and words(reply(n, "shared backup")) == ["drain"]


def test_the_weight_falls_with_the_wake_time_and_stays_in_haproxys_range():
    assert wake_weight(0) == 100 and wake_weight(1) == 50 and wake_weight(10**6) == 1 and wake_weight(-1) == 100
    assert [wake_weight(s) for s in (0.1, 0.5, 2, 5, 30)] == sorted([wake_weight(s) for s in (0.1, 0.5, 2, 5, 30)], reverse=True)


@pytest.mark.parametrize("line", ["shared", "shared backup", "wrong-key shared", "k3y-0f-the-front2 shared", "shared k3y-0f-the-front",
                                  "", "x" * 600])
def test_with_an_agent_key_a_line_without_it_is_answered_as_a_name_not_served_here(line):
    n = node(agent_key="k3y-0f-the-front", shared=State.AWAKE)
    assert reply(n, line) == reply(n, "k3y-0f-the-front nobody") == "down #not served on this node"


def test_with_an_agent_key_the_fronts_line_carries_it_before_the_model():
    n = node(agent_key="k3y-0f-the-front", shared=State.AWAKE, cheap=State.SLEEPING)
    assert words(reply(n, "k3y-0f-the-front shared\n")) == ["up", "ready", "100%"]
    assert words(reply(n, "k3y-0f-the-front cheap")) == ["up", "drain"]
    assert "ready" in words(reply(n, "k3y-0f-the-front cheap backup"))
    assert reply(n, "k3y-0f-the-front cheap primary") == "down #expected '<key> <model>' or '<key> <model> backup'"


def test_a_virtual_name_is_answered_for_the_member_a_request_now_would_go_to():
    n = node(cheap=State.SLEEPING, awake=State.AWAKE)
    class Virtuals:
        def __contains__(self, name):
            return name == "chat"

        def pick(self, name, scheduler):
            return n.by_name[self.member]

    n.virtuals = Virtuals()
    n.virtuals.member = "awake"
    assert words(reply(n, "chat")) == ["up", "ready", "100%"]
    n.virtuals.member = "cheap"
    assert words(reply(n, "chat backup")) == ["up", "ready", f"{wake_weight(0.25)}%"]
    assert reply(n, "chat-other") == "down #not served on this node"
