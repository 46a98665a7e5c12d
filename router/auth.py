"""Who may call what: client keys on /v1/* and every proxied route (`router.proxy.routes`), the admin
key on /admin/* and /ui (without one: loopback only, and never a request a proxy forwarded). Each
client key's scope (`router.keys`) is left on the request for the handlers: a model outside it is
answered as one that does not exist.
With client keys, nothing open names models or keys: /metrics and /metrics/model-server (the
Inference Extension's scrape) take a metrics or admin key (unless auth.open_metrics), and /ready
lists only what the caller's key may see. Nor does an answer to a caller without a key say which node
this is (`known_caller`, read by `router.fleet.node`'s X-Hotswap-Node).

Clients present their key as `Authorization: Bearer`; on the Anthropic routes (/v1/messages*)
also as `x-api-key`, which is how the anthropic SDK sends it. Failures raise APIError, so
the error middleware answers in the route's shape.
"""

from __future__ import annotations

import base64
import ipaddress
from typing import Callable, Collection, Optional

from aiohttp import web

from router.errors import APIError, anthropic_path, error_response
from router.keys import EVERYTHING, NOTHING, Grant, KeyTable


METRICS_PATHS = frozenset({"/metrics", "/metrics/model-server"})
# A front on the same host (try-local's HAProxy, a sidecar) makes every client arrive from loopback;
# one that says it forwarded the request is not trusted as loopback for /admin/* and /ui.
FORWARDING_HEADERS = ("X-Forwarded-For", "Forwarded", "X-Real-IP")
GRANT = "hotswap.grant"  # request[GRANT]: the Grant of the client key on /v1/* and the proxied routes
KEY_NAME = "hotswap.key_name"  # request[KEY_NAME]: the name of the key presented, for the access log (never the key)
KNOWN = "hotswap.known"  # request[KNOWN]: the caller passed a key check (or needs none for a client route)


def auth_middleware(keys: Callable[[], KeyTable], client_paths: Collection[str]):
    """`keys` returns the table in force (a roster reload replaces it between two requests); `client_paths`
    are the proxied routes outside /v1/ (`router.proxy.CLIENT_PATHS`), which take a client key too."""

    def presented(request: web.Request) -> bytes:
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            return _as_sent(value.strip())
        if scheme.lower() == "basic":  # a browser on /ui: any user name, the admin key as password
            try:
                return base64.b64decode(value.strip(), validate=True).partition(b":")[2]
            except ValueError:
                return b""
        return b""

    def client_key(request: web.Request) -> bytes:
        if anthropic_path(request.path) and "x-api-key" in request.headers:
            return _as_sent(request.headers["x-api-key"].strip())
        return presented(request)

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        table = keys()
        path = request.path
        if path.startswith("/v1/") or path in client_paths:
            grant = _identify(request, table, client_key(request)) if table.client_auth else EVERYTHING
            if grant is None or not grant.models:  # an admin-only key is no client key
                how = "'x-api-key: <key>' or 'Authorization: Bearer <key>'" if anthropic_path(path) else "'Authorization: Bearer <key>'"
                raise APIError(401, f"Missing or invalid API key: send {how}.", "invalid_api_key")
            request[GRANT] = grant
            request[KNOWN] = True
        if path.startswith("/admin/") or path == "/ui":
            if table.admin_auth:
                grant = _identify(request, table, presented(request))
                if grant is None or not grant.admin:
                    response = error_response(401, "Missing or invalid admin key (a key with admin: true, or auth.admin_key).",
                                              "invalid_admin_key")
                    # A browser answers the challenge with the credentials it logged in to /ui with: the
                    # page's own requests to /admin/* (its log follower) need it, as /ui does.
                    response.headers["WWW-Authenticate"] = 'Basic realm="hotswap"'
                    return response
                request[KNOWN] = True
            elif not _is_loopback(request.remote) or _forwarded(request):
                return error_response(403, f"{path} is loopback-only until an admin key is set (auth.admin_key, "
                                           "or a key with admin: true); a request a proxy forwarded "
                                           f"({', '.join(FORWARDING_HEADERS)}) is not loopback.", "admin_loopback_only")
        if path in METRICS_PATHS and table.metrics_auth:
            grant = _identify(request, table, presented(request))
            if grant is None or not grant.metrics:
                return error_response(401, f"Missing or invalid metrics key: with client keys configured, {path} (it names "
                                           "every model and key) takes a key with metrics: true or an admin key, as "
                                           "'Authorization: Bearer <key>' (Prometheus: `authorization:` in its scrape config); "
                                           "or set auth.open_metrics: true.", "invalid_metrics_key")
            request[KNOWN] = True
        if path == "/ready" and table.client_auth:
            # /ready is for probes, which send no key: they get the status; a key gets the names it may see.
            grant = _identify(request, table, presented(request))
            request[GRANT] = NOTHING if grant is None else EVERYTHING if grant.metrics else grant
            request[KNOWN] = grant is not None
        return await handler(request)

    return auth


def _identify(request: web.Request, table: KeyTable, key: bytes) -> Optional[Grant]:
    """The grant of `key`; its name is left on the request for the access log ("unknown": a key no grant has)."""
    grant = table.identify(key)
    request[KEY_NAME] = grant.name if grant is not None else "unknown" if key else None
    return grant


def _as_sent(value: str) -> bytes:
    """A header value as the client's bytes. aiohttp decodes headers as UTF-8 with surrogateescape, so bytes
    that are not UTF-8 (`Bearer \\xff\\xfe`) arrive as lone surrogates a plain .encode() refuses; given back
    as sent, they are a key like any other, and no key matches them."""
    return value.encode("utf-8", "surrogateescape")


def known_caller(request: web.Request) -> bool:
    """Whether the caller may be told which node this is: it passed a key check (a client route without client
    keys needs none: /v1/models names the node to anyone then). A 401, /health and a probe of /ready without a
    key are not told."""
    return request.get(KNOWN, False)


def grant_of(request: web.Request) -> Grant:
    return request.get(GRANT, EVERYTHING)


def _forwarded(request: web.Request) -> bool:
    return any(name in request.headers for name in FORWARDING_HEADERS)


def _is_loopback(remote: Optional[str]) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False
