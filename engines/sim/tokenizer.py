"""The simulated engine's tokenizer: one id per word, as the simulator counts tokens, and an exact
inverse, so an answer can be continued from its token ids (router.proxy.continuation) as on vLLM.

A piece is a run of non-space characters with the spaces before it (and, at the end of a text, after
it), so a text has as many pieces as `str.split()` finds words. The words the simulated model writes
(WORDS, with and without their leading space) have small ids of their own; any other piece is its
UTF-8 bytes, seven to an id behind a marker byte, so ids of a long word or a character split across
two of them decode only together (a byte-level vocabulary's behaviour, which the router's seam step
has to handle).
"""

from __future__ import annotations

import re

# The simulated model's vocabulary: plain words, so healthy output looks like (meaningless) prose in logs.
WORDS = (
    "the of and to in is was for on that with as by at from his it an were are "
    "which this be or has had first one their its new after but who not they have "
    "her she two been other when there all during into school time may years more "
    "most only over city some world would where later up such used many can state "
    "about national out known university united then made"
).split()
SPECIAL = 3  # 0..2: bos, eos, pad (they decode to nothing)
_VOCAB = [piece for word in WORDS for piece in (" " + word, word)]
_IDS = {piece: SPECIAL + i for i, piece in enumerate(_VOCAB)}
_CHUNK = 7  # bytes an id carries: with its marker byte, below 2**63 (router.proxy.resume keeps ids as int64)
_PIECE = re.compile(r"\s*\S+(?:\s+$)?|\s+$")


def word_id(piece: str) -> int:
    """The id of one of the model's words (`" the"` or `"the"`)."""
    return _IDS[piece]


def encode(text: str) -> list[int]:
    ids: list[int] = []
    for piece in _PIECE.findall(text):
        known = _IDS.get(piece)
        if known is not None:
            ids.append(known)
            continue
        raw = piece.encode()
        for at in range(0, len(raw), _CHUNK):
            ids.append(int.from_bytes(b"\x01" + raw[at : at + _CHUNK], "big"))
    return ids


def decode(ids: list[int]) -> str:
    out = bytearray()
    for i in ids:
        if i < SPECIAL:
            continue
        if i < SPECIAL + len(_VOCAB):
            out += _VOCAB[i - SPECIAL].encode()
        elif i > 0xFF:
            raw = i.to_bytes((i.bit_length() + 7) // 8, "big")
            out += raw[1:]  # past the marker byte
    return out.decode("utf-8", "replace")


def count(text: str) -> int:
    """Tokens in `text` (at least one: an empty prompt still takes a position)."""
    return max(1, len(encode(text)))
