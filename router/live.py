"""The roster made live: engines, the scheduler that places them, the name -> engine table, and
the observer that turns what engines do into metrics and logs. `router.app` builds it and the
aiohttp app around it; the wings' handlers find it under `ROUTER_KEY`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from pathlib import Path
from typing import Any, Optional, Protocol

import aiohttp
from aiohttp import web

from config.schema import ModelSpec, Roster
from engines import watch
from engines.vllm import EngineError
from engines.engine import Engine, Observer, State
from engines.gate import Verdict
from router.errors import APIError
from router.keys import EVERYTHING, Grant, Holds, KeyTable
from router.metrics import Metrics
from router.scheduling import Events, History, Lease, Scheduler, SwapRecord, capacity, devices_view, level1_weights
from router.tasks import spawn
from router.virtuals import Virtuals

log = logging.getLogger("hotswap")

SAMPLE_S = 1.0  # how often the history looks at host RAM and GPU shares (kept only when they changed)


class ConnectionPools(Protocol):
    """The proxied requests' connections, a pool per engine URL (`router.proxy.Upstreams`)."""

    def close(self, base_url: str) -> None: ...

    def close_all(self) -> None: ...


class RequestLog(Protocol):
    """Where each proxied request is recorded when it ends (`router.admin.ActivityLog`, the activity log)."""

    @property
    def wants_answers(self) -> bool:
        """Whether `request_done` records the answer's numbers (a stream then keeps its last bytes to read them)."""

    def request_done(self, *, key_name: str, model: Any, engine: Optional[str], peer: Optional[str], endpoint: str, status: int,
                     found_awake: Optional[bool], swap_id: Optional[int], queue_wait_s: Optional[float],
                     ttfb_s: Optional[float], duration_s: float, prompt_tokens: Optional[int],
                     completion_tokens: Optional[int], mean_acceptance_length: Optional[float],
                     request_class: Optional[str] = None, resumed: Optional[str] = None, paused_s: Optional[float] = None,
                     cut: Optional[str] = None, wait: Optional[Lease] = None) -> None: ...

    def close(self) -> None:
        """Flush and close (it may block: called off the event loop)."""


class Router(Observer, Events):
    """The roster made live: engines, their scheduler, and the name -> engine table."""

    def __init__(self, roster: Roster, log_dir: Path, control: aiohttp.ClientSession, upstreams: ConnectionPools,
                 activity: RequestLog):
        self.roster = roster
        self.log_dir = log_dir
        # The engines' control calls (sleep, wake, reload, canary, metrics) and nothing else: a request's
        # bytes travel on `upstreams` (to engines) or the peers' own pool, so a wake never waits behind them.
        self.control = control
        self.upstreams = upstreams
        self.activity = activity
        self.metrics = Metrics()
        self.started = int(time.time())
        self.history = History()  # before any engine exists: each reports its states there from its first
        self.engines: dict[str, Engine] = {m.name: self.new_engine(m) for m in roster.models}
        for name in self.engines:
            self.history.state(name, State.COLD.value)
        self.by_name: dict[str, Engine] = {n: self.engines[m.name] for m in roster.models for n in m.names}
        self.virtuals = Virtuals(roster.virtual_models, self.by_name)
        self.keys = KeyTable(roster.auth)
        self.placement = Scheduler(list(self.engines.values()), roster.swap, roster.queue, capacity(roster),
                                   weights=level1_weights(roster.models), observer=self)
        self.metrics.attach(self)
        self.verdicts: dict[str, collections.deque[Verdict]] = {name: collections.deque(maxlen=10) for name in self.engines}
        self._tasks: list[asyncio.Task[None]] = []
        self.draining = False  # SIGTERM seen: /ready says 503 while in-flight work finishes
        self.holds = Holds()  # models an operator's trial holds off client traffic (router.keys)
        self.simulated = False  # `serve --simulate`: every engine is the simulator, and a reload's roster becomes one too

    def new_engine(self, spec: ModelSpec) -> Engine:
        return Engine(spec, self.roster.swap, self.control, self.log_dir, self)

    def add_engine(self, engine: Engine) -> None:
        self.engines[engine.name] = engine
        self.verdicts[engine.name] = collections.deque(maxlen=10)
        self.metrics.engine_added(engine)
        self.history.state(engine.name, engine.state.value)
        self.placement.add(engine)

    def resolve(self, model: Any, grant: Grant) -> tuple[Engine, str]:
        """The engine for a request's `model` (None: the roster's default), if `grant` may use it, and the name
        it was asked by: a roster name or alias, a virtual model (the member it picks), a LoRA adapter."""
        if model is None:
            model = self.default_model(grant)
        elif not isinstance(model, str) or not model:
            raise APIError(400, "'model' must be a non-empty string naming a model from GET /v1/models.", "missing_model",
                           param="model")
        if model in self.by_name:
            return self.lookup(model, grant), model
        if model in self.virtuals:  # the member it picks answers, under its own name
            return self.pick_member(model, grant), model
        for candidate in self.engines.values():  # a LoRA adapter (or other served name) an engine reported
            if model in candidate.other_names and not candidate.retiring and grant.allows(candidate, model):
                return candidate, model
        raise self.unknown_model(model, grant)

    def default_model(self, grant: Grant) -> str:
        for m in self.roster.models:
            if m.default and m.name in self.engines and grant.allows(self.engines[m.name], m.name):
                return m.name
        raise APIError(400, "The request names no 'model' and the roster has no default model (`default: true`). "
                            f"Name one of: {self.usable_names(grant)}", "missing_model", param="model")

    def lookup(self, model: str, grant: Grant = EVERYTHING) -> Engine:
        """The engine serving roster name or alias `model`, if `grant` may use it; else the 404 of
        an unknown model, listing only the names `grant` may use."""
        engine = self.by_name.get(model)
        if engine is None and self.virtuals.reachable(grant, model):  # the admin API acts on one engine
            members = ", ".join(e.name for e in self.virtuals.members(model, grant))
            raise APIError(400, f"'{model}' is a virtual model, which stands for any of its members ({members}); "
                                "name the member to act on", "virtual_model", param="model")
        if engine is None or not grant.allows(engine, model):
            raise self.unknown_model(model, grant)
        return engine

    def pick_member(self, virtual: str, grant: Grant = EVERYTHING) -> Engine:
        """The member engine a request for virtual model `virtual` goes to now, among those `grant` reaches
        through it; none: the 404 of a model it may not use, as a request by a member's name would get."""
        engine = self.virtuals.pick(virtual, self.placement, grant)
        if engine is None:
            raise self.unknown_model(virtual, grant)
        return engine

    def usable_names(self, grant: Grant) -> str:
        """The roster names, aliases and virtual names `grant` may use, for messages that list them."""
        names = [n for n, e in self.by_name.items() if grant.may_use(e.spec.names)] + self.virtuals.names(grant)
        return ", ".join(sorted(names)) or "none"

    def unknown_model(self, model: str, grant: Grant) -> APIError:
        known = self.usable_names(grant)
        return APIError(404, f"The model '{model}' does not exist. Available: {known}", "model_not_found", param="model")

    def adapters(self) -> list[tuple[str, Engine, Optional[str]]]:
        """(adapter, engine, root) for every LoRA adapter an engine reported in its /v1/models (a card
        with a `parent`), as read at boot or after an admin load/unload. Other served names (an
        attached engine's extra --served-model-name) still route to their engine but are not adapters."""
        out = []
        for engine in self.engines.values():
            if engine.retiring:
                continue
            cards = engine.client.model_cards if engine.client is not None else {}
            for name in sorted(engine.served_names):
                card = cards.get(name, {})
                if card.get("parent") and name != engine.served_name and name not in self.by_name:
                    out.append((name, engine, card.get("root")))
        return out

    @property
    def ready(self) -> bool:
        # Parked engines count: with idle_sleep_s every engine may be asleep, and a router that
        # reported unready then would be taken out of rotation and never woken by traffic.
        return any(e.serviceable for e in self.engines.values())

    def start(self) -> None:
        log.info("hotswap: %d engines; engine logs in %s", len(self.engines), next(iter(self.engines.values())).log_dir)
        self.placement.start()
        self._tasks = [spawn(self._watch_acceptance(), "acceptance-watch"), spawn(self._report_boot(), "boot-report"),
                       spawn(self._sample_placement(), "history-sample")]

    async def _report_boot(self) -> None:
        """Once every engine has booted, say plainly what came up and what did not, and why."""
        await self.placement.boot_done.wait()
        failed = [e for e in self.engines.values() if e.state is State.FAILED]
        if not failed:
            log.info("hotswap: boot finished: all %d engines booted and recorded their baseline", len(self.engines))
            return
        why = "\n".join(f"  {e.name}: {e.failure}" for e in failed)
        if len(failed) == len(self.engines):
            log.error("hotswap: boot finished: EVERY engine failed (%d of %d); nothing can be served and /ready answers 503. "
                      "Each is retried when a request for it arrives. Why:\n%s", len(failed), len(self.engines), why)
        else:
            log.error("hotswap: boot finished: %d of %d engines FAILED (%s); serving the others. "
                      "A failed one is retried when a request for it arrives. Why:\n%s",
                      len(failed), len(self.engines), ", ".join(e.name for e in failed), why)

    async def _sample_placement(self) -> None:
        """Host RAM held for Level 1 (measured after each sleep and wake, so not at a state change) and each
        GPU's shares, into the history whenever they change."""
        failed = False
        while True:
            scheduler = self.placement
            try:
                gpus = {view.index: {name: (state, round(share, 4)) for name, (state, share) in view.shares.items()}
                        for view in devices_view(scheduler.ledger())}
                self.history.sample(scheduler.level1_gb(), scheduler.capacity.ram_budget_gb, gpus)
            except Exception:  # a defect: the pictures miss a sample, nothing else; logged once, not every second
                if not failed:
                    log.exception("history: cannot sample host RAM and GPU shares (internal error); retrying each second")
                failed = True
            await asyncio.sleep(SAMPLE_S)

    async def _watch_acceptance(self) -> None:
        """Keep measuring acceptance on the awake engines: a collapse can also appear mid-life."""
        while True:  # the watched set is read each round: a reload may add or change engines
            watched = [e for e in self.engines.values() if e.has_draft and e.spec.gate.enabled and not e.retiring]
            await asyncio.sleep(min([5.0, *(e.spec.gate.midlife_window_s / 4 for e in watched)]))
            for engine in watched:
                await self._watch_one(engine)

    async def _watch_one(self, engine: Engine) -> None:
        try:
            await watch.acceptance(engine)
        except Exception as exc:  # never ends the watch: the other engines are still watched
            first = engine.gate.watch_error is None
            if isinstance(exc, EngineError):
                engine.gate.watch_error = str(exc)
                if first:
                    log.warning("acceptance watch on %s cannot read the engine: %s", engine.name, exc)
            else:
                engine.gate.watch_error = f"internal error: {exc!r}"
                if first:
                    log.exception("acceptance watch on %s: internal error", engine.name)
        else:
            engine.gate.watch_error = None
        if engine.gate.needs_restart:
            self.placement.poke()

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; give those in flight or already queued until `timeout` to finish."""
        self.draining = True
        self.placement.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(e.in_flight or self.placement.queued(e) for e in self.engines.values()):
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.placement.stop()
        await asyncio.gather(*(e.stop() for e in self.engines.values()), return_exceptions=True)
        self.upstreams.close_all()
        await asyncio.to_thread(self.activity.close)

    # -- Observer: engines report here --------------------------------------------------------

    def state_changed(self, engine: Engine, old: State, new: State) -> None:
        self.metrics.state_changed(engine, old, new)
        self.history.state(engine.name, new.value, engine.sleep_level if new is State.SLEEPING else None)
        if new is State.COLD and engine.client is not None:
            # Its process is stopping (a stop, a restart, a reload's retire or respec), and a new boot
            # may take another port: keeping these connections would only leak them, and an
            # attached (`url:`) engine outlives its entry and would hold them open.
            self.upstreams.close(engine.client.base_url)
        if new is State.FAILED:
            self.placement.poke()

    def step_done(self, engine: Engine, phase: str, seconds: float, ok: bool) -> None:
        self.metrics.step_done(engine, phase, seconds, ok)

    def verdict(self, engine: Engine, verdict: Verdict) -> None:
        self.verdicts[engine.name].append(verdict)
        self.metrics.verdict(engine, verdict)
        if verdict.result in ("refused", "allowed"):
            self.history.mark(engine.name, verdict.result, verdict.reason)
        log.log(logging.INFO if verdict.result in ("passed", "baseline", "skipped") else logging.ERROR,
                "gate %s: %s (%s)", engine.name, verdict.result, verdict.reason)

    def restarted(self, engine: Engine, reason: str) -> None:
        self.metrics.restarted(engine, reason)
        self.history.mark(engine.name, "restart", reason)

    def midlife_collapse(self, engine: Engine, observed_mal: float, reason: str) -> None:
        self.metrics.midlife_collapse(engine, observed_mal, reason)

    # -- Events: the scheduler reports here ----------------------------------------------------

    def swap_done(self, record: SwapRecord) -> None:
        self.metrics.swap_done(record)
        self.history.swap(record)

    def evicted(self, engine: Engine, reason: str) -> None:
        self.metrics.evicted(engine, reason)
        if reason == "preempt":  # the timeline shows where batch streams were paused for a user
            self.history.mark(engine.name, "preempt", f"{engine.in_flight} batch request(s) paused for a user's waiter")

    def woke_ahead(self, engine: Engine, outcome: str) -> None:
        self.metrics.woke_ahead(engine, outcome)
        self.history.mark(engine.name, "ahead", outcome)

    def retired(self, engine: Engine) -> None:
        self.history.retired(engine.name)
        self.engines.pop(engine.name, None)
        self.verdicts.pop(engine.name, None)


ROUTER_KEY = web.AppKey("router", Router)
ROUTED_MODEL = "hotswap.model"  # request[ROUTED_MODEL]: the roster name a request was routed to (the access log says it)
