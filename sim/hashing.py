"""The simulated engine's own block hashes: what it publishes in KV events, never the router's keys.

Two algorithms: "sha256" (the sim's default: sha256 over parent hash, packed token ids and extra
keys, folded to 64 bits) and "sha256_cbor" (vLLM's exact default values, for peers that recompute them).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

import cbor2
import msgspec

HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor")

_sha256 = hashlib.sha256
_encode_extra = msgspec.msgpack.Encoder().encode

#: vLLM's chain seed: sha256 of the canonical CBOR of "vllm-none-hash" (PYTHONHASHSEED unset or 0).
VLLM_NONE_HASH: bytes = _sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()

#: Seed of the "sha256" chain. Distinct from vLLM's and from router.keys' namespace seed so that
#: nothing can line the engine's hashes up with the router's keys by accident.
OWN_CHAIN_SEED: int = int.from_bytes(_sha256(b"kvroute-sim-engine-block-hash/v1").digest()[24:], "big")


def event_block_hash(digest: bytes) -> int:
    """The 64-bit value a KV event carries for a digest: its last 8 bytes read big-endian."""
    return int.from_bytes(digest[-8:], "big")


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids (or trace block ids) as little-endian int64, the payload of the "sha256" algorithm."""
    try:
        return array("q", token_ids).tobytes()
    except OverflowError:
        # Trace hash ids may be unsigned 64-bit values.
        return array("Q", token_ids).tobytes()


def sha256_block_hash(parent: int | None, packed_tokens: bytes, extra: Sequence[Any] | None = None) -> int:
    """Own algorithm: sha256(parent as 8 LE bytes || packed token ids || msgpack(extra)) -> 64 bits.

    ``parent`` is the previous block's 64-bit hash, or None for block 0 (then OWN_CHAIN_SEED)."""
    seed = OWN_CHAIN_SEED if parent is None else parent
    data = seed.to_bytes(8, "little") + packed_tokens
    if extra:
        data += _encode_extra(list(extra))
    return int.from_bytes(_sha256(data).digest()[24:], "big")


def sha256_cbor_block_digest(
    parent_digest: bytes | None, token_ids: Sequence[int], extra: Sequence[Any] | None = None
) -> bytes:
    """vLLM's sha256_cbor: sha256(cbor_canonical([parent or NONE_HASH, [tokens], extra or null]))."""
    payload = [
        VLLM_NONE_HASH if parent_digest is None else parent_digest,
        list(token_ids),
        list(extra) if extra else None,
    ]
    return _sha256(cbor2.dumps(payload, canonical=True)).digest()


class BlockHashCache:
    """Memo of (parent, block content, extra keys) -> hash, so that a prefix resent every turn
    (multi-turn chats, agents) is hashed once. Bounded: cleared when it outgrows ``max_entries``.
    One instance may serve several engines of one hash algorithm (the offline simulator)."""

    __slots__ = ("_entries", "max_entries")

    def __init__(self, max_entries: int = 1_000_000) -> None:
        if max_entries <= 0:
            raise ValueError(f"BlockHashCache max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._entries: dict[tuple[Any, ...], Any] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[Any, ...]) -> Any:
        return self._entries.get(key)

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        entries = self._entries
        if len(entries) >= self.max_entries:
            # Clearing costs one rebuild of the working set; an LRU would cost on every hit.
            entries.clear()
        entries[key] = value


class HashChain:
    """The block hashes of one sequence, extended one full block at a time.

    ``hashes[i]`` is block i's 64-bit event hash; the chain remembers what the next block needs
    (the 64-bit parent, or the full 32-byte digest for "sha256_cbor"). With a ``cache``, blocks
    already hashed under the same parent (by any chain sharing the cache) are looked up."""

    __slots__ = ("_cache", "_cbor", "_parent_digest", "hashes")

    def __init__(self, algo: str = "sha256", cache: BlockHashCache | None = None) -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash_algo {algo!r}; accepted: {', '.join(HASH_ALGOS)}")
        self._cbor = algo == "sha256_cbor"
        self._cache = cache
        self._parent_digest: bytes | None = None
        self.hashes: list[int] = []

    def __len__(self) -> int:
        return len(self.hashes)

    def append(self, token_ids: Sequence[int], extra: Sequence[Any] | None = None) -> int:
        """Hash the next block (its token ids, or its single trace id) and return its event hash."""
        cache = self._cache
        if cache is not None:
            parent_key = self._parent_digest if self._cbor else (self.hashes[-1] if self.hashes else None)
            key = (self._cbor, parent_key, tuple(token_ids), tuple(extra) if extra else None)
            hit = cache.get(key)
            if hit is not None:
                if self._cbor:
                    self._parent_digest = hit
                    hit = event_block_hash(hit)
                self.hashes.append(hit)
                return int(hit)
        if self._cbor:
            digest = sha256_cbor_block_digest(self._parent_digest, token_ids, extra)
            self._parent_digest = digest
            value = event_block_hash(digest)
            if cache is not None:
                cache.put(key, digest)
        else:
            parent = self.hashes[-1] if self.hashes else None
            value = sha256_block_hash(parent, pack_token_ids(token_ids), extra)
            if cache is not None:
                cache.put(key, value)
        self.hashes.append(value)
        return value
