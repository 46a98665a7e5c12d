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
import time
from typing import Any, Awaitable, Optional
from urllib.parse import quote

from aiohttp import web

from config.sections import INTERACTIVE, REQUEST_CLASSES
from engines.engine import Engine
from router.proxy import keepalive, multipart, routes
from router.auth import grant_of
from router.fleet import PEERS_KEY
from router.errors import CLIENT_CLOSED, APIError, sse_error
from router.keys import CLASS_HEADER, Grant
from router.live import ROUTED_MODEL, ROUTER_KEY, Router
from router.metrics import UNKNOWN_MODEL
from router.proxy.body import encoded, read_json
from router.proxy.forward import ANSWER_NUMBERS, NONE, ClientClosed, forward, json_for, read_numbers
from router.proxy.responses import Pin, ResponseIds, StreamSniffer, id_in_answer
from router.scheduling import Lease

RESPONSE_IDS_KEY = web.AppKey("response_ids", ResponseIds)
MAX_WAIT_HEADER = "X-Hotswap-Max-Wait"
# Endpoints whose vLLM request takes `priority` (vLLM 0.32 and 0.33: chat_completion/protocol.py:388,
# completion/protocol.py:136, responses/protocol.py:327; every pooling request, by PoolingBasicRequestMixin
# in pooling/base/protocol.py:70: embeddings, /v2/embed, pooling, classify, score, rerank): each is given
# its class's. A `priority` a client wrote on any other route is bounded all the same.
PRIORITY_ENDPOINTS = frozenset({"chat", "completions", "embeddings", "responses", "embed_v2", "pooling", "classify",
                                "score", "rerank"})
# vLLM's priority scheduler serves lower values first ("lower means earlier handling; default: 0",
# vllm/entrypoints/openai/chat_completion/protocol.py:393 in vLLM 0.32), and refuses any value but 0
# from an engine without `--scheduling-policy priority`: so only such an engine is sent one.
PRIORITY = {klass: rank for rank, klass in enumerate(REQUEST_CLASSES)}


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


def request_class(request: web.Request, grant: Grant) -> str:
    """The request's class: its key's (auth.keys[].class), lowered by X-Hotswap-Class, never raised."""
    text = request.headers.get(CLASS_HEADER)
    if text is None:
        return grant.klass
    asked = text.strip().lower()
    if asked not in REQUEST_CLASSES:
        raise APIError(400, f"{CLASS_HEADER} must be one of {', '.join(REQUEST_CLASSES)} (found {text[:40]!r})", "invalid_header")
    # Lowering only: a key whose class is batch stays batch whatever its client sends.
    return max(asked, grant.klass, key=REQUEST_CLASSES.index)


def class_priority(asked: Any, klass: str) -> Any:
    """The `priority` an engine with priority scheduling gets: the class's, or the client's own when that is
    served later. A key's class bounds its place in the engine's queue as it bounds its class: lowered, never
    raised, so a batch key's `priority: -10` is not served before interactive traffic."""
    floor = PRIORITY[klass]
    if asked is None:
        return floor
    if isinstance(asked, bool) or not isinstance(asked, (int, float)):
        # vLLM would take "-10" as -10: a string is refused here, not passed on past the bound.
        raise APIError(400, f"'priority' must be an integer, lower served earlier (found {json_type(asked)}).",
                       "invalid_request", param="priority")
    return asked if asked >= floor else floor  # NaN compares false: the class's


def json_type(value: Any) -> str:
    return {str: "a string", bool: "a boolean", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def uses_priority(engine: Engine) -> bool:
    """Whether the engine runs vLLM's priority scheduling (`--scheduling-policy priority` in its args or command)."""
    return engine.spec.flag("--scheduling-policy") == "priority"


def default_model(router, grant: Grant) -> str:
    for m in router.roster.models:
        if m.default and m.name in router.engines and grant.allows(router.engines[m.name], m.name):
            return m.name
    raise APIError(400, "The request names no 'model' and the roster has no default model (`default: true`). "
                        f"Name one of: {router.usable_names(grant)}", "missing_model", param="model")


def resolve(router, model: Any, grant: Grant) -> tuple[Engine, str]:
    """The engine for a request's `model` (None: the roster's default), if `grant` may use it, and the name it was asked by."""
    if model is None:
        model = default_model(router, grant)
    elif not isinstance(model, str) or not model:
        raise APIError(400, "'model' must be a non-empty string naming a model from GET /v1/models.", "missing_model", param="model")
    if model in router.by_name:
        return router.lookup(model, grant), model
    if model in router.virtuals:  # the member it picks answers, under its own name
        return router.pick_member(model, grant), model
    for candidate in router.engines.values():  # a LoRA adapter (or other served name) an engine reported
        if model in candidate.other_names and not candidate.retiring and grant.allows(candidate, model):
            return candidate, model
    raise router.unknown_model(model, grant)


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
                 "not_here", "lease", "queued_s", "status", "klass")

    def __init__(self, request: web.Request, endpoint: str):
        self.request = request
        self.router: Router = request.app[ROUTER_KEY]
        self.endpoint = endpoint  # the route family, the metrics' `endpoint` label
        self.started = time.monotonic()
        self.asked: Any = None  # the client's `model`, as it wrote it
        self.stream = False
        self.body: dict[str, Any] = {}
        self.raw = b""
        self.form: Optional[multipart.Form] = None
        self.engine: Optional[Engine] = None
        self.peer: Optional[str] = None  # the node a request for a model this node does not serve was passed to
        self.name = ""  # the name the engine was asked by (an alias, an adapter)
        self.not_here: Optional[APIError] = None  # the 404 of a model this node does not serve
        self.lease: Optional[Lease] = None
        self.queued_s: Optional[float] = None
        self.klass: Optional[str] = None  # interactive or batch, once the lease is asked for (release gives it back so)
        # Replaced by how the walk ends; left as it is, an exception of ours (the error middleware's 500).
        self.status = 500

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
        try:
            return await self.forward(route, prepared)
        finally:
            self.router.placement.release(self.engine, self.klass)

    async def read(self, route: routes.Route) -> None:
        """The client's body (bounded in size and time): a multipart form (audio) or JSON; its `model`, and
        whether it asks for a stream."""
        listen = self.router.roster.listen
        if route.multipart:
            self.form = await multipart.read_form(self.request, listen)
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
                self.engine, self.name = resolve(self.router, self.asked, grant)
            else:
                self.engine, self.name = _engine_for(self.request, self.router, self.body, route)
        except APIError as exc:
            if exc.code != "model_not_found" or self.form is not None:
                raise
            self.not_here = exc
            return False
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
        if keepalive_s:
            prepared, self.lease = await keepalive.acquire(self.request, self.router.placement, self.engine, keepalive_s,
                                                           anthropic, max_wait_s=limit, klass=klass)
        else:
            self.lease = await self.router.placement.acquire(self.engine, max_wait_s=limit, klass=klass)
        self.queued_s = time.monotonic() - self.started
        return prepared

    async def forward(self, route: routes.Route, prepared: Optional[web.StreamResponse]) -> web.StreamResponse:
        """The request to the engine, its answer back; a failure after keep-alive comments ends their stream."""
        engine, router = self.engine, self.router
        assert engine is not None
        kw: dict[str, Any] = {"prepared": prepared, "stall_s": router.roster.queue.stall_timeout_s,
                              "numbers": router.activity.wants_answers}
        try:
            if self.form is not None:
                model = self.form.value("model")
                form_type, data = await self.form.encode(model if model in engine.served_names else engine.served_name)
                return await forward(self.request, router.upstreams, engine, route.path, data, content_type=form_type, **kw)
            if route.creates_response:
                kw.update(_pinning(self.request, engine, self.name, self.body))
            if (route.endpoint in PRIORITY_ENDPOINTS or "priority" in self.body) and uses_priority(engine):
                asked = self.body.get("priority")
                priority = class_priority(asked, self.klass or INTERACTIVE)
                if priority is not asked:  # a priority the client may have is forwarded as it wrote it
                    self.body["priority"] = priority
                    self.raw = encoded(self.body)
            return await forward(self.request, router.upstreams, engine, route.path, json_for(engine, self.body, self.raw),
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
        self.engine = _usable(self.router, request.app[RESPONSE_IDS_KEY].pin(response_id), grant_of(request))
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
        first_byte_s = request.get("first_byte_at", done) - self.started
        key = grant_of(request).name
        label, group = (engine.name, engine.spec.group or "") if engine is not None else (UNKNOWN_MODEL, "")
        self.router.metrics.request_done(label, group, self.endpoint, "true" if self.stream else "false", self.status,
                                         self.queued_s, first_byte_s, done - self.started, key=key)
        lease, numbers = self.lease, request.get(ANSWER_NUMBERS, NONE)
        self.router.activity.request_done(
            key_name=key, model=self.asked, engine=None if engine is None else engine.name, peer=self.peer, endpoint=self.endpoint,
            status=self.status, found_awake=None if lease is None else lease.found_awake,
            swap_id=None if lease is None else lease.swap_id, queue_wait_s=self.queued_s,
            ttfb_s=first_byte_s if self.stream else None, duration_s=done - self.started, prompt_tokens=numbers.prompt_tokens,
            completion_tokens=numbers.completion_tokens, mean_acceptance_length=numbers.mean_acceptance_length,
            request_class=self.klass)


def _engine_for(request: web.Request, router, body: dict[str, Any], route: routes.Route) -> tuple[Engine, str]:
    model = body.get("model")
    if route.creates_response and (model is None or model in router.virtuals):
        # A follow-up without a model continues where its conversation lives, under the name it was started with;
        # one by a virtual name, on the member that holds the conversation (another member never saw it).
        previous = body.get("previous_response_id")
        pin = request.app[RESPONSE_IDS_KEY].pin(previous) if isinstance(previous, str) else None
        engine = _usable(router, pin, grant_of(request))
        if engine is not None and pin is not None and (model is None or router.virtuals.reaches(grant_of(request), model, engine)):
            return engine, pin.model
    return resolve(router, model, grant_of(request))


def _usable(router, pin: Optional[Pin], grant: Grant) -> Optional[Engine]:
    """The engine a response was pinned to, unless it has left the roster or `grant` may not use it
    under the name the response was created with (the same check as resolution's)."""
    engine = router.engines.get(pin.engine) if pin is not None else None
    if engine is None or pin is None or engine.retiring:
        return None
    if not (grant.allows(engine, pin.model) or router.virtuals.reaches(grant, pin.model, engine)):
        return None
    return engine


def _pinning(request: web.Request, engine: Engine, name: str, body: dict[str, Any]) -> dict[str, Any]:
    ids = request.app[RESPONSE_IDS_KEY]

    def remember(response_id: str) -> None:
        ids.remember(response_id, engine.name, name)

    if body.get("stream") is True:
        return {"sniffer": StreamSniffer(remember)}
    return {"on_answer": lambda payload: (rid := id_in_answer(payload)) and remember(rid)}
