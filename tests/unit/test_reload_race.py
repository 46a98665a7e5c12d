"""A reload racing a removal, forced deterministically on a real Router (engines never started):
the removed model's engine finishes stopping while the reload is inside its one slow step
(sizing the new entries' weights, in a thread). The reload must be decided against what runs
when it is applied: whole, with the name table rebuilt, and saying what it did."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import yaml

from config import load_roster
from router.admin import ActivityLog
from router.admin import reload as reload_module
from router.admin.reload import Reloads
from router.live import Router
from router.scheduling import level1_weights
from tests.support import roster_dict, sim_model


class NoPools:
    def close(self, base_url: str) -> None: ...

    def close_all(self) -> None: ...


def write(path: Path, *names: str) -> None:
    path.write_text(yaml.safe_dump(roster_dict(*(sim_model(n) for n in names))))


@pytest.fixture
async def live(tmp_path):
    """A Router over a roster of `kept` and `gone`, booted as far as a reload cares, with `gone`
    removed by an earlier reload (retiring: its engine has not stopped yet)."""
    roster_path = tmp_path / "roster.yaml"
    write(roster_path, "kept", "gone")
    async with aiohttp.ClientSession() as session:
        roster = load_roster(roster_path)
        router = Router(roster, tmp_path / "engines", session, NoPools(), ActivityLog(roster.activity))
        router.placement.booted = True
        router.placement.retire(router.engines["gone"])
        yield router, roster_path


def retire_completes_during_sizing(router: Router, monkeypatch) -> list[list[str]]:
    """Size weights as the router does, but let the scheduler's retire path finish stopping `gone`
    (and drop it from the router) the first time, while the reload waits for the sizing thread."""
    loop = asyncio.get_running_loop()
    sized: list[list[str]] = []

    def sizing(specs):
        specs = list(specs)
        sized.append([s.name for s in specs])
        if len(sized) == 1:
            gone = router.engines["gone"]
            asyncio.run_coroutine_threadsafe(router.placement._retire(gone), loop).result(timeout=10)
        return level1_weights(specs)

    monkeypatch.setattr(reload_module, "level1_weights", sizing)
    return sized


async def test_a_removal_that_completes_during_the_reload_leaves_the_reload_whole(live, monkeypatch):
    router, roster_path = live
    sized = retire_completes_during_sizing(router, monkeypatch)
    write(roster_path, "kept", "gone", "added")  # `gone` back before it stopped, and a new model

    changes = await Reloads(router).reload("test")

    assert "gone" not in [e.name for e in router.placement.engines if e.retiring], "its retirement did complete"
    assert sized[0] == ["added"] and "gone" in sized[-1], "decided again after the await: gone is now new"
    assert [m.name for m in changes.added] == ["gone", "added"] and changes.revived == ()
    assert changes.summary() == ["+ gone: new; boots in the background", "+ added: new; boots in the background"]
    # Whole: the name table resolves every name of the new roster to an engine the scheduler runs.
    scheduled = {e.name: e for e in router.placement.engines}
    assert {n: e.name for n, e in router.by_name.items()} == {"kept": "kept", "gone": "gone", "added": "added"}
    assert all(scheduled[name] is engine for name, engine in router.by_name.items())
    assert router.engines == scheduled and not router.engines["gone"].retiring
    assert {"gone", "added"} <= router.placement.to_boot
    assert [m.name for m in router.roster.models] == ["kept", "gone", "added"]


async def test_a_reload_that_cannot_be_built_changes_nothing(live, monkeypatch):
    router, roster_path = live
    before = (router.roster, router.keys, dict(router.by_name), dict(router.engines), list(router.placement.engines))
    write(roster_path, "kept", "added")

    def broken(spec):
        raise RuntimeError("cannot build this engine")

    monkeypatch.setattr(router, "new_engine", broken)
    with pytest.raises(RuntimeError):
        await Reloads(router).reload("test")
    after = (router.roster, router.keys, dict(router.by_name), dict(router.engines), list(router.placement.engines))
    assert after == before and router.engines["gone"].retiring, "all or nothing: nothing of the new roster in force"


async def test_re_adding_a_model_still_being_removed_says_it_is_revived(live):
    router, roster_path = live
    write(roster_path, "kept", "gone")
    changes = await Reloads(router).reload("test")
    assert changes.revived == ("gone",) and changes.unchanged == ("kept",) and not changes.empty
    assert changes.summary() == ["+ gone: revived (was being removed); it serves on"]
    assert not router.engines["gone"].retiring and router.by_name["gone"] is router.engines["gone"]
