"""The router's HTTP surface for clients: every vLLM route it forwards, and how.

Each route's upstream path is the route's own constant, never the client's spelling, so no
path trick reaches an engine's dev endpoints (`/sleep`, `/collective_rpc`, ...): what is
not in this table is a 404 from the router. docs/operators.md's "HTTP surface" table lists the same
routes and says why the other vLLM routes are not here.

The rest of the surface is read without being proxied: the models a client may use (`/v1/models`,
with each one's state and node), `/health` and `/ready` (with client keys, its model lists only
for a key, and only the models that key may use).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from router.auth import grant_of
from router.errors import APIError, json_answer
from router.fleet import card as node_card
from router.keys import Grant
from router.live import ROUTER_KEY, Router


@dataclass(frozen=True)
class Route:
    path: str
    endpoint: str  # the `endpoint` label of the request metrics: bounded, one per route family
    multipart: bool = False  # multipart/form-data whose `model` is a form field (audio)
    anthropic: bool = False  # errors in Anthropic's shape, x-api-key accepted
    creates_response: bool = False  # answers carry a Responses id to pin to the engine


PROXIED: tuple[Route, ...] = (
    Route("/v1/chat/completions", "chat"),
    Route("/v1/completions", "completions"),
    Route("/v1/embeddings", "embeddings"),
    Route("/v1/responses", "responses", creates_response=True),
    Route("/v1/messages", "messages", anthropic=True),
    Route("/v1/messages/count_tokens", "count_tokens", anthropic=True),
    Route("/v1/audio/transcriptions", "transcriptions", multipart=True),
    Route("/v1/audio/translations", "translations", multipart=True),
    Route("/v1/rerank", "rerank"),
    Route("/rerank", "rerank"),
    Route("/v2/rerank", "rerank"),
    Route("/v1/score", "score"),
    Route("/score", "score"),
    Route("/v2/embed", "embed_v2"),
    Route("/pooling", "pooling"),
    Route("/classify", "classify"),
    Route("/tokenize", "tokenize"),
    Route("/detokenize", "detokenize"),
)
BY_PATH = {r.path: r for r in PROXIED}

# Paths outside /v1/ that still need the client key (every proxied route does).
CLIENT_PATHS = frozenset(r.path for r in PROXIED)


# -- read without being proxied ------------------------------------------------------------

DRAINING_RETRY_AFTER_S = 5  # what the scheduler tells refused requests while shutting down, too


def _model_cards(router: Router, grant: Grant) -> list[dict]:
    """Every name `grant` may use: roster names and aliases, the virtual models, then the engines' LoRA adapters."""
    scheduler = router.placement
    now = scheduler.clock()
    where = node_card(router.roster)

    def card(name: str, engine, root, parent=None, alias_of=None) -> dict:
        return {"id": name, "object": "model", "created": router.started, "owned_by": "hotswap", "root": root,
                "parent": parent, "alias_of": alias_of, "state": engine.state.value, "group": engine.spec.group,
                "wake_estimate_s": round(scheduler.predicted_wait(engine, now), 2), "node": where}

    # `root`: what the engine serves, never where it listens (an attached engine's url is internal, and may
    # carry a password): a `url:` or `command:` engine's card says its name. `parent` is OpenAI's and vLLM's
    # word for an adapter's base model; an alias is another name of the same engine, so it says `alias_of`.
    cards = [card(name, engine, engine.spec.model or engine.name, alias_of=None if name == engine.name else engine.name)
             for name, engine in router.by_name.items() if grant.allows(engine, name)]
    # A virtual model's card is its member's of the moment (state, wake estimate): what a request now would meet.
    # Its members are those the key reaches through it: a key is told of no model outside its scope.
    for name in router.virtuals.names(grant):
        picked = router.virtuals.pick(name, scheduler, grant)
        if picked is None:  # names() lists only those through which the key reaches a member
            continue
        cards.append({**card(name, picked, name), "members": [e.name for e in router.virtuals.members(name, grant)],
                      "picks": picked.name, "group": None})
    # An adapter's parent is its engine's roster name: the name clients use (vLLM's card says the served name).
    return cards + [card(name, engine, root, parent=engine.name) for name, engine, root in router.adapters()
                    if grant.allows(engine, name)]


async def list_models(request: web.Request) -> web.Response:
    return json_answer({"object": "list", "data": _model_cards(request.app[ROUTER_KEY], grant_of(request))})


async def get_model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    for card in _model_cards(request.app[ROUTER_KEY], grant_of(request)):
        if card["id"] == model_id:
            return json_answer(card)
    raise APIError(404, f"The model '{model_id}' does not exist.", "model_not_found", param="model")


async def health(request: web.Request) -> web.Response:
    return json_answer({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    grant = grant_of(request)  # with client keys: the caller's (a probe without a key: no model)
    body = {"ready": router.ready and not router.draining, "draining": router.draining}
    if grant.models:
        visible = [e for e in router.engines.values() if grant.may_use(e.spec.names)]
        body.update(promoted=[e.name for e in visible if e.promoted], serviceable=[e.name for e in visible if e.serviceable])
    # Draining for shutdown: a front that polls /ready takes the node out of rotation now,
    # while it still answers (new work gets 503 + Retry-After, in-flight work finishes).
    headers = {"Retry-After": str(DRAINING_RETRY_AFTER_S)} if router.draining else None
    return json_answer(body, status=200 if body["ready"] else 503, headers=headers)
