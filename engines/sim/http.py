"""The simulated engine's HTTP plumbing, shared by every route module: vLLM's error shape, the
request-body reader, the access log line vLLM's uvicorn writes, and the broken answers the
`malformed` and `cut` faults send (control.py).
"""

from __future__ import annotations

import http
import json
from typing import NoReturn

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from .control import hang_forever


# `malformed`: what a broken serialiser or proxy leaves of an answer. The ids are the
# prefixes vLLM gives each route, so the truncation sits where a real one could.
TRUNCATED_JSON = {
    "/v1/completions": b'{"id": "cmpl-',
    "/v1/chat/completions": b'{"id": "chatcmpl-',
    "/v1/embeddings": b'{"id": "embd-',
}
TRUNCATED_JSON_OTHER = b'{"'
# A non-numeric sample value: prometheus_client's parser raises ValueError on it. It
# comes first, so a strict parser gets nothing out of the otherwise valid text after it.
MALFORMED_METRICS_LINE = b'vllm:num_requests_running{engine="0"} None\n'


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.type, self.param)


def error_response(status: int, message: str, type_: str, param: str | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": type_, "param": param, "code": status}}, status=status
    )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param)


class UvicornAccessLogger(AbstractAccessLogger):
    """One line per request, in the format a supervisor tailing vLLM's log expects."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        try:
            phrase = http.HTTPStatus(response.status).phrase
        except ValueError:
            phrase = ""
        self.logger.info(
            '%s - "%s %s HTTP/%d.%d" %d %s',
            request.remote,
            request.method,
            request.path_qs,
            request.version.major,
            request.version.minor,
            response.status,
            phrase,
        )

    @property
    def enabled(self) -> bool:
        return True


async def read_json(request: web.Request) -> dict:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"JSON decode error: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    return body


def query_json(request: web.Request) -> dict:
    """The query as logged: repeated keys (tags) become lists."""
    out: dict = {}
    for k in request.query:
        vals = request.query.getall(k)
        out[k] = vals if len(vals) > 1 or k == "tags" else vals[0]
    return out


async def cut(request: web.Request) -> NoReturn:
    """Drop the connection the way a dying proxy does: whatever was written goes out,
    then FIN; no status line if nothing was, no terminating chunk if a body was under way.

    The handler then waits to be cancelled (handler_cancellation, set in __main__):
    returning would make aiohttp log a response nobody received."""
    if request.transport is not None:
        request.transport.close()
    await hang_forever()
    raise AssertionError("unreachable")


def truncated_json(path: str) -> bytes:
    return TRUNCATED_JSON.get(path, TRUNCATED_JSON_OTHER)
