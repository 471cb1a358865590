# ruff: noqa: F811 - the shared fixtures imported from test_events_live are used as arguments
"""Issue 10's ingestion faults, one test each, over real ZMQ sockets: vLLM-compatible publishers
(the simulator's ZmqEventPublisher, or raw XPUB/ROUTER sockets for hostile streams) feeding the
router's EventManager, and the fully wired router where the fault lives in the wiring."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import httpx
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcore import sim_tokenizer
from kvcore.index import PrefixIndex
from kvcore.keys import block_keys
from kvcore.wire import offset_endpoint_port, publisher_binds
from router.config import load_config
from router.events import END_SEQ, EventManager, EventSource, discover_sources, sources_for_engine
from router.service import build_router_app, event_sources
from sim.server import EngineServerConfig, ThreadedEngineServer
from sim.zmq_publisher import KVEventsConfig, ZmqEventPublisher
from tests.conftest import ThreadedServer
from tests.test_events_live import (  # noqa: F401 - fixtures are used by name
    TOPIC,
    FramePublisher,
    _payload,
    _stored,
    free_port,
    ipc_dir,
    last_seq,
    make_manager,
    make_publisher,
    wait_for,
)


def free_ports(n: int) -> int:
    """A base port such that base .. base+n-1 are all free on loopback (data-parallel ranks)."""
    for _ in range(100):
        base = free_port()
        socks = []
        try:
            for offset in range(n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def tokens_of(n: int, base: int) -> list[int]:
    return list(range(base, base + 16 * n))


def stored_event(block: int, base: int = 0) -> dict[str, Any]:
    """BlockStored of one full block: tokens base+16*block.., chained on the previous block."""
    toks = list(range(base + 16 * block, base + 16 * block + 16))
    return _stored([base + block + 1], toks, parent=base + block if block else None)


def held_blocks(index: PrefixIndex, tokens: list[int], engine: str = "e0") -> int:
    return index.match(block_keys(tokens, 16), [engine])[engine].blocks


@pytest.fixture
async def sim_publishers() -> AsyncIterator[Callable[..., ZmqEventPublisher]]:
    """The simulator's vLLM-compatible publisher (PUB + replay ROUTER), closed after the test."""
    made: list[ZmqEventPublisher] = []

    def make(
        endpoint: str, replay: str | None, dp_rank: int = 0, buffer_steps: int = 10_000
    ) -> ZmqEventPublisher:
        cfg = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=endpoint,
            replay_endpoint=replay,
            topic=TOPIC,
            buffer_steps=buffer_steps,
        )
        pub = ZmqEventPublisher(cfg, dp_rank=dp_rank)
        pub.start()
        made.append(pub)
        return pub

    yield make
    for pub in made:
        await pub.close()


def health_of(manager: EventManager, name: str = "e0/dp0") -> dict[str, Any]:
    return manager.health()["sources"][name]


# ----------------------------------------------------------------------------- fault 1


class CountingPublisher:
    """An XPUB that counts the subscriber connections it accepted (socket monitor), and a replay
    ROUTER that counts requests; both in a thread."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.monitor = self.pub.get_monitor_socket(zmq.EVENT_ACCEPTED)
        self.pub.bind(endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(replay)
        self.accepted = 0
        self.replay_requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                if sock is self.monitor:
                    recv_monitor_message(self.monitor)
                    self.accepted += 1
                else:
                    identity, _empty, _start = self.router.recv_multipart()
                    self.replay_requests += 1
                    self.router.send_multipart([identity, b"", b"", b"\xff" * 8, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.disable_monitor()
        for sock in (self.monitor, self.router, self.pub):
            sock.close(0)
        self.ctx.term()


def _router_config(engines: list[dict[str, Any]], **sections: Any) -> Any:
    data: dict[str, Any] = {
        "engines": engines,
        "health": {"interval_s": 0},
        "costs": {"scrape_interval_s": 0},
        "log_level": "warning",
    }
    data.update(sections)
    return load_config(environ={}, overrides=data)


def test_fault1_one_subscriber_per_engine_and_it_is_the_visible_one(
    serve_asgi: Callable[..., ThreadedServer],
) -> None:
    port, replay_port = free_port(), free_port()
    pub = CountingPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        config = _router_config(
            [
                {
                    "id": "e0",
                    "url": f"http://127.0.0.1:{free_port()}",
                    "kv_events_endpoint": f"tcp://127.0.0.1:{port}",
                    "kv_replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                    "kv_events_topic": TOPIC,
                }
            ]
        )
        url = serve_asgi(build_router_app(config)).url
        deadline = time.monotonic() + 30
        while pub.replay_requests < 1:
            assert time.monotonic() < deadline, "the router never asked for the replay buffer"
            time.sleep(0.02)
        time.sleep(0.5)  # a second manager would have connected and asked by now
        assert pub.accepted == 1, "one SUB connection per engine and rank"
        assert pub.replay_requests == 1
        pub.pub.send_multipart([TOPIC.encode(), (0).to_bytes(8, "big"), _payload(stored_event(0))])
        deadline = time.monotonic() + 30
        while True:
            source = httpx.get(f"{url}/debug/index").json()["events"]["sources"]["e0/dp0"]
            if source["batches"] == 1:
                break
            assert time.monotonic() < deadline, source
            time.sleep(0.02)
        ready = httpx.get(f"{url}/ready").json()["events"]
        assert ready["ok"] and ready["sources"]["e0/dp0"]["last_seq"] == 0
        assert 'kvroute_kv_event_batches_total{engine="e0"} 1.0' in httpx.get(f"{url}/metrics").text
    finally:
        pub.close()


def test_fault1_bind_mode_router_is_ready(serve_asgi: Callable[..., ThreadedServer]) -> None:
    """A publisher that connects out: the router binds once; a second manager used to fail with
    'Address already in use' and /ready said so forever."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    config = _router_config(
        [
            {
                "id": "e0",
                "url": f"http://127.0.0.1:{free_port()}",
                "kv_events_endpoint": endpoint,
                "kv_events_mode": "bind",
            }
        ]
    )
    url = serve_asgi(build_router_app(config)).url
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.connect(endpoint)
        assert pub.poll(30000), "the router never subscribed"
        pub.recv()
        pub.send_multipart([b"", (0).to_bytes(8, "big"), _payload(stored_event(0))])
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/debug/index").json()["events"]["sources"]["e0/dp0"]["batches"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        ready = httpx.get(f"{url}/ready").json()["events"]
        assert ready["ok"], ready
        assert ready["source_problems"] == {}
    finally:
        pub.close(0)
        ctx.term()


# ----------------------------------------------------------------------------- fault 2


async def test_fault2_nested_payload_is_counted_and_survived(ipc_dir, make_publisher, make_manager) -> None:
    endpoint = f"ipc://{ipc_dir}/pub"
    pub = make_publisher(endpoint, None)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None, topic="")])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    nested = b"\x93\xcb" + b"\x00" * 8 + b"\x91" * 200_000 + b"\xc0"  # [ts, [[[[...]]]]]
    pub.publish(0, nested)
    pub.publish(0, _payload(stored_event(0)))
    await wait_for(lambda: last_seq(manager) == 0, "the valid frame after the nested one")
    health = health_of(manager)
    assert health["decode_errors"] == 1 and "nested" in health["last_error"]
    assert health["task_restarts"] == 0 and held_blocks(index, tokens_of(1, 0)) == 1


async def test_fault2_crashed_task_is_restarted_and_reported(ipc_dir, make_publisher, make_manager) -> None:
    endpoint = f"ipc://{ipc_dir}/pub"
    pub = make_publisher(endpoint, None)
    index = PrefixIndex()
    calls: list[int] = []

    def on_batch(source: EventSource, batch: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("observer bug")

    manager = make_manager(index, [EventSource("e0", endpoint, None)], on_batch=on_batch)
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    pub.publish(0, _payload(stored_event(0)))
    await wait_for(lambda: health_of(manager)["task_restarts"] == 1, "the task restart")
    await wait_for(lambda: health_of(manager)["peer_connected"], "the restarted task's socket")
    deadline = time.monotonic() + 30
    while last_seq(manager) != 1:  # resent until the new subscription has reached the publisher
        assert time.monotonic() < deadline, health_of(manager)
        pub.publish(1, _payload(stored_event(1)))
        await asyncio.sleep(0.05)
    health = health_of(manager)
    assert "observer bug" in health["last_error"]
    assert held_blocks(index, tokens_of(2, 0)) == 2


# ----------------------------------------------------------------------------- faults 3 and 4


async def test_fault3_late_join_replays_a_full_default_buffer(sim_publishers, make_manager) -> None:
    port, replay_port = free_port(), free_port()
    pub = sim_publishers(f"tcp://*:{port}", f"tcp://*:{replay_port}")
    for block in range(10_000):
        pub.publish([stored_event(block)])
    index = PrefixIndex()
    source = EventSource("e0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic=TOPIC)
    manager = make_manager(index, [source])
    await manager.start()
    await wait_for(lambda: health_of(manager)["replayed_batches"] == 10_000, "the whole buffer", timeout_s=60)
    health = health_of(manager)
    assert health["batches"] == 10_000 and health["replayed_batches"] == 10_000, health
    assert health["status"] == "ok" and not health["stale"]
    assert held_blocks(index, tokens_of(10_000, 0)) == 10_000


class ReplayRouter:
    """A stand-in for an engine's replay ROUTER socket, serving in its own thread: ``answer`` is
    called for every request (the asker's identity and the first sequence asked for) and sends
    with ``batch`` and ``end``; ``close`` stops the thread and the socket."""

    def __init__(self, endpoint: str, payloads: list[bytes]) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.payloads = payloads
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> ReplayRouter:
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            identity, _empty, start = self.sock.recv_multipart()
            self.requests += 1
            self.answer(identity, int.from_bytes(start, "big"))

    def answer(self, identity: bytes, start_seq: int) -> None:
        raise NotImplementedError

    def batch(self, identity: bytes, seq: int) -> None:
        self.sock.send_multipart([identity, b"", TOPIC.encode(), seq.to_bytes(8, "big"), self.payloads[seq]])

    def end(self, identity: bytes) -> None:
        self.sock.send_multipart([identity, b"", b"", END_SEQ.to_bytes(8, "big"), b""])

    def stopped(self, wait_s: float = 0.0) -> bool:
        return self._stop.wait(wait_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


class PacedReplay(ReplayRouter):
    """Answers every request with all ``payloads`` in ``slices`` pieces, ``pause_s`` apart, then
    the end marker: a long answer that is never silent for long."""

    def __init__(self, endpoint: str, payloads: list[bytes], slices: int, pause_s: float) -> None:
        super().__init__(endpoint, payloads)
        self.slices, self.pause_s = slices, pause_s
        self.took_s = 0.0

    def answer(self, identity: bytes, start_seq: int) -> None:
        started = time.monotonic()
        step = -(-len(self.payloads) // self.slices)
        for first in range(0, len(self.payloads), step):
            for seq in range(first, min(first + step, len(self.payloads))):
                self.batch(identity, seq)
            if self.stopped(self.pause_s):
                return
        self.took_s = time.monotonic() - started  # before the end marker the router waits for
        self.end(identity)


async def test_fault3_replay_timeout_is_per_silence_not_per_answer(
    ipc_dir, make_publisher, make_manager
) -> None:
    """A replay answer that takes 3 s in all but is never silent for more than ~0.1 s is complete
    with a 1.5 s replay timeout: the timeout measures silence, not the whole answer (a timeout on
    the whole answer would fail this replay every time; the 15x margin on the silences keeps a
    loaded machine from failing it)."""
    endpoint, replay = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    make_publisher(endpoint, None)
    payloads = [_payload(stored_event(block)) for block in range(3_000)]
    server = PacedReplay(replay, payloads, slices=30, pause_s=0.1).start()
    try:
        index = PrefixIndex()
        manager = make_manager(index, [EventSource("e0", endpoint, replay)], replay_timeout_s=1.5)
        await manager.start()
        await wait_for(
            lambda: health_of(manager)["replayed_batches"] == 3_000, "the paced replay", timeout_s=60
        )
        await wait_for(lambda: server.took_s > 0 and health_of(manager)["trusted"], "the end of the answer")
        health = health_of(manager)
        assert server.took_s > 1.5 * 1.9, server.took_s  # longer than the timeout, whatever the load
        assert server.requests == 1 and health["replay_failures"] == 0, health
        assert health["status"] == "ok" and not health["stale"] and health["trusted"], health
        assert held_blocks(index, tokens_of(3_000, 0)) == 3_000
    finally:
        server.close()


class StallingReplay(ReplayRouter):
    """Answers the first request with ``first_n`` batches and then falls silent (no end marker);
    later requests get the whole buffer."""

    def __init__(self, endpoint: str, payloads: list[bytes], first_n: int) -> None:
        super().__init__(endpoint, payloads)
        self.first_n = first_n

    def answer(self, identity: bytes, start_seq: int) -> None:
        n = self.first_n if self.requests == 1 else len(self.payloads)
        for seq in range(n):
            self.batch(identity, seq)
        if self.requests > 1:
            self.end(identity)


async def test_fault3_incomplete_replay_marks_untrusted_until_caught_up(
    ipc_dir, make_publisher, make_manager
) -> None:
    endpoint, replay = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    make_publisher(endpoint, None)
    payloads = [_payload(stored_event(block)) for block in range(300)]
    server = StallingReplay(replay, payloads, first_n=100).start()
    try:
        index = PrefixIndex()
        manager = make_manager(
            index,
            [EventSource("e0", endpoint, replay)],
            replay_timeout_s=0.3,
            resync_burst=1,
            resync_per_s=2.0,
        )
        await manager.start()
        # Untrusted from the start (waiting for the replay answer), then because the answer stalled.
        assert manager.untrusted_engines() == {"e0"}
        await wait_for(
            lambda: "incomplete" in (health_of(manager)["stale_reason"] or ""),
            "untrusted after the stalled replay",
        )
        assert manager.untrusted_engines() == {"e0"} and not manager.trusts("e0")
        # The retry (held back by the rate limit, then allowed) brings the whole buffer.
        await wait_for(lambda: last_seq(manager) == 299, "the retried replay")
        await wait_for(lambda: manager.untrusted_engines() == set(), "trusted again")
        assert manager.trusts("e0")
        assert server.requests == 2 and held_blocks(index, tokens_of(300, 0)) == 300
    finally:
        server.close()


async def test_fault4_idle_engine_is_visible_after_router_start(sim_publishers, make_manager) -> None:
    port, replay_port = free_port(), free_port()
    pub = sim_publishers(f"tcp://*:{port}", f"tcp://*:{replay_port}")
    for block in range(3):
        pub.publish([stored_event(block)])
    index = PrefixIndex()  # the router (re)starts after the engine went idle
    source = EventSource("e0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic=TOPIC)
    manager = make_manager(index, [source])
    await manager.start()
    await wait_for(lambda: held_blocks(index, tokens_of(3, 0)) == 3, "the idle engine's blocks")
    # Trusted once the replay's answer is in (its blocks can reach the index a moment before the
    # source is marked fresh: wait on that too, not assert it at once).
    await wait_for(lambda: not health_of(manager)["stale"], "the idle engine trusted after the replay")


# ----------------------------------------------------------------------------- fault 5


async def test_fault5_restart_whose_first_batches_were_missed(sim_publishers, make_manager) -> None:
    port, replay_port = free_port(), free_port()
    endpoint, replay = f"tcp://*:{port}", f"tcp://*:{replay_port}"
    old = sim_publishers(endpoint, replay)
    index = PrefixIndex()
    source = EventSource("e0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic=TOPIC)
    manager = make_manager(index, [source])
    await manager.start()
    await wait_for(lambda: health_of(manager)["peer_connected"], "connected to the first incarnation")
    await wait_for(lambda: health_of(manager)["replays"] >= 1, "the replay on connect")
    for block in range(3):
        old.publish([stored_event(block, base=10_000)])
    await wait_for(lambda: last_seq(manager) == 2, "the old incarnation's seq 2")
    await old.close()
    new = sim_publishers(endpoint, replay)
    for block in range(4):  # published before the SUB reconnects: lost live, only in the buffer
        new.publish([stored_event(block, base=50_000)])
    await wait_for(lambda: health_of(manager)["restarts"] == 1, "restart detected from the replay answer")
    new.publish([stored_event(4, base=50_000)])  # seq 4: would have looked like a gap after 2
    await wait_for(lambda: last_seq(manager) == 4, "the new incarnation's seq 4")
    assert held_blocks(index, tokens_of(3, 10_000)) == 0, "the dead incarnation's entries stay"
    assert held_blocks(index, tokens_of(5, 50_000)) == 5
    assert not health_of(manager)["stale"]


# ----------------------------------------------------------------------------- fault 6


async def test_fault6_undecodable_frame_does_not_move_the_seq(ipc_dir, make_publisher, make_manager) -> None:
    endpoint = f"ipc://{ipc_dir}/pub"
    pub = make_publisher(endpoint, None)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None)])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    pub.publish(0, _payload(stored_event(0)))
    pub.send_raw([TOPIC.encode(), (2**64 - 1).to_bytes(8, "big"), b"\xc1 junk"])
    pub.publish(1, _payload(stored_event(1)))
    await wait_for(lambda: last_seq(manager) == 1, "seq 1")
    health = health_of(manager)
    assert health["decode_errors"] == 1 and health["restarts"] == 0 and health["gaps"] == 0
    assert held_blocks(index, tokens_of(2, 0)) == 2


# ----------------------------------------------------------------------------- fault 7


def test_fault7_lora_request_matches_its_own_blocks(serve_asgi: Callable[..., ThreadedServer]) -> None:
    port, replay_port = free_port(), free_port()
    engine_cfg = EngineServerConfig(
        port=0,
        gpu_blocks=256,
        time_scale=100.0,
        lora_modules=("sql-lora",),
        kv_events=KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{replay_port}",
            topic=TOPIC,
        ),
    )
    with ThreadedEngineServer(engine_cfg) as engine:
        config = _router_config(
            [{"id": "e0", "url": engine.url, "model": sim_tokenizer.NAME}],
            tokenizer={"backend": "sim"},
            health={"interval_s": 0.1},
            policy={"name": "kv_gpu"},
        )
        url = serve_asgi(build_router_app(config)).url
        deadline = time.monotonic() + 30
        while "sql-lora" not in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        messages = [{"role": "user", "content": "select the rows of table t " * 12}]
        body = {"model": "sql-lora", "messages": messages, "max_tokens": 1}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
        deadline = time.monotonic() + 30
        while True:
            lora = httpx.post(f"{url}/v1/route/explain", json=body).json()
            if lora["engines"][0]["prefix_blocks"] > 0:
                break
            assert time.monotonic() < deadline, lora
            time.sleep(0.05)
        assert lora["engines"][0]["prefix_blocks"] == lora["prompt_blocks"]
        base = httpx.post(f"{url}/v1/route/explain", json={**body, "model": sim_tokenizer.NAME}).json()
        assert base["engines"][0]["prefix_blocks"] == 0, "base-model requests cannot reuse adapter blocks"


# ----------------------------------------------------------------------------- fault 8


async def test_fault8_data_parallel_ranks_from_a_static_entry(sim_publishers, make_manager) -> None:
    port, replay_port = free_ports(2), free_ports(2)
    pubs = [sim_publishers(f"tcp://*:{port}", f"tcp://*:{replay_port}", dp_rank=r) for r in range(2)]
    config = _router_config(
        [
            {
                "id": "e0",
                "url": "http://127.0.0.1:8000",
                "kv_events_endpoint": f"tcp://127.0.0.1:{port}",
                "kv_replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                "kv_events_topic": TOPIC,
                "data_parallel_size": 2,
            }
        ]
    )
    sources, _ = event_sources(config.engines, discover=False)
    assert [(s.endpoint, s.replay_endpoint, s.dp_rank) for s in sources] == [
        (f"tcp://127.0.0.1:{port + r}", f"tcp://127.0.0.1:{replay_port + r}", r) for r in range(2)
    ]
    index = PrefixIndex()
    manager = make_manager(index, sources)
    await manager.start()
    for rank, pub in enumerate(pubs):
        pub.publish([stored_event(0, base=1000 * (rank + 1))])  # published before we listen
    await wait_for(lambda: held_blocks(index, tokens_of(1, 1000)) == 1, "rank 0's block")
    await wait_for(lambda: held_blocks(index, tokens_of(1, 2000)) == 1, "rank 1's block")


async def test_fault8_publisher_that_connects_out(sim_publishers, make_manager) -> None:
    """vLLM endpoint with a concrete host: the sim publisher connects out, the router binds."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    config = _router_config(
        [{"id": "e0", "url": "http://10.0.0.5:8000", "kv_events_endpoint": endpoint}]
    )  # a host other than the engine's: the engine connects to us
    (source,) = event_sources(config.engines, discover=False)[0]
    assert source.bind and source.endpoint == endpoint
    index = PrefixIndex()
    manager = make_manager(index, [source])
    await manager.start()
    await wait_for(lambda: health_of(manager)["connected"], "bound")
    pub = sim_publishers(endpoint, None)
    await wait_for(lambda: health_of(manager)["peer_connected"], "the publisher connected")
    # Resent until it lands: the subscription travels to the PUB after the connection (a batch
    # sent before it arrives is dropped by ZMQ), and a busy machine gives no bound on when.
    deadline = time.monotonic() + 30
    while held_blocks(index, tokens_of(1, 0)) != 1:
        assert time.monotonic() < deadline, health_of(manager)
        pub.publish([stored_event(0)])
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://*:5557",
        "tcp://[::]:5557",
        "tcp://[::1]:5557",
        "tcp://[fe80::1]:5557",
        "tcp://[2001:db8:0:0:0:0:0:1]:5557",
        "tcp://10.0.0.9:5557",
        "ipc:///tmp/kv",
    ],
)
def test_fault8_both_sides_apply_one_bind_rule(endpoint: str) -> None:
    """Exactly one side binds for every endpoint shape, IPv6 included (both used to bind for
    ``tcp://[::1]:...``), and rank offsets keep IPv6 hosts intact."""
    (source,) = sources_for_engine("e0", "10.0.0.5", endpoint)
    assert publisher_binds(endpoint) != source.bind, source
    assert offset_endpoint_port("tcp://[::1]:5557", 3) == "tcp://[::1]:5560"
    if source.bind:
        assert source.endpoint == endpoint


# ----------------------------------------------------------------------------- fault 9


async def test_fault9_discovery_against_the_real_simulated_engine(make_manager) -> None:
    port, replay_port = free_port(), free_port()
    engine_cfg = EngineServerConfig(
        port=0,
        gpu_blocks=256,
        time_scale=100.0,
        kv_events=KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{replay_port}",
            topic=TOPIC,
        ),
    )
    with ThreadedEngineServer(engine_cfg) as engine:
        async with aiohttp.ClientSession() as session:
            (source,) = await discover_sources(session, "e0", engine.url)
            assert not source.bind and source.endpoint == f"tcp://127.0.0.1:{port}"
            index = PrefixIndex()
            manager = make_manager(index, [], discover={"e0": engine.url}, http_session=session)
            await manager.start()
            await wait_for(lambda: bool(manager.source_health()), "the discovered source")
            await wait_for(lambda: health_of(manager)["peer_connected"], "connected to the engine")
            prompt = list(range(500, 500 + 64))
            async with session.post(
                f"{engine.url}/v1/completions",
                json={"model": sim_tokenizer.NAME, "prompt": prompt, "max_tokens": 1},
            ) as resp:
                assert resp.status == 200
            await wait_for(lambda: held_blocks(index, prompt) == 4, "the engine's blocks")
            assert health_of(manager)["status"] == "ok"
            await manager.stop()


# ----------------------------------------------------------------------------- fault 10


def test_fault10_no_silent_alarm_for_requests_that_store_nothing(
    serve_asgi: Callable[..., ThreadedServer],
) -> None:
    port, replay_port = free_port(), free_port()
    engine_cfg = EngineServerConfig(
        port=0,
        gpu_blocks=256,
        time_scale=100.0,
        kv_events=KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{replay_port}",
            topic=TOPIC,
        ),
    )
    with ThreadedEngineServer(engine_cfg) as engine:
        config = _router_config(
            [{"id": "e0", "url": engine.url, "model": sim_tokenizer.NAME}],
            tokenizer={"backend": "sim"},
            health={"interval_s": 0.2},
            costs={"scrape_interval_s": 0.1},
            events={"silent_after_s": 0.3},
        )
        url = serve_asgi(build_router_app(config)).url
        client = httpx.Client(base_url=url, timeout=30)
        long_prompt = [{"role": "user", "content": "a long question that fills blocks " * 6}]
        assert client.post(
            "/v1/completions", json={"model": sim_tokenizer.NAME, "prompt": list(range(64)), "max_tokens": 1}
        ).is_success  # stores blocks, and the events come
        for _ in range(3):
            for messages in (long_prompt, [{"role": "user", "content": "hi"}]):  # repeated, short
                body = {"model": sim_tokenizer.NAME, "messages": messages, "max_tokens": 1}
                assert client.post("/v1/chat/completions", json=body).is_success
            rejected = {"model": sim_tokenizer.NAME, "prompt": [1, 2], "max_tokens": -1}
            assert client.post("/v1/completions", json=rejected).status_code == 400
            time.sleep(0.4)  # idle for longer than silent_after_s, scraped several times
        ready = client.get("/ready").json()["events"]
        assert ready["silent_engines"] == {} and ready["ok"], ready
        assert 'kvroute_event_source_silent{engine="e0"} 0.0' in client.get("/metrics").text


# ----------------------------------------------------------------------------- fault 11


async def test_fault11_a_burst_shares_the_event_loop(ipc_dir, make_manager) -> None:
    endpoint = f"ipc://{ipc_dir}/pub"
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None)])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(endpoint)
    try:
        await manager.start()
        assert await asyncio.to_thread(pub.poll, 30000)
        pub.recv()
        seen: list[int] = []

        async def ticker() -> None:
            while True:
                seen.append(health_of(manager)["batches"])
                await asyncio.sleep(0.001)

        n = 3000
        frames = [[b"", seq.to_bytes(8, "big"), _payload(stored_event(seq))] for seq in range(n)]
        for f in frames:
            pub.send_multipart(f)
        task = asyncio.create_task(ticker())
        await wait_for(lambda: last_seq(manager) == n - 1, "the burst", timeout_s=60)
        task.cancel()
        # The ticker ran while the burst was being ingested, not only before or after it.
        assert any(0 < count < n for count in seen), seen[:5]
    finally:
        pub.close(0)
        ctx.term()


async def test_fault11_bounded_backlog_counts_drops_and_marks_untrusted(ipc_dir, make_manager) -> None:
    endpoint = f"ipc://{ipc_dir}/pub"
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None)], rcvhwm=50)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 50)
    pub.bind(endpoint)
    try:
        await manager.start()
        assert await asyncio.to_thread(pub.poll, 30000)
        pub.recv()
        n = 5000
        for seq in range(n):  # the loop is busy here: the router cannot drain meanwhile
            pub.send_multipart([b"", seq.to_bytes(8, "big"), _payload(stored_event(seq))], zmq.NOBLOCK)
        time.sleep(0.3)  # noqa: ASYNC251 - keep the loop busy so that the backlog overflows
        # Now the router drains what was kept; the last batch is resent until it lands (sent while
        # the queues are still full, XPUB drops it; a second copy is a counted duplicate).
        deadline = time.monotonic() + 30
        while last_seq(manager) != n:
            assert time.monotonic() < deadline, health_of(manager)
            pub.send_multipart([b"", n.to_bytes(8, "big"), _payload(stored_event(n))])
            await asyncio.sleep(0.2)
        health = health_of(manager)
        assert health["missed_batches"] > 0 and health["batches"] + health["missed_batches"] == n + 1
        assert health["stale"] and manager.untrusted_engines() == {"e0"}
    finally:
        pub.close(0)
        ctx.term()


# ----------------------------------------------------------------------------- fault 12


async def test_fault12_regressing_seqs_are_rate_limited(
    ipc_dir, make_publisher, make_manager, caplog
) -> None:
    endpoint, replay = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    pub = make_publisher(endpoint, replay)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, replay, topic=TOPIC)])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    await wait_for(lambda: pub.replay_requests == [0], "the replay on connect")
    caplog.set_level(logging.WARNING, logger="router.events")
    n, chunk = 2000, 200
    for start in range(0, n, chunk):  # two interleaved streams: every other message goes backwards
        for i in range(start, start + chunk):
            seq = 1000 + i // 2 if i % 2 == 0 else i // 2
            pub.send_raw([TOPIC.encode(), seq.to_bytes(8, "big"), _payload(stored_event(i % 64))])
        # Paced by what the router has taken in: 2,000 messages sent at once can overrun the
        # publisher's send queue (ZMQ's default high-water mark, 1,000) on a busy machine, and a
        # dropped message is a regression never seen.
        sent = start + chunk
        await wait_for(
            lambda sent=sent: health_of(manager)["seq_regressions"] >= sent // 2 - 10,
            "the regressions",
            timeout_s=30,
        )
    health = health_of(manager)
    assert health["restarts"] <= 10 and len(pub.replay_requests) <= 12, (health, pub.replay_requests)
    assert health["resyncs_deferred"] > 0 and health["stale"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 12, [r.getMessage() for r in warnings]


# ----------------------------------------------------------------------------- fault 13


@pytest.mark.slow
async def test_fault13_short_lived_publisher_is_not_missed(ipc_dir) -> None:
    """Defaults only: 3.5 s without a publisher let ZMQ's reconnect interval grow (to 3.2 s with
    the old 5 s cap); a publisher then lives 1.5 s and must be heard."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = PrefixIndex()
    manager = EventManager(index, [EventSource("e0", endpoint, None)])
    await manager.start()
    ctx = zmq.Context()
    try:
        await asyncio.sleep(3.5)
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(endpoint)
        for seq in range(30):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), _payload(stored_event(seq))])
            await asyncio.sleep(0.05)
        pub.close(0)
        # What was received while it lived is in the SUB's queue: applied even if read after.
        await wait_for(lambda: health_of(manager)["batches"] > 0, "a batch of the short-lived publisher")
    finally:
        await manager.stop()
        ctx.term()
