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
"""

from __future__ import annotations

import json
import re
from array import array
from typing import Any, Iterator, Optional

from aiohttp import web

CHAT, COMPLETIONS = "chat", "completions"
ENGINE_FAILED = "engine_failed"  # the fourth reason a request is paused, beside engines.leases' cuts
# Past this many bytes of relayed events a stream's transcript is read down to its text and ids: what the
# router keeps per stream is then 8 bytes per token, its text as one string, and at most this much more.
COMPACT_BYTES = 16 * 1024
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
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n"
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
    return None


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
                 "done", "usage", "unresumable")

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
        texts = _TEXT[self.chat].findall(events)
        if texts:
            self.text.append("".join(json.loads(b"[" + b",".join(texts) + b"]")))
        ids = b",".join(filter(None, _IDS.findall(events)))
        if ids:
            self.ids.extend(map(int, ids.split(b",")))

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
