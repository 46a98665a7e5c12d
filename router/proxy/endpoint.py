"""The proxied routes (see `router.proxy.routes`), as a request's walk: read its body, resolve its
model to an engine (or to a peer node), take a lease, forward, and record how it ended.

Every route goes through the same queue, lease and gate as chat completions: a request for
a parked model wakes it. The engine comes from `router.lookup` (roster names and aliases),
from the LoRA adapters the engines serve, from the roster's default model when the request
names none, or, for Responses follow-ups, retrieve and cancel, from the engine that created
the response.

How a request ended is the status its client got, with one addition: a client that went away
before its answer was complete (mid-stream, or while it waited for a swap) is recorded as 499,
nginx's "client closed request", so that a disconnect is never counted as a server error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, NoReturn, Optional
from urllib.parse import quote

from aiohttp import web

from config.sections import INTERACTIVE
from engines.engine import Engine
from router.proxy import keepalive, routes
from router.auth import grant_of
from router.fleet import PEERS_KEY, PeerFailed
from router.errors import CLIENT_CLOSED, APIError, sse_error
from router.keys import HOLD_HEADER, class_priority, request_class
from router.live import ROUTED_MODEL, ROUTER_KEY, Router
from router.metrics import UNKNOWN_MODEL
from router.proxy.body import Form, encoded, read_form, read_json
from router.proxy.forward import ANSWER_NUMBERS, CUT, NONE, ClientClosed, forward, json_for, read_numbers
from router.proxy.responses import RESPONSE_IDS_KEY, engine_for, pinned_engine, pinning
from router.proxy.continuation import Finished, Plan, detokenize, plan
from router.proxy.resume import ENGINE_FAILED, Cut, Paused, Pauses, Transcript, asking_ids, end_cut, resumable, too_often
from router.scheduling import Lease

PROBE_WAIT_S = 10.0  # longer than engines.watch's health call: its verdict comes first
MIGRATED = "migrated"  # a paused answer finished on a peer node: its resume's reason, whatever paused it
RESUME_KEEPALIVE_S = 15.0  # a paused stream's comment lines when queue.stream_keepalive_s is 0: it must not look dead
MAX_WAIT_HEADER = "X-Hotswap-Max-Wait"
# Endpoints whose vLLM request takes `priority` (vLLM 0.32 and 0.33: chat_completion/protocol.py:388,
# completion/protocol.py:136, responses/protocol.py:327; every pooling request, by PoolingBasicRequestMixin
# in pooling/base/protocol.py:70: embeddings, /v2/embed, pooling, classify, score, rerank): each is given
# its class's. A `priority` a client wrote on any other route is bounded all the same.
PRIORITY_ENDPOINTS = frozenset({"chat", "completions", "embeddings", "responses", "embed_v2", "pooling", "classify",
                                "score", "rerank"})
log = logging.getLogger("hotswap")


def max_wait(request: web.Request) -> Optional[float]:
    """The client's X-Hotswap-Max-Wait: answer 503 at once rather than wait longer than this for a wake."""
    text = request.headers.get(MAX_WAIT_HEADER)
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise APIError(400, f"{MAX_WAIT_HEADER} must be a number of seconds >= 0 (found {text[:40]!r})", "invalid_header")
    return seconds


def uses_priority(engine: Engine) -> bool:
    """Whether the engine runs vLLM's priority scheduling (`--scheduling-policy priority` in its args or command)."""
    return engine.spec.flag("--scheduling-policy") == "priority"


async def proxy_endpoint(request: web.Request) -> web.StreamResponse:
    route = routes.BY_PATH[request.match_info.route.resource.canonical]  # type: ignore[union-attr]
    walk = Walk(request, route.endpoint)
    return await walk.ends(walk.proxied(route))


async def response_pinned(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel, on the engine that created it."""
    walk = Walk(request, "responses")
    return await walk.ends(walk.pinned())


class Walk:
    """One proxied request on its way: each step below is one stage of it, and `ends` records how
    it ended (router.metrics, and the activity log the Router was handed)."""

    __slots__ = ("request", "router", "endpoint", "started", "asked", "stream", "body", "raw", "form", "engine", "peer", "name",
                 "not_here", "lease", "queued_s", "status", "klass", "unresumable", "pauses", "cut", "first_byte_at")

    def __init__(self, request: web.Request, endpoint: str):
        self.request = request
        self.router: Router = request.app[ROUTER_KEY]
        self.endpoint = endpoint  # the route family, the metrics' `endpoint` label
        self.started = time.monotonic()
        self.asked: Any = None  # the client's `model`, as it wrote it
        self.stream = False
        self.body: dict[str, Any] = {}
        self.raw = b""
        self.form: Optional[Form] = None
        self.engine: Optional[Engine] = None
        self.peer: Optional[str] = None  # the node a request for a model this node does not serve was passed to
        self.name = ""  # the name the engine was asked by (an alias, an adapter)
        self.not_here: Optional[APIError] = None  # the 404 of a model this node does not serve
        self.lease: Optional[Lease] = None
        self.queued_s: Optional[float] = None
        self.klass: Optional[str] = None  # interactive or batch, once the lease is asked for (release gives it back so)
        # Replaced by how the walk ends; left as it is, an exception of ours (the error middleware's 500).
        self.status = 500
        self.unresumable: Optional[str] = "shape"  # why a cut answer could not be resumed (router.proxy.resume); None: it can
        self.pauses: Optional[Pauses] = None  # each time its answer was paused and resumed
        self.cut: Optional[str] = None  # why its answer was cut for good, if it was
        self.first_byte_at: Optional[float] = None  # the first part's, once a continuation follows it

    async def ends(self, steps: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        try:
            response = await steps
        except keepalive.AnsweredInStream as exc:
            self.status = exc.status
            return exc.response
        except ClientClosed as exc:
            self.status = CLIENT_CLOSED
            return exc.response
        except APIError as exc:
            self.status = exc.status
            raise
        except ConnectionResetError:  # a write to the client's closed connection (a keep-alive comment, say)
            self.status = CLIENT_CLOSED
            raise
        except asyncio.CancelledError:
            # aiohttp cancels the handler of a client that disconnects; otherwise it is the router's own
            # doing (a shutdown that cut what the drain left), and a server error. A shutdown closes the
            # transport before the handler sees its cancellation, so the draining flag decides first.
            transport = self.request.transport
            if not self.router.draining and (transport is None or transport.is_closing()):
                self.status = CLIENT_CLOSED
            raise
        else:
            self.status = response.status
            return response
        finally:
            self.record()

    # -- the steps, in order ---------------------------------------------------------------------

    async def proxied(self, route: routes.Route) -> web.StreamResponse:
        await self.read(route)
        if not self.resolve(route):
            return await self.hand_off(route)
        prepared = await self.take_lease(self.router.roster.queue.stream_keepalive_s if self.stream else 0,
                                         route.anthropic)
        if self.form is None:
            self.unresumable = resumable(route.endpoint, self.body, route.anthropic)
        then: Optional[Plan] = None
        while True:
            try:
                return await self.forward(route, prepared, then)
            except Paused as exc:
                paused = exc
            finally:
                self.router.placement.release(self.engine, self.klass)
            while True:  # the engine may fail again before the rest is asked for: one more pause
                try:
                    prepared, then = await self.resume(route, paused)
                    break
                except Paused as exc:
                    paused = exc
                except Finished as done:
                    return done.response

    async def resume(self, route: routes.Route, paused: Paused) -> tuple[Optional[web.StreamResponse], Plan]:
        """Wait for the model again and plan the rest of a paused answer (router.proxy.resume)."""
        engine, router, request = self.engine, self.router, self.request
        assert engine is not None
        pauses = self.pauses = self.pauses or Pauses()
        pauses.began(paused.reason)
        try:
            too_often(pauses.reasons, paused.why)
        except Cut as exc:
            await self.cut_for_good(exc, paused.response, route)
        self.first_byte_at = self.first_byte_at or request.get("first_byte_at")
        log.info("paused an answer of %s to %s (%s): %s; the rest is asked for as a continuation once the model serves again",
                 engine.name, request.remote, paused.reason, paused.why)
        await self.migrate(route, paused, pauses)
        if paused.reason == ENGINE_FAILED and engine.probe is not None:  # a lease before the probe's verdict would be for a dead engine
            await asyncio.wait({engine.probe}, timeout=PROBE_WAIT_S)
        try:
            response, _ = await keepalive.wait_again(  # the record keeps its first lease, as its queue_wait_s
                request, router.placement, engine, paused, router.roster.queue.stream_keepalive_s or RESUME_KEEPALIVE_S,
                route.anthropic, self.klass or INTERACTIVE, max_wait(request))
        except (APIError, keepalive.AnsweredInStream) as exc:
            self.cut = "wait"
            router.metrics.stream_cut(engine.name, "wait")
            raise exc
        try:
            then = await plan(lambda ids: detokenize(router.upstreams, engine, ids), f"engine '{engine.name}'", route.endpoint,
                              self.body, paused, lambda body: json_for(engine, body, encoded(body)),
                              lambda tokens, seconds: router.placement.costs.observe_prefill(engine.name, tokens, seconds))
        except BaseException as exc:  # the lease goes back whatever ends the plan (the client leaving too)
            router.placement.release(engine, self.klass)
            if isinstance(exc, Cut):
                await self.cut_for_good(exc, response, route)
            if isinstance(exc, Finished):
                assert response is not None
                await exc.send(response)
                router.metrics.stream_resumed(engine.name, paused.reason, pauses.ended())
            raise
        router.metrics.stream_resumed(engine.name, paused.reason, pauses.ended())
        return response, then

    async def cut_for_good(self, cut: Cut, response: Optional[web.StreamResponse], route: routes.Route) -> NoReturn:
        """An answer that cannot be resumed: counted with its reason and ended (a stream's error event, else a 503)."""
        assert self.engine is not None
        self.cut = cut.reason
        self.router.metrics.stream_cut(self.engine.name, cut.reason)
        raise keepalive.AnsweredInStream(await end_cut(response, cut, route.anthropic), 503) from None

    async def migrate(self, route: routes.Route, paused: Paused, pauses: Pauses) -> None:
        """Finish a paused stream on a peer node where its model is awake, if one is (router.fleet.peers): raises
        AnsweredInStream when it did, Paused when the peer failed after some of it went out; returns to wait here."""
        response, transcript, model = paused.response, paused.transcript, self.body.get("model")
        if response is None or transcript is None or not isinstance(model, str):
            return
        peers, router, engine = self.request.app[PEERS_KEY], self.router, self.engine
        assert engine is not None
        peer = await peers.awake_peer(self.request, router, model)
        if peer is None:
            return
        try:
            then = await plan(lambda ids: peers.detokenize(self.request, router, peer, model, ids), f"peer {peer}",
                              route.endpoint, self.body, paused, encoded)
            assert then.splice is not None
            await response.write(keepalive.migrating_comment(paused))
            self.peer = await peers.continue_on(self.request, router, peer, route.path, then.body, self.klass or INTERACTIVE,
                                                response, then.splice)
        except PeerFailed as exc:
            if exc.sent:  # what went out is in the transcript: the rest is asked for again, here or elsewhere
                raise Paused(ENGINE_FAILED, str(exc), response, transcript) from None
            log.info("an answer of %s to %s could not be finished on a peer (%s); it waits here", engine.name,
                     self.request.remote, exc)
            return
        except Cut as exc:
            await self.cut_for_good(exc, response, route)
        except Finished as done:
            await done.send(response)
            router.metrics.stream_resumed(engine.name, paused.reason, pauses.ended())
            raise
        await response.write_eof()
        waited = pauses.ended()
        pauses.resumed[-1] = MIGRATED
        router.metrics.stream_resumed(engine.name, MIGRATED, waited)
        log.info("resumed an answer of %s to %s on peer node %s after %.2f s", engine.name, self.request.remote, self.peer, waited)
        raise keepalive.AnsweredInStream(response, 200)

    async def read(self, route: routes.Route) -> None:
        """The client's body (bounded in size and time): a multipart form (audio) or JSON; its `model`, and
        whether it asks for a stream."""
        listen = self.router.roster.listen
        if route.multipart:
            self.form = await read_form(self.request, listen)
            self.asked = self.form.value("model")
            self.stream = (self.form.value("stream") or "").lower() == "true"
        else:
            self.body, self.raw = await read_json(self.request, listen)
            self.asked = self.body.get("model")
            self.stream = self.body.get("stream") is True

    def resolve(self, route: routes.Route) -> bool:
        """The engine for the request's model. False: no model of this node, which a peer may serve (a front
        that could not read `model` sent it here); a form is not passed on (its bytes are not kept)."""
        grant = grant_of(self.request)
        try:
            if self.form is not None:
                self.engine, self.name = self.router.resolve(self.asked, grant)
            else:
                self.engine, self.name = engine_for(self.request, self.router, self.body, route.creates_response)
        except APIError as exc:
            if exc.code != "model_not_found" or self.form is not None:
                raise
            self.not_here = exc
            return False
        held = self.router.holds.remaining(self.engine.name, self.request.headers.get(HOLD_HEADER))
        if held is not None:
            raise APIError(503, f"model '{self.engine.name}' is held for an operator's trial (hotswap trial) for up to "
                           f"{held:.0f} s more; retry then", "model_held", retry_after=held)
        if self.form is None and self.asked is None and self.name in self.engine.other_names:
            # A follow-up of an adapter's conversation stays on the adapter (a key may be scoped to it alone).
            self.body["model"] = self.name
            self.raw = encoded(self.body)
        self.request[ROUTED_MODEL] = self.engine.name
        return True

    async def hand_off(self, route: routes.Route) -> web.StreamResponse:
        """The request to the peer node that serves its model (router.fleet.peers), or the 404."""
        assert self.not_here is not None
        # The class decided here travels with it: the peer lowers its own key's class by it, never raises it.
        self.klass = request_class(self.request, grant_of(self.request))
        passed = await self.request.app[PEERS_KEY].hand_off(self.request, self.router, route.path, self.raw,
                                                            self.body["model"], self.not_here, self.klass)
        self.peer = passed.peer
        if passed.first_byte_at is not None:
            self.request["first_byte_at"] = passed.first_byte_at
        if self.router.activity.wants_answers and passed.status < 300:
            self.request[ANSWER_NUMBERS] = read_numbers(passed.end)
        if passed.status == CLIENT_CLOSED:
            raise ClientClosed(passed.response)
        return passed.response

    async def take_lease(self, keepalive_s: float, anthropic: bool = False) -> Optional[web.StreamResponse]:
        """The engine's lease: at once when it is awake, else once the scheduler has woken it. A stream that
        waits gets comment lines every `keepalive_s`; returns the response they began, if any."""
        assert self.engine is not None
        limit = max_wait(self.request)
        self.klass = klass = request_class(self.request, grant_of(self.request))  # recorded even when the wait fails
        prepared = None
        try:
            if keepalive_s:
                prepared, self.lease = await keepalive.acquire(self.request, self.router.placement, self.engine, keepalive_s,
                                                               anthropic, max_wait_s=limit, klass=klass)
            else:
                self.lease = await self.router.placement.acquire(self.engine, max_wait_s=limit, klass=klass)
        except (APIError, keepalive.AnsweredInStream) as exc:
            if exc.wait is not None:  # refused after waiting: the record says how long and why
                self.lease, self.queued_s = exc.wait, time.monotonic() - self.started
            raise
        self.queued_s = time.monotonic() - self.started
        return prepared

    async def forward(self, route: routes.Route, prepared: Optional[web.StreamResponse], then: Optional[Plan] = None
                      ) -> web.StreamResponse:
        """The request to the engine, its answer back; a failure after keep-alive comments ends their stream.
        `then`: the rest of a paused answer (router.proxy.resume)."""
        engine, router = self.engine, self.router
        assert engine is not None
        kw: dict[str, Any] = {"prepared": prepared, "stall_s": router.roster.queue.stall_timeout_s,
                              "numbers": router.activity.wants_answers, "resumable": self.unresumable is None}
        try:
            if then is not None:  # a failure of the rest, too, ends a stream whose head is out with its error event
                # Sent again from its start (nothing of it went out): the prompt's ids are stripped as the first time.
                again = then.splice is None and then.transcript is not None and self.body.get("return_token_ids") is not True
                return await forward(self.request, router.upstreams, engine, route.path, then.body, anthropic=route.anthropic,
                                     transcript=then.transcript, splice=then.splice, strip=again, **kw)
            ids = self.stream and self.unresumable is None
            if ids:
                kw.update(transcript=Transcript(route.endpoint == "chat"), strip=self.body.get("return_token_ids") is not True)
            if self.form is not None:
                model = self.form.value("model")
                form_type, data = await self.form.encode(model if model in engine.served_names else engine.served_name)
                return await forward(self.request, router.upstreams, engine, route.path, data, content_type=form_type, **kw)
            if route.creates_response:
                kw.update(pinning(self.request, engine, self.name, self.body))
            if (route.endpoint in PRIORITY_ENDPOINTS or "priority" in self.body) and uses_priority(engine):
                asked = self.body.get("priority")
                priority = class_priority(asked, self.klass or INTERACTIVE)
                if priority is not asked:  # a priority the client may have is forwarded as it wrote it
                    self.body["priority"] = priority
                    self.raw = encoded(self.body)
            data = json_for(engine, self.body, self.raw)
            return await forward(self.request, router.upstreams, engine, route.path, asking_ids(data) if ids else data,
                                 anthropic=route.anthropic, **kw)
        except APIError as exc:
            if prepared is None:
                raise
            await prepared.write(sse_error(exc.message, exc.code, status=exc.status, anthropic=route.anthropic))
            await prepared.write_eof()
            raise keepalive.AnsweredInStream(prepared, exc.status) from None

    async def pinned(self) -> web.StreamResponse:
        """A Responses retrieve or cancel: the engine that created the response, a lease, the call."""
        request = self.request
        response_id = request.match_info["response_id"]
        self.engine = pinned_engine(self.router, request.app[RESPONSE_IDS_KEY].pin(response_id), grant_of(request))
        if self.engine is None:
            raise APIError(404, f"Response with id '{response_id}' not found (the router pins the responses it saw "
                                "created, for a bounded time).", "response_not_found", param="response_id")
        request[ROUTED_MODEL] = self.engine.name
        cancel = request.path.endswith("/cancel")
        path = f"/v1/responses/{quote(response_id, safe='')}" + ("/cancel" if cancel else "")
        params = {k: v for k, v in request.query.items() if k in ("starting_after", "stream")}
        if params:
            path += "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in params.items())
        await self.take_lease(0)
        try:
            return await forward(request, self.router.upstreams, self.engine, path, method="POST" if cancel else "GET",
                                 content_type=None, stall_s=self.router.roster.queue.stall_timeout_s)
        finally:
            self.router.placement.release(self.engine, self.klass)

    # -- how it ended --------------------------------------------------------------------------

    def record(self) -> None:
        """The request's metrics and its line in the activity log (router.admin.activity)."""
        done, request, engine = time.monotonic(), self.request, self.engine
        first_byte_s = (self.first_byte_at or request.get("first_byte_at", done)) - self.started
        key = grant_of(request).name
        label, group = (engine.name, engine.spec.group or "") if engine is not None else (UNKNOWN_MODEL, "")
        if request.get(CUT) and self.cut is None:
            self.cut = self.unresumable or "mid_event"
            self.router.metrics.stream_cut(label, self.cut)
        lease, numbers = self.lease, request.get(ANSWER_NUMBERS, NONE)
        # The queue-wait histogram is the wait for an awake engine: a refused wait's is in its activity record only.
        self.router.metrics.request_done(label, group, self.endpoint, "true" if self.stream else "false", self.status,
                                         None if lease is not None and lease.refused else self.queued_s, first_byte_s,
                                         done - self.started, key=key)
        self.router.activity.request_done(
            key_name=key, model=self.asked, engine=None if engine is None else engine.name, peer=self.peer, endpoint=self.endpoint,
            status=self.status, found_awake=None if lease is None else lease.found_awake,
            swap_id=None if lease is None else lease.swap_id, queue_wait_s=self.queued_s, wait=lease,
            ttfb_s=first_byte_s if self.stream else None, duration_s=done - self.started, prompt_tokens=numbers.prompt_tokens,
            completion_tokens=numbers.completion_tokens, mean_acceptance_length=numbers.mean_acceptance_length,
            request_class=self.klass, resumed=",".join(self.pauses.resumed) if self.pauses and self.pauses.resumed else None,
            paused_s=self.pauses.paused_s if self.pauses else None, cut=self.cut)
