"""Forward one request to the engine that holds its lease.

The request goes out as raw bytes on a pooled keep-alive connection (router.proxy.upstream, router.proxy.exchange); a
stream's bytes pass through as the engine framed them (router.proxy.relay), with back-pressure; other
answers are read whole. If the client goes away, the upstream connection is cut at once, which
makes vLLM abort the generation. When the router has
already sent a stream's headers (keep-alive comments while the request waited for a swap),
the engine's answer must travel inside that stream, errors included.

An answer's numbers (its `usage` token counts and its own `metrics.speculative_decoding`) are read
here, once, from the end of the answer the router holds anyway (a buffered body, or a stream's last
chunks): the acceptance watch (`engines.watch.answered`) and the walk's record both get them, and
no text of the answer is kept.

A request holds its engine's lease while it runs, so it can be cut: by its engine's drain when
`swap.drain_timeout_s` runs out or its engine restarts, by a preemption of batch work
(`Engine.cuttable`: the request's task is cancelled), and, for a stream, by a client that takes none
of it for `queue.stall_timeout_s` (`Relay.drained`). A resumable request (`resumable=True`; a stream's
`transcript` records what its client got) that is cut, or whose engine fails mid-answer, raises
`Paused`: the walk waits for its model again and asks for the rest (router.proxy.resume). Any other
cut becomes a 503, or the stream's error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, NamedTuple, Optional

from aiohttp import web

from engines import watch
from engines.engine import Engine
from engines.gate import answer_spec_counts, mean_acceptance_length
from router.errors import APIError, for_clients, sse_error
from router.proxy.body import encoded
from router.proxy.relay import ClientStalled, Relay
from router.proxy.continuation import Splice
from router.proxy.resume import ENGINE_FAILED, Paused, Transcript
from router.proxy.responses import StreamSniffer
from router.proxy.exchange import ClientGone, Exchange, Unreachable, UpstreamError
from router.proxy.upstream import Pool, Upstreams, request_bytes

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
STALL_S = 60.0  # queue.stall_timeout_s's default
# The request's key for its answer's Numbers, read once from its end: the
# acceptance watch gets them here, and the walk records them.
ANSWER_NUMBERS = "answer_numbers"
# Set on a request whose answer was cut and not resumed (the walk counts it in hotswap_streams_cut_total).
CUT = "hotswap.cut"
log = logging.getLogger("hotswap")


class ClientClosed(Exception):
    """The client left mid-stream (or was cut for taking nothing of it): `response` is all it got."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("the client went away before the end of its stream")
        self.response = response


class Hold:
    """A request's hold on its engine, as the engine's drain ends it early (`Engine.cuttable`)."""

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        self.why: Optional[str] = None
        self.reason = ""
        self.response: Optional[web.StreamResponse] = None  # a stream whose head is out: a cut can only end its connection

    def cut(self, why: str, reason: str) -> None:
        if self.why is None and self.task is not None:
            self.why, self.reason = why, reason
            self.task.cancel()

    def was_cut(self) -> bool:
        """Whether a CancelledError is this cut's alone (then it is taken back: the request answers
        why), not also the client's leaving. Call once per CancelledError."""
        return self.why is not None and self.task is not None and self.task.uncancel() == 0


def json_for(engine: Engine, body: dict[str, Any], raw: bytes) -> bytes:
    """The request body for `engine`: as received, unless the engine serves the model under another name."""
    if body.get("model") not in engine.served_names:  # only attached engines that serve other names, or no model given
        body["model"] = engine.served_name
        return encoded(body)
    return raw


async def forward(request: web.Request, upstreams: Upstreams, engine: Engine, path: str, body: bytes = b"", *,
                  method: str = "POST", content_type: Optional[str] = "application/json",
                  on_answer: Optional[Callable[[bytes], None]] = None, sniffer: Optional[StreamSniffer] = None,
                  prepared: Optional[web.StreamResponse] = None, anthropic: bool = False,
                  stall_s: float = STALL_S, numbers: bool = False, resumable: bool = False,
                  transcript: Optional[Transcript] = None, strip: bool = False, splice: Optional[Splice] = None
                  ) -> web.StreamResponse:
    """`numbers`: read the answer's numbers into `request[ANSWER_NUMBERS]` (for the activity log; an
    engine with a draft has them read anyway, for its acceptance watch); a stream keeps its last bytes for it.
    `resumable`: a cut raises Paused; `transcript` records a stream's events (`strip`: of the prompt's ids the client
    did not ask for), `splice` rewrites a continuation's."""
    client = engine.client
    if client is None:  # a lease implies a started engine; say so rather than crash if that ever breaks
        raise APIError(502, f"engine '{engine.name}' has no address yet", "engine_unreachable")
    pool = upstreams.pool(client.base_url, client.tls)
    hold = Hold()
    # What a cut would compute again, for the price of a preemption: a body's bytes over 4 stand in for its
    # prompt's tokens until the engine has counted them.
    size = (lambda: transcript.tokens(len(body) // 4)) if resumable and transcript is not None else \
        (lambda: len(body) // 4) if resumable else None
    with engine.cuttable(hold.cut, size):
        try:
            # A resumable request whose engine fails before its answer began (a crash while a buffered answer is
            # computed: its head comes last) is paused like one cut mid-answer; nothing of it reached the client.
            # Not on an engine the router does not run (`url:`): nothing here brings it back, so the client hears
            # at once (a front may send it elsewhere).
            failed = (lambda why: Paused(ENGINE_FAILED, why, prepared, transcript)) if resumable and engine.spec.managed \
                else None
            exchange = await _send(pool, engine, request_bytes(method, path, pool, client.headers, content_type, body), failed)
            try:
                if exchange.stream:
                    return await _stream(request, exchange, engine, sniffer, prepared, anthropic, hold, stall_s,
                                         numbers or engine.has_draft, transcript if resumable else None, strip, splice)
                return await _buffered(request, exchange, engine, on_answer, prepared, anthropic,
                                       numbers or engine.has_draft, resumable)
            finally:
                if exchange.trailing:
                    log.warning("engine %s sent %d bytes after a complete answer to %s %s (a second response on the same "
                                "connection?): the client got the first answer alone; the bytes were dropped and the "
                                "connection closed", engine.name, exchange.trailing, method, path)
                exchange.end()
        except asyncio.CancelledError:
            if not hold.was_cut():
                raise
            if resumable:  # cut before its answer began: nothing of it reached the client
                raise Paused(hold.reason, hold.why or "", prepared, transcript) from None
            request[CUT] = True
            if hold.response is None:
                raise APIError(503, f"{hold.why}, so it was cut; retry it", "drain_timeout") from None
            if request.transport is not None:
                request.transport.abort()
            return hold.response


async def _buffered(request: web.Request, exchange: Exchange, engine: Engine, on_answer: Optional[Callable[[bytes], None]],
                    prepared: Optional[web.StreamResponse], anthropic: bool, numbers: bool, resumable: bool) -> web.StreamResponse:
    try:
        payload = await exchange.body()
    except UpstreamError as exc:
        watch.suspect(engine, f"while answering: {exc}")
        if resumable:
            raise Paused(ENGINE_FAILED, f"engine '{engine.name}' failed while answering: {for_clients(str(exc))}",
                         prepared, None) from None
        request[CUT] = True
        raise APIError(502, f"engine '{engine.name}' failed while answering: {for_clients(str(exc))}", "engine_error") from None
    request["first_byte_at"] = time.monotonic()
    if numbers and exchange.status < 300:
        _answered(request, engine, payload)
    if prepared is not None:
        return await _inside_stream(prepared, exchange.status, payload, anthropic)
    if exchange.status < 300:
        if on_answer is not None:
            on_answer(payload)
    return web.Response(status=exchange.status, body=payload, headers={"Content-Type": exchange.content_type})


def _answered(request: web.Request, engine: Engine, end: bytes) -> None:
    """The answer's numbers, read once from its end: for the acceptance watch, and for the walk's record."""
    request[ANSWER_NUMBERS] = numbers = read_numbers(end)
    if numbers.spec is not None:
        watch.answered(engine, *numbers.spec)


async def _send(pool: Pool, engine: Engine, data: bytes, failed: Optional[Callable[[str], Paused]] = None) -> Exchange:
    """The request sent and its answer's head read. `failed(why)`: the Paused to raise when the engine cannot be
    reached or fails before its head (a resumable request); otherwise a 502."""
    try:
        return await pool.request(data)
    except Unreachable as exc:
        watch.suspect(engine, f"connect: {exc}")
        why, code = f"engine '{engine.name}' is unreachable: {for_clients(str(exc))}", "engine_unreachable"
    except UpstreamError as exc:
        watch.suspect(engine, f"before answering: {exc}")
        why, code = f"engine '{engine.name}' failed before answering: {for_clients(str(exc))}", "engine_error"
    if failed is not None:
        raise failed(why)
    raise APIError(502, why, code)


async def _stream(request: web.Request, exchange: Exchange, engine: Engine, sniffer: Optional[StreamSniffer],
                  prepared: Optional[web.StreamResponse], anthropic: bool, hold: Hold, stall_s: float,
                  numbers: bool, transcript: Optional[Transcript], strip: bool, splice: Optional[Splice]) -> web.StreamResponse:
    response = prepared
    if response is None:
        response = hold.response = web.StreamResponse(status=exchange.status,
                                                       headers={**SSE_HEADERS, "Content-Type": exchange.content_type})
        await response.prepare(request)
    hold.response = response
    writer, transport = request.writer, request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away")
    writer.send_headers()  # type: ignore[attr-defined]
    relay = Relay(transport, writer.chunked, exchange.chunked, sniffer, keep_tail=numbers,  # type: ignore[attr-defined]
                  transcript=transcript, strip=strip, rewrite=splice)
    writer.chunked = False  # type: ignore[attr-defined]  # the relay frames the body; write_eof adds nothing
    try:
        await exchange.relay(relay, lambda: relay.drained(writer.drain, stall_s))
    except ClientGone as exc:  # aiohttp cancels this handler for it too (handler_cancellation); nothing left to send
        if splice is not None and splice.ended and not relay.transport.is_closing():  # a stop across the seam: complete
            relay.end()
            request["first_byte_at"] = exchange.first_body_at or time.monotonic()
            await response.write_eof()
            return response
        if isinstance(exc, ClientStalled):
            log.warning("cut a stream of %s to %s: %s; its lease is freed", engine.name, request.remote, exc)
        request["first_byte_at"] = exchange.first_body_at or time.monotonic()
        raise ClientClosed(response) from None
    except asyncio.CancelledError:
        if not hold.was_cut():
            raise
        if transcript is not None and relay.at_boundary and not relay.congested():
            # Between chunks, and a client that reads (one that does not would stall the pause's comment lines).
            writer.chunked = relay.chunked  # type: ignore[attr-defined]  # the writer frames again
            raise Paused(hold.reason, hold.why or "", response, transcript) from None
        request[CUT] = True
        if relay.congested():  # behind a client that does not read: no event could reach it
            relay.transport.abort()
            return response
        relay.end_with_error(sse_error(f"{hold.why}, so it was cut; retry it", "drain_timeout", anthropic=anthropic))
    except UpstreamError as exc:
        # Headers are gone already: the error travels in the stream, where the SDK raises it.
        watch.suspect(engine, f"mid-stream: {exc}")
        why = f"engine '{engine.name}' failed mid-stream: {for_clients(str(exc))}"
        if transcript is not None and relay.at_boundary and not relay.congested():
            writer.chunked = relay.chunked  # type: ignore[attr-defined]
            raise Paused(ENGINE_FAILED, why, response, transcript) from None
        request[CUT] = True
        relay.end_with_error(sse_error(why, "engine_error", anthropic=anthropic))
    else:
        relay.end()
        if relay.tail and exchange.status < 300:
            _answered(request, engine, b"".join(relay.tail))
    request["first_byte_at"] = exchange.first_body_at or time.monotonic()
    await response.write_eof()
    return response


async def _inside_stream(response: web.StreamResponse, status: int, payload: bytes, anthropic: bool) -> web.StreamResponse:
    """A JSON answer (an engine's error, typically) to a stream whose headers the router already sent."""
    if status >= 400:
        message = _engine_message(payload) or f"engine answered HTTP {status}"
        await response.write(sse_error(message, "engine_error", status=status, anthropic=anthropic))
    else:
        await response.write(b"data: " + payload + b"\n\n")
    await response.write_eof()
    return response


def _engine_message(payload: bytes) -> Optional[str]:
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError, RecursionError):
        return None
    message = error.get("message") if isinstance(error, dict) else error
    return message if isinstance(message, str) else None


# -- an answer's numbers -----------------------------------------------------------------------

_USAGE_KEY = b'"usage":'  # JSON escapes a quote inside a string, so generated text cannot match
_DECODER = json.JSONDecoder()
# `usage` and `metrics` close an answer's JSON (and a stream's kept tail is small already): only
# this many bytes at its end are searched, so a large body (many embeddings) costs no more.
END_BYTES = 16_384


class Numbers(NamedTuple):
    """An answer's numbers: the acceptance watch and the activity log get these, never its bytes."""

    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    spec: Optional[tuple[int, int]] = None  # (steps, accepted draft tokens): the answer's own, as the gate counts them

    @property
    def mean_acceptance_length(self) -> Optional[float]:
        mal = mean_acceptance_length(*self.spec) if self.spec is not None else None
        return None if mal is None else round(mal, 4)


NONE = Numbers()


def read_numbers(end: Optional[bytes]) -> Numbers:
    """An answer's numbers from its end (a buffered body, or a stream's last chunks). OpenAI's `usage` names, or Anthropic's and Responses' (`input_tokens`, `output_tokens`)."""
    if not end:
        return NONE
    end = end[-END_BYTES:]
    prompt = completion = None
    at = end.rfind(_USAGE_KEY)
    if at >= 0:
        try:
            usage, _ = _DECODER.raw_decode(end[at + len(_USAGE_KEY):].decode("utf-8").lstrip())
        except (ValueError, UnicodeDecodeError):  # a tail cut inside the event: no numbers
            usage = None
        if isinstance(usage, dict):
            prompt = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
            completion = _count(usage.get("completion_tokens", usage.get("output_tokens")))
    return Numbers(prompt, completion, answer_spec_counts(end))


def _count(value: Any) -> Optional[int]:
    return value if type(value) is int and value >= 0 else None
