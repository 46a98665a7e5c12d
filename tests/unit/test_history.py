"""The router's recent history (router.scheduling.History): bounded by time and by count, and /ui's
pictures drawn from it (router.admin.pictures): well-formed SVG, every name escaped."""

from __future__ import annotations

from xml.etree import ElementTree

from router.admin import pictures
from router.admin.timeline import window
from router.scheduling import History, SwapRecord
from router.scheduling import history as history_module


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_an_engine_lane_is_contiguous_intervals_with_the_open_one_last_and_sleeping_split_by_level():
    clock = Clock()
    h = History(clock)
    for state, level in (("cold", None), ("booting", None), ("awake", None), ("draining", None), ("sleeping", 1),
                         ("waking", None), ("verifying", None), ("awake", None), ("draining", None), ("sleeping", 2)):
        h.state("a", state, level)
        clock.now += 10
    lane = h.window(30)["engines"]["a"]
    assert [pictures.lane_state(i) for i in lane] == ["cold", "booting", "awake", "draining", "sleeping L1", "waking",
                                                      "verifying", "awake", "draining", "sleeping L2"]
    assert all(x["to"] == y["from"] for x, y in zip(lane, lane[1:])) and lane[-1]["to"] is None
    assert "level" not in lane[0] and lane[4]["level"] == 1


def test_what_is_older_than_the_history_keeps_is_forgotten_but_the_state_in_force_stays():
    clock = Clock()
    h = History(clock, keep_s=600)
    h.state("a", "awake")
    h.swap(SwapRecord("a", [], "ok", 1.0, {}, 1.0, at=clock.now))
    h.mark("a", "refused", "draft collapsed")
    h.sample(0.0, 10.0, {0: {"a": ("awake", 0.9)}})
    clock.now += 700
    h.state("a", "draining")
    h.state("a", "sleeping", 2)
    h.sample(1.0, 10.0, {0: {"a": ("sleeping", 0.01)}})
    assert [i.state for i in h.lanes["a"]] == ["awake", "draining", "sleeping"], "the awake one ended only now: it stays"
    clock.now += 700
    h.state("a", "waking")
    assert [i.state for i in h.lanes["a"]] == ["sleeping", "waking"]
    assert not h.swaps and not h.marks
    data = h.window(60)
    assert [s["host_gb"] for s in data["samples"]] == [1.0], "the sample still in force"


def test_the_history_is_bounded_by_count_too():
    clock = Clock()
    h = History(clock)
    for n in range(history_module.MAX_INTERVALS + 50):
        h.state("a", "awake" if n % 2 else "draining")
        h.swap(SwapRecord("a", [], "ok", 0.1, {}, 0.1, at=clock.now))
        h.mark("a", "restart", "gate")
        h.sample(n, 10.0, {})
        clock.now += 0.01
    assert len(h.lanes["a"]) == history_module.MAX_INTERVALS
    assert len(h.swaps) == history_module.MAX_SWAPS and len(h.marks) == history_module.MAX_MARKS
    assert len(h.samples) <= history_module.MAX_SAMPLES


def test_a_sample_is_kept_only_when_something_changed():
    clock = Clock()
    h = History(clock)
    for _ in range(5):
        h.sample(1.0, 10.0, {0: {"a": ("awake", 0.9)}})
        clock.now += 1
    h.sample(1.0, 10.0, {0: {"a": ("draining", 0.9)}})
    assert len(h.samples) == 2


def test_the_window_keeps_an_intervals_real_start_and_leaves_out_what_ended_before_it():
    clock = Clock()
    h = History(clock)
    h.state("a", "booting")
    clock.now += 100
    h.state("a", "awake")
    clock.now += 1000
    data = h.window(1)
    assert [(i["state"], i["from"]) for i in data["engines"]["a"]] == [("awake", 1_000_100.0)]
    assert data["since"] == clock.now - 60 and data["started"] == 1_000_000.0


NASTY = "<b>&'\"x"


def scenario() -> dict:
    """A swap to NASTY whose gate refused and whose restart repaired it, in /admin/timeline's shape."""
    clock = Clock()
    h = History(clock)
    h.state("a", "awake")
    h.state(NASTY, "sleeping", 2)
    h.sample(0.0, 12.0, {0: {"a": ("awake", 0.9), NASTY: ("sleeping", 0.0125)}})
    clock.now += 5
    h.state("a", "draining")
    h.state("a", "sleeping", 2)
    h.state(NASTY, "waking")
    clock.now += 1
    h.state(NASTY, "verifying")
    h.mark(NASTY, "refused", "mean acceptance length 1.00 <is> below")
    h.mark(NASTY, "restart", "gate")
    h.state(NASTY, "cold")
    h.state(NASTY, "booting")
    clock.now += 3
    h.state(NASTY, "awake")
    h.sample(0.0, 12.0, {0: {"a": ("sleeping", 0.0125), NASTY: ("awake", 0.9)}})
    h.swap(SwapRecord(NASTY, ["a"], "ok", 4.0, {"drain": 0.1, "sleep": 0.2, "wake_weights": 0.5, "gate": 0.2, "restart": 3.0},
                      2.0, at=clock.now, gates=["refused", "restarted", "passed"]))
    clock.now += 1
    return window(h, 30)


def parse(svg: str) -> ElementTree.Element:
    return ElementTree.fromstring(svg)  # raises on anything that is not well-formed XML


SVG = "{http://www.w3.org/2000/svg}"


def test_a_preemption_is_drawn_on_its_engines_lane_as_a_pause_with_why():
    clock = Clock()
    h = History(clock)
    h.state("evals", "awake")
    clock.now += 2
    h.mark("evals", "preempt", "2 batch request(s) paused for a user's waiter")
    h.state("evals", "draining")
    clock.now += 1
    root = parse(pictures.timeline(window(h, 30), {"evals": [0]}))
    [marker] = [g for g in root.iter(SVG + "g") if g.get("class") == "preempt-marker"]
    assert "evals: preempt: 2 batch request(s) paused" in marker.find(SVG + "title").text


def test_the_timeline_is_well_formed_svg_with_a_lane_per_engine_and_every_name_escaped():
    data = scenario()
    svg = pictures.timeline(data, {"a": [0], NASTY: [0], "big": [0, 1]})
    root = parse(svg)
    lanes = {g.get("data-engine"): g for g in root.iter(SVG + "g") if g.get("class") == "lane"}
    assert set(lanes) == {"a", NASTY, "big"}, "the names survive escaping"
    assert lanes[NASTY].get("id") == f"lane-{NASTY}"
    assert NASTY not in svg, "never written raw"
    kinds = lambda lane: sorted(e.get("class") for e in lane.iter() if (e.get("class") or "").endswith("-marker"))
    assert kinds(lanes[NASTY]) == ["refusal-marker", "restart-marker", "swap-marker"] and kinds(lanes["a"]) == []
    states = [r.get("class") for r in lanes["a"].iter(SVG + "rect") if "interval" in (r.get("class") or "")]
    assert states == ["interval state-awake", "interval state-draining", "interval state-sleeping-L2"]
    groups = [t.text for t in root.iter(SVG + "text") if t.get("class") == "gpu-group"]
    assert groups == ["GPU 0", "GPUs 0, 1"]


def test_the_phase_bars_tell_the_refusal_and_the_memory_chart_each_gpu():
    data = scenario()
    bars = parse(pictures.phases(data["swaps"]))
    swap = next(g for g in bars.iter(SVG + "g") if "swap-phases" in (g.get("class") or ""))
    assert swap.get("data-to") == NASTY and "warn" in swap.get("class")
    assert [r.get("class") for r in swap.iter(SVG + "rect")] == [
        "phase phase-drain", "phase phase-sleep", "phase phase-wake_weights", "phase phase-gate", "phase phase-restart", "predicted"]
    assert any(t.text == "refused → restarted → passed" for t in swap.iter(SVG + "text"))
    memory = parse(pictures.memory(data))
    assert [g.get("id") for g in memory.iter(SVG + "g") if g.get("class") == "gpu-shares"] == ["gpu-shares-0"]
    residual = [r for r in memory.iter(SVG + "rect") if NASTY + ": sleeping" in "".join(r.itertext())]
    assert residual and all(float(r.get("height")) >= 2 for r in residual), "a residual of 1 % stays visible"
    assert pictures.phases([]).startswith("<p") and pictures.story(["passed"]) is None
    assert pictures.story(["refused", "restarted", "refused"]) == "refused → restarted → refused"


def test_a_removed_engines_lane_ends_at_its_retirement_and_is_forgotten_once_older_than_the_hour_kept():
    clock = Clock()
    h = History(clock, keep_s=100)
    h.state("gone", "cold")
    clock.now += 10
    h.retired("gone")
    h.retired("gone")  # told twice: one end
    assert [(i["state"], i["to"] is None) for i in h.window(30)["engines"]["gone"]] == [("cold", False), ("removed", False)]
    clock.now += 5
    h.state("gone", "cold")  # added back by a later reload: the lane goes on
    assert h.window(30)["engines"]["gone"][-1] == {"state": "cold", "from": clock.now, "to": None}
    h.retired("gone")
    clock.now += 101
    h.state("other", "cold")  # any later record forgets what is past the hour
    assert "gone" not in h.window(30)["engines"]
