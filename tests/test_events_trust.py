# ruff: noqa: F811 - the shared fixtures imported from test_events_live are used as arguments
"""Issue 25: the index tells the truth about itself. One test per item over real ZMQ sockets
(the simulator's vLLM-compatible publisher, or raw XPUB/ROUTER sockets for hostile streams),
timing rules in virtual time through the manager's injected clock."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from kvcore.index import PrefixIndex
from kvcore.keys import block_keys
from policies.base import Tier
from router.events import EventSource
from sim.cache import StoragePool
from sim.engine import EngineCore, EngineProfile, SimRequest
from tests.test_events_faults import (  # noqa: F401
    ReplayRouter,
    health_of,
    held_blocks,
    sim_publishers,
    stored_event,
    tokens_of,
)
from tests.test_events_live import (  # noqa: F401 - fixtures are used by name
    TOPIC,
    _payload,
    _stored,
    free_port,
    ipc_dir,
    last_seq,
    make_manager,
    make_publisher,
    wait_for,
)


class Clock:
    """Virtual monotonic seconds for the manager's timing rules (grace, probes)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


# ----------------------------------------------------------------------------- item 1


async def test_item1_storage_removals_are_applied(sim_publishers, make_manager) -> None:
    """The life cycle GPU store -> STORAGE store -> GPU eviction -> STORAGE eviction, from the
    simulated engine through its vLLM-compatible publisher: the index's STORAGE equals the pool."""
    port = free_port()
    pub = sim_publishers(f"tcp://*:{port}", None)
    profile = EngineProfile(num_gpu_blocks=12, kv_bytes_per_token=1000, prefill_attention_s_per_token_ctx=0.0)
    pool = StoragePool("disk", capacity_blocks=6)
    engine = EngineCore("e0", profile, storage=pool)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", f"tcp://127.0.0.1:{port}", None, topic=TOPIC)])
    await manager.start()
    await wait_for(lambda: health_of(manager)["peer_connected"], "the subscriber's connection")
    await asyncio.sleep(0.2)  # let the subscription reach the PUB before the first batch
    for i in range(6):  # 6 prompts of 4 blocks: the 12-block GPU and 6-block pool both evict
        engine.add_request(SimRequest(f"r{i}", [*tokens_of(4, 10_000 * (i + 1)), 7], max_tokens=1))
        while engine.has_unfinished():
            pub.publish(engine.step().events)
    await wait_for(lambda: last_seq(manager) == pub.next_seq - 1, "every batch")
    stats = index.stats()["engines"]["e0"]
    # 6 prompts x 4 blocks written through; the pool keeps 6 and announced the other 18 removed.
    assert stats["storage_blocks"] == len(pool) == 6 and stats["unknown_removals"] == 0
    assert index.stats()["storage_pools"]["private:e0"]["removed_blocks"] == 18
    newest = block_keys(tokens_of(4, 60_000), 16)
    assert index.holders(newest[0]).get("e0", set()) >= {Tier.STORAGE}
    oldest = block_keys(tokens_of(4, 10_000), 16)
    assert Tier.STORAGE not in index.holders(oldest[0]).get("e0", set())


# ----------------------------------------------------------------------------- item 2


async def test_item2_dead_replay_socket_neither_flaps_trust_nor_holds_up_live_batches(
    ipc_dir, make_publisher, make_manager
) -> None:
    endpoint, dead_replay = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/nobody-binds-this"
    pub = make_publisher(endpoint, None)
    index = PrefixIndex()
    clock = Clock()
    # A long silence timeout: a batch held up by a replay attempt would wait 30 s for it.
    manager = make_manager(
        index,
        [EventSource("e0", endpoint, dead_replay, topic=TOPIC)],
        replay_timeout_s=30.0,
        replay_connect_timeout_s=0.2,
        clock=clock,
    )
    trusted_samples: list[bool] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            trusted_samples.append(manager.untrusted_engines() == set())
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample())
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    # Seq 0 never arrives live and cannot be replayed: the picture lacks block 0 for good.
    for seq in range(1, 24):
        if seq % 4 == 0:
            continue  # more gaps, each one a replay attempt (or one held back by the backoff)
        pub.publish(seq, _payload(stored_event(seq)))
        await wait_for(lambda s=seq: last_seq(manager) == s, f"live batch {seq}", timeout_s=5.0)
        # Virtual time passes: the failure backoff (2, 4, 8 s) lets the resyncs retry.
        clock.now += 1.0
        await asyncio.sleep(0.05)
    stop.set()
    await sampler
    health = health_of(manager)
    assert health["restarts"] == 0 and health["replay_failures"] >= 3 and health["replays"] >= 4
    assert not any(trusted_samples), f"trusted in {sum(trusted_samples)} of {len(trusted_samples)} samples"
    assert health["stale"] and "accepted no connection" in (health["last_error"] or "")


# ----------------------------------------------------------------------------- item 3


async def test_item3_wrapped_buffer_trust_returns_on_delivered_cached_tokens(
    sim_publishers, make_manager
) -> None:
    """A router joining an engine whose 5-step buffer has wrapped: untrusted (blocks before the
    buffer are unknown) until the engine's reported cached tokens agree with the index."""
    port, replay_port = free_port(), free_port()
    pub = sim_publishers(f"tcp://*:{port}", f"tcp://*:{replay_port}", buffer_steps=5)
    for block in range(20):  # one chain of 20 blocks, one block per step: seqs 0..19
        pub.publish([stored_event(block)])
    index = PrefixIndex()
    manager = make_manager(
        index,
        [EventSource("e0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic=TOPIC)],
        trust_evidence_requests=8,
    )
    await manager.start()
    await wait_for(lambda: health_of(manager)["synced"], "the first replay answer")
    health = health_of(manager)
    assert not health["trusted"] and "starts at seq 15" in health["stale_reason"]
    assert manager.untrusted_engines() == {"e0"}
    # Blocks 0..14 were announced before the buffer: the index cannot chain 15..19 onto them.
    chain = block_keys(tokens_of(20, 0), 16)

    def request(delivered: int, at: float) -> None:
        # What the routing core does per request: note the index's prediction when it routes,
        # report the engine's cached blocks when the answer comes.
        index.refresh_pool_reads("e0", chain, at)
        index.learn_delivered("e0", chain, delivered, 0, at)

    # The engine delivers 19 cached blocks where the index predicted none: disagreement.
    for i in range(8):
        request(19, 1.0 + i)
    assert manager.check_evidence() == [] and manager.untrusted_engines() == {"e0"}
    # Prompts the engine and the index both hold nothing of agree (0 predicted, 0 delivered), and
    # so does the tail of the chain both know (the index holds 15..19 only after 0..14: nothing).
    other = block_keys(tokens_of(3, 50_000), 16)
    for i in range(7):
        index.refresh_pool_reads("e0", other, 100.0 + i)
        index.learn_delivered("e0", other, 0, 0, 100.0 + i)
    # 7 of the last 8 agree: under trust_evidence_agree 0.9.
    assert manager.check_evidence() == [] and manager.untrusted_engines() == {"e0"}
    index.refresh_pool_reads("e0", other, 200.0)
    index.learn_delivered("e0", other, 0, 0, 200.0)
    assert manager.check_evidence() == ["e0/dp0"]
    health = health_of(manager)
    assert health["trusted"] and "agreed with the index on 8 of the last 8" in health["trust_reason"]
    assert [e["trusted"] for e in health["trust_log"]][-2:] == [False, True]
    assert manager.untrusted_engines() == set()


# ----------------------------------------------------------------------------- item 4


class GatedReplay(ReplayRouter):
    """A replay ROUTER answering from a fixed buffer in two halves; the second half only once
    ``release`` is set (an engine whose answer takes a while)."""

    def __init__(self, endpoint: str, payloads: list[bytes]) -> None:
        super().__init__(endpoint, payloads)
        self.first_half_sent = threading.Event()
        self.release = threading.Event()

    def answer(self, identity: bytes, start_seq: int) -> None:
        half = len(self.payloads) // 2
        for seq in range(len(self.payloads)):
            if seq == half:
                self.first_half_sent.set()
                while not self.release.wait(0.02):
                    if self.stopped():
                        return
            if seq >= start_seq:
                self.batch(identity, seq)
        self.end(identity)

    def close(self) -> None:
        self.release.set()
        super().close()


async def test_item4_trust_waits_for_the_replay_answer(ipc_dir, make_publisher, make_manager) -> None:
    endpoint, replay = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    make_publisher(endpoint, None)
    server = GatedReplay(replay, [_payload(stored_event(block)) for block in range(40)]).start()
    try:
        index = PrefixIndex()
        manager = make_manager(
            index, [EventSource("e0", endpoint, replay, topic=TOPIC)], replay_timeout_s=10.0
        )
        await manager.start()
        assert manager.untrusted_engines() == {"e0"}  # before anything is known
        await asyncio.to_thread(server.first_half_sent.wait, 5)
        await wait_for(lambda: health_of(manager)["replayed_batches"] == 20, "the first half applied")
        # Half the picture is there: replayed_batches moved, trust still waits for the end.
        health = health_of(manager)
        assert manager.untrusted_engines() == {"e0"} and not health["trusted"]
        assert "waiting for the first replay answer" in health["trust_reason"]
        assert held_blocks(index, tokens_of(40, 0)) == 20
        server.release.set()
        await wait_for(lambda: manager.untrusted_engines() == set(), "trusted after the answer")
        health = health_of(manager)
        assert health["replayed_batches"] == 40 and held_blocks(index, tokens_of(40, 0)) == 40
        assert "reaches back to the engine's first batch" in health["trust_reason"]
    finally:
        server.close()


# ----------------------------------------------------------------------------- item 5


async def test_item5_lost_tail_is_found_by_an_idle_probe(ipc_dir, make_publisher, make_manager) -> None:
    endpoint, replay = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    pub = make_publisher(endpoint, replay)
    clock = Clock()
    index = PrefixIndex()
    manager = make_manager(
        index, [EventSource("e0", endpoint, replay, topic=TOPIC)], clock=clock, probe_idle_s=5.0
    )
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    await wait_for(lambda: pub.replay_requests == [0], "the replay on connect")
    for seq in range(3):
        pub.publish(seq, _payload(stored_event(seq)))
    await wait_for(lambda: last_seq(manager) == 2, "the live batches")
    for seq in range(3, 10):  # the tail the PUB dropped: only the replay buffer has it
        pub.publish(seq, _payload(stored_event(seq)), live=False)
    clock.now += 4.9  # idle, but not for probe_idle_s: no probe
    await asyncio.sleep(0.4)
    assert pub.replay_requests == [0] and last_seq(manager) == 2
    clock.now += 0.2
    await wait_for(lambda: last_seq(manager) == 9, "the tail found by the probe")
    health = health_of(manager)
    assert pub.replay_requests == [0, 2]  # from the last applied seq: it proves the incarnation
    assert health["probes"] == 1 and health["probe_batches"] == 7 and health["missed_batches"] == 7
    assert held_blocks(index, tokens_of(10, 0)) == 10 and health["trusted"]
    # Nothing more missing: the next probe waits another probe_idle_s and costs one batch.
    await asyncio.sleep(0.4)
    assert health_of(manager)["probes"] == 1
    clock.now += 5.1
    await wait_for(lambda: health_of(manager)["probes"] == 2, "the rate-limited second probe")
    await wait_for(lambda: pub.replay_requests == [0, 2, 9], "its request")
    health = health_of(manager)
    assert health["replayed_batches"] == 7 and health["probe_batches"] == 7 and health["trusted"]


# ----------------------------------------------------------------------------- item 6


async def test_item6_sources_that_never_connected_are_reported_after_the_grace(make_manager) -> None:
    clock = Clock()
    index = PrefixIndex()
    nobody = f"tcp://127.0.0.1:{free_port()}"  # a static entry on a port no publisher uses
    bound = f"tcp://127.0.0.1:{free_port()}"  # a connect-mode publisher that never connects to us
    manager = make_manager(
        index,
        [EventSource("e0", nobody, None), EventSource("e1", bound, None, bind=True)],
        clock=clock,
        peer_grace_s=10.0,
    )
    await manager.start()
    await wait_for(lambda: all(s["connected"] for s in manager.health()["sources"].values()), "sockets open")
    clock.now += 9.0
    for name in ("e0/dp0", "e1/dp0"):
        assert health_of(manager, name)["status"] == "ok"
    assert manager.untrusted_engines() == set()
    clock.now += 2.0
    for name in ("e0/dp0", "e1/dp0"):
        health = health_of(manager, name)
        assert health["status"] == "disconnected" and not health["trusted"] and not health["peer_connected"]
        assert "no publisher connected" in health["trust_reason"] and health["peer_absent_s"] == 11.0
    assert manager.untrusted_engines() == {"e0", "e1"}


async def test_item6_a_publisher_that_connects_is_trusted(ipc_dir, make_publisher, make_manager) -> None:
    clock = Clock()
    endpoint = f"ipc://{ipc_dir}/pub"
    pub = make_publisher(endpoint, None)
    manager = make_manager(PrefixIndex(), [EventSource("e0", endpoint, None, topic=TOPIC)], clock=clock)
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    await wait_for(lambda: health_of(manager)["peer_connected"], "the handshake seen by the monitor")
    clock.now += 60.0
    health = health_of(manager)
    assert (health["peer_connected"], health["status"], health["trusted"]) == (True, "silent", True), health


# ----------------------------------------------------------------------------- items 7, 8


async def test_item7_a_store_of_another_block_size_untrusts_the_engine(
    ipc_dir, make_publisher, make_manager
) -> None:
    endpoint = f"ipc://{ipc_dir}/pub"
    pub = make_publisher(endpoint, None)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None, topic=TOPIC)], block_sizes={"e0": 16})
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    pub.publish(0, _payload(stored_event(0)))
    await wait_for(lambda: last_seq(manager) == 0, "seq 0")
    assert manager.untrusted_engines() == set()
    wrong = dict(_stored([99], list(range(5000, 5032)), parent=1), block_size=32)
    pub.publish(1, _payload(wrong))
    await wait_for(lambda: last_seq(manager) == 1, "seq 1")
    health = health_of(manager)
    assert manager.untrusted_engines() == {"e0"} and health["status"] == "stale"
    assert "block_size [32]" in health["trust_reason"] and health["block_size_mismatches"] == {"GPU": 1}


async def test_item8_media_of_vllm_connectors_and_lmcache_map_and_unknown_ones_are_named(
    ipc_dir, make_publisher, make_manager
) -> None:
    endpoint = f"ipc://{ipc_dir}/pub"
    pub = make_publisher(endpoint, None)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None, topic=TOPIC)])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    a, b, c, d = (tokens_of(1, base) for base in (0, 1000, 2000, 3000))
    batch = [
        dict(_stored([1], a), medium="Disk"),  # vLLM's DiskLoadStoreSpec
        dict(_stored([2], b), medium="cpu"),  # LMCache's CPU backend
        dict(_stored([3], c), medium="CXL"),  # LMCache's CXL backend (host-attached memory)
        dict(_stored([4], d), medium="LocalNVMeBackend"),
        dict(_stored([5], d), medium="LocalNVMeBackend"),
    ]
    pub.publish(0, _payload(*batch))
    await wait_for(lambda: last_seq(manager) == 0, "seq 0")
    tiers = [index.match(block_keys(t, 16), ["e0"])["e0"].blocks_by_tier for t in (a, b, c, d)]
    assert tiers == [(0, 0, 1), (0, 1, 0), (0, 1, 0), (0, 0, 0)]
    health = health_of(manager)
    assert health["unknown_media"] == {"LocalNVMeBackend": 2}
    assert index.stats()["engines"]["e0"]["malformed_events"] == 0


# ----------------------------------------------------------------------------- items 9, 10


async def test_item9_a_seq_beyond_vllms_counter_is_malformed(ipc_dir, make_publisher, make_manager) -> None:
    endpoint = f"ipc://{ipc_dir}/pub"
    pub = make_publisher(endpoint, None)
    manager = make_manager(PrefixIndex(), [EventSource("e0", endpoint, None, topic=TOPIC)])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    pub.publish(0, _payload(stored_event(0)))
    await wait_for(lambda: last_seq(manager) == 0, "seq 0")
    for seq in (2**64 - 1, 2**63):
        pub.send_raw([TOPIC.encode(), seq.to_bytes(8, "big"), _payload(stored_event(1))])
    pub.publish(1, _payload(stored_event(1)))
    await wait_for(lambda: last_seq(manager) == 1, "seq 1")
    health = health_of(manager)
    assert health["missed_batches"] == 0 and health["gaps"] == 0 and health["decode_errors"] == 2


async def test_item10_a_live_batch_repeating_the_last_seq(ipc_dir, make_publisher, make_manager) -> None:
    """Same bytes at the last applied seq: a duplicate. Other bytes: a new incarnation."""
    endpoint = f"ipc://{ipc_dir}/pub"
    pub = make_publisher(endpoint, None)
    index = PrefixIndex()
    manager = make_manager(index, [EventSource("e0", endpoint, None, topic=TOPIC)])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    first = _payload(_stored([1, 2], tokens_of(2, 0)))
    pub.publish(0, first)
    await wait_for(lambda: last_seq(manager) == 0, "seq 0")
    pub.send_raw([TOPIC.encode(), (0).to_bytes(8, "big"), first])
    await wait_for(lambda: health_of(manager)["duplicates"] == 1, "the duplicate")
    assert held_blocks(index, tokens_of(2, 0)) == 2 and health_of(manager)["restarts"] == 0
    pub.send_raw([TOPIC.encode(), (0).to_bytes(8, "big"), _payload(_stored([7], tokens_of(1, 900)))])
    await wait_for(lambda: health_of(manager)["restarts"] == 1, "the restart")
    health = health_of(manager)
    assert health["seq_regressions"] == 1 and health["gaps"] == 0 and health["missed_batches"] == 0
    assert held_blocks(index, tokens_of(2, 0)) == 0 and held_blocks(index, tokens_of(1, 900)) == 1


# ----------------------------------------------------------------------------- issue 24


async def test_a_batch_replayed_and_then_received_live_counts_once(
    ipc_dir, make_publisher, make_manager
) -> None:
    """The connect replay brings seq 0 before its live copy is read: the live copy is a duplicate
    and the batch is not counted as replayed (it was not lost), whichever copy came first."""
    endpoint, replay = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    pub = make_publisher(endpoint, replay)
    payload = _payload(stored_event(0))
    pub.publish(0, payload, live=False)  # in the buffer before the subscriber's replay
    manager = make_manager(PrefixIndex(), [EventSource("e0", endpoint, replay, topic=TOPIC)])
    await manager.start()
    await asyncio.to_thread(pub.wait_subscriber)
    await wait_for(lambda: last_seq(manager) == 0, "seq 0 from the replay")
    assert health_of(manager)["replayed_batches"] == 1
    pub.send_raw([TOPIC.encode(), (0).to_bytes(8, "big"), payload])  # its live copy, late
    await wait_for(lambda: health_of(manager)["duplicates"] == 1, "the live copy")
    health = health_of(manager)
    assert health["replayed_batches"] == 0 and health["batches"] == 1 and health["trusted"]
