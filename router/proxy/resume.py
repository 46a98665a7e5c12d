"""What a stream has sent its client, kept so that a cut answer can be resumed exactly
(router.proxy.continuation asks for the rest and splices it in).

An answer is resumed from token ids, not text: on vLLM 0.32 a text continuation is exact only where
the relayed text happens to tokenize back to the ids the model produced, which it often does not
(docs/contributors.md, "Resuming an answer", has the measurements). So a resumable stream is asked
for with `return_token_ids` (vllm/entrypoints/openai/chat_completion/protocol.py:423,
completion/protocol.py:171): its first chunk carries the prompt's ids, every chunk its own. The
client gets the prompt's ids only if it asked for them (`strip_prompt_ids`, on the first event); the
answer's ids ride along in each choice's `token_ids`, as vLLM writes them (OpenAI's clients ignore a
field they do not know, as they ignore vLLM's `stop_reason`): removing them from every chunk cost a
resumable stream 10-15% of its proxy CPU (docs/benchmarks.md), and the hot path pays for resuming
only a reference to each chunk it relays. The chunks are read (into text and ids) past
`COMPACT_BYTES`, and at a cut.

A request's pauses are counted here too (`Pauses`): one paused too often, or whose engine died under
it too often, is cut for good (`too_often`, `Cut`, `end_cut`).
"""

from __future__ import annotations

import json
import re
import time
from array import array
from typing import Any, Iterator, Optional

from aiohttp import web

from router.errors import APIError, sse_error

CHAT, COMPLETIONS = "chat", "completions"
MAX_RESUMES = 8  # an answer cut more often than this is cut for good
# An answer whose engine died under it this often may be what kills it (a poison request): no more restarts for it.
MAX_FAILURES = 2
ENGINE_FAILED = "engine_failed"  # the fourth reason a request is paused, beside engines.leases' cuts
# Past this many bytes of relayed events a stream's transcript is read down to its text and ids: what the
# router keeps per stream is then 8 bytes per token, its text as one string, and at most this much more.
COMPACT_BYTES = 16 * 1024
MAX_SILENT = 64  # distinct ids kept that came without text (router.proxy.continuation asks the engine about each)
# The prompt's ids `return_token_ids` adds to a stream's first event, as vLLM writes them (pydantic's compact
# JSON; never first in their object). JSON escapes a quote inside a string, so no generated text can contain
# these bytes; ids are integers, so the first `]` closes the list.
_PROMPT_IDS_FIELD = re.compile(rb',"prompt_token_ids":(?:null|\[[^\]]*\])')
# What the parse of a stream's events looks for; events without any of these carry only text and ids, which
# are read by pattern (resumable streams have one choice; JSON escapes quotes inside strings, so these bytes
# cannot come from generated text).
# Found with bytes.find (memchr), one marker at a time: a regex alternation tries each at every byte.
_UNUSUAL = (b'"role"', b'"tool_calls"', b'"reasoning', b'"error"', b'"usage":{', b'prompt_token_ids', b'"finish_reason":"',
            b"[DONE]")
_IDS = re.compile(rb'"token_ids":\[([^\]]*)\]')
_TEXT = {True: re.compile(rb'"content":("[^"\\]*(?:\\.[^"\\]*)*")'), False: re.compile(rb'"text":("[^"\\]*(?:\\.[^"\\]*)*")')}
# Keys that make the rest of an answer depend on more than its ids so far (docs/operators.md lists why).
_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_PENALTIES = ("frequency_penalty", "presence_penalty")  # vLLM counts them over output tokens only
# vLLM 0.32 renders chat messages with a non-text part (an image, audio, a file) again and ignores the ids it
# was given (chat_completion/protocol.py:1033-1051, renderers/online_renderer.py:128-133): its answer would start over.
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking", "tool_reference")
_MEDIA_KEYS = ("image_url", "input_image", "image_embeds", "image_pil", "audio_url", "input_audio", "audio_embeds",
               "video_url", "video_embeds", "prompt_embeds")


class Paused(Exception):
    """A resumable answer was cut (`reason`: engines.leases' codes, or ENGINE_FAILED): `response` is
    the client's stream if its head is out, `transcript` what that stream has sent."""

    def __init__(self, reason: str, why: str, response: Optional[web.StreamResponse], transcript: Optional[Transcript]):
        super().__init__(why)
        self.reason, self.why, self.response, self.transcript = reason, why, response, transcript


class NotResumable(Exception):
    """The answer cannot be continued exactly: `reason` is the cut's label in hotswap_streams_cut_total."""

    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason = reason


def resumable(endpoint: str, body: dict[str, Any], anthropic: bool) -> Optional[str]:
    """None if an answer to `body` can be resumed exactly when cut, else the reason it cannot."""
    if anthropic or endpoint not in (CHAT, COMPLETIONS):
        return "shape"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
        return "n"  # several sequences (beam search keeps several until the end): one continuation has one
    if endpoint == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(type(i) is int for i in prompt))):
            return "n"  # a list of prompts is a batch: one answer each
    if any(body.get(key) is not None for key in _STRUCTURED) and body.get("response_format") not in ({"type": "text"},):
        return "structured_output"
    if any(body.get(key) not in (None, 0) for key in _PENALTIES):
        return "penalties"
    if body.get("bad_words"):
        return "bad_words"  # matched against the answer's own tokens only (vllm/v1/sample/sampler.py:385)
    if body.get("truncate_prompt_tokens") not in (None, -1):
        return "truncation"  # the continuation's prompt (prompt and answer so far) would be cut elsewhere
    if endpoint == CHAT and _media(body.get("messages")):
        return "media"
    return None


def _media(messages: Any) -> bool:
    """Whether a message has a content part that is not text (vllm/renderers/chat_utils.py:1824-1843)."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and (part.get("type", "text") not in _TEXT_PARTS or
                                           any(key in part for key in _MEDIA_KEYS)):
                return True
    return False


def with_ids(body: dict[str, Any]) -> dict[str, Any]:
    """The body a resumable stream is sent with: its token ids asked for."""
    return body if body.get("return_token_ids") is True else {**body, "return_token_ids": True}


def asking_ids(data: bytes) -> bytes:
    """A JSON object's bytes with `return_token_ids` asked for, without encoding it again: the key goes
    first, so a client's own `return_token_ids` (written later) is the one that counts."""
    start = data.find(b"{") + 1
    if not start or data[start:].lstrip().startswith(b"}"):
        return encoded_with_ids(data)
    return b'{"return_token_ids":true,' + data[start:]


def encoded_with_ids(data: bytes) -> bytes:
    return json.dumps(with_ids(json.loads(data))).encode()


def strip_prompt_ids(pieces: list[bytes], _sub=_PROMPT_IDS_FIELD.sub) -> list[bytes]:
    """The relayed chunks without the prompt's ids the router asked for (the client did not). A field cut
    across two chunks is left whole: an extra field is still valid JSON."""
    return [_sub(b"", piece) for piece in pieces]


def _found(block: bytes, at: int) -> Iterator[int]:
    """Where in `block`, from `at`, an event says more than text and ids."""
    for marker in _UNUSUAL:
        found = block.find(marker, at)
        while found >= 0:
            yield found
            found = block.find(marker, found + len(marker))


class Transcript:
    """The events a stream has sent its client, as references to the relayed chunks until they are
    worth reading (`COMPACT_BYTES`), then as the answer's text, its token ids and the prompt's. Reading
    costs the stream's hot path: most events carry only a piece of text and its ids, and are read by
    pattern (`_TEXT`, `_IDS`: a few C calls per block); the others are parsed."""

    __slots__ = ("chat", "pieces", "size", "rest", "first", "text", "ids", "prompt_ids", "role_sent", "finish_reason",
                 "done", "usage", "unresumable", "silent")

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.pieces: list[bytes] = []
        self.size = 0
        self.rest = b""  # an event not yet complete
        self.first: Optional[dict[str, Any]] = None  # id, object, created, model of the first chunk the client got
        self.text: list[str] = []
        self.ids = array("q")  # the answer's token ids so far
        self.prompt_ids: Optional[array] = None
        self.role_sent = False
        self.finish_reason: Optional[str] = None
        self.done = False  # `data: [DONE]` went out
        self.usage = False  # a usage chunk went out
        self.unresumable: Optional[str] = None  # what was sent that a continuation cannot follow
        # Ids that came alone in a chunk without text: a special token vLLM skipped (skip_special_tokens), or
        # the first bytes of a character, or text held back for a stop string (router.proxy.continuation tells).
        self.silent: set[int] = set()

    def extend(self, pieces: list[bytes]) -> None:
        self.pieces.extend(pieces)
        self.size += sum(map(len, pieces))
        if self.size > COMPACT_BYTES:
            self.compact()

    def compact(self) -> None:
        """Read what was relayed: the events that say more than text and ids (the first, a role, a finish,
        usage, tool calls, an error, [DONE]) parsed, the ordinary ones between them read by pattern."""
        data = self.rest + b"".join(self.pieces)
        self.pieces, self.size = [], 0
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self.rest = data
            return
        block, self.rest = data[:end], data[end:]
        at = 0
        while self.first is None and at < end and not self.unresumable:
            stop = block.find(b"\n\n", at) + 2
            self._parse(block[at:stop])
            at = stop
        for found in sorted(_found(block, at)):
            if found < at:
                continue  # in an event parsed already
            start = block.rfind(b"\n\n", at, found)
            start = at if start < 0 else start + 2
            stop = block.find(b"\n\n", found) + 2
            self._ordinary(block[at:start])
            self._parse(block[start:stop])
            at = stop
        self._ordinary(block[at:])
        if len(self.text) > 1:
            self.text = ["".join(self.text)]  # one string, not one object per token

    def _ordinary(self, events: bytes) -> None:
        if not events:
            return
        texts, ids = _TEXT[self.chat].findall(events), _IDS.findall(events)
        if len(texts) != len(ids) or b'""' in texts:  # an event with ids and no text: which ones came alone counts
            self._parse(events)
            return
        if texts:
            self.text.append("".join(json.loads(b"[" + b",".join(texts) + b"]")))
        joined = b",".join(filter(None, ids))
        if joined:
            self.ids.extend(map(int, joined.split(b",")))

    def _parse(self, events: bytes) -> None:
        datas = []
        for event in events.split(b"\n\n"):
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # comments (keep-alive, the seam) and `event:` lines
                line = line[5:].strip()
                if line == b"[DONE]":
                    self.done = True
                else:
                    datas.append(line)
        if not datas:
            return
        try:
            chunks = json.loads(b"[" + b",".join(datas) + b"]")
        except ValueError:
            chunks = None
        if chunks is None or len(chunks) != len(datas):  # one is not JSON (or two made one): each on its own
            chunks = []
            for line in datas:
                try:
                    chunks.append(json.loads(line))
                except ValueError:
                    self.unresumable = "malformed"
        for chunk in chunks:
            self.record(chunk)

    def record(self, chunk: Any) -> None:
        """One chunk the client got (the continuation's are recorded here as they are rewritten)."""
        if not isinstance(chunk, dict) or "error" in chunk:
            self.unresumable = "engine_error"
            return
        if self.first is None:
            self.first = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = True
        if isinstance(chunk.get("prompt_token_ids"), list) and self.prompt_ids is None:  # chat: in the first chunk
            self.prompt_ids = array("q", chunk["prompt_token_ids"])
        for choice in chunk.get("choices") or ():
            if isinstance(choice.get("prompt_token_ids"), list) and self.prompt_ids is None:  # completions
                self.prompt_ids = array("q", choice["prompt_token_ids"])
            if self.chat:
                delta = choice.get("delta") or {}
                if delta.get("role"):
                    self.role_sent = True
                if delta.get("tool_calls"):
                    self.unresumable = "tools"
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.unresumable = "reasoning"
                content = delta.get("content")
            else:
                content = choice.get("text")
            if isinstance(content, str):
                self.text.append(content)
            if isinstance(choice.get("token_ids"), list):
                self.ids.extend(choice["token_ids"])
                if len(choice["token_ids"]) == 1 and not content and len(self.silent) < MAX_SILENT:
                    self.silent.add(choice["token_ids"][0])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    def tokens(self, prompt_guess: int) -> int:
        """Its prompt's tokens and the answer's so far: what a cut now would compute again (priced by the
        scheduler only when it weighs a preemption). `prompt_guess` until the first chunk has said."""
        self.compact()
        return (prompt_guess if self.prompt_ids is None else len(self.prompt_ids)) + len(self.ids)

    def so_far(self) -> str:
        """The answer's text the client has, once everything relayed is read. Raises NotResumable
        when what was sent cannot be continued exactly."""
        self.compact()
        if self.rest.strip():
            raise NotResumable("mid_event", "the cut came in the middle of an event the client had begun to receive")
        if self.unresumable is not None:
            raise NotResumable(self.unresumable, f"the answer so far holds what a continuation cannot follow ({self.unresumable})")
        text = "".join(self.text)
        self.text = [text] if text else []
        if self.first is not None and self.prompt_ids is None:
            raise NotResumable("no_token_ids", "the engine sent no token ids (return_token_ids), so the answer cannot be "
                                               "continued exactly")
        return text

    def restart_at(self, ids: int) -> None:
        """After a seam: the answer is its first `ids` ids; the continuation's follow."""
        del self.ids[ids:]


# -- a request's pauses, and the end of one that cannot be resumed --------------------------------

class Cut(Exception):
    """The paused answer cannot be resumed: `reason` labels it in hotswap_streams_cut_total."""

    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason = reason


def too_often(reasons: list[str], why: str) -> None:
    """Raises Cut when an answer was paused too often to try again (`reasons`: each pause's, this one's last)."""
    if len(reasons) > MAX_RESUMES:
        raise Cut("too_many", f"the answer was cut {len(reasons)} times; the last: {why}")
    if reasons.count(ENGINE_FAILED) > MAX_FAILURES:
        raise Cut("engine_failed", f"its engine failed {MAX_FAILURES + 1} times while answering it, so it is not tried "
                                   f"again (the request may be what kills it); the last: {why}")


async def end_cut(response: Optional[web.StreamResponse], cut: Cut, anthropic: bool) -> web.StreamResponse:
    """An answer that could not be resumed: a stream ends with its error event, a buffered request gets the 503."""
    message = f"{cut}; it was cut and cannot be resumed ({cut.reason}); retry it"
    if response is None:
        raise APIError(503, message, "stream_cut")
    await response.write(sse_error(message, "stream_cut", status=503, anthropic=anthropic))
    await response.write_eof()
    return response


class Pauses:
    """A request's pauses, for its metrics and its record: each one's reason, those that were resumed, and
    the time they waited."""

    __slots__ = ("reasons", "resumed", "paused_s", "since")

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.resumed: list[str] = []
        self.paused_s = 0.0
        self.since = 0.0

    def began(self, reason: str) -> None:
        self.reasons.append(reason)
        self.since = time.monotonic()

    def ended(self) -> float:
        """The pause just resumed: how long it waited."""
        waited = time.monotonic() - self.since
        self.paused_s += waited
        self.resumed.append(self.reasons[-1])
        return waited
