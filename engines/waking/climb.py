"""One engine's climb between its rungs, step by step: which steps a sleep, a further park, a wake or
a demotion runs (engines.waking.ladder down, engines.waking.steps back up, from the roster entry in
force), the stage of a Level-2 wake, the drill, and the running of every step, the gate's included.

The Engine keeps its states and makes every transition (engines/engine.py); its climb runs what goes
between two of them. Each step runs under its own timeout (`swap.timeouts.<phase>`), is timed and
reported to the observer, and on any error leaves the engine FAILED (`Engine.fail`, a transition the
Engine makes) with a message naming the step and the cause. The stage is timed and reported like a
step, but whatever happens the wake goes on (engines.waking.stage).

The drill (POST /admin/drill, `hotswap trial --drill`) is an operator's switch on one wake: armed
here, read and disarmed by the next wake, which leaves out its draft reload on purpose, so the draft
comes back as vLLM #52479 leaves it and the gate is seen to refuse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Awaitable, Callable, Iterator, Optional, Protocol

from config.schema import ModelSpec, Swap
from engines.process import EngineProcess
from engines.progress import Progress
from engines.states import EngineFailed, Observer, State
from engines.vllm import EngineError, EngineRefused, VLLMClient, outstanding
from engines.waking import ladder, steps
from engines.waking.stage import Stager

log = logging.getLogger("hotswap")


class Climber(Protocol):
    """What a climb reads of its engine (engines.engine.Engine, which sits above this module and hands itself in)."""

    name: str
    spec: ModelSpec
    swap: Swap
    state: State
    failure: Optional[str]
    sleep_level: Optional[int]
    client: Optional[VLLMClient]
    process: Optional[EngineProcess]
    progress: Progress
    stager: Stager
    observer: Observer
    last_phases: dict[str, float]

    def fail(self, what: str) -> EngineFailed: ...


class Climb:
    def __init__(self, engine: Climber) -> None:
        self.engine = engine
        self.quiet = asyncio.Event()  # set while no step talks to the engine (a death then is the process watch's to report)
        self.quiet.set()
        self.drill_armed = False  # an operator's drill: the next wake skips the draft reload (arm_drill)

    # -- which steps ----------------------------------------------------------------------

    def phases(self) -> list[str]:
        """The steps the engine's sleep and wake go through (for metrics that must exist up front)."""
        levels = ladder.rungs(self.engine.spec.sleep_level)
        down = [s.phase for level in levels for s in ladder.down(level, "wait")]
        up = [p for level in levels for p in self.wake_phases(level)]
        return [*dict.fromkeys(down + up), "gate"]

    def wake_phases(self, level: int) -> list[str]:
        return steps.phases(level, self.engine.spec.draft_restore, self.engine.stager.enabled)

    # -- the climb down and back up -----------------------------------------------------------

    async def down(self, level: int, mode: str) -> None:
        """Park an awake, drained engine on rung `level` (`mode`: vLLM's pause mode)."""
        await self.run(ladder.down(level, mode))

    async def further(self, level: int) -> None:
        """A KV-parked engine down to `level` without waking it."""
        await self.run(ladder.further(level))

    async def up(self, level: int, drill: bool = False) -> None:
        """The staged wake from rung `level` (`drill`: without its draft reload, see take_drill)."""
        engine = self.engine
        if drill:
            log.warning("engine %s: DRILL: this Level-%d wake skips the draft reload on purpose (POST /admin/drill); "
                        "the gate is expected to refuse it (vLLM #52479)", engine.name, level)
        await self.run(steps.steps(level, engine.spec.draft_restore, engine.stager.enabled, drill))
        if level == 2:
            engine.stager.reloaded()

    async def run(self, sequence: tuple[steps.Step, ...]) -> None:
        for step in sequence:
            if step.fatal:
                await self.step(step.phase, lambda t, run=step.run: run(self.engine.client, t))
            else:
                await self._stage()

    # -- one step -------------------------------------------------------------------------------

    async def step(self, phase: str, action: Callable[[float], Awaitable[Any]], timeout: Optional[float] = None) -> Any:
        """Run one named step under its own timeout; record its duration; FAILED on any error."""
        engine = self.engine
        if engine.state is State.FAILED:  # the process died between two steps
            raise EngineFailed(engine.failure or f"engine {engine.name}: failed before {phase}")
        timeout = timeout if timeout is not None else getattr(engine.swap.timeouts, phase)
        started = time.monotonic()
        with self.talking(phase):
            try:
                with outstanding() as calls:
                    async with asyncio.timeout(timeout):
                        result = await action(timeout)
            except (EngineError, TimeoutError, OSError) as exc:
                self.done(phase, started, False)
                cause = str(exc)
                if isinstance(exc, TimeoutError):  # the step's deadline, not a call's: name the call it cut off
                    cause = f"no answer within {timeout:.3g} s"
                    if calls:
                        cause = f"{calls[0]}: {cause}"
                if isinstance(exc, EngineRefused) and engine.process is not None:
                    await engine.process.reap_briefly()  # so the message can say how the process ended
                raise engine.fail(f"{phase} failed: {cause}") from None
            except Exception as exc:  # a defect, ours or an answer nothing anticipated: contained to this engine
                self.done(phase, started, False)
                log.exception("engine %s: unexpected error in step %s", engine.name, phase)
                raise engine.fail(f"{phase} failed: internal error: {exc!r} (traceback in the router log)") from None
        self.done(phase, started, True)
        return result

    @contextlib.contextmanager
    def talking(self, phase: str) -> Iterator[None]:
        """While a step talks to the engine: its progress shows the step, and a death meanwhile is the step's to report."""
        self.quiet.clear()
        self.engine.progress.step = phase
        try:
            yield
        finally:
            self.quiet.set()
            self.engine.progress.step = None

    def done(self, phase: str, started: float, ok: bool) -> None:
        self.engine.last_phases[phase] = seconds = time.monotonic() - started
        self.engine.observer.step_done(self.engine, phase, seconds, ok)

    async def _stage(self) -> None:
        """The stage step: timed and reported like a step, but whatever happens the wake goes on (engines.waking.stage)."""
        started = time.monotonic()
        with self.talking("stage"):  # a death meanwhile is reported by the next step, naming it
            ok = await self.engine.stager.step(self.engine.client, self.engine.swap.timeouts.stage)
        self.done("stage", started, ok)

    # -- the drill ------------------------------------------------------------------------------

    def arm_drill(self) -> None:
        """POST /admin/drill (admin key only): the next wake leaves out the draft reload, once, so an operator
        sees the draft lost as vLLM #52479 loses it and the gate refuse the wake. Only for an engine asleep at
        Level 2 whose wake reloads its draft; ValueError (saying why) otherwise. The wake disarms it as it reads
        it (take_drill); the admin route disarms it too once its swap is over, so it never outlives that one request."""
        engine = self.engine
        if engine.state is not State.SLEEPING or engine.sleep_level != 2:
            where = f"asleep at level {engine.sleep_level}" if engine.state is State.SLEEPING else engine.state.value
            raise ValueError(f"engine {engine.name} is {where}: a drill wakes an engine asleep at level 2 "
                             f"(POST /admin/sleep?model={engine.name}&level=2 first)")
        if "reload_draft" not in self.wake_phases(2):
            raise ValueError(f"engine {engine.name}'s Level-2 wake has no draft reload to skip "
                             f"(speculative: {'set' if engine.spec.speculative is not None else 'none'}, "
                             f"draft_restore: {engine.spec.draft_restore})")
        self.drill_armed = True

    def take_drill(self) -> bool:
        """Whether this wake is a drill; disarmed as it is read (one wake, whatever becomes of it)."""
        drill, self.drill_armed = self.drill_armed, False
        return drill
