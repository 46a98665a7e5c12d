"""A drain's deadline cuts every request still holding a lease, including one that starts using
its lease while the others are being cut, and waits until the leases are back."""

from __future__ import annotations

import asyncio

from engines.leases import Leases


async def test_cut_all_cuts_every_holder_even_one_that_starts_during_the_cut():
    leases = Leases("a")
    cut: list[str] = []
    later: list[asyncio.Task[None]] = []

    async def request(name: str, started: asyncio.Event, on_cut=None) -> None:
        done = asyncio.Event()
        try:
            def stop(why: str) -> None:
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
