"""Boot while serving: each engine serves as soon as it has booted and recorded its baseline,
while the others still boot. A request for a model not booted yet moves its boot to the front;
engines on different GPUs boot at once, on one GPU one at a time (vLLM sizes its KV cache from
what moves on the device while it boots)."""

from __future__ import annotations

import re

from tests.support import RouterProcess, ask, client, eventually, roster_dict, sim_model


def booting(name: str, seconds: float, share: float = 0.3, **extra) -> dict:
    return sim_model(name, args=("--sim-boot-s", str(seconds), "--gpu-memory-utilization", str(share)), **extra)


def log_order(router: RouterProcess, *lines: str) -> list[int]:
    """Where each line first appears in the router's log (-1: not yet)."""
    log = router.log()
    return [log.find(line) for line in lines]


async def test_a_request_for_a_booted_model_is_answered_while_a_slow_one_still_boots(start_router):
    router = await start_router(roster_dict(booting("alpha", 0.5), booting("beta", 60), queue={"max_wait_s": 10},
                                            swap={"boot_timeout_s": 120}), booted=False)
    assert await ask(client(router), "alpha"), "sent while alpha boots too: it waits for alpha's boot only"
    assert (await router.engine("beta"))["state"] == "booting", "beta is still booting: alpha did not wait for it"
    status = await router.status()
    assert status["ready"] and not status["booted"], "/ready as soon as one engine serves; booted once all have"


async def test_a_request_for_a_model_not_booted_yet_moves_its_boot_to_the_front(start_router):
    router = await start_router(roster_dict(booting("first", 3), booting("second", 3), booting("asked", 0)),
                                booted=False, timeout_s=60)
    await eventually(lambda: router.log().find("booting first (1/3)") >= 0, timeout=10, what="first booting")
    assert await ask(client(router), "asked"), "answered once first's boot ended, before second's"
    first, asked, second = log_order(router, "booting first (1/3)", "booting asked (2/3)", "booting second (3/3)")
    assert -1 < first < asked, router.log()
    assert second == -1 or asked < second, "second boots after the model someone asked for"
    await router.wait_ready(60)


async def test_engines_on_different_gpus_boot_at_once_and_on_one_gpu_one_after_the_other(start_router):
    router = await start_router(roster_dict(booting("a0", 2, devices=[0]), booting("b0", 2, devices=[0]),
                                            booting("a1", 2, devices=[1])), booted=False, timeout_s=60)
    await router.wait_ready(60)
    events = [m.group(0) for m in re.finditer(r"booting \w+ \(|\w+ booted in", router.log())]
    assert events.index("booting a1 (") < events.index("a0 booted in"), f"GPU 1 boots beside GPU 0: {events}"
    assert events.index("a0 booted in") < events.index("booting b0 ("), f"GPU 0 boots one at a time: {events}"


async def test_a_router_whose_port_was_taken_before_it_bound_it_starts_again_on_another(start_router, monkeypatch):
    """The tests' own harness (tests.support.RouterProcess): parallel workers pick free ports at once, and one
    may take the port another just picked for its router. That router starts again, once, on another port."""
    import socket

    import tests.support

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # bound, not listening: the router cannot bind it, and a probe of it is refused
    port = taken.getsockname()[1]
    picks = iter([port])
    real = tests.support.free_port
    monkeypatch.setattr(tests.support, "free_port", lambda: next(picks, None) or real())
    with taken:
        router = await start_router(roster_dict(booting("alpha", 0)))
    assert router.port_retries == 1 and router.port != port
    assert "address already in use" in router.log() and await ask(client(router), "alpha")
