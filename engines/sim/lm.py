"""The simulated language model: what text a set of weights produces.

Outputs are a pure function of (model, prompt, position) so that a temperature-0
canary gives the same text across restarts, which is what the router's output
check relies on. Discarded target weights produce junk instead: on a GPU they are
uninitialised memory, so the text is nonsense and a prefix check must fail.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct

# Plain words so healthy output looks like (meaningless) prose in logs.
WORDS = (
    "the of and to in is was for on that with as by at from his it an were are "
    "which this be or has had first one their its new after but who not they have "
    "her she two been other when there all during into school time may years more "
    "most only over city some world would where later up such used many can state "
    "about national out known university united then made"
).split()

# Characters no sane tokenizer would string together: junk is unmistakable.
JUNK = "ʘ¤§#@~^ЖЩ҂ψ⌘ξ%&*ÿþ¿¬ŧđ€±"

EMBEDDING_DIM = 16


def _digest(*parts: object) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\0")
    return h.digest()


def token_text(model: str, prompt: str, pos: int, salt: str = "") -> str:
    """Token at `pos` from healthy weights (a leading space, like BPE word tokens)."""
    d = _digest("tok", model, salt, prompt, pos)
    return " " + WORDS[int.from_bytes(d[:4], "little") % len(WORDS)]


def junk_text(nonce: str, prompt: str, pos: int) -> str:
    """Token at `pos` from uninitialised weights: junk characters, never a word."""
    d = _digest("junk", nonce, prompt, pos)
    n = 2 + d[0] % 4
    return " " + "".join(JUNK[b % len(JUNK)] for b in d[1 : 1 + n])


def unit(*parts: object) -> float:
    """A number in [0, 1), a pure function of the parts (a token's logprob is drawn from one)."""
    return int.from_bytes(_digest(*parts)[:8], "little") / 2**64


def natural_length(model: str, prompt: str) -> int:
    """Where the model would emit EOS. Never below 64, so short requests and the
    usual canary always run to max_tokens; `ignore_eos` skips it entirely."""
    d = _digest("eos", model, prompt)
    return 64 + int.from_bytes(d[:4], "little") % 192


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
    return max(1, len(text.split()))
