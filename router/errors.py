"""Errors the router itself produces, in the shape of the route that failed.

OpenAI's `{"error": {"message", "type", "param", "code"}}` everywhere, except on the Anthropic
Messages routes (`/v1/messages*`), where it is Anthropic's
`{"type": "error", "error": {"type", "message"}}`. The SDKs read these fields into their
exception classes, so a client sees our message under the class it expects.

`json_answer` is the one place the router's own JSON answers are made (errors, /v1/models, /health,
/ready, /admin/*): each ends with a newline, as `curl` at a terminal and line-reading tools want.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from typing import Any, Mapping, Optional

from aiohttp import web

log = logging.getLogger("hotswap")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "server_error",
}

# Anthropic's error types (https://docs.anthropic.com/en/api/errors), by HTTP status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}

ANTHROPIC_PREFIX = "/v1/messages"
# nginx's "client closed request": how the metrics and the activity log record a request whose client left
# before its answer was complete, so that a disconnect is never counted as a server error.
CLIENT_CLOSED = 499


def anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


# Where an engine listens, as its failure messages name it: a URL, a socket address tuple, host:port.
# (An IPv6 socket tuple has four fields; a host name with a port is what aiohttp's "Cannot connect to host" names.)
_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"()]+|\('[^']*'(?:, \d+)+\)|\[[0-9a-f:]+\]:\d+"
                      r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\b[\w][\w.-]*:\d{2,5}\b", re.I)


def for_clients(text: str) -> str:
    """An engine's failure as a client may read it: the step and the cause, not where the engine listens
    (an internal address; operators read it whole in /admin/status and the log)."""
    return _ADDRESS.sub("<engine address>", text)


class APIError(Exception):
    """Raised anywhere in request handling; rendered once, by the error middleware."""

    def __init__(self, status: int, message: str, code: str, *, param: Optional[str] = None, retry_after: Optional[float] = None,
                 close_connection: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.close_connection = close_connection  # the client's connection is closed once this is written
        # A request refused after it waited: its wait's parts (router.scheduling.state.Lease), for its activity record.
        self.wait: Any = None

    def after_waiting(self, wait: Any) -> APIError:
        """This error for one waiter, with its wait's parts: an engine's failure is one error for all its waiters."""
        error = APIError(self.status, self.message, self.code, param=self.param, retry_after=self.retry_after,
                         close_connection=self.close_connection)
        error.wait = wait
        return error

    def response(self, anthropic: bool = False) -> web.Response:
        return error_response(self.status, self.message, self.code, param=self.param, retry_after=self.retry_after,
                              anthropic=anthropic)


def error_body(status: int, message: str, code: str, param: Optional[str] = None, anthropic: bool = False) -> dict:
    if anthropic:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def json_answer(data: Any, status: int = 200, headers: Optional[Mapping[str, str]] = None) -> web.Response:
    return web.Response(status=status, body=json.dumps(data).encode() + b"\n", content_type="application/json",
                        headers=headers)


def error_response(status: int, message: str, code: str, *, param: Optional[str] = None, retry_after: Optional[float] = None,
                   anthropic: bool = False) -> web.Response:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return json_answer(error_body(status, message, code, param, anthropic), status, headers)


def sse_error(message: str, code: str, status: int = 502, anthropic: bool = False) -> bytes:
    """An error inside an SSE stream that has already started, as the route's SDK parses one:
    the openai SDK raises a `data: {"error": ...}` event, the anthropic SDK an `event: error`."""
    body = json.dumps(error_body(status, message, code, anthropic=anthropic)).encode()
    return (b"event: error\ndata: " if anthropic else b"data: ") + body + b"\n\n"


@web.middleware
async def api_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error the router produces, in the shape of the route (Anthropic's on /v1/messages*)."""
    anthropic = anthropic_path(request.path)
    try:
        return await handler(request)
    except APIError as exc:
        if exc.close_connection:
            return await _then_close(request, exc.response(anthropic))
        return exc.response(anthropic)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(413, f"The request body is larger than listen.max_body_mb ({exc.text}).", "body_too_large", anthropic=anthropic)
    except web.HTTPNotFound:
        return error_response(404, f"No route {request.method} {request.path}. See the HTTP surface table in docs/operators.md for the routes "
                                   "hotswap serves.", "not_found", anthropic=anthropic)
    except web.HTTPMethodNotAllowed as exc:
        return error_response(405, f"{request.method} is not allowed on {request.path} (allowed: {', '.join(sorted(exc.allowed_methods))}).",
                              "method_not_allowed", anthropic=anthropic)
    except web.HTTPException as exc:
        return error_response(exc.status, exc.reason, "http_error", anthropic=anthropic)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "Internal error in the router (logged).", "internal_error", anthropic=anthropic)


async def _then_close(request: web.Request, response: web.Response) -> web.Response:
    """Write `response`, then close the connection at once. Left to aiohttp, a request whose body
    was not read whole is followed by up to 10 s of "lingering" reads of the rest, which is what
    a client that stopped sending would get."""
    response.force_close()  # Connection: close
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()  # the transport sends what it holds, then closes
    return response
