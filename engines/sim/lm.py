"""The simulated language model: what text a set of weights produces.

Each token is a pure function of (model, sampling salt, the text before it: prompt and answer so
far), so a temperature-0 canary gives the same text across restarts, which is what the router's
output check relies on, and an answer asked for again with its first tokens appended to the prompt
goes on exactly where it was (a continuation, as vLLM's greedy decoding does). The end of an answer
(EOS) is decided the same way, and never before 64 words of prose in a row, so short requests and the
usual canary run to max_tokens. Discarded target weights produce junk instead: on a GPU they are
uninitialised memory, so the text is nonsense and a prefix check must fail.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct

from . import tokenizer
from .tokenizer import WORDS, word_id

# Characters no sane tokenizer would string together: junk is unmistakable.
JUNK = "ʘ¤§#@~^ЖЩ҂ψ⌘ξ%&*ÿþ¿¬ŧđ€±"

EMBEDDING_DIM = 16


def _digest(*parts: object) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\0")
    return h.digest()


class Context:
    """The text a generation has seen so far, hashed as it grows: the next token, and whether the answer
    ends here, come from it alone. One hash update a token, not the whole text again."""

    MIN_RUN = 64  # no EOS before this many words of prose in a row
    EOS_ODDS = 96  # past it, one step in this many ends the answer (a mean length of 64 + 96)

    __slots__ = ("_hash", "_run", "_line_start")

    def __init__(self, model: str, prompt: str, salt: str = "") -> None:
        self._hash = hashlib.blake2b(f"tok\0{model}\0{salt}\0".encode(), digest_size=16)
        self._hash.update(prompt.encode())
        self._run = 0  # the model's own words at the end of the text (a prompt ending in prose counts its words)
        for word in reversed(prompt.split()):
            if word not in _WORD_SET:
                break
            self._run += 1
        self._line_start = not prompt or prompt.endswith("\n")

    def next(self) -> tuple[str, int]:
        """The next token from healthy weights, as text and id (a word; after a line break, without its space)."""
        d = self._hash.copy().digest()
        word = WORDS[int.from_bytes(d[:4], "little") % len(WORDS)]
        piece = word if self._line_start else " " + word
        self.extend(piece, word=True)
        return piece, word_id(piece)

    def extend(self, piece: str, word: bool = False) -> None:
        self._hash.update(piece.encode())
        self._run = self._run + 1 if word else 0
        self._line_start = piece.endswith("\n")

    def ends(self) -> bool:
        """Whether the model emits EOS now."""
        if self._run < self.MIN_RUN:
            return False
        d = self._hash.copy()
        d.update(b"\0eos")
        return int.from_bytes(d.digest()[:4], "little") % self.EOS_ODDS == 0


_WORD_SET = frozenset(WORDS)


def junk_text(nonce: str, prompt: str, pos: int) -> str:
    """Token at `pos` from uninitialised weights: junk characters, never a word."""
    d = _digest("junk", nonce, prompt, pos)
    n = 2 + d[0] % 4
    return " " + "".join(JUNK[b % len(JUNK)] for b in d[1 : 1 + n])


def unit(*parts: object) -> float:
    """A number in [0, 1), a pure function of the parts (a token's logprob is drawn from one)."""
    return int.from_bytes(_digest(*parts)[:8], "little") / 2**64


def natural_length(model: str, prompt: str, salt: str = "") -> int:
    """How many tokens the model writes for `prompt` before its EOS."""
    ctx, n = Context(model, prompt, salt), 0
    while True:  # the first token comes whatever the prompt
        ctx.next()
        n += 1
        if ctx.ends():
            return n


def embedding(model: str, text: str, junk_nonce: str | None = None) -> list[float]:
    seed = ("junk", junk_nonce) if junk_nonce is not None else ("emb", model)
    raw = []
    for i in range(EMBEDDING_DIM):
        d = _digest(*seed, text, i)
        raw.append(int.from_bytes(d[:4], "little") / 2**32 - 0.5)
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def embedding_base64(vec: list[float]) -> str:
    # The OpenAI SDK asks for base64 by default: little-endian float32, like vLLM.
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


def count_tokens(text: str) -> int:
    return tokenizer.count(text)
