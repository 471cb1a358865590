"""Event ingestion over real ZMQ sockets: a test publisher (XPUB + ROUTER replay) on loopback/ipc
feeds an EventManager; fixture frames, gaps with replay (both reply layouts), engine restart,
publisher killed and restarted, garbage frames, discovery via GET /kv_event_sources."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
import zmq
from aiohttp import web

from kvcore.index import PrefixIndex
from kvcore.keys import block_keys, request_extra_keys
from policies.base import PrefixMatch
from router.events import END_SEQ, EventManager, EventSource, discover_sources

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "vllm-kv-events"
TOPIC = "kv-events"

T_TOKENS = list(range(1000, 1064)) + list(range(2000, 2040))
S_TOKENS = list(range(1000, 1032))
T_KEYS = block_keys(T_TOKENS, 16)
S_SALTED_KEYS = block_keys(S_TOKENS, 16, extra_keys=request_extra_keys(2, cache_salt="tenant-b"))

#: The README's table: after seq -> (prefix of T, salted prefix of S) as (blocks, (gpu, cpu, storage)).
EXPECTED_AFTER_SEQ: dict[int, tuple[tuple[int, tuple[int, int, int]], tuple[int, tuple[int, int, int]]]] = {
    0: ((4, (4, 0, 0)), (0, (0, 0, 0))),
    1: ((6, (6, 0, 0)), (0, (0, 0, 0))),
    2: ((6, (6, 0, 0)), (0, (0, 0, 0))),
    3: ((4, (2, 2, 0)), (0, (0, 0, 0))),
    4: ((4, (2, 2, 0)), (0, (0, 0, 0))),
    5: ((4, (2, 2, 0)), (2, (2, 0, 0))),
    6: ((3, (2, 1, 0)), (2, (2, 0, 0))),
    7: ((3, (0, 3, 0)), (0, (0, 0, 0))),
}


def fixture_frames() -> list[dict]:
    lines = (FIXTURES / "vllm-0.33.0-frames.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def live_fixture() -> list[tuple[int, bytes]]:
    return [(f["seq"], base64.b64decode(f["payload_b64"])) for f in fixture_frames() if f["kind"] == "pub"]


def assert_fixture_state(index: PrefixIndex, seq: int) -> None:
    (t_blocks, t_tiers), (s_blocks, s_tiers) = EXPECTED_AFTER_SEQ[seq]
    assert index.match(T_KEYS, ["e0"])["e0"] == PrefixMatch(t_blocks, t_tiers), f"after seq {seq}"
    assert index.match(S_SALTED_KEYS, ["e0"])["e0"] == PrefixMatch(s_blocks, s_tiers), f"after seq {seq}"


class FramePublisher:
    """vLLM-like publisher: XPUB (knows when a subscriber joined) + ROUTER replay in a thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, *, topic_in_replay: bool = True) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.topic_in_replay = topic_in_replay
        self.replay_requests: list[int] = []
        #: When set, a replay request is answered with exactly these frames (recorded bytes).
        self.canned_replay: list[list[bytes]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def wait_subscriber(self, timeout_s: float = 30.0) -> None:
        if not self.pub.poll(int(timeout_s * 1000)):
            raise TimeoutError("no subscriber joined the test publisher")
        self.pub.recv()

    def publish(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        with self.lock:
            self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), payload])

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            identity, _empty, start = self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            if self.canned_replay is not None:
                for frames in self.canned_replay:
                    self.router.send_multipart([identity, *frames])
                continue
            with self.lock:
                batches = [(s, p) for s, p in self.buffer if s >= start_seq]
            for seq, payload in batches:
                head = [identity, b""] + ([TOPIC.encode()] if self.topic_in_replay else [])
                self.router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            end = [identity, b""] + ([b""] if self.topic_in_replay else [])
            self.router.send_multipart([*end, END_SEQ.to_bytes(8, "big"), b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self.router.close(0)
        self.pub.close(0)
        self.ctx.term()


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvev-") as path:
        yield path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., FramePublisher]]:
    made: list[FramePublisher] = []

    def make(*args: object, **kwargs: object) -> FramePublisher:
        pub = FramePublisher(*args, **kwargs)  # type: ignore[arg-type]
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()


@pytest.fixture
async def make_manager() -> AsyncIterator[Callable[..., EventManager]]:
    made: list[EventManager] = []

    def make(index: PrefixIndex, sources: list[EventSource], **kwargs: object) -> EventManager:
        # A replay answer silent for 2 s (the default) is a failed replay; a loaded machine can
        # starve the test publisher's thread that long. Tests of replay timeouts pass their own.
        kwargs.setdefault("replay_timeout_s", 10.0)
        manager = EventManager(index, sources, backoff_initial_s=0.05, backoff_max_s=0.2, **kwargs)  # type: ignore[arg-type]
        made.append(manager)
        return manager

    yield make
    for manager in made:
        await manager.stop()


async def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def last_seq(manager: EventManager) -> int | None:
    (health,) = manager.source_health().values()
    return health.last_seq


async def connect_replay_done(manager: EventManager) -> None:
    """Wait until the replay asked for on connect was answered and applied. A batch published
    before that answer is built is applied from the replay (and counted as replayed), its live
    copy then being a duplicate: tests that count replayed batches publish only after this."""
    await wait_for(
        lambda: any(h.last_replay_s is not None for h in manager.source_health().values()),
        "the replay on connect",
    )


async def test_fixture_frames_live_each_seq(ipc_dir, make_publisher, make_manager) -> None:
    endpoint, replay = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    pub = make_publisher(endpoint, replay)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, replay, topic=TOPIC)])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    for seq, payload in live_fixture():
        pub.publish(seq, payload)
        await wait_for(lambda s=seq: last_seq(manager) == s, f"seq {seq}")
        assert_fixture_state(index, seq)
    health = manager.health()["sources"]["e0/dp0"]
    assert health["gaps"] == 0 and health["decode_errors"] == 0 and health["batches"] == 8
    assert health["clears"] == 1 and health["status"] == "ok"


@pytest.mark.parametrize("topic_in_replay", [True, False], ids=["replay-with-topic", "replay-legacy"])
async def test_fixture_gap_is_replayed(ipc_dir, make_publisher, make_manager, topic_in_replay) -> None:
    endpoint, replay = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    pub = make_publisher(endpoint, replay, topic_in_replay=topic_in_replay)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, replay, topic=TOPIC)])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    await connect_replay_done(manager)
    dropped = {2, 3, 4, 6}
    for seq, payload in live_fixture():
        pub.publish(seq, payload, live=seq not in dropped)
        if seq in dropped:
            continue
        await wait_for(lambda s=seq: last_seq(manager) == s, f"seq {seq}")
        assert_fixture_state(index, seq)
    health = manager.health()["sources"]["e0/dp0"]
    # 0: the buffer on connect; then each gap asks from the last applied seq (1, 5) so the answer's
    # first batch proves the publisher is still the incarnation we followed.
    assert pub.replay_requests == [0, 1, 5]
    assert health["gaps"] == 2 and health["missed_batches"] == 4 and health["replayed_batches"] == 4
    assert not health["stale"] and health["batches"] == 8


async def test_recorded_replay_frames_are_applied(ipc_dir, make_publisher, make_manager) -> None:
    """Live 0-4, drop 5-6, live 7: the gap is filled by the exact frames vLLM's ROUTER sent."""
    endpoint, replay = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    pub = make_publisher(endpoint, replay)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, replay, topic=TOPIC)])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    await connect_replay_done(manager)  # answered from the (empty) buffer, not the canned frames
    assert pub.replay_requests == [0]
    pub.canned_replay = [
        [base64.b64decode(f) for f in rec["frames_b64"]]
        for rec in fixture_frames()
        if rec["kind"] == "replay"
    ]
    live = live_fixture()
    for seq, payload in live[:5]:
        pub.publish(seq, payload)
    await wait_for(lambda: last_seq(manager) == 4, "seq 4")
    # Before the gap is filled the salted prefix is absent; seq 5 (replayed) adds it, 7 clears it.
    assert index.match(S_SALTED_KEYS, ["e0"])["e0"].blocks == 0
    pub.publish(*live[7])
    await wait_for(lambda: last_seq(manager) == 7, "seq 7")
    assert_fixture_state(index, 7)
    assert pub.replay_requests == [0, 4]
    health = manager.health()["sources"]["e0/dp0"]
    assert health["replayed_batches"] == 2 and health["batches"] == 8 and not health["stale"]


async def test_gap_without_replay_marks_stale(make_publisher, make_manager) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    pub = make_publisher(endpoint, None)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None, topic=TOPIC)])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    live = live_fixture()
    pub.publish(*live[0])
    pub.publish(*live[3])
    await wait_for(lambda: last_seq(manager) == 3, "seq 3")
    health = manager.health()["sources"]["e0/dp0"]
    assert health["stale"] and health["status"] == "stale" and health["missed_batches"] == 2
    assert manager.untrusted_engines() == {"e0"}
    assert not manager.trusts("e0") and manager.trusts("e1")  # the per-engine query agrees
    # AllBlocksCleared resets the picture: trusted again.
    pub.publish(*live[7])
    await wait_for(lambda: last_seq(manager) == 7, "seq 7")
    assert manager.untrusted_engines() == set()
    assert manager.trusts("e0")


def _stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def _payload(*events: dict, ts: float = 0.0) -> bytes:
    return msgspec.msgpack.encode([ts or time.time(), list(events), 0])


async def test_seq_backwards_drops_engine_entries_and_garbage_is_counted(
    ipc_dir, make_publisher, make_manager
) -> None:
    endpoint = f"ipc://{ipc_dir}/pub"
    pub = make_publisher(endpoint, None)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None, topic="")])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    a_tokens, b_tokens = list(range(32)), list(range(100, 132))
    pub.publish(0, _payload(_stored([1, 2], a_tokens)))
    # Garbage: wrong frame count, short seq, undecodable payload, a batch with an unknown event type.
    pub.send_raw([b"kv", b"x"])
    pub.send_raw([b"kv", b"\x00\x01", b"\x90"])
    pub.send_raw([b"kv", (1).to_bytes(8, "big"), b"\xc1not msgpack"])
    pub.publish(2, _payload({"type": "FutureEvent", "x": 1}, _stored([3], list(range(200, 216)))))
    await wait_for(lambda: last_seq(manager) == 2, "seq 2")
    health = manager.health()["sources"]["e0/dp0"]
    assert health["decode_errors"] == 3 and health["skipped_events"] == 1 and health["restarts"] == 0
    assert index.match(block_keys(a_tokens, 16), ["e0"])["e0"].blocks == 2
    assert index.match(block_keys(list(range(200, 216)), 16), ["e0"])["e0"].blocks == 1
    # Engine restart: seq starts again at 0 with other content.
    pub.publish(0, _payload(_stored([7, 8], b_tokens)))
    await wait_for(lambda: manager.health()["sources"]["e0/dp0"]["restarts"] == 1, "restart")
    await wait_for(lambda: last_seq(manager) == 0, "seq 0 again")
    assert index.match(block_keys(a_tokens, 16), ["e0"])["e0"].blocks == 0
    assert index.match(block_keys(b_tokens, 16), ["e0"])["e0"].blocks == 2


PUBLISHER_SCRIPT = r"""
import sys, time, msgspec, zmq
endpoint, base = sys.argv[1], int(sys.argv[2])
ctx = zmq.Context(); pub = ctx.socket(zmq.XPUB); pub.bind(endpoint)
pub.recv()  # wait for the subscriber
seq = 0
while True:
    tokens = list(range(base + 16 * seq, base + 16 * seq + 16))
    ev = {"type": "BlockStored", "block_hashes": [base + seq], "parent_block_hash": None,
          "token_ids": tokens, "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    pub.send_multipart([b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [ev], 0])])
    seq += 1
    time.sleep(0.02)
"""


@pytest.fixture
def spawn_publisher() -> Iterator[Callable[[str, int], subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(endpoint: str, base: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", PUBLISHER_SCRIPT, endpoint, str(base)])
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        proc.kill()
        proc.wait(10)


async def test_publisher_killed_and_restarted_reconnects(spawn_publisher, make_manager) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None, topic="kv")])
    await manager.start()

    def first_block(base: int) -> list[int]:
        return block_keys(list(range(base, base + 16)), 16)

    proc = spawn_publisher(endpoint, 10_000)
    await wait_for(lambda: (last_seq(manager) or 0) >= 3, "first publisher's events")
    assert index.match(first_block(10_000), ["e0"])["e0"].blocks == 1
    proc.kill()
    await asyncio.to_thread(proc.wait, 10)
    spawn_publisher(endpoint, 50_000)
    await wait_for(
        lambda: index.match(first_block(50_000), ["e0"])["e0"].blocks == 1, "second publisher's events"
    )
    health = manager.health()["sources"]["e0/dp0"]
    assert health["restarts"] == 1 and health["connected"]
    # Everything the killed engine announced was dropped.
    assert index.match(first_block(10_000), ["e0"])["e0"].blocks == 0


async def test_subscriber_binds_for_connecting_publisher(make_manager) -> None:
    """A publisher whose endpoint names a host connects out; the router binds there."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None, topic="", bind=True)])
    await manager.start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.connect(endpoint)
        assert await asyncio.to_thread(pub.poll, 30000), "router never subscribed"
        pub.recv()
        pub.send_multipart([b"", (0).to_bytes(8, "big"), _payload(_stored([5], list(range(16))))])
        await wait_for(lambda: last_seq(manager) == 0, "seq 0")
        assert index.match(block_keys(list(range(16)), 16), ["e0"])["e0"].blocks == 1
    finally:
        pub.close(0)
        ctx.term()


async def test_discovery_from_kv_event_sources(ipc_dir, make_publisher, make_manager) -> None:
    """Endpoints come from the engine's GET /kv_event_sources (a real aiohttp server)."""
    port = free_port()
    replay_port = free_port()
    pub = make_publisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    body = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": TOPIC,
        }
    }

    async def kv_event_sources(_request: web.Request) -> web.Response:
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/kv_event_sources", kv_event_sources)
    runner = web.AppRunner(app)
    await runner.setup()
    http_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{http_port}"
            (source,) = await discover_sources(session, "e0", url)
            assert source.endpoint == f"tcp://127.0.0.1:{port}" and not source.bind
            assert source.replay_endpoint == f"tcp://127.0.0.1:{replay_port}" and source.topic == TOPIC
            index = PrefixIndex()
            manager = make_manager(index, [], discover={"e0": url}, http_session=session)
            await manager.start()
            await asyncio.to_thread(pub.wait_subscriber)
            for seq, payload in live_fixture()[:2]:
                pub.publish(seq, payload)
            await wait_for(lambda: bool(manager.source_health()) and last_seq(manager) == 1, "seq 1")
            assert_fixture_state(index, 1)
            await manager.stop()
    finally:
        await runner.cleanup()


async def test_health_reports_silent_source(make_manager) -> None:
    now = [100.0]
    index = PrefixIndex()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    manager = make_manager(index, [EventSource("e0", endpoint)], silent_after_s=5.0, clock=lambda: now[0])
    await manager.start()
    await wait_for(lambda: manager.health()["sources"]["e0/dp0"]["connected"], "connected")
    assert manager.health()["sources"]["e0/dp0"]["status"] == "ok"
    now[0] += 6.0
    snap = manager.health()["sources"]["e0/dp0"]
    assert snap["silent"] and snap["status"] == "silent" and snap["last_seq"] is None
