"""Staged weights in the scheduler (issue 32, part 1): what a staged Level-2 wake is predicted to cost,
and which checkpoints are staged when, within host.page_cache_budget_gb. Fake engines, a fake clock and
a fake engine client whose stage answers at once."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from engines.engine import State
from engines.waking.stage import Stager
from engines.vllm import EngineTimeout
from router.scheduling.estimates import WakeCosts
from tests.unit.test_scheduler import Clock, FakeEngine, awake, clock, scheduler  # noqa: F401 (clock: the fixture)

STAGED = {"files": 2, "bytes": 4_000_000_000, "read_bytes": 4_000_000_000, "seconds": 0.5, "resident_before": 0.0}


class StagingClient:
    """What a stage asks of an engine: collective_rpc hotswap_stage_weights, answered as the extension answers."""

    def __init__(self, answer: dict[str, Any] = STAGED):
        self.answer = answer
        self.calls = 0
        self.looks = 0  # the calls with read=False: mincore only, nothing read

    async def collective_rpc(self, method: str, timeout: float, args=(), kwargs=None) -> list[Any]:
        assert method == "hotswap_stage_weights"
        if kwargs == {"read": False}:
            self.looks += 1
            return [{**self.answer, "read_bytes": 0}]
        assert not kwargs, kwargs
        self.calls += 1
        return [dict(self.answer)]


class HeldStagingClient(StagingClient):
    """A stage that reads until the test lets it finish."""

    def __init__(self, answer: dict[str, Any] = STAGED):
        super().__init__(answer)
        self.release = asyncio.Event()

    async def collective_rpc(self, method: str, timeout: float, args=(), kwargs=None) -> list[Any]:
        await self.release.wait()
        return await super().collective_rpc(method, timeout, args, kwargs)


def stages(engine: FakeEngine, answer: dict[str, Any] = STAGED) -> FakeEngine:
    """The engine loads the worker extension (as the router composes it for a Level-2 sleeper)."""
    engine.stager = Stager(engine.name, enabled=True)
    engine.client = StagingClient(answer)
    return engine


def demand(s, name: str, requests: int, clock: Clock) -> None:
    for _ in range(requests):
        s.demand.arrived(name, clock.now)


async def settle(*engines: FakeEngine) -> None:
    await asyncio.gather(*(e.stager.task for e in engines if e.stager.task is not None))


async def staged_ahead_once(s, engine: FakeEngine, clock: Clock) -> None:
    """A 1 GB sleeper asked for 3 times, within a 10 GB host.page_cache_budget_gb: staged ahead once, to its end."""
    s.weights[engine.name] = 1.0
    s.capacity = dataclasses.replace(s.capacity, page_cache_gb=10.0)
    demand(s, engine.name, 3, clock)
    s.stage_ahead(clock.now)
    await settle(engine)


# -- the estimate -------------------------------------------------------------------------------------

def test_a_staged_level2_wake_is_priced_from_the_page_cache_rate_measured_on_any_model():
    costs = WakeCosts({"big": 20.0, "small": 2.0})
    # small's wake read the disk (its stage failed): 10 s, 8 of them the reload, 4 s per GB
    costs.observe_wake("small", 2, 10.0, reload_s=8.0, cached=False)
    # big woke after a stage: its reload read the page cache at 0.2 s per GB
    costs.observe_wake("big", 2, 12.0, reload_s=4.0, stage_s=5.0, cached=True)
    assert costs.reload_s_per_gb == {False: pytest.approx(4.0), True: pytest.approx(0.2)}
    unstaged, staged = costs.wake_s("small", 2), costs.wake_s("small", 2, staged=True)
    assert unstaged == pytest.approx(10.0)
    assert staged == pytest.approx(2.0 + 2.0 * 0.2), "its wake without the reload, plus 2 GB at the page cache's rate"
    assert costs.wake_s("small", 1) == pytest.approx(2.0), "Level 1 still falls back to the wake without its reload"


def test_a_measured_staged_wake_replaces_the_formula_and_never_prices_above_the_unstaged_one():
    costs = WakeCosts({"m": 4.0})
    costs.observe_wake("m", 2, 9.0, reload_s=6.0, cached=True)
    costs.observe_wake("m", 2, 3.5, reload_s=1.0, staged=True, cached=True)
    assert costs.staged_wake == {"m": 3.5} and costs.wake[("m", 2)] == 9.0, "a staged wake is kept apart"
    assert costs.wake_s("m", 2, staged=True) == pytest.approx(3.5)
    costs.observe_wake("m", 2, 30.0, reload_s=1.0, staged=True, cached=True)  # a stall, once
    assert costs.wake_s("m", 2, staged=True) <= costs.wake_s("m", 2)


def test_before_any_staged_reload_is_measured_a_staged_wake_costs_what_an_unstaged_one_does():
    costs = WakeCosts({"m": 4.0})
    costs.observe_wake("m", 2, 9.0, reload_s=6.0)
    assert costs.wake_s("m", 2, staged=True) == costs.wake_s("m", 2) == pytest.approx(9.0)


# -- the policy ---------------------------------------------------------------------------------------

async def test_the_target_of_a_wake_stages_while_its_victims_drain_and_sleep_budget_or_not(clock):
    a, b = awake("a", clock), stages(FakeEngine("b"))
    s = scheduler(a, b, clock=clock)
    s.making_room["b"] = (["a"], clock.now)  # decide chose to park a for b
    s.stage_ahead(clock.now)
    assert b.stager.running and b.stager.why == "room"
    await settle(b)
    assert b.stager.staged and b.client.calls == 1
    s.weights["b"] = 8.0
    s.capacity = dataclasses.replace(s.capacity, page_cache_gb=4.0)  # host.page_cache_budget_gb below b's checkpoint
    s.stage_ahead(clock.now)
    assert b.stager.staged, "staged for its wake, budget or not: not taken as evicted while its room is made"


async def test_a_target_whose_victim_sleeps_sooner_than_its_staged_reload_is_not_staged_for_its_wake(clock):
    # b's staged reload was measured at 0.5 s per GB: 8 s for its 16 GB. Idle a sleeps in 1 s, so a stage
    # begun now would still be reading when b's reload starts, which waits for it, then reads the page cache.
    a, b = awake("a", clock), stages(FakeEngine("b"))
    s = scheduler(a, b, clock=clock)
    s.weights["b"] = 16.0
    s.costs.observe_wake("b", 2, 12.0, reload_s=8.0, stage_s=3.0, cached=True)
    s.costs.observe_sleep("a", 1.0, busy_drain_s=20.0)
    s.making_room["b"] = (["a"], clock.now)
    s.stage_ahead(clock.now)
    assert not b.stager.running and b.client.calls == 0, "its reload reads the disk itself"
    del s.making_room["b"]
    s.stage_ahead(clock.now)
    # The next room made for b: a is serving, and its drains have lasted 20 s, longer than the staged reload.
    a.in_flight = 2
    clock.now += 60
    s.making_room["b"] = (["a"], clock.now)
    s.stage_ahead(clock.now)
    assert b.stager.running and b.stager.why == "room", "a's drain and sleep cover the stage's read"


async def test_a_wake_with_no_stage_running_only_looks_and_its_reload_is_priced_at_what_it_found():
    cold = {**STAGED, "resident_before": 0.0}
    b = stages(FakeEngine("b"), cold)
    assert await b.stager.step(b.client, 5.0), "a look is a stage step that worked"
    assert (b.client.looks, b.client.calls) == (1, 0), "nothing read: the reload reads the disk itself"
    assert not b.stager.found_resident and b.stager.cached is False and not b.stager.staged
    b.client.answer = {**STAGED, "resident_before": 1.0}  # evicted nothing since it was last read
    assert await b.stager.step(b.client, 5.0)
    assert b.stager.found_resident and b.stager.cached is True
    b.client.answer = {**STAGED, "resident_before": 0.5}  # half there: neither rate's sample
    await b.stager.step(b.client, 5.0)
    assert not b.stager.found_resident and b.stager.cached is None
    # A stage running when the wake reaches the step is joined: the reload would wait for it anyway.
    b.client.answer = cold
    b.stager.begin(b.client, 5.0, "ahead")
    assert await b.stager.step(b.client, 5.0)
    assert (b.client.looks, b.client.calls) == (3, 1) and b.stager.cached is True and not b.stager.found_resident


async def test_within_the_budget_the_likeliest_level2_sleepers_are_staged_one_at_a_time(clock):
    hot, warm, small, idle = (stages(FakeEngine(n)) for n in ("hot", "warm", "small", "idle"))
    s = scheduler(hot, warm, small, idle, clock=clock)
    s.weights.update(hot=8.0, warm=4.0, small=2.0, idle=1.0)
    s.capacity = dataclasses.replace(s.capacity, page_cache_gb=10.0)  # host.page_cache_budget_gb: 10
    demand(s, "hot", 10, clock), demand(s, "warm", 5, clock), demand(s, "small", 1, clock)
    s.stage_ahead(clock.now)
    assert [e.name for e in (hot, warm, small, idle) if e.stager.running] == ["hot"], "the likeliest first, alone"
    await settle(hot)
    s.stage_ahead(clock.now)
    assert not warm.stager.running, "warm does not fit beside hot (8 + 4 > 10)"
    assert small.stager.running, "small does (8 + 2)"
    await settle(small)
    s.stage_ahead(clock.now)
    assert not any(e.stager.running for e in (hot, warm, small, idle)), "idle was never asked for: not staged"
    assert [e.name for e in (hot, warm, small, idle) if e.stager.staged] == ["hot", "small"]


async def test_a_staged_checkpoint_that_later_reads_pushed_past_the_budget_is_staged_again_ahead_of_its_wake(clock):
    # The page cache keeps 100 GB of checkpoints. hot (60 GB) is staged; then big wakes from Level 2 and
    # its reload reads 64 GB: hot's pages are the oldest, and the kernel drops them first. Left as it is,
    # hot's wake would find them gone and read its disk.
    hot, cool = stages(FakeEngine("hot")), stages(FakeEngine("cool"))
    big = awake("big", clock)
    big.stager = Stager("big", enabled=True)
    s = scheduler(hot, cool, big, clock=clock)
    s.weights.update(hot=60.0, cool=30.0, big=64.0)
    s.capacity = dataclasses.replace(s.capacity, page_cache_gb=100.0)  # host.page_cache_budget_gb: 100
    demand(s, "hot", 10, clock), demand(s, "cool", 2, clock)
    s.stage_ahead(clock.now)
    await settle(hot)
    s.stage_ahead(clock.now)
    await settle(cool)
    assert hot.stager.staged and cool.stager.staged and hot.client.calls == cool.client.calls == 1, "60 + 30 fit in 100"
    big.stager.reloaded()  # its wake read its checkpoint: 64 GB, newest
    s.stage_ahead(clock.now)
    assert cool.stager.staged, "64 + 30: cool, read after hot, is kept"
    assert hot.stager.running and hot.stager.why == "ahead", "hot, read first, is dropped first: read again, ahead of its wake"
    await settle(hot)
    s.stage_ahead(clock.now)
    assert cool.stager.running, "hot's read dropped cool's pages (60 + 64 + 30 > 100): cool is read again"
    await settle(cool)
    s.stage_ahead(clock.now)
    assert hot.stager.staged and cool.stager.staged and not any(e.stager.running for e in (hot, cool))
    assert hot.client.calls == cool.client.calls == 2, "the sleepers' checkpoints stay; big's, awake, is what the kernel drops"


async def test_nothing_is_staged_ahead_without_a_budget_or_while_a_wake_reads_the_disk(clock):
    hot, other = stages(FakeEngine("hot")), stages(FakeEngine("other", level=2))
    s = scheduler(hot, other, clock=clock)
    s.weights.update(hot=8.0, other=1.0)
    demand(s, "hot", 10, clock)
    s.stage_ahead(clock.now)
    assert not hot.stager.running, "host.page_cache_budget_gb unset: nothing ahead of need"
    s.capacity = dataclasses.replace(s.capacity, page_cache_gb=10.0)  # host.page_cache_budget_gb: 10
    s.doing["other"] = ("wake", clock.now, 5.0)
    s.stage_ahead(clock.now)
    assert not hot.stager.running, "a wake's reload has the disk"
    del s.doing["other"]
    s.stage_ahead(clock.now)
    assert hot.stager.running
    await settle(hot)


async def test_a_sleeper_whose_stage_failed_is_not_staged_again_ahead_of_its_next_wake(clock):
    broken = stages(FakeEngine("broken"), {"files": 0, "bytes": 0, "read_bytes": 0, "seconds": 0.0, "resident_before": 1.0,
                                           "reason": "ShardedStateLoader does not read checkpoint files vLLM's default way"})
    s = scheduler(broken, clock=clock)
    await staged_ahead_once(s, broken, clock)
    assert not broken.stager.staged and "ShardedStateLoader" in broken.stager.failure
    s.stage_ahead(clock.now)
    assert not broken.stager.running and broken.client.calls == 1


class OnceTimedOutStagingClient(StagingClient):
    """An engine whose first stage ran out of time (a disk busy with another reload), and answers since."""

    async def collective_rpc(self, method: str, timeout: float, args=(), kwargs=None) -> list[Any]:
        if self.calls + self.looks == 0:
            self.calls += 1
            raise EngineTimeout("POST /collective_rpc", f"no answer within {timeout:.3g} s")
        return await super().collective_rpc(method, timeout, args, kwargs)


async def test_a_sleeper_whose_stage_failed_once_is_staged_ahead_again_once_its_wake_found_staging_works(clock):
    sleeper = stages(FakeEngine("sleeper"))
    sleeper.client = OnceTimedOutStagingClient()
    s = scheduler(sleeper, clock=clock)
    await staged_ahead_once(s, sleeper, clock)
    assert sleeper.stager.failure and not sleeper.stager.staged
    s.stage_ahead(clock.now)
    assert not sleeper.stager.running, "a failed one waits for its next wake"
    # Its wake: the stage step looks (mincore), and the extension answers; the reload reads the disk.
    assert await sleeper.stager.step(sleeper.client, 5.0)
    sleeper.stager.reloaded()
    assert sleeper.stager.failure is None, "the wake's own stage step worked: staging does"
    # Parked at Level 2 again, still asked for: staged ahead of its next wake, as before the timeout.
    clock.now += 60
    s.stage_ahead(clock.now)
    assert sleeper.stager.running and sleeper.stager.why == "ahead"
    await settle(sleeper)
    assert sleeper.stager.staged and sleeper.client.calls == 2


async def test_a_level1_sleeper_or_an_engine_without_the_extension_is_never_staged(clock):
    level1 = stages(FakeEngine("level1", level=1))
    plain = FakeEngine("plain")  # no worker extension: its stager is off
    s = scheduler(level1, plain, clock=clock)
    s.weights.update(level1=1.0, plain=1.0)
    s.capacity = dataclasses.replace(s.capacity, page_cache_gb=10.0)  # host.page_cache_budget_gb: 10
    demand(s, "level1", 3, clock), demand(s, "plain", 3, clock)
    s.making_room["plain"] = ([], clock.now)
    s.stage_ahead(clock.now)
    assert not level1.stager.running and not plain.stager.running and plain.state is State.SLEEPING


async def test_the_scheduler_predicts_a_staged_targets_wake_from_the_staged_estimate(clock):
    a, b = awake("a", clock), stages(FakeEngine("b"))
    s = scheduler(a, b, clock=clock)
    s.weights["b"] = 2.0
    s.costs.observe_wake("b", 2, 10.0, reload_s=8.0, cached=False)
    s.costs.observe_wake("b", 2, 3.0, reload_s=0.5, staged=True, cached=True)
    assert s.wake_estimate_s(b, 2) == pytest.approx(10.0), "not staged yet"
    s.making_room["b"] = (["a"], clock.now)
    s.stage_ahead(clock.now)
    await settle(b)
    assert s.wake_estimate_s(b, 2) == pytest.approx(3.0)


async def test_a_wake_that_will_join_a_stage_still_reading_is_predicted_at_the_staged_wake_plus_the_read_left(clock):
    # b's checkpoint is 2 GB; the disk was measured at 4 s per GB (a cold reload), a staged wake at 3 s.
    a, b = awake("a", clock), stages(FakeEngine("b"))
    b.client = HeldStagingClient()
    s = scheduler(a, b, clock=clock)
    s.weights["b"] = 2.0
    s.costs.observe_wake("b", 2, 10.0, reload_s=8.0, cached=False)
    s.costs.observe_wake("b", 2, 3.0, reload_s=0.5, staged=True, cached=True)
    s.making_room["b"] = (["a"], clock.now)
    s.stage_ahead(clock.now)
    assert b.stager.running
    assert s.wake_estimate_s(b, 2) == pytest.approx(3.0 + 8.0), "the whole read is still to come"
    clock.now += 5.0
    assert s.wake_estimate_s(b, 2) == pytest.approx(3.0 + 3.0)
    clock.now += 10.0
    assert s.wake_estimate_s(b, 2) == pytest.approx(3.0), "a stage past its expected read: the staged wake alone"
    b.client.release.set()
    await settle(b)
    assert s.wake_estimate_s(b, 2) == pytest.approx(3.0)


async def test_a_failed_stage_for_a_target_is_not_retried_while_its_room_is_made_but_is_for_the_next_room(clock):
    a = awake("a", clock)
    b = stages(FakeEngine("b"), {"files": 0, "bytes": 0, "read_bytes": 0, "seconds": 0.0, "resident_before": 1.0,
                                 "reason": "no weight files"})
    s = scheduler(a, b, clock=clock)
    s.making_room["b"] = (["a"], clock.now)
    s.stage_ahead(clock.now)
    await settle(b)
    for _ in range(3):  # the loop goes round while a drains and sleeps: the stage's end pokes it
        s.stage_ahead(clock.now)
    assert b.client.calls == 1, "the wake's own stage step is the retry"
    del s.making_room["b"]
    s.stage_ahead(clock.now)
    clock.now += 60
    s.making_room["b"] = (["a"], clock.now)
    s.stage_ahead(clock.now)
    await settle(b)
    assert b.client.calls == 2


def test_a_model_only_ever_woken_staged_is_predicted_from_that_not_from_its_boot():
    costs = WakeCosts({"m": 4.0})
    costs.observe_boot("m", 40.0)
    costs.observe_wake("m", 2, 3.0, reload_s=1.0, staged=True, cached=True)
    assert costs.wake_s("m", 2) == pytest.approx(3.0), "every room made for it staged it in time"


async def test_parking_at_level2_costs_less_where_the_page_cache_budget_will_keep_the_checkpoint_staged(clock):
    victim = stages(awake("victim", clock, sleep_level=2))
    s = scheduler(victim, clock=clock)
    s.weights.update(victim=2.0, other=2.0)
    s.costs.observe_wake("victim", 2, 10.0, reload_s=8.0, cached=False)
    s.costs.observe_wake("other", 2, 3.0, reload_s=1.0, cached=True)  # the page cache's rate, host-wide: 0.5 s/GB
    demand(s, "victim", 5, clock)
    without = s.expected_cost(victim, "park", clock.now)
    s.capacity = dataclasses.replace(s.capacity, page_cache_gb=4.0)
    with_budget = s.expected_cost(victim, "park", clock.now)
    assert with_budget < without / 2, (with_budget, without)
    s.capacity = dataclasses.replace(s.capacity, page_cache_gb=1.0)
    assert s.expected_cost(victim, "park", clock.now) == pytest.approx(without), "2 GB does not fit a 1 GB budget"


async def test_stopping_a_level2_sleeper_the_budget_keeps_staged_costs_its_boot_beyond_a_staged_wake(clock):
    # Just woken and parked again, its checkpoint is not staged this moment, but the staging ahead will
    # stage it: not stopping it leaves a staged wake (1 s), not a cold-disk one as slow as the boot.
    sleeper = stages(FakeEngine("sleeper", share=0.3))
    s = scheduler(sleeper, clock=clock)
    s.weights.update(sleeper=2.0)
    s.costs.observe_boot("sleeper", 10.0)
    s.costs.observe_wake("sleeper", 2, 9.0, reload_s=8.0, cached=False)
    s.costs.observe_wake("sleeper", 2, 1.0, reload_s=0.5, staged=True, cached=True)
    demand(s, "sleeper", 5, clock)
    assert not sleeper.stager.staged
    reuse = s._reuse(sleeper, clock.now, s.swap.demand_tau_s)  # a stop's boot is paid whenever it is next asked for
    s.capacity = dataclasses.replace(s.capacity, page_cache_gb=4.0)
    assert s.expected_cost(sleeper, "stop", clock.now) == pytest.approx(
        reuse * (s.waited(sleeper, 10.0, clock.now) - s.waited(sleeper, 1.0, clock.now)), rel=1e-3)
    s.capacity = dataclasses.replace(s.capacity, page_cache_gb=1.0)
    assert s.expected_cost(sleeper, "stop", clock.now) == pytest.approx(
        reuse * (s.waited(sleeper, 10.0, clock.now) - s.waited(sleeper, 9.0, clock.now)), rel=1e-3), \
        "2 GB does not fit a 1 GB budget: its next wake reads the disk"
