"""router.shared_state against a real redis-server: replicas see each other's load and routing
records, a dead replica's reservations expire, a Redis outage degrades to local knowledge without
raising, and a Redis restart gets every replica's share rewritten."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.redis_server import RedisServer, redis_binary
from router.shared_state import SharedState, write_script_args

pytestmark = pytest.mark.skipif(
    redis_binary() is None, reason="redis-server binary not found (apt-get install redis-server)"
)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


async def _until(check: Callable[[], Awaitable[Any]], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _state(url: str, replica: str, **kwargs: Any) -> SharedState:
    kwargs.setdefault("ttl_s", 1.0)
    # Generous: these tests check behaviour, and the machine running them may be busy.
    kwargs.setdefault("timeout_s", 1.0)
    return SharedState(url, cluster="t", replica_id=replica, **kwargs)


async def test_replicas_see_each_others_load_and_routing(redis_server: RedisServer) -> None:
    a, b = _state(redis_server.url, "a"), _state(redis_server.url, "b")
    seen: list[tuple[str, list[int]]] = []
    b.add_routed_listener(lambda engine, keys, age_s: seen.append((engine, list(keys))))
    await a.start()
    await b.start()
    try:
        assert a.up and b.up
        big_key = 2**64 - 3  # keys are unsigned 64-bit; the top bit must survive the trip
        a.reserve("e0", 300)
        a.routed("e0", [11, big_key])
        a.reserve("e0", 50)
        a.reserve("e1", 7)

        async def b_sees() -> bool:
            remote = await b.refresh()
            return remote.in_flight == {"e0": 2, "e1": 1} and remote.queued_prefill_tokens == {
                "e0": 350,
                "e1": 7,
            }

        await _until(b_sees, "b to see a's reservations")
        assert b.remote.replicas == 1
        # A replica does not count itself: its own load is already in its local tracker.
        assert (await a.refresh()).in_flight == {}
        a.first_byte("e0", 300)
        a.end("e0")

        async def b_sees_less() -> bool:
            remote = await b.refresh()
            return remote.in_flight.get("e0") == 1 and remote.queued_prefill_tokens.get("e0") == 50

        await _until(b_sees_less, "first byte and end to reach b")
        await _until(lambda: asyncio.sleep(0, result=seen), "b to receive a's routing record")
        assert seen == [("e0", [11, big_key])]
    finally:
        await a.stop()
        await b.stop()


async def test_dead_replica_reservations_expire(redis_server: RedisServer) -> None:
    a, b = _state(redis_server.url, "a", ttl_s=0.6), _state(redis_server.url, "b", ttl_s=0.6)
    await a.start()
    await b.start()
    try:
        a.reserve("e0", 100)
        await _until(lambda: _in_flight(b, "e0", 1), "b to see a's reservation")
        # Simulate a crash: a's background tasks stop (no heartbeat, no clean delete).
        for task in a._tasks:
            task.cancel()
        await asyncio.sleep(0.05)
        # Within 25 TTLs: a bound that says "expires" (not "stays forever") on a busy machine too.
        await _until(lambda: _in_flight(b, "e0", 0), "a's reservation to expire", timeout_s=15.0)
        assert b.remote.replicas == 0
    finally:
        await b.stop()
        for conn in (a._reader, a._writer, a._tail):
            await conn.aclose()


async def _in_flight(state: SharedState, engine: str, want: int) -> bool:
    return (await state.refresh()).in_flight.get(engine, 0) == want


async def test_redis_outage_degrades_then_restart_restores_every_share(redis_server: RedisServer) -> None:
    a, b = _state(redis_server.url, "a"), _state(redis_server.url, "b")
    await a.start()
    await b.start()
    try:
        a.reserve("e0", 10)
        await _until(lambda: _in_flight(b, "e0", 1), "b to see a's reservation")
        redis_server.stop()
        remote = await a.refresh()  # must not raise: the request path goes on locally
        assert remote.in_flight == {} and not a.up
        assert "read" in a.last_error
        assert a.ready_detail()["mode"] == "local"
        # Load taken while Redis is away is kept locally and published once it is back.
        a.reserve("e1", 5)
        a.end("e0")
        redis_server.start()
        await _until(lambda: asyncio.sleep(0, result=a.up and b.up), "both replicas to reconnect")

        async def restored() -> bool:
            remote = await b.refresh()
            return remote.in_flight == {"e0": 0, "e1": 1} and remote.queued_prefill_tokens.get("e1") == 5

        await _until(restored, "a's share to be rewritten into the restarted Redis")
    finally:
        await a.stop()
        await b.stop()


async def test_unreachable_at_start_routes_locally_and_joins_later(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "late")
    state = _state(server.url, "late", timeout_s=0.2)
    await state.start()
    try:
        assert not state.up and state.ready_detail()["ok"] is False
        state.reserve("e0", 1)
        assert (await state.refresh()).in_flight == {}
        server.start()
        await _until(lambda: asyncio.sleep(0, result=state.up), "the replica to join once Redis answers")
    finally:
        await state.stop()
        server.stop()


async def test_a_restarted_replica_relearns_what_the_others_routed(redis_server: RedisServer) -> None:
    a = _state(redis_server.url, "a")
    await a.start()
    try:
        a.routed("e2", [1, 2, 3])
        a.routed("e1", [4, 5])
        # The writer flushed both records: a replica listening since before sees them.
        listener = _state(redis_server.url, "listener")
        heard: list[str] = []
        listener.add_routed_listener(lambda engine, keys, age_s: heard.append(engine))
        await listener.start()
        try:
            await _until(lambda: asyncio.sleep(0, result=len(heard) == 2), "a's records in Redis")
        finally:
            await listener.stop()
        seen: list[tuple[str, list[int]]] = []
        restarted = _state(redis_server.url, "b")
        restarted.add_routed_listener(lambda engine, keys, age_s: seen.append((engine, list(keys))))
        await restarted.start()
        try:
            await _until(lambda: asyncio.sleep(0, result=len(seen) == 2), "the replay of a's records")
            assert seen == [("e2", [1, 2, 3]), ("e1", [4, 5])]
        finally:
            await restarted.stop()
    finally:
        await a.stop()


def test_a_batch_sums_deltas_between_rewrites() -> None:
    ops = [
        ("reserve", "e0", 300),
        ("routed", "e0", b"k1"),
        ("add", "p:e0", -300),
        ("rewrite", {"f:e0": 1, "p:e0": 0}),  # taken after the ops above: they are in it
        ("reserve", "e1", 50),
        ("add", "f:e1", -1),
        ("add", "p:e1", -50),  # began and ended within the batch: nothing to send
        ("reserve", "e0", 10),
        ("routed", "e0", b"k2"),
    ]
    assert write_script_args(ops) == [
        "x", "e0", b"k1",
        "w", 2, "f:e0", 1, "p:e0", 0,
        "x", "e0", b"k2",
        "h", "f:e0", 1,
        "h", "p:e0", 10,
    ]  # fmt: skip


async def test_a_batch_is_one_command_and_renews_the_ttl(redis_server: RedisServer) -> None:
    """Redis itself counts the writer's commands: one script call for a batch of many writes."""
    import redis.asyncio as aioredis

    # A long TTL: no heartbeat (every TTL / 4) adds a batch while the test runs.
    a = _state(redis_server.url, "a", ttl_s=120.0)
    probe = aioredis.from_url(redis_server.url)
    await a.start()
    try:

        async def registered() -> bool:
            return await probe.zscore("kvroute:t:replicas", "a") is not None

        await _until(registered, "the first rewrite")
        stats = await probe.info("commandstats")
        calls_before = stats.get("cmdstat_evalsha", {}).get("calls", 0)
        batches_before = a.write_batches
        for i in range(10):  # ten requests routed in one event-loop turn: one batch
            a.reserve(f"e{i % 2}", 100)
            a.routed(f"e{i % 2}", [i + 1])
        a.first_byte("e0", 100)
        expected = {b"f:e0": b"5", b"p:e0": b"400", b"f:e1": b"5", b"p:e1": b"500"}

        async def landed() -> bool:
            return await probe.hgetall("kvroute:t:load:a") == expected

        await _until(landed, "the batch")
        stats = await probe.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] - calls_before == 1
        assert a.write_batches - batches_before == 1
        assert await probe.xlen("kvroute:t:routed:a") == 10
        assert 0 < await probe.pttl("kvroute:t:load:a") <= 120_000
    finally:
        await a.stop()
        await probe.aclose()
