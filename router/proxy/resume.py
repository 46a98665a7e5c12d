"""What a stream has sent its client, kept so that a cut answer can be resumed exactly
(router.proxy.continuation asks for the rest and splices it in).

An answer is resumed from token ids, not text: on vLLM 0.32 a text continuation is exact only where
the relayed text happens to tokenize back to the ids the model produced, which it often does not
(docs/contributors.md, "Resuming an answer", has the measurements). So a resumable stream is asked
for with `return_token_ids` (vllm/entrypoints/openai/chat_completion/protocol.py:423,
completion/protocol.py:171): its first chunk carries the prompt's ids, every chunk its own. The
client gets the chunks without those fields unless it asked for them (`strip_ids`).

The hot path pays for a stream only a reference to each chunk it relays and the removal of the ids
fields; the chunks are parsed (into text and ids) only past `COMPACT_BYTES`, and at a cut.
"""

from __future__ import annotations

import json
from array import array
from typing import Any, Optional

from aiohttp import web

CHAT, COMPLETIONS = "chat", "completions"
ENGINE_FAILED = "engine_failed"  # the fourth reason a request is paused, beside engines.leases' cuts
# Past this many bytes of relayed events a stream's transcript is parsed down to its text and ids:
# what the router keeps per stream is then about 4 bytes per token, its text, and at most this much more.
COMPACT_BYTES = 64 * 1024
MAX_SILENT = 64  # distinct ids kept that came without text (router.proxy.continuation asks the engine about each)
# The fields `return_token_ids` adds, as vLLM writes them (pydantic's compact JSON; never first in their
# object). JSON escapes a quote inside a string, so no generated text can contain these bytes.
_ID_KEYS = (b',"token_ids":', b',"prompt_token_ids":')
_IDS_MARK = b'token_ids":'
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


def strip_ids(pieces: list[bytes]) -> list[bytes]:
    """The relayed chunks without the ids fields the router asked for (the client did not)."""
    out = []
    for piece in pieces:
        if _IDS_MARK in piece:
            for key in _ID_KEYS:
                at = piece.find(key)
                while at >= 0:
                    start = at + len(key)
                    if piece.startswith(b"null", start):
                        end = start + 4
                    elif piece.startswith(b"[", start) and (close := piece.find(b"]", start)) >= 0:
                        end = close + 1
                    else:
                        break  # cut across two chunks: left whole, an extra field is still valid JSON
                    piece = piece[:at] + piece[end:]
                    at = piece.find(key, at)
        out.append(piece)
    return out


class Transcript:
    """The events a stream has sent its client, as references to the relayed chunks until they are
    worth parsing (`COMPACT_BYTES`), then as the answer's text, its token ids and the prompt's."""

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
        data = self.rest + b"".join(self.pieces)
        self.pieces, self.size = [], 0
        *events, self.rest = data.split(b"\n\n")
        for event in events:
            self._read(event)

    def _read(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments (keep-alive, the seam) and `event:` lines
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                self.unresumable = "malformed"
                continue
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

    def restart_at(self, ids: int, text: str) -> None:
        """After a seam: the answer is its first `ids` ids, whose text is `text`; the continuation's follow."""
        del self.ids[ids:]
        self.text = [text] if text else []
