"""The router's HTTP surface for clients: every vLLM route it forwards, and how.

Each route's upstream path is the route's own constant, never the client's spelling, so no
path trick reaches an engine's dev endpoints (`/sleep`, `/collective_rpc`, ...): what is
not in this table is a 404 from the router. README's "HTTP surface" table lists the same
routes and says why the other vLLM routes are not here.
"""

from __future__ import annotations

from dataclasses import dataclass


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
