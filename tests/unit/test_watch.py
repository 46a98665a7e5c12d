"""The mid-life acceptance watch over a fake engine whose counters the test moves: no processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from config.schema import Gate, Swap
from engines import watch
from engines.engine import State
from engines.gate import GateRecord


class FakeClient:
    def __init__(self) -> None:
        self.drafts = 0.0
        self.accepted = 0.0

    def serve(self, drafts: float, accepted: float) -> None:
        self.drafts += drafts
        self.accepted += accepted

    async def metrics(self, timeout: float) -> str:
        return (f"vllm:spec_decode_num_drafts_total {self.drafts}\n"
                f"vllm:spec_decode_num_accepted_tokens_total {self.accepted}\n")


def fake_engine(on_midlife: str = "restart") -> SimpleNamespace:
    gate = Gate(on_midlife=on_midlife, midlife_window_s=3600, midlife_min_drafts=100)
    collapses: list[str] = []
    record = GateRecord(gate)
    record.baseline = SimpleNamespace(mal=3.0)  # the cold-boot canary's acceptance
    return SimpleNamespace(
        name="a", state=State.AWAKE, has_draft=True, gate=record, client=FakeClient(), swap=Swap(),
        observer=SimpleNamespace(midlife_collapse=lambda engine, mal, reason: collapses.append(reason)), collapses=collapses,
    )


async def test_a_collapse_asks_for_a_restart_once():
    engine = fake_engine()
    await watch.acceptance(engine)
    engine.client.serve(drafts=200, accepted=0)  # every draft token rejected
    await watch.acceptance(engine)
    assert engine.gate.needs_restart and "the draft model looks lost" in engine.gate.needs_restart
    assert engine.gate.observed_mal == pytest.approx(1.0) and len(engine.collapses) == 1
    engine.client.serve(drafts=200, accepted=0)
    await watch.acceptance(engine)
    assert len(engine.collapses) == 1, "one collapse, one alert"


async def test_a_pending_restart_is_dropped_when_acceptance_recovers_before_it_starts():
    engine = fake_engine()
    await watch.acceptance(engine)
    engine.client.serve(drafts=200, accepted=0)
    await watch.acceptance(engine)
    assert engine.gate.needs_restart
    engine.client.serve(drafts=10_000, accepted=20_000)  # the window's MAL is back near 3
    await watch.acceptance(engine)
    assert engine.gate.needs_restart is None and not engine.gate.midlife.collapsed
    assert engine.gate.midlife.last_collapse is not None, "what happened stays visible"


async def test_with_on_midlife_log_a_collapse_is_flagged_but_nothing_restarts():
    engine = fake_engine(on_midlife="log")
    await watch.acceptance(engine)
    engine.client.serve(drafts=200, accepted=0)
    await watch.acceptance(engine)
    assert engine.gate.midlife.collapsed and engine.collapses and engine.gate.needs_restart is None


async def test_an_engine_that_is_not_serving_is_not_scraped():
    engine = fake_engine()
    engine.state = State.SLEEPING
    engine.client = None  # any scrape would fail
    await watch.acceptance(engine)
