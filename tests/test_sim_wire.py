"""The sim engine's KV events on the wire: byte-exact encoding against vLLM 0.33's recorded frames,
the fixture scenario driven through a real server and decoded from a real SUB socket, and replay
over a real DEALER socket including the end marker."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from sim.server import EngineServerConfig, ThreadedEngineServer, free_port
from sim.zmq_publisher import (
    END_SEQ,
    BatchEncoder,
    KVEventsConfig,
    ZmqEventPublisher,
    endpoint_binds,
    parse_kv_events_config,
    resolved_source,
)

DATA = Path(__file__).resolve().parents[1] / "data"
FRAMES = DATA / "fixtures" / "vllm-kv-events" / "vllm-0.33.0-frames.jsonl"
TOPIC = "kv-events"
T = list(range(1000, 1064)) + list(range(2000, 2040))


def _fixture() -> tuple[list[dict[str, Any]], list[list[bytes]]]:
    pubs, replay = [], []
    for line in FRAMES.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "pub":
            pubs.append(rec)
        else:
            replay.append([base64.b64decode(f) for f in rec["frames_b64"]])
    return pubs, replay


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int]:
    """A decoder written from the contract (§2): array [ts, events, dp_rank], events as maps."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) == 3, batch
    ts, events, rank = batch
    assert isinstance(ts, float) and isinstance(rank, int)
    assert all(isinstance(ev, dict) and "type" in ev for ev in events)
    return ts, events, rank


def test_encoder_is_byte_identical_to_vllm_frames() -> None:
    pubs, _ = _fixture()
    encoder = BatchEncoder()
    assert len(pubs) == 8
    for rec in pubs:
        ts, events, rank = rec["decoded"]
        assert encoder.encode(ts, events, rank) == base64.b64decode(rec["payload_b64"]), rec["note"]


def test_encoder_rejects_unknown_event_fields() -> None:
    with pytest.raises(ValueError, match="BlockRemoved"):
        BatchEncoder().encode(0.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "x": 1}])
    with pytest.raises(ValueError, match="unknown KV event type"):
        BatchEncoder().encode(0.0, [{"type": "Nope"}])


def test_kv_events_config_parsing() -> None:
    cfg = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567",'
        ' "topic": "kv-events", "buffer_steps": 5}'
    )
    assert cfg.enable_kv_cache_events and cfg.buffer_steps == 5 and cfg.topic == "kv-events"
    with pytest.raises(ValueError, match="unknown key"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint_typo": "tcp://*:1"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_kv_events_config("{nope")
    assert (
        endpoint_binds("tcp://*:5557") and endpoint_binds("ipc:///tmp/x") and endpoint_binds("tcp://[::]:1")
    )
    assert not endpoint_binds("tcp://127.0.0.1:5557")
    src = resolved_source(cfg, "10.1.2.3")
    assert src["endpoint"] == "tcp://10.1.2.3:5557" and src["replay_endpoint"] == "tcp://10.1.2.3:5567"
    assert resolved_source(cfg, "10.1.2.3", dp_rank=2)["endpoint"] == "tcp://10.1.2.3:5559"


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def wire_server() -> Iterator[ThreadedEngineServer]:
    pub_port, replay_port = free_port(), free_port()
    cfg = EngineServerConfig(
        port=0,
        gpu_blocks=10,
        cpu_blocks=4,
        storage_pool="pool0",
        storage_blocks=64,
        time_scale=1000.0,
        kv_events=KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://*:{pub_port}",
            replay_endpoint=f"tcp://*:{replay_port}",
            topic=TOPIC,
        ),
    )
    with ThreadedEngineServer(cfg) as server:
        yield server


def _recv_until_cleared(sub: zmq.Socket[bytes]) -> list[tuple[bytes, int, bytes]]:
    frames: list[tuple[bytes, int, bytes]] = []
    while True:
        assert sub.poll(10_000), "no KV event batch within 10 s"
        topic, seq, payload = sub.recv_multipart()
        frames.append((topic, int.from_bytes(seq, "big"), payload))
        if any(ev["type"] == "AllBlocksCleared" for ev in decode_batch(payload)[1]):
            return frames


def _signature(ev: dict[str, Any]) -> tuple[Any, ...]:
    return (
        ev["type"],
        ev.get("medium"),
        bool(ev.get("token_ids")),
        "extra_keys" in ev,
        ev.get("parent_block_hash") is not None,
    )


def _types(ev: dict[str, Any]) -> list[tuple[str, type]]:
    return [(k, type(v)) for k, v in ev.items()]


def test_fixture_scenario_over_real_sockets(wire_server: ThreadedEngineServer, zmq_ctx: zmq.Context) -> None:
    sources = httpx.get(f"{wire_server.url}/kv_event_sources").json()
    endpoint, replay_endpoint = sources["0"]["endpoint"], sources["0"]["replay_endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:") and sources["0"]["topic"] == TOPIC
    sub = zmq_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(endpoint)
    sub.poll(300)  # let the subscription reach the PUB before the first batch (slow joiner)

    with httpx.Client(base_url=wire_server.url, timeout=30) as http:

        def complete(tokens: list[int], **extra: Any) -> dict[str, Any]:
            r = http.post("/v1/completions", json={"prompt": tokens, "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            return r.json()

        complete(T[:64])  # B0-B3 on GPU, written through to CPU (placeholders) and STORAGE
        assert complete(T)["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # + B4-B5
        complete([*T[:32], 7, 7, 7], cache_salt="tenant-b")  # S0-S1, distinct hashes
        complete(list(range(3000, 3100)))  # fills the 10-block GPU pool: GPU evictions
        assert http.post("/reset_prefix_cache").status_code == 200

    live = _recv_until_cleared(sub)
    assert [seq for _, seq, _ in live] == list(range(len(live))), "seq must start at 0 and step by 1"
    assert all(topic == TOPIC.encode() for topic, _, _ in live)
    events = [ev for _, _, payload in live for ev in decode_batch(payload)[1]]

    pubs, _ = _fixture()
    fixture_events = [ev for rec in pubs for ev in rec["decoded"][1]]
    by_sig: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for ev in events:
        by_sig.setdefault(_signature(ev), []).append(ev)
    for fev in fixture_events:
        matches = by_sig.get(_signature(fev))
        assert matches, f"engine sent no event shaped like {fev}"
        ev = matches[0]
        assert list(ev) == list(fev), "keys and their order must match vLLM's"
        assert _types(ev) == _types(fev)
        if fev["type"] == "BlockStored":
            assert ev["block_size"] == fev["block_size"]
            assert ev["lora_id"] is None and ev["lora_name"] is None and ev["group_idx"] == 0
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ev["block_hashes"])
            if fev["token_ids"]:
                assert len(ev["token_ids"]) == ev["block_size"] * len(ev["block_hashes"])
            else:  # CPU placeholder: hash only
                assert ev["token_ids"] == [] and ev["block_size"] == 0 and len(ev["block_hashes"]) == 1

    gpu_stores = by_sig[("BlockStored", "GPU", True, False, False)]
    assert gpu_stores[0]["token_ids"] == T[:64]
    chained = by_sig[("BlockStored", "GPU", True, False, True)][0]
    assert chained["token_ids"] == T[64:96]
    assert chained["parent_block_hash"] == gpu_stores[0]["block_hashes"][-1]
    storage = by_sig[("BlockStored", "STORAGE", True, False, False)][0]
    assert storage["locality"] == "LOCAL" and storage["token_ids"][:32] == T[:32]
    assert storage["block_hashes"][:4] == gpu_stores[0]["block_hashes"]  # same hash in every tier
    salted = by_sig[("BlockStored", "GPU", True, True, False)][0]
    assert salted["extra_keys"] == [["tenant-b"], None] and salted["token_ids"] == T[:32]
    assert not set(salted["block_hashes"]) & set(gpu_stores[0]["block_hashes"])
    cpu_placeholders = {ev["block_hashes"][0] for ev in by_sig[("BlockStored", "CPU", False, False, False)]}
    assert set(gpu_stores[0]["block_hashes"]) <= cpu_placeholders
    removed_gpu = {
        h for ev in by_sig[("BlockRemoved", "GPU", False, False, False)] for h in ev["block_hashes"]
    }
    assert removed_gpu & set(gpu_stores[0]["block_hashes"] + chained["block_hashes"])
    assert events[-1] == {"type": "AllBlocksCleared"}

    # Replay over a real DEALER: every buffered batch from seq 2, same bytes as live, then the marker.
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", (2).to_bytes(8, "big")])
    replayed = []
    while True:
        assert dealer.poll(10_000), "replay did not answer within 10 s"
        frames = dealer.recv_multipart()
        if frames[2] == END_SEQ:
            assert frames == [b"", b"", END_SEQ, b""]
            break
        assert len(frames) == 4 and frames[0] == b"" and frames[1] == TOPIC.encode()
        replayed.append((int.from_bytes(frames[2], "big"), frames[3]))
    assert replayed == [(seq, payload) for _, seq, payload in live if seq >= 2]


async def test_replay_frames_match_fixture_layout(zmq_ctx: zmq.Context) -> None:
    """Publishing the fixture's batches and replaying from 5 gives the fixture's replay frames."""
    pubs, fixture_replay = _fixture()
    replay_ep = f"tcp://127.0.0.1:{free_port()}"
    cfg = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}", replay_endpoint=replay_ep, topic=TOPIC
    )
    publisher = ZmqEventPublisher(cfg)
    publisher.start()
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        for rec in pubs:
            ts, events, _rank = rec["decoded"]
            assert publisher.publish(events, ts_s=ts) == rec["seq"]
        dealer.connect(replay_ep)
        dealer.send_multipart([b"", (5).to_bytes(8, "big")])
        got = []
        for _ in fixture_replay:
            for _ in range(200):
                if dealer.poll(0):
                    break
                await asyncio.sleep(0.05)
            got.append(dealer.recv_multipart(flags=zmq.NOBLOCK))
        assert got == fixture_replay
    finally:
        dealer.close(linger=0)
        await publisher.close()


def test_publisher_connects_out_to_a_binding_subscriber(zmq_ctx: zmq.Context) -> None:
    """An endpoint without '*' makes the PUB connect; the subscriber binds (vLLM's rule)."""
    port = free_port()
    sub = zmq_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")

    async def run() -> list[bytes]:
        publisher = ZmqEventPublisher(
            KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
        )
        try:
            # Re-publish until the connection is up (the first batches of a fresh connection may drop).
            for _ in range(100):
                publisher.publish([{"type": "AllBlocksCleared"}])
                if sub.poll(50):
                    return sub.recv_multipart()
            raise AssertionError("subscriber received nothing from a connecting publisher")
        finally:
            await publisher.close()

    topic, seq, payload = asyncio.run(run())
    assert topic == b"" and len(seq) == 8
    assert decode_batch(payload)[1] == [{"type": "AllBlocksCleared"}]
