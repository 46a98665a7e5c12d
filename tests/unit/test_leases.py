"""A drain's deadline cuts every request still holding a lease, including one that starts using
its lease while the others are being cut, and waits until the leases are back. The mean time a
lease is held (Little's law, for a virtual model's `balance`) follows the engine's recent requests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engines import leases as leases_module
from engines.leases import Leases


async def test_cut_all_cuts_every_holder_even_one_that_starts_during_the_cut():
    leases = Leases("a", lambda: 300.0)
    cut: list[str] = []
    later: list[asyncio.Task[None]] = []

    async def request(name: str, started: asyncio.Event, on_cut=None) -> None:
        done = asyncio.Event()
        try:
            def stop(why: str, reason: str) -> None:
                cut.append(name)
                done.set()
                if on_cut:
                    on_cut()
            with leases.cuttable(stop):
                started.set()
                await done.wait()  # a request that would otherwise never end
        finally:
            leases.give_back()

    def grant_another() -> None:  # granted now; its request starts using the lease a loop turn later
        leases.take()
        later.append(asyncio.create_task(request("late", asyncio.Event())))

    started = asyncio.Event()
    leases.take()
    running = asyncio.create_task(request("running", started, grant_another))
    await started.wait()
    await asyncio.wait_for(leases.cut_all("the drain ran out"), 5)
    assert cut == ["running", "late"] and leases.count == 0
    await asyncio.gather(running, *later)


def test_the_mean_time_held_is_the_recent_requests_when_their_length_changes(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(leases_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    tau = [1000.0]
    leases = Leases("a", lambda: tau[0])
    assert leases.mean_held_s is None, "nothing given back yet: nothing says how long a request holds it"

    def requests(n: int, each_s: float, in_flight: int) -> None:
        for _ in range(n):  # `in_flight` at a time, each held `each_s`
            for _ in range(in_flight):
                leases.take()
            now[0] += each_s
            for _ in range(in_flight):
                leases.give_back()

    # A lease's time is weighed along its life and its return at its end: the mean reads S/2τ low.
    requests(50, 10.0, 2)  # long generations, two at a time, for 500 s
    assert leases.mean_held_s == pytest.approx(10.0, rel=0.01)
    requests(1000, 1.0, 4)  # then short ones, for 1000 s: one tau
    assert 1.0 < leases.mean_held_s < 1.15, "the long ones' weight decayed by e (a lifetime mean reads 1.22)"
    requests(10_000, 1.0, 4)  # ten tau later, the long ones are forgotten
    assert leases.mean_held_s == pytest.approx(1.0, rel=1e-3)
    tau[0] = 1e9  # a reload that sets swap.demand_tau_s is read at the next change
    requests(10, 1.0, 1)
    assert leases.mean_held_s == pytest.approx(1.0, rel=1e-3)
