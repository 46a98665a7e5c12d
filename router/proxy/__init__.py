"""A request's way to an engine and back: the routes table (`routes`), the endpoint handler that
resolves the model, takes a lease, forwards and releases (`endpoint`), the pooled upstream
connections (`upstream`, `exchange`, `relay`, `forward`), the client's body (`body`: JSON and multipart forms),
Responses-id pinning (`responses`), stream keep-alives, a paused answer's transcript and continuation (`resume`,
`continuation`), and the client-facing read-only routes (`routes`). The rest of the router
uses the names exported here.

Imports nothing of `router.admin` or `router.cli` (tests/unit/test_layout.py).
"""

from router.proxy.endpoint import proxy_endpoint, response_pinned
from router.proxy.exchange import UpstreamError
from router.proxy.relay import Relay
from router.proxy.responses import RESPONSE_IDS_KEY, ResponseIds
from router.proxy.routes import CLIENT_PATHS, PROXIED, get_model, health, list_models, ready
from router.proxy.upstream import Pool, Upstreams, request_bytes

__all__ = ["CLIENT_PATHS", "PROXIED", "Pool", "RESPONSE_IDS_KEY", "Relay", "ResponseIds", "UpstreamError", "Upstreams",
           "get_model", "health", "list_models", "proxy_endpoint", "ready", "request_bytes", "response_pinned"]
