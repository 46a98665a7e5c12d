"""The rest of a paused answer (router.proxy.resume keeps what was sent): the continuation asked of
the engine that serves the model now, and the splice that writes it into the client's stream as
if one engine had answered.

The continuation starts from the answer's token ids, not its text (vLLM 0.32):
- completions: the prompt's ids plus the answer's, as the prompt;
- chat: the same ids in `kv_transfer_params.prompt_token_ids`, which vLLM takes instead of rendering
  the messages (vllm/renderers/online_renderer.py:105-153) and still answers in chat's shape;
- `max_tokens` (`max_completion_tokens`) and `min_tokens` less the j ids it starts from.
The seam: j is the longest run of the answer's ids that decodes to whole characters (an id prompt
ending inside a UTF-8 character would make vLLM's first delta the whole prompt's text:
vllm/v1/engine/detokenizer.py:195-198). Its text (one `/detokenize`) against what the client has
gives what vLLM had held back (`pending`, sent first: vLLM holds back the last len(stop)-1
characters while a stop string could still match, detokenizer.py:85-90, 161-176) or what the client
has beyond j (dropped from the continuation's start). A stop string that begins in `pending` is
invisible to the continuing engine, so the splice checks that window itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from array import array
from typing import Any, Awaitable, Callable, NamedTuple, Optional

from aiohttp import web

from engines.engine import Engine
from router.errors import sse_error
from router.proxy.exchange import UpstreamError
from router.proxy.resume import CHAT, ENGINE_FAILED, Cut, NotResumable, Paused, Transcript, with_ids
from router.proxy.upstream import Upstreams, request_bytes

DETOKENIZE_TIMEOUT_S = 30.0
REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of a character it has not seen whole
Decode = Callable[[list[int]], Awaitable[str]]  # token ids to text: an engine's /detokenize, here or on a peer


class Plan(NamedTuple):
    """What the next forward of a paused request sends: its body, and for a stream how its events are kept and rewritten."""

    body: bytes
    transcript: Optional[Transcript]
    splice: Optional[Splice]


async def plan(decode: Decode, where: str, endpoint: str, body: dict[str, Any], paused: Paused, encode,
               prefilled: Optional[Callable[[int, float], None]] = None) -> Plan:
    """The continuation to send now the lease is back (`decode`: ids to text, by the engine or peer `where` that
    will continue it). Raises Cut when the answer cannot be resumed exactly, Finished when the client has every
    token of it already, Paused when the engine failed again. `prefilled(tokens, seconds)`: told how long the
    continuation's prompt took to its first event (`Splice`)."""
    chat = endpoint == CHAT
    transcript = paused.transcript
    if transcript is None:  # a buffered answer: its engine's partial answer never reached the router; sent again whole
        return Plan(encode(body), None, None)
    try:
        text = transcript.so_far()
    except NotResumable as exc:
        raise Cut(exc.reason, str(exc)) from None
    if transcript.first is None:  # nothing went out yet: the original request, recorded from its start
        return Plan(encode(with_ids(body)), Transcript(chat), None)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    prompt_ids = transcript.prompt_ids
    assert prompt_ids is not None
    if transcript.done or transcript.finish_reason is not None:
        raise Finished(transcript, "", include_usage, len(prompt_ids), len(transcript.ids))
    try:
        j, decoded = await whole_characters(decode, transcript.ids)
        if not (decoded.startswith(text) or text.startswith(decoded)) and transcript.silent:
            # vLLM's /detokenize writes special tokens out; its stream skipped them (skip_special_tokens):
            # decode again without the ids the stream sent without text and that are whole text alone.
            skipped = await specials(decode, transcript.silent)
            if skipped:
                j, decoded = await whole_characters(decode, transcript.ids, skipped)
    except UpstreamError as exc:  # the engine failed again: one more pause
        raise Paused(ENGINE_FAILED, f"{where} failed before the rest could be asked for: {exc}",
                     paused.response, transcript) from None
    if decoded.startswith(text):
        pending, drop = decoded[len(text):], ""
    elif text.startswith(decoded):
        pending, drop = "", text[len(decoded):]
    else:
        raise Cut("mismatch", "the answer's token ids do not decode to the text its client got")
    left = remaining(body, j)
    beyond = len(transcript.ids) - j  # ids the client has past the seam: the continuation writes them again
    # The ids from here are the continuation's; the text stays the client's (the splice records what it sends,
    # pending text included), so a second pause before the pending text went out finds it pending again.
    transcript.restart_at(j)
    if left is not None and left <= 0:  # the cut fell after its last token: only the end is left to send
        raise Finished(transcript, pending, include_usage, len(prompt_ids), j)
    ids = [*prompt_ids, *transcript.ids]
    include_stop = bool(body.get("include_stop_str_in_output"))
    splice = Splice(transcript, j, len(prompt_ids), include_usage, pending, drop, stops(body), include_stop,
                    before=text if include_stop else "", beyond=beyond, prefilled=prefilled)
    return Plan(encode(continuation(endpoint, body, ids, j)), transcript, splice)


def continuation(endpoint: str, body: dict[str, Any], ids: list[int], j: int) -> dict[str, Any]:
    """The request for the rest of an answer whose prompt and first `j` answer ids are `ids`."""
    out = with_ids(body)
    out["stream"] = True
    out["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int):
            out[key] = body[key] - j
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - j)
    out.pop("prompt_logprobs", None)  # the prompt's logprobs went out with the first part
    out["echo"] = False  # the prompt was echoed with the first part
    if endpoint == CHAT:
        out["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), "prompt_token_ids": ids}
    else:
        out["prompt"] = ids
    return out


def remaining(body: dict[str, Any], k: int) -> Optional[int]:
    """How many tokens the answer may still have (None: no limit asked)."""
    limits = [body[key] for key in ("max_tokens", "max_completion_tokens") if isinstance(body.get(key), int)]
    return min(limits) - k if limits else None


def stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,) if stop else ()
    return tuple(s for s in stop if isinstance(s, str) and s) if isinstance(stop, list) else ()


async def whole_characters(decode: Decode, ids: array, skipped: frozenset[int] = frozenset()) -> tuple[int, str]:
    """The longest run of `ids` from the start that decodes to whole characters, and its text (the
    continuing engine's `/detokenize`, without the `skipped` ids; a UTF-8 character is at most 4 ids long
    on a byte-level vocabulary)."""
    j = len(ids)
    while True:
        text = (await decode([i for i in ids[:j] if i not in skipped])) if j else ""
        if not text.endswith(REPLACEMENT) or j == 0 or len(ids) - j >= 4:
            return j, text
        j -= 1


async def specials(decode: Decode, silent: set[int]) -> frozenset[int]:
    """Of the ids a stream sent without text, those that decode alone to whole text: special tokens, which
    vLLM's stream skips (skip_special_tokens, vllm/v1/engine/detokenizer.py:187-198) and its /detokenize
    writes out (it has no skip_special_tokens: entrypoints/serve/tokenize/protocol.py:164-176). The others
    were bytes of a character or text held back for a stop string."""
    out = set()
    for i in sorted(silent):
        text = await decode([i])
        if text and REPLACEMENT not in text:
            out.add(i)
    return frozenset(out)


async def detokenize(upstreams: Upstreams, engine: Engine, ids: list[int]) -> str:
    client = engine.client
    if client is None:
        raise Cut("engine_error", f"engine '{engine.name}' has no address")
    pool = upstreams.pool(client.base_url, client.tls)
    data = json.dumps({"model": engine.served_name, "tokens": ids}).encode()
    try:
        async with asyncio.timeout(DETOKENIZE_TIMEOUT_S):
            exchange = await pool.request(request_bytes("POST", "/detokenize", pool, client.headers, "application/json", data))
            try:
                answer = await exchange.body()
            finally:
                exchange.end()
        text = json.loads(answer).get("prompt")
    except UpstreamError:
        raise
    except (TimeoutError, ValueError, AttributeError) as exc:
        raise Cut("detokenize", f"engine '{engine.name}' could not decode the answer so far (/detokenize: {exc!r})") from None
    if exchange.status >= 300 or not isinstance(text, str):
        raise Cut("detokenize", f"engine '{engine.name}' could not decode the answer so far (/detokenize: HTTP {exchange.status})")
    return text


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


class Finished(Exception):
    """The client has every token of the answer (the cut fell after its last): only its end is left to send."""

    def __init__(self, transcript: Transcript, pending: str, include_usage: bool, prompt_tokens: int, completion_tokens: int):
        super().__init__("finished")
        self.transcript, self.pending, self.include_usage = transcript, pending, include_usage
        self.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}
        self.response: Optional[web.StreamResponse] = None

    async def send(self, response: web.StreamResponse) -> web.StreamResponse:
        """What the client lacks of the end: held-back text, the finish (`length`), its usage if asked, and [DONE]."""
        transcript = self.transcript
        if not transcript.done:
            first = transcript.first or {}
            if transcript.finish_reason is None:
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
                choice.update({"delta": {"content": self.pending}} if transcript.chat else {"text": self.pending})
                await response.write(_event({**first, "choices": [choice]}))
            if self.include_usage and not transcript.usage:
                await response.write(_event({**first, "choices": [], "usage": self.usage}))
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self.response = response
        return response


class Splice:
    """Rewrites a continuation's events as the rest of the client's answer: the first chunk's identity
    throughout, no second role delta, the seam's held-back text first (or the text the client has
    already dropped), stop strings checked across the seam, the usage counting the whole answer (only
    if the client asked for it), each choice's `token_ids` as the first part had them, never the
    continuation's prompt ids (the answer so far). Records what it sends."""

    def __init__(self, transcript: Transcript, j: int, prompt_tokens: int, include_usage: bool, pending: str, drop: str,
                 stop: tuple[str, ...], include_stop: bool, before: str, beyond: int = 0,
                 prefilled: Optional[Callable[[int, float], None]] = None) -> None:
        self.transcript = transcript
        self.identity = transcript.first or {}
        self.j, self.prompt_tokens = j, prompt_tokens
        self.include_usage = include_usage
        self.beyond = beyond  # the continuation's first ids that the client already has (as `drop` is text)
        self.pending, self.drop = pending, drop
        self.stop, self.include_stop = stop, include_stop
        # The seam's window: held until a stop string that begins before the continuation's own text (in
        # `pending`, or with include_stop_str_in_output in what the client has: vLLM then holds nothing
        # back) can be told from none. The continuing engine finds those that begin in its own text.
        longest = max(map(len, stop), default=0)
        self.before = before[len(before) - longest + 1:] if longest > 1 else ""
        self.starts = len(self.before) + len(pending)  # a match beginning before this is the splice's to find
        self.window = len(pending) + longest - 1 if stop and self.starts else 0
        self.held: list[dict[str, Any]] = []
        self.rest = b""
        self.ended = False  # a stop across the seam ended the answer: the continuation is cut off
        self.generated = 0
        # From the plan (right after the lease) to the continuation's first event: the recompute of its prompt and
        # the answer's first `j` tokens, the engine's prefill rate the scheduler prices a preemption at.
        self.planned_at, self.prefilled = time.monotonic(), prefilled

    def __call__(self, pieces: list[bytes]) -> list[bytes]:
        data = self.rest + b"".join(pieces)
        *events, self.rest = data.split(b"\n\n")
        if events and self.prefilled is not None:
            self.prefilled(self.prompt_tokens + self.j, time.monotonic() - self.planned_at)
            self.prefilled = None
        out: list[bytes] = []
        for event in events:
            if not self.ended:
                out += self._event(event)
        return out

    def flush(self) -> list[bytes]:
        """What is left when the continuation ends."""
        rest, self.rest = self.rest, b""
        out = self._event(rest) if rest.strip() and not self.ended else []
        return out + (self._release(None) if self.held else [])

    def _event(self, event: bytes) -> list[bytes]:
        if not event.startswith(b"data:"):
            return [event + b"\n\n"]  # a comment or an `event:` line: as it came
        data = event[5:].strip()
        if data == b"[DONE]":
            return [*self._release(None), event + b"\n\n"]
        try:
            chunk = json.loads(data)
        except ValueError:
            return [event + b"\n\n"]
        if not isinstance(chunk, dict) or "error" in chunk:
            return [*self._release(None), event + b"\n\n"]
        chunk.update(self.identity)
        chunk.pop("prompt_token_ids", None)  # the continuation's prompt is the answer so far: never the client's
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if isinstance(usage, dict) and not choices:
            if not self.include_usage:
                return self._release(None)
            completion = self.j + usage.get("completion_tokens", 0)
            chunk["usage"] = {**usage, "prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                              "total_tokens": self.prompt_tokens + completion}
            return [*self._release(None), _event(chunk)]
        if "usage" in chunk and not self.include_usage:
            chunk.pop("usage")  # continuous usage the client never asked for
        kept = []
        for choice in choices:
            choice.pop("prompt_token_ids", None)  # completions: the continuation's prompt, in its first choice
            delta = choice.get("delta") if self.transcript.chat else None
            if isinstance(delta, dict) and delta.get("role") is not None:
                delta.pop("role")
                if not delta.get("content") and choice.get("finish_reason") is None and not choice.get("logprobs"):
                    continue  # the continuation's own role delta: the client had its one
            if isinstance(choice.get("token_ids"), list):
                self.generated += len(choice["token_ids"])
            kept.append(choice)
        if choices and not kept:
            return []
        chunk["choices"] = kept
        return self._seam(chunk)

    def _seam(self, chunk: dict[str, Any]) -> list[bytes]:
        """The held-back text first; what the client already has dropped; the window held for stop strings."""
        for choice in chunk["choices"]:
            key, holder = ("content", choice.setdefault("delta", {})) if self.transcript.chat else ("text", choice)
            text = holder.get(key) or ""
            if self.drop and text:
                n = min(len(self.drop), len(text))
                if text[:n] != self.drop[:n]:  # a sampled continuation that did not regenerate them
                    self.ended = True
                    return [sse_error("the resumed answer diverged from what was already sent; retry it", "stream_cut", 503)]
                self.drop, text = self.drop[n:], text[n:]
            if self.pending:
                text, self.pending = self.pending + text, ""
            if key in holder or text:
                holder[key] = text
        if self.window:
            self.held.append(chunk)
            seen = "".join(self._text(c) for c in self.held)
            if len(seen) < self.window and not any(c.get("finish_reason") for c in chunk["choices"]):
                return []
            return self._release(seen)
        return [self._send(chunk)]

    def _text(self, chunk: dict[str, Any]) -> str:
        key = "content" if self.transcript.chat else "text"
        return "".join(((c.get("delta") or {}) if self.transcript.chat else c).get(key) or "" for c in chunk["choices"])

    def _release(self, seen: Optional[str]) -> list[bytes]:
        """The held chunks, as one: cut at a stop string that began in the held-back text, if one did."""
        if not self.held:
            return []
        held, self.held = self.held, []
        self.window = 0
        seen = "".join(self._text(c) for c in held) if seen is None else seen
        last = held[-1]
        window_text = self.before + seen
        found = [(at, s) for s in self.stop if 0 <= (at := window_text.find(s)) < self.starts and at + len(s) > len(self.before)]
        choice = dict(last["choices"][0]) if last["choices"] else {"index": 0}
        if any(isinstance(c.get("token_ids"), list) for h in held for c in h["choices"]):
            choice["token_ids"] = [i for h in held for c in h["choices"] for i in c.get("token_ids") or ()]
        key = "content" if self.transcript.chat else "text"
        if found:
            at, s = min(found)
            end = at + len(s) if self.include_stop else at
            seen, choice["finish_reason"], choice["stop_reason"] = seen[:max(0, end - len(self.before))], "stop", s
            self.ended = True
        if self.transcript.chat:
            choice["delta"] = {**(choice.get("delta") or {}), key: seen}
        else:
            choice[key] = seen
        merged = {**last, "choices": [choice]}
        out = [self._send(merged)]
        if self.ended:
            if self.include_usage:
                completion = self.j + self.generated
                out.append(_event({**self.identity, "choices": [], "usage": {
                    "prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                    "total_tokens": self.prompt_tokens + completion}}))
            out.append(b"data: [DONE]\n\n")
        return out

    def _send(self, chunk: dict[str, Any]) -> bytes:
        self.transcript.record(chunk)
        for choice in chunk.get("choices") or ():
            if self.beyond and isinstance(choice.get("token_ids"), list):
                n = min(self.beyond, len(choice["token_ids"]))
                choice["token_ids"], self.beyond = choice["token_ids"][n:], self.beyond - n
        return _event(chunk)
