"""Decoding of KV-event payloads: every golden frame, the legacy array layout, hash types,
unknown keys and event types, garbage."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgspec
import pytest

from router.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_events, decode_payload

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "vllm-kv-events"


def _lines(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


def _event_as_dict(event: object) -> dict:
    out = msgspec.to_builtins(event)
    return out if isinstance(out, dict) else {"type": type(event).__name__}


@pytest.mark.parametrize(
    "record",
    [r for r in _lines("vllm-0.33.0-frames.jsonl") if r["kind"] == "pub"],
    ids=lambda r: f"seq{r['seq']}",
)
def test_every_golden_frame_decodes_like_the_generic_decode(record: dict) -> None:
    batch = decode_payload(base64.b64decode(record["payload_b64"]))
    ts, events, rank = record["decoded"]
    assert batch.ts == ts and batch.dp_rank == rank and batch.skipped_events == 0
    assert len(batch.events) == len(events)
    for got, want in zip(batch.events, events, strict=True):
        assert type(got).__name__ == want["type"]
        got_fields = _event_as_dict(got)
        for key, value in want.items():
            if key != "type":
                assert got_fields[key] == value, key


def test_replay_frames_of_the_golden_file_decode() -> None:
    replies = [r["frames_b64"] for r in _lines("vllm-0.33.0-frames.jsonl") if r["kind"] == "replay"]
    seqs = []
    for frames_b64 in replies:
        frames = [base64.b64decode(f) for f in frames_b64]
        seq = int.from_bytes(frames[2], "big")
        seqs.append(seq)
        if seq != 0xFFFFFFFFFFFFFFFF:
            assert frames[1] == b"kv-events"
            assert decode_payload(frames[3]).events
    assert seqs == [5, 6, 7, 0xFFFFFFFFFFFFFFFF]


def test_legacy_array_layout() -> None:
    batches = [
        decode_payload(base64.b64decode(r["payload_b64"])) for r in _lines("legacy-array-layout.jsonl")
    ]
    first, second, third = batches
    assert first.dp_rank is None and second.dp_rank == 1 and third.dp_rank is None
    (stored,) = first.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [11, 12] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(1000, 1032)) and stored.block_size == 16 and stored.medium is None
    stored2, removed = second.events
    assert isinstance(stored2, BlockStored) and stored2.parent_block_hash == 12 and stored2.medium == "GPU"
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [11] and removed.medium == "GPU"
    removed2, cleared = third.events
    assert isinstance(removed2, BlockRemoved) and removed2.medium is None
    assert isinstance(cleared, AllBlocksCleared)


def test_hash_types_unknown_keys_and_trailing_elements() -> None:
    big = 2**64 - 1
    payload = msgspec.msgpack.encode(
        [
            1.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [big, b"\x01" * 32, -5],
                    "parent_block_hash": b"\x02" * 16,
                    "token_ids": [],
                    "block_size": 0,
                    "lora_id": None,
                    "medium": "cpu",
                    "lora_name": None,
                    "brand_new_field": {"x": 1},
                },
                {"type": "BlockRemoved", "block_hashes": [big], "medium": "STORAGE", "ownership": "kvcr"},
            ],
            3,
        ]
    )
    batch = decode_payload(payload)
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [big, b"\x01" * 32, -5]
    assert stored.parent_block_hash == b"\x02" * 16 and stored.medium == "cpu"
    assert isinstance(removed, BlockRemoved) and removed.ownership == "kvcr" and batch.dp_rank == 3
    legacy = msgspec.msgpack.encode([2, [["BlockRemoved", [big], "GPU", 0, "LOCAL", None, "extra", "more"]]])
    (removed_legacy,) = decode_payload(legacy).events
    assert isinstance(removed_legacy, BlockRemoved) and removed_legacy.locality == "LOCAL"


def test_unknown_event_type_is_skipped_not_fatal() -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "Future"}, {"type": "AllBlocksCleared"}, 7], 0])
    batch = decode_payload(payload)
    assert batch.skipped_events == 2 and [type(e) for e in batch.events] == [AllBlocksCleared]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"not msgpack at all",
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["x", []]),
        msgspec.msgpack.encode([1.0, "events"]),
    ],
)
def test_garbage_payload_raises_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_payload(payload)


def test_decode_events_on_python_objects() -> None:
    events = decode_events(
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": list(range(16)),
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            ["BlockRemoved", [1], "GPU"],
            ("AllBlocksCleared",),
        ]
    )
    assert isinstance(events[0], BlockStored) and isinstance(events[1], BlockRemoved)
    assert isinstance(events[2], AllBlocksCleared)
    with pytest.raises(ValueError, match="event 0"):
        decode_events([{"type": "Nope"}])
