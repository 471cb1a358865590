"""Block keys: the one hash that requests, KV events and the simulator share.

key_i = xxh3_64(key_{i-1} as 8 little-endian bytes || token ids of block i as int64 LE
                || msgpack(extra keys of block i)), with key_{-1} = the namespace seed.
Only full blocks get a key; a partial trailing block never counts (engines cache full blocks only).
Engine block hashes are never used as keys: they are opaque ids mapped to these keys per engine.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
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
