"""vLLM's KV-event wire format, one definition for the router's decoder and the simulator's publisher.

Pure code, no I/O: the msgspec structs of vLLM 0.33 (map layout, and the positional array layout of
releases before mid-2026), batch encode/decode, the frame layouts of live and replay messages, and
vLLM's endpoint rules (bind-or-connect, data-parallel port offset, wildcard host substitution).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

Hash = int | bytes

#: Seq of the replay end marker (vLLM sends -1 as 8 bytes).
END_SEQ = 0xFFFFFFFFFFFFFFFF
END_SEQ_BYTES = END_SEQ.to_bytes(8, "big")


# --------------------------------------------------------------------------------- event structs
# The map layout (vLLM >= mid-2026) is the one both sides share. Fields 1-7 of BlockStored and 1-2
# of BlockRemoved have no default: vLLM always sends them (possibly null), and with omit_defaults
# the encoder writes them always, the optional ones only when set - byte for byte like vLLM's own
# encoder (msgspec writes the map header from the number of fields it emits). Unknown map keys are
# ignored on decode (msgspec's default), so newer engines with extra fields still decode.


class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", omit_defaults=True):
    pass


# The legacy array layout: ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium?].
# Decode only; subclasses, so isinstance(event, BlockStored) holds for both layouts. Everything
# after the hashes has a default because old arrays stop early; extra trailing elements are ignored.


class LegacyBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    parent_block_hash: Hash | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class LegacyBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    medium: str | None = None


class LegacyAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


KVEvent = (
    BlockStored
    | BlockRemoved
    | AllBlocksCleared
    | LegacyBlockStored
    | LegacyBlockRemoved
    | LegacyAllBlocksCleared
)
CLEARED_TYPES = (AllBlocksCleared, LegacyAllBlocksCleared)
_MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
_ArrayEvent = LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared


class _MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class EventBatch:
    """One decoded batch (one engine scheduler step). ``skipped_events``: undecodable events."""

    ts: float
    events: list[Any]
    dp_rank: int | None = None
    skipped_events: int = 0


_decode_map_batch = msgspec.msgpack.Decoder(_MapBatch).decode
_decode_array_batch = msgspec.msgpack.Decoder(_ArrayBatch).decode
_decode_raw_batch = msgspec.msgpack.Decoder(_RawBatch).decode


def decode_payload(payload: bytes) -> EventBatch:
    """Decode one msgpack batch payload, either layout, 2- or 3-element batch.

    Raises ValueError for anything that is not a batch - also for payloads msgspec cannot even walk
    (a deeply nested one raises RecursionError inside msgspec). Single undecodable events (e.g. an
    event type this router does not know) are skipped and counted in ``skipped_events``."""
    try:
        return _decode(payload)
    except RecursionError:
        raise ValueError("KV-event payload nested too deeply to decode") from None


def _decode(payload: bytes) -> EventBatch:
    batch: _MapBatch | _ArrayBatch | _RawBatch
    try:
        batch = _decode_map_batch(payload)
    except msgspec.MsgspecError:
        try:
            batch = _decode_array_batch(payload)
        except msgspec.MsgspecError:
            try:
                batch = _decode_raw_batch(payload)
            except msgspec.MsgspecError as exc:
                raise ValueError(f"not a KV-event batch payload: {exc}") from None
            events, skipped = _convert_events(batch.events)
            return EventBatch(batch.ts, events, batch.data_parallel_rank, skipped)
    return EventBatch(batch.ts, list(batch.events), batch.data_parallel_rank)


def _convert_events(objs: Iterable[Any]) -> tuple[list[Any], int]:
    events: list[Any] = []
    skipped = 0
    for obj in objs:
        try:
            if isinstance(obj, Mapping):
                events.append(msgspec.convert(obj, _MapEvent))  # type: ignore[arg-type]
            elif isinstance(obj, list | tuple):
                events.append(msgspec.convert(list(obj), _ArrayEvent))  # type: ignore[arg-type]
            else:
                skipped += 1
        except msgspec.MsgspecError:
            skipped += 1
    return events, skipped


def decode_events(objs: Sequence[Any]) -> list[Any]:
    """The same normalisation on already-decoded Python objects (map dicts or legacy arrays).

    Raises ValueError naming the first event that is not a known KV event."""
    events: list[Any] = []
    for i, obj in enumerate(objs):
        converted, skipped = _convert_events([obj])
        if skipped:
            raise ValueError(f"event {i} is not a BlockStored/BlockRemoved/AllBlocksCleared: {obj!r:.200}")
        events.extend(converted)
    return events


# --------------------------------------------------------------------------------- encoding

_EVENT_TYPES: dict[str, type[msgspec.Struct]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def event_struct(event: Mapping[str, Any]) -> msgspec.Struct:
    """The typed form of one engine event dict (``{"type": ..., fields...}``).

    Typed structs, not dicts, because msgspec writes a struct's map header from its field count
    exactly like vLLM's own encoder; a dict would give different bytes. ValueError on unknown
    types or fields."""
    kind = event.get("type")
    cls = _EVENT_TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown KV event type {kind!r}; expected one of {sorted(_EVENT_TYPES)}")
    try:
        return cls(**{k: v for k, v in event.items() if k != "type"})
    except TypeError as exc:
        raise ValueError(f"malformed {kind} event: {exc}") from None


class BatchEncoder:
    """Encodes ``[ts, events, dp_rank]`` byte-for-byte as vLLM 0.33 does (ts is a float64)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(
        self, ts_s: float, events: Sequence[Mapping[str, Any] | msgspec.Struct], dp_rank: int = 0
    ) -> bytes:
        structs = [ev if isinstance(ev, msgspec.Struct) else event_struct(ev) for ev in events]
        return self._encoder.encode([float(ts_s), structs, dp_rank])


# --------------------------------------------------------------------------------- frames


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def parse_live_frames(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """``[topic, seq, payload]`` (or ``[seq, payload]`` without a topic frame) -> (seq, payload);
    None when the message does not have that shape."""
    if len(frames) == 3:
        _topic, seq_frame, payload = frames
    elif len(frames) == 2:
        seq_frame, payload = frames
    else:
        return None
    if len(seq_frame) != 8:
        return None
    return int.from_bytes(seq_frame, "big"), payload


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to a replay ROUTER to get every buffered batch with seq >= start_seq."""
    return [b"", seq_bytes(start_seq)]


def parse_replay_frames(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """A DEALER's replay reply ``[b"", topic, seq, payload]`` (older vLLM: ``[b"", seq, payload]``)
    -> (seq, payload); seq END_SEQ is the end marker. None when malformed."""
    if len(frames) == 4:
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3:
        seq_frame, payload = frames[1], frames[2]
    else:
        return None
    if len(seq_frame) != 8:
        return None
    return int.from_bytes(seq_frame, "big"), payload


# --------------------------------------------------------------------------------- endpoints


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule for its PUB socket, verbatim: bind when the endpoint contains ``*`` or ``::``
    anywhere (so ``tcp://[::1]:5557`` and ``tcp://[fe80::1]:5557`` bind too) or is ipc/inproc;
    connect out otherwise, and then the subscriber must bind at that address."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str, dp_rank: int) -> str:
    """Endpoint of data-parallel rank ``dp_rank``: tcp port + rank (IPv6 hosts included, the port
    is after the last colon); ipc/inproc get a ``_dp<rank>`` suffix. Rank 0 is unchanged."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"endpoint {endpoint!r} has no tcp port to offset for rank {dp_rank}")
        return f"{base}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


def split_tcp(endpoint: str) -> tuple[str, int] | None:
    """``tcp://host:port`` -> (host without IPv6 brackets, port); None for other transports."""
    if not endpoint.startswith("tcp://"):
        return None
    addr, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not port.isdigit():
        return None
    return addr.strip("[]"), int(port)


_WILDCARD_HOSTS = ("*", "::", "0.0.0.0", "")


def is_wildcard_host(host: str) -> bool:
    return host in _WILDCARD_HOSTS


def with_host(endpoint: str, host: str) -> str:
    """Replace a wildcard host (``*``, ``::``, ``0.0.0.0``) of a tcp endpoint by ``host``
    (IPv6 hosts get brackets); other endpoints are returned unchanged."""
    parts = split_tcp(endpoint)
    if parts is None or not is_wildcard_host(parts[0]):
        return endpoint
    host = host.strip("[]")
    return f"tcp://{f'[{host}]' if ':' in host else host}:{parts[1]}"
