"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

The `openai` SDK reads these fields into its exceptions, so a client sees our message.
"""

from __future__ import annotations

import json
import math
from typing import Optional

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "server_error",
}


class APIError(Exception):
    """Raised anywhere in request handling; rendered once, by the error middleware."""

    def __init__(self, status: int, message: str, code: str, *, param: Optional[str] = None, retry_after: Optional[float] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.code, param=self.param, retry_after=self.retry_after)


def error_body(status: int, message: str, code: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(status: int, message: str, code: str, *, param: Optional[str] = None, retry_after: Optional[float] = None) -> web.Response:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return web.Response(
        status=status,
        body=json.dumps(error_body(status, message, code, param)),
        content_type="application/json",
        headers=headers,
    )


def sse_error(message: str, code: str) -> bytes:
    """An error inside an SSE stream that has already started: the openai SDK raises it as its APIError."""
    return b"data: " + json.dumps(error_body(502, message, code)).encode() + b"\n\n"
