"""The shared STORAGE pool's read queue: the router books the reads it places on a pool several
engines mount and prices the wait behind them (kvcore.core.StorageReadQueue,
policies.costs.storage_read_parts). Checked in virtual time, and against the simulated pool's true
waits (sim/engine.py books every read on the pool's aggregate bandwidth)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvcore.calibration import CostModel
from kvcore.core import InMemoryLoadLedger, RoutingCore, StorageReadQueue
from policies.base import EngineView, FleetView, PrefixMatch, RouteRequest
from policies.costs import STORAGE_QUEUE_KEY, EngineCosts, PredictedParts, engine_wait_parts, predict_parts
from policies.round_robin import RoundRobinPolicy
from policies.tier_cost import TierCostPolicy
from sim.des import FleetSimulator, SimConfig
from sim.engine import EngineProfile
from sim.fleets import EngineSpec, FleetSpec
from sim.workloads import Conversation, Turn, Workload
from tests.test_des import HAND, prefill_s


def test_reads_queue_first_come_at_the_pool_bandwidth_and_drain_with_time() -> None:
    reads = StorageReadQueue({"pool": 0.5e6})
    assert reads.queue_s("pool", 0.0) == 0.0
    reads.book("pool", 1e6, 0.0)  # 2 s of the pool
    assert reads.queue_s("pool", 0.0) == pytest.approx(2.0)
    assert reads.queue_s("pool", 1.5) == pytest.approx(0.5)
    reads.book("pool", 0.5e6, 1.0)  # queued behind the first: done at 3 s
    assert reads.queue_s("pool", 1.0) == pytest.approx(2.0)
    assert reads.queue_s("pool", 3.0) == 0.0
    reads.book("pool", 0.5e6, 10.0)  # an idle pool starts the read at once
    assert reads.queue_s("pool", 10.0) == pytest.approx(1.0)
    # A pool without a bandwidth books nothing; nor do zero bytes.
    reads.book("other", 1e9, 10.0)
    reads.book("pool", 0.0, 10.0)
    assert reads.queue_s("other", 10.0) == 0.0 and reads.queue_s("pool", 10.0) == pytest.approx(1.0)
    assert "pool" in reads and "other" not in reads
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="read bandwidth must be a positive"):
            StorageReadQueue({"pool": bad})
    with pytest.raises(ValueError, match="pool's name"):
        StorageReadQueue({"": 1e6})


def test_the_read_wait_prices_only_a_storage_read_and_is_a_wait_not_work() -> None:
    costs = EngineCosts()
    engine = EngineView("e0", extra={STORAGE_QUEUE_KEY: 3.0})
    request = RouteRequest("r", prompt_tokens=1000)
    reads = engine_wait_parts(predict_parts(costs, (0.0, 0.0, 512.0), 488.0, 0.0), engine, request, 1000)
    assert reads.read_wait_s == 3.0
    assert reads.total_s == pytest.approx(3.0 + reads.service_s)
    own = predict_parts(costs, (0.0, 0.0, 512.0), 488.0, 0.0)
    assert reads.service_s == own.service_s  # the queue is not the request's work
    # No STORAGE hit, or no queue: nothing added.
    local = engine_wait_parts(predict_parts(costs, (512.0, 0.0, 0.0), 488.0, 0.0), engine, request, 1000)
    assert local.read_wait_s == 0.0
    quiet = engine_wait_parts(own, EngineView("e1"), request, 1000)
    assert quiet.read_wait_s == 0.0
    # The explanation carries it, and the parts come back from it.
    assert PredictedParts.from_scores(reads.as_scores()) == reads
    assert reads.as_scores()["total_s"] == pytest.approx(reads.total_s)


def _pool_core(bandwidth: float, write_through: bool = False) -> tuple[RoutingCore, list[EngineView]]:
    costs = CostModel(EngineCosts(kv_bytes_per_token=1000))
    for e in ("e0", "e1"):
        costs.set_storage_pool(e, "pool")
    core = RoutingCore(
        ledger=InMemoryLoadLedger(["e0", "e1"]),
        costs=costs,
        storage_reads=StorageReadQueue({"pool": bandwidth}, write_through=write_through),
    )
    return core, [EngineView("e0"), EngineView("e1")]


def test_tier_cost_sends_a_pool_read_where_the_queue_does_not_make_it_wait() -> None:
    # Both engines hold the prompt's 512 tokens only in the shared pool; e1 also holds 256 of them
    # on its GPU. After a 10 MB read is booked on the pool, e1 is priced the 20 s queue too (its
    # 256 pool tokens wait behind it) and a request reading nothing from the pool goes untouched.
    core, views = _pool_core(0.5e6)
    policy = TierCostPolicy()
    booked = RouteRequest(
        "first",
        prompt_tokens=20_000,
        block_keys=list(range(10_000 // 16)),
        prefix_matches={"e0": PrefixMatch(625, (0, 0, 625))},
    )
    reservation = core.route(policy, booked, views, 0.0)
    assert reservation.engine_id == "e0" and core.storage_reads is not None
    assert core.storage_reads.queue_s("pool", 0.0) == pytest.approx(10_000 * 1000 / 0.5e6)
    request = RouteRequest(
        "second",
        prompt_tokens=1000,
        prefix_matches={"e0": PrefixMatch(32, (0, 0, 32)), "e1": PrefixMatch(32, (16, 0, 16))},
    )
    decision = core.score(policy, request, views, 5.0)
    parts = decision.parts
    assert parts is not None
    assert parts["e0"].read_wait_s == pytest.approx(15.0)
    assert parts["e1"].read_wait_s == pytest.approx(15.0)
    assert "storage read queue 15.0000" in decision.reason
    gpu_only = RouteRequest("third", prompt_tokens=1000, prefix_matches={"e1": PrefixMatch(16, (16, 0, 0))})
    assert core.score(policy, gpu_only, views, 5.0).parts["e1"].read_wait_s == 0.0  # type: ignore[index]
    # Drained: the key is gone from the views again (an empty extra keeps tier_cost's fast path).
    core.score(policy, request, views, 30.0)
    assert all(STORAGE_QUEUE_KEY not in v.extra for v in views)


def test_write_through_books_the_blocks_a_request_computes_too() -> None:
    # The same first request on a pool whose engines write every computed block through: its
    # 10,000 computed tokens (20,000 - its 10,000 pool hit) are booked beside its read.
    core, views = _pool_core(0.5e6, write_through=True)
    request = RouteRequest(
        "first",
        prompt_tokens=20_000,
        block_keys=list(range(10_000 // 16)),
        prefix_matches={"e0": PrefixMatch(625, (0, 0, 625))},
    )
    core.route(TierCostPolicy(), request, views, 0.0)
    assert core.storage_reads is not None
    assert core.storage_reads.queue_s("pool", 0.0) == pytest.approx(20_000 * 1000 / 0.5e6)
    # A request reading nothing from the pool still writes what it computes there.
    core.route(TierCostPolicy(), RouteRequest("second", prompt_tokens=1000), views, 0.0)
    assert core.storage_reads.queue_s("pool", 0.0) == pytest.approx(21_000 * 1000 / 0.5e6)


def test_every_policy_books_its_pool_reads_and_keeps_the_wait_in_its_parts() -> None:
    # round_robin prices nothing itself: the core's parts for it carry the queue all the same
    # (calibration and the priority deadline read them).
    core, views = _pool_core(1e6)
    policy = RoundRobinPolicy()
    hold = {"e0": PrefixMatch(100, (0, 0, 100)), "e1": PrefixMatch(100, (0, 0, 100))}
    first = core.route(
        policy, RouteRequest("a", prompt_tokens=2000, block_size=16, prefix_matches=hold), views, 0.0
    )
    second = core.route(
        policy, RouteRequest("b", prompt_tokens=2000, block_size=16, prefix_matches=hold), views, 0.0
    )
    assert first.parts.read_wait_s == 0.0
    assert second.parts.read_wait_s == pytest.approx(1600 * 1000 / 1e6)
    assert {first.engine_id, second.engine_id} == {"e0", "e1"}


# ------------------------------------------------------------ against the simulated pool


def _two_conversations() -> Workload:
    """A and C: 320-token first turns at 0 s (20 blocks each, their own), then 480-token turns at
    5 s extending them. Round robin: A1 -> e0, C1 -> e1, A2 -> e2, C2 -> e0."""

    def conversation(name: str, base: int) -> Conversation:
        return Conversation(
            name,
            [
                Turn(320, 1, list(range(base, base + 20)), at_s=0.0),
                Turn(480, 1, list(range(base, base + 30)), at_s=5.0),
            ],
        )

    return Workload("pool", 16, [conversation("A", 0), conversation("C", 5000)])


class _TurnsReadingTheIndex(RoundRobinPolicy):
    """round_robin's placement, with the index's matches filled in (the booking reads them)."""

    uses_index = True


def _run(read_queue: bool, writes: bool = False) -> dict[str, dict[str, float]]:
    profile = EngineProfile(num_gpu_blocks=64, **HAND)  # type: ignore[arg-type]
    fleet = FleetSpec(
        [EngineSpec(f"e{i}", dataclasses.replace(profile)) for i in range(3)],
        storage_pool_blocks=1000,
        storage_shared_bytes_per_s=0.5e6,
    )
    cfg = SimConfig(
        scrape_interval_s=0,
        split_ttft=True,
        storage_read_queue=read_queue,
        storage_read_queue_writes=writes,
        router_priors="nominal",  # the router knows the engines' KV bytes per token
    )
    sim = FleetSimulator(_two_conversations(), _TurnsReadingTheIndex(), fleet, cfg)
    return sim.run().ttft_split_by_request


def test_the_booked_wait_is_the_wait_the_simulated_pool_gives() -> None:
    split = _run(read_queue=True)
    second = {k: v for k, v in split.items() if k.endswith("#1")}
    assert len(second) == 2
    first, behind = sorted(second.values(), key=lambda v: v["ttft_s"])
    pool_s = 20 * 16_000 / 0.5e6  # one 20-block read on the pool: 0.64 s (an engine's link: 0.32 s)
    # The true waits: the first read runs at once, the second queues behind it on the pool.
    assert first["ttft_s"] == pytest.approx(pool_s + 0.005 + prefill_s(160, 320))
    assert behind["ttft_s"] == pytest.approx(2 * pool_s + 0.005 + prefill_s(160, 320))
    # What the router booked and priced: exactly that queue, for the second only.
    assert first["predicted_read_wait_s"] == 0.0
    assert behind["predicted_read_wait_s"] == pytest.approx(behind["ttft_s"] - first["ttft_s"])
    # Booking the write-through too: A2 also writes its 10 computed blocks to the pool, but after
    # its prefill, so after C2's read: the booking, made when both are placed, counts them ahead of
    # C2's read (it knows no engine's timing), an overestimate of exactly those writes.
    with_writes = {k: v for k, v in _run(read_queue=True, writes=True).items() if k.endswith("#1")}
    first_w, behind_w = sorted(with_writes.values(), key=lambda v: v["ttft_s"])
    assert (first_w["ttft_s"], behind_w["ttft_s"]) == pytest.approx((first["ttft_s"], behind["ttft_s"]))
    assert behind_w["predicted_read_wait_s"] == pytest.approx(pool_s + 10 * 16_000 / 0.5e6)
    # Off: the same run, no wait priced.
    off = _run(read_queue=False)
    assert all(v["predicted_read_wait_s"] == 0.0 for v in off.values())
    assert sorted(v["ttft_s"] for v in off.values()) == pytest.approx(
        sorted(v["ttft_s"] for v in split.values())
    )


def test_the_read_queue_needs_a_shared_pool_with_a_bandwidth() -> None:
    profile = EngineProfile(num_gpu_blocks=64, **HAND)  # type: ignore[arg-type]
    for fleet in (
        FleetSpec([EngineSpec("e0", profile)]),
        FleetSpec([EngineSpec("e0", profile)], storage_pool_blocks=100, storage_shared_bytes_per_s=None),
    ):
        with pytest.raises(ValueError, match="no shared pool with one"):
            FleetSimulator(_two_conversations(), "round_robin", fleet, SimConfig(storage_read_queue=True))


def test_a_fleet_view_without_the_core_prices_no_read_wait() -> None:
    # A policy priced outside the core (no booking): no key, no wait.
    policy = TierCostPolicy()
    request = RouteRequest("r", prompt_tokens=1000, prefix_matches={"e0": PrefixMatch(32, (0, 0, 32))})
    decision = policy.choose(request, FleetView([EngineView("e0")]))
    assert decision.parts is not None and decision.parts["e0"].read_wait_s == 0.0


def test_bench_quality_reads_the_readq_switch_beside_the_other_suffixes() -> None:
    from loadtest.bench_quality import Cell, sim_config

    cell = Cell("b1", "1/2", "tier_cost", 1, scheduling="priority:20:inf+escalate:5:route+readq")
    cfg = sim_config(cell)
    assert cfg.storage_read_queue and cfg.escalate_after_s == 5.0 and cfg.priority_stretch == 20.0
    assert not sim_config(dataclasses.replace(cell, scheduling="priority:20:inf")).storage_read_queue
    assert cfg.storage_read_queue_writes
    reads = sim_config(dataclasses.replace(cell, scheduling="fcfs+readq:reads"))
    assert reads.storage_read_queue and not reads.storage_read_queue_writes
    with pytest.raises(ValueError, match=r"\+readq:FORM, FORM one of writes, reads"):
        sim_config(dataclasses.replace(cell, scheduling="fcfs+readq:5"))
