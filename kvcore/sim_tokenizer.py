"""The simulator's tokenizer and chat template ("kvroute-sim"), shared by sim engines and the router.

Deterministic, reversible and stable under prefix extension: text is cut into 3-byte UTF-8 chunks
per segment (a message's content is one segment), each chunk one token; special tokens separate
segments, so appending messages never changes the tokens of earlier ones. Turn N+1's prompt
therefore starts with turn N's prompt (generation prompt included), as with real chat templates.

Template: BOS, then per message ROLE content END, then ASSISTANT when add_generation_prompt.
Token ids: specials < 1000; a chunk of n bytes (1..3) is 1000 + (n-1) * 2**24 + int(chunk, big-endian).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

NAME = "kvroute-sim"

BOS = 1
END = 2
EOS = 3
ROLE_TOKENS: dict[str, int] = {"system": 10, "user": 11, "assistant": 12, "tool": 13, "developer": 14}
SPECIAL_TEXT: dict[int, str] = {
    BOS: "<|bos|>",
    END: "<|end|>",
    EOS: "<|eos|>",
    **{tok: f"<|{role}|>" for role, tok in ROLE_TOKENS.items()},
}
CHUNK_BYTES = 3
_BASE = 1000
_SPAN = 1 << 24
VOCAB_LIMIT = _BASE + CHUNK_BYTES * _SPAN  # every valid token id is below this

#: ASCII characters per token of plain text: use it to make a text of exactly N tokens.
CHARS_PER_TOKEN = CHUNK_BYTES


#: Id offset of a full 3-byte chunk.
_FULL_OFFSET = _BASE + (CHUNK_BYTES - 1) * _SPAN
#: An array typecode of 4-byte unsigned items (C "unsigned int" almost everywhere).
_U32 = next(code for code in "IL" if array(code).itemsize == 4)


def encode_text(text: str) -> list[int]:
    """Tokens of one segment of text (no special tokens).

    The full 3-byte chunks are converted in C: spread to big-endian uint32 (a zero high byte) by
    slice assignment, read as an array, offset by ``map``: ~7x faster than a Python loop over the
    chunks on a 16K-token text (tests/test_tokenize.py checks it against the per-chunk definition).
    """
    return encode_utf8(text.encode("utf-8"))


def encode_utf8(data: bytes) -> list[int]:
    """``encode_text`` of text given as its UTF-8 bytes (a cut at a multiple of 3 bytes may fall
    inside a character: the tokens of the two parts are still those of the whole)."""
    n_full = len(data) // CHUNK_BYTES
    words = bytearray(4 * n_full)
    for k in range(CHUNK_BYTES):
        words[k + 1 :: 4] = data[k : CHUNK_BYTES * n_full : CHUNK_BYTES]
    values = array(_U32)
    values.frombytes(words)
    if sys.byteorder == "little":
        values.byteswap()
    out = list(map(_FULL_OFFSET.__add__, values))
    tail = data[CHUNK_BYTES * n_full :]
    if tail:
        out.append(_BASE + (len(tail) - 1) * _SPAN + int.from_bytes(tail, "big"))
    return out


def _chunk_bytes(tok: int) -> bytes:
    n = (tok - _BASE) // _SPAN + 1
    return ((tok - _BASE) % _SPAN).to_bytes(n, "big")


def decode(tokens: Iterable[int], *, skip_special: bool = False) -> str:
    """Text of a token sequence; specials render as ``<|name|>`` unless skipped."""
    parts: list[str] = []
    buf = bytearray()
    for tok in tokens:
        if _BASE <= tok < VOCAB_LIMIT:
            buf += _chunk_bytes(tok)
            continue
        if buf:
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
        if not skip_special:
            parts.append(SPECIAL_TEXT.get(tok, f"<|{tok}|>"))
    if buf:
        parts.append(buf.decode("utf-8", errors="replace"))
    return "".join(parts)


def message_text(content: Any) -> str:
    """Text of an OpenAI message ``content``: a string, None, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
        return "".join(texts)
    raise ValueError("message content must be a string, null or a list of content parts")


def encode_prompt(prompt: str) -> list[int]:
    """Tokens of a completion prompt: BOS + text."""
    return [BOS, *encode_text(prompt)]


def encode_chat(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
    """Tokens of a chat through the simulator's template. Raises ValueError on a malformed message."""
    out = [BOS]
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if role not in ROLE_TOKENS:
            raise ValueError(f"messages[{i}].role must be one of {sorted(ROLE_TOKENS)}, got {role!r}")
        out.append(ROLE_TOKENS[role])
        out.extend(encode_text(message_text(msg.get("content"))))
        out.append(END)
    if add_generation_prompt:
        out.append(ROLE_TOKENS["assistant"])
    return out


def render_chat(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
    """The chat rendered as text (what ``decode(encode_chat(...))`` gives)."""
    return decode(encode_chat(messages, add_generation_prompt=add_generation_prompt))


_FILLER = b"the quick brown fox jumps over a lazy dog while kv blocks stay warm in the cache "


def filler_text(num_tokens: int, seed: int = 0) -> str:
    """Plain ASCII text of exactly ``num_tokens`` tokens, deterministic in ``seed``."""
    n = num_tokens * CHUNK_BYTES
    start = (seed * 7919) % len(_FILLER)
    reps = (start + n) // len(_FILLER) + 1
    return (_FILLER * reps)[start : start + n].decode("ascii")


def filler_tokens(num_tokens: int, seed: int = 0) -> list[int]:
    """``num_tokens`` plain-text tokens, deterministic in ``seed`` (the sim engine's output)."""
    return encode_text(filler_text(num_tokens, seed))
