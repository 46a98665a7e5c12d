"""Who may call what: client keys on /v1/* and every proxied route (`router.routes`), the admin
key on /admin/* and /ui (loopback-only without one).

Clients present their key as `Authorization: Bearer`; on the Anthropic routes (/v1/messages*)
also as `x-api-key`, which is how the anthropic SDK sends it. Failures raise APIError, so
the error middleware answers in the route's shape.
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
from typing import Optional

from aiohttp import web

from config.schema import Roster
from router.errors import APIError, anthropic_path, error_response
from router.routes import CLIENT_PATHS


def auth_middleware(roster: Roster):
    client_keys = [k.encode() for k in roster.auth.api_keys]
    admin_key = roster.auth.admin_key.encode() if roster.auth.admin_key else None

    def presented(request: web.Request) -> bytes:
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            return value.strip().encode()
        if scheme.lower() == "basic":  # a browser on /ui: any user name, the admin key as password
            try:
                return base64.b64decode(value.strip(), validate=True).partition(b":")[2]
            except ValueError:
                return b""
        return b""

    def matches(key: bytes, keys: list[bytes]) -> bool:
        # Compare against every key, so the time taken does not say which one was close.
        return bool(key) and sum(hmac.compare_digest(key, k) for k in keys) > 0

    def client_key(request: web.Request) -> bytes:
        if anthropic_path(request.path) and "x-api-key" in request.headers:
            return request.headers["x-api-key"].strip().encode()
        return presented(request)

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        path = request.path
        if client_keys and (path.startswith("/v1/") or path in CLIENT_PATHS) and not matches(client_key(request), client_keys):
            how = "'x-api-key: <key>' or 'Authorization: Bearer <key>'" if anthropic_path(path) else "'Authorization: Bearer <key>'"
            raise APIError(401, f"Missing or invalid API key: send {how}.", "invalid_api_key")
        if path.startswith("/admin/") or path == "/ui":
            if admin_key is not None:
                if not matches(presented(request), [admin_key]):
                    response = error_response(401, "Missing or invalid admin key.", "invalid_admin_key")
                    if path == "/ui":
                        response.headers["WWW-Authenticate"] = 'Basic realm="hotswap"'
                    return response
            elif not _is_loopback(request.remote):
                return error_response(403, f"{path} is loopback-only until auth.admin_key is set.", "admin_loopback_only")
        return await handler(request)

    return auth


def _is_loopback(remote: Optional[str]) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False
