"""Block keys: the one hash that requests, KV events and the simulator share.

key_i = xxh3_64(key_{i-1} as 8 little-endian bytes || token ids of block i as int64 LE
                || msgpack(extra keys of block i)), with key_{-1} = the namespace seed.
Only full blocks get a key; a partial trailing block never counts (engines cache full blocks only).
Engine block hashes are never used as keys: they are opaque ids mapped to these keys per engine.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

_xxh3 = xxhash.xxh3_64_intdigest
_encode_extra = msgspec.msgpack.Encoder().encode

#: Namespace seed used when none is configured. All engines of one fleet (and every router replica)
#: must use the same namespace so that equal prefixes give equal keys, also across a shared
#: storage pool.
DEFAULT_NAMESPACE = 0


def namespace_seed(name: str | None) -> int:
    """Seed of a key chain for a namespace (e.g. a model family); "" or None -> DEFAULT_NAMESPACE."""
    if not name:
        return DEFAULT_NAMESPACE
    return _xxh3(name.encode())


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    # struct.pack is ~2.5x faster than array("q", list) on the event-ingestion hot path.
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in int64 range: {exc}") from None


def chain_key(parent: int, tokens: Sequence[int], extra: Sequence[Any] | None = None) -> int:
    """Key of one block given its parent's key, its token ids and its extra keys (or None)."""
    data = parent.to_bytes(8, "little") + _pack_tokens(tokens)
    if extra:
        data += _encode_extra(list(extra))
    return _xxh3(data)


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: int = DEFAULT_NAMESPACE,
    extra_keys: Sequence[Sequence[Any] | None] | None = None,
) -> list[int]:
    """Keys of every full block of ``token_ids``, chained from ``parent``.

    ``extra_keys[i]`` (if given) is folded into block i, exactly as an engine's BlockStored event
    lists them (LoRA name, multimodal ids, cache_salt on the first block of a request).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    keys: list[int] = []
    key = parent
    packed = _pack_tokens(token_ids[: n_blocks * block_size])
    width = 8 * block_size
    for i in range(n_blocks):
        data = key.to_bytes(8, "little") + packed[i * width : (i + 1) * width]
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        if extra:
            data += _encode_extra(list(extra))
        key = _xxh3(data)
        keys.append(key)
    return keys


def request_extra_keys(
    num_blocks: int, *, lora_name: str | None = None, cache_salt: str | None = None
) -> list[tuple[Any, ...] | None] | None:
    """Per-block extra keys of a request, in vLLM's order: LoRA name (every block), then the
    cache_salt (first block only). None when the request has neither."""
    if not lora_name and not cache_salt:
        return None
    out: list[tuple[Any, ...] | None] = []
    for i in range(num_blocks):
        parts: list[Any] = []
        if lora_name:
            parts.append(lora_name)
        if cache_salt and i == 0:
            parts.append(cache_salt)
        out.append(tuple(parts) if parts else None)
    return out


#: Bytes one cached entry costs per token (a list slot plus the int object, which the entry keeps
#: alive once the tokenizer's own cache let it go) and per block key (the same), and per entry.
_CACHE_TOKEN_BYTES = 36
_CACHE_KEY_BYTES = 40
_CACHE_ENTRY_BYTES = 200


def _same_prefix(a: Sequence[int], b: Sequence[int], width: int) -> bool:
    """``a[:width] == b[:width]``, slicing only what is longer than ``width`` (a 16K-token prompt
    costs two 128 KB copies otherwise). One list is equal to itself: a repeated prompt, which the
    tokenizer's whole-prompt cache hands back as the same list, costs no pass over its tokens."""
    if a is b:
        return True
    return (a if len(a) == width else a[:width]) == (b if len(b) == width else b[:width])


def common_blocks(a: Sequence[int], b: Sequence[int], block_size: int, limit: int) -> int:
    """How many leading full blocks (at most ``limit``) ``a`` and ``b`` share: one comparison when
    all do (a conversation's next turn), two when all but the last do (one growing message, whose
    cached version ended with the template's generation prompt), else a binary search."""
    n = min(limit, len(a) // block_size, len(b) // block_size)
    if n == 0 or _same_prefix(a, b, n * block_size):
        return n
    if n > 1 and _same_prefix(a, b, (n - 1) * block_size):
        return n - 1  # all but the last block: the cached prompt ended with the template's tail
    low, high = 0, n - 2  # the first ``low`` blocks are equal, the first ``high + 1`` are not
    while low < high:
        mid = (low + high + 1) // 2
        if _same_prefix(a, b, mid * block_size):
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(slots=True)
class _KeyEntry:
    tokens: Sequence[int]
    keys: list[int]
    size: int
    #: (scope, anchor) names still pointing at this entry; it is dropped when none is left.
    names: list[tuple[Hashable, int]]


class KeyChainCache:
    """Block keys of recent prompts, so a conversation's next turn hashes only its new blocks.

    A chat turn resends the whole history: at 16K tokens, packing and hashing its ~1,000 blocks cost
    more than the rest of routing. The caller names each prompt by anchors (hashes of its message
    prefixes, and of its last message's content cuts): ``put`` files the prompt's tokens and keys
    under ``file_under``, ``reusable`` looks its ``anchors`` up longest first and returns the keys of
    the leading blocks whose token ids are verified equal, never more. ``scope`` is everything else
    a key depends on (block size, chain seed, LoRA name, cache_salt): another scope never matches.

    Bounded by the estimated bytes of its entries (LRU). A name filed again points at the new entry;
    an entry no name points at is dropped, so a conversation holds one entry. Pure, single-threaded.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._names: dict[tuple[Hashable, int], int] = {}
        self._entries: OrderedDict[int, _KeyEntry] = OrderedDict()
        self._next_id = 0
        self.size_bytes = 0
        self.hits = 0
        self.misses = 0
        #: Blocks whose keys came from the cache / were hashed, over all lookups.
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def reusable(
        self, anchors: Sequence[int], scope: Hashable, tokens: Sequence[int], block_size: int
    ) -> tuple[list[int], int | None]:
        """(keys of the leading full blocks of ``tokens`` known from a cached prompt (at most
        ``len(tokens) // block_size``), only blocks whose token ids equal the cached prompt's;
        the cached entry ``tokens`` extends, for ``put(replaces=)``, or None).

        ``tokens`` extends the entry when it holds all of the entry's blocks but perhaps the last
        (a cached prompt's last block may end with the chat template's generation prompt)."""
        tried: set[int] = set()
        for anchor in reversed(anchors):
            entry_id = self._names.get((scope, anchor))
            if entry_id is None or entry_id in tried:
                continue
            tried.add(entry_id)
            entry = self._entries[entry_id]
            n = common_blocks(tokens, entry.tokens, block_size, len(entry.keys))
            if n:
                self._entries.move_to_end(entry_id)
                self.hits += 1
                extended = entry_id if n >= len(entry.keys) - 1 else None
                return (entry.keys if n == len(entry.keys) else entry.keys[:n]), extended
        self.misses += 1
        return [], None

    def refiled(
        self, file_under: Sequence[int], scope: Hashable, tokens: Sequence[int], block_size: int
    ) -> list[int] | None:
        """The keys of ``tokens`` when they are the very list (the same object) filed under every
        name of ``file_under`` with keys for all its full blocks: a prompt sent again, whose
        tokenizer handed back its cached list. Counted as ``reusable`` (looking ``file_under[0]``
        up first, as it does the whole prompt's name) and ``put`` count that prompt; None, with
        nothing counted, otherwise."""
        if not file_under:
            return None
        filed = self._names
        entry_id = filed.get((scope, file_under[0]))
        if entry_id is None:
            return None
        entry = self._entries[entry_id]
        keys = entry.keys
        if entry.tokens is not tokens or not keys or len(keys) != len(tokens) // block_size:
            return None
        for anchor in file_under[1:]:
            if filed.get((scope, anchor)) != entry_id:
                return None
        self._entries.move_to_end(entry_id)
        self.hits += 1
        self.reused_blocks += len(keys)
        return keys

    def put(
        self,
        file_under: Sequence[int],
        scope: Hashable,
        tokens: Sequence[int],
        keys: list[int],
        *,
        reused_blocks: int = 0,
        replaces: int | None = None,
    ) -> None:
        """File ``tokens`` (kept by reference: the caller must not change them) and their ``keys``
        under each anchor of ``file_under``, replacing what those names pointed at, and the entry
        they extend (``replaces``, from ``reusable``): one entry per conversation."""
        self.reused_blocks += reused_blocks
        self.hashed_blocks += len(keys) - reused_blocks
        if replaces is not None:
            entry = self._entries.get(replaces)
            if entry is not None and entry.keys is keys and entry.tokens is tokens and file_under:
                filed = self._names
                for anchor in file_under:
                    if filed.get((scope, anchor)) != replaces:
                        break
                else:
                    return  # the very prompt filed again under its own names: nothing changes
            if entry is not None:
                self._drop(replaces)
        size = _CACHE_ENTRY_BYTES + _CACHE_TOKEN_BYTES * len(tokens) + _CACHE_KEY_BYTES * len(keys)
        if not file_under or size > self.max_bytes:
            return
        entry_id = self._next_id
        self._next_id += 1
        names = [(scope, anchor) for anchor in file_under]
        for name in names:
            old = self._names.get(name)
            self._names[name] = entry_id
            if old is not None:
                old_entry = self._entries[old]
                old_entry.names.remove(name)
                if not old_entry.names:
                    self._drop(old)
        self._entries[entry_id] = _KeyEntry(tokens, keys, size, names)
        self.size_bytes += size
        while self.size_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.size_bytes -= entry.size
        for name in entry.names:
            if self._names.get(name) == entry_id:
                del self._names[name]

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "names": len(self._names),
            "bytes": self.size_bytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "reused_blocks": self.reused_blocks,
            "hashed_blocks": self.hashed_blocks,
        }
