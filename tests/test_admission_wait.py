"""The admission wait under vLLM's whole-sequence rule (issue 27, round q6): where a turn's TTFT
goes in the DES (``sim.des.ttft_split``) and its pricing from the router's ledger."""

from __future__ import annotations

import dataclasses

import pytest

from kvcore.core import ADMISSION_DECODE_S_PER_TOKEN, SequenceLedger
from loadtest.bench_quality import admission_of, parse_scheduling
from policies.base import EngineView, FleetView, PrefixMatch, RouteRequest
from policies.costs import ADMISSION_WAIT_KEY, EngineCosts, PriorCosts
from policies.tier_cost import TierCostPolicy
from sim.des import SPLIT_CACHED_FRACTION_KEY, TTFT_SPLIT_KEYS, FleetSimulator, SimConfig
from sim.engine import EngineProfile
from sim.fleets import EngineSpec, FleetSpec
from sim.frontend import ServerStage
from sim.workloads import LadderConfig, Workload, ladder_workload


def _tight_fleet(scheduling_policy: str = "fcfs", engines: int = 2) -> FleetSpec:
    """Engines whose KV holds about four of the workload's sequences: turns wait for blocks."""
    engine = EngineProfile(
        block_size=16, num_gpu_blocks=640, num_cpu_blocks=1024, scheduling_policy=scheduling_policy
    )
    return FleetSpec([EngineSpec(f"e{i}", engine) for i in range(engines)])


def _workload(seed: int = 3) -> Workload:
    return ladder_workload(
        LadderConfig(
            first_prompt_tokens=2_000,
            system_prefix_tokens=400,
            tokens_per_turn=400,
            turns=3,
            answer_min_tokens=40,
            answer_max_tokens=120,
            think_time_mean_s=1.0,
            concurrency=16,
            total_conversations=24,
            block_size=16,
            seed=seed,
        )
    )


def test_the_ttft_split_adds_up_to_the_measured_ttft_and_finds_the_kv_wait() -> None:
    """Every turn's parts sum to its TTFT (no time lost or counted twice), none is negative, the
    split leaves the run unchanged, and on engines whose KV is full turns do wait for blocks."""
    plain = FleetSimulator(_workload(), "tier_cost", _tight_fleet(), SimConfig(seed=3)).run()
    result = FleetSimulator(
        _workload(), "tier_cost", _tight_fleet(), SimConfig(seed=3, split_ttft=True)
    ).run()
    assert result.ttfts_s == plain.ttfts_s
    splits = result.ttft_split_by_request
    assert set(splits) == set(result.ttft_by_request_s)
    for rid, s in splits.items():
        assert set(s) == {*TTFT_SPLIT_KEYS, SPLIT_CACHED_FRACTION_KEY}
        measured = (
            s["queue_s"] + s["admission_kv_s"] + s["admission_seqs_s"] + s["service_s"] + s["preemption_s"]
        )
        assert measured == pytest.approx(s["ttft_s"], abs=1e-9)
        assert s["ttft_s"] == pytest.approx(result.ttft_by_request_s[rid], abs=1e-9)
        assert min(s[k] for k in ("queue_s", "admission_kv_s", "admission_seqs_s", "service_s")) >= -1e-9
    assert sum(s["admission_kv_s"] for s in splits.values()) > 0


def test_split_ttft_refuses_fleets_with_server_stages() -> None:
    fleet = _tight_fleet()
    fleet.api_server = ServerStage()
    with pytest.raises(ValueError, match="split_ttft needs a fleet without server stages"):
        FleetSimulator(_workload(), "tier_cost", fleet, SimConfig(split_ttft=True))


# ------------------------------------------------------------------ pricing from the ledger


def test_an_engine_with_free_kv_prices_no_admission_wait() -> None:
    book = SequenceLedger()
    book.place("a", "e", 4_000, 1_000)
    book.first_token("a", 0.0)
    # 5,000 reserved + 5,000 asked = the capacity: it fits.
    assert book.admission_wait_s("e", 5_000, 10_000, now=1.0) == 0.0
    assert book.admission_wait_s("other", 9_000, 10_000, now=1.0) == 0.0


def test_a_kv_full_of_long_decodes_makes_a_long_prompt_wait_for_their_remaining_decode() -> None:
    """Two running 4,000 + 1,000 sequences fill 10,000 tokens of KV; at the prior 0.05 s per output
    token they finish 50 s after their first tokens (at 0 s and 20 s). A 3,000-token prompt needs
    the first one gone (40 s from now at 10 s); a 6,000-token one both (60 s); a 12,000-token one
    can never fit and waits for every sequence placed there. Catches: a wait priced from queued
    prefill (there is none), or from the reservations' count rather than when they end."""
    book = SequenceLedger()
    decode_s = ADMISSION_DECODE_S_PER_TOKEN
    for rid, first_s in (("a", 0.0), ("b", 20.0)):
        book.place(rid, "e", 4_000, 1_000)
        book.first_token(rid, first_s)
    now = 10.0
    assert book.reserved_tokens("e") == 10_000
    assert book.admission_wait_s("e", 3_000, 10_000, now) == pytest.approx(1_000 * decode_s - now)
    assert book.admission_wait_s("e", 6_000, 10_000, now) == pytest.approx(20.0 + 1_000 * decode_s - now)
    assert book.admission_wait_s("e", 12_000, 10_000, now) == pytest.approx(20.0 + 1_000 * decode_s - now)
    # A sequence without a first token yet is assumed to start decoding now.
    book.place("c", "e", 1_000, 200)
    assert book.admission_wait_s("e", 1_000, 11_000, now) == pytest.approx(200 * decode_s)
    # Finished sequences free their tokens; their seconds per token become the engine's.
    book.finish("a", 1_000 * 0.02 + 1.0)
    assert book.reserved_tokens("e") == 6_200
    assert book.decode_s_per_token("e") == pytest.approx((1_000 * 0.02 + 1.0) / 999)
    assert book.decode_s_per_token("other") == decode_s
    book.finish("a", 99.0)  # twice: ignored
    assert book.reserved_tokens("e") == 6_200


def test_a_decode_prior_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_s_per_token must be > 0 seconds, got 0"):
        SequenceLedger(0.0)


def _engine(engine_id: str, wait_s: float | None) -> EngineView:
    view = EngineView(engine_id=engine_id, in_flight=4)
    if wait_s is not None:
        view.extra[ADMISSION_WAIT_KEY] = lambda prompt_tokens, parts: wait_s * prompt_tokens / 10_000
    return view


def test_tier_cost_prices_the_admission_wait_as_its_slot_wait_and_avoids_a_full_engine() -> None:
    """The hook replaces in flight x slot seconds (so the learned slot term is not counted twice);
    without the hook the prediction is the first-come one, to the digit. A long prompt whose
    history e0 holds on the GPU goes to e1 when e0's KV is full for 30 s."""
    costs = PriorCosts(EngineCosts(prefill_tokens_per_s=10_000.0, slot_s_per_request=0.5))
    request = RouteRequest(
        request_id="r",
        prompt_tokens=20_000,
        block_size=16,
        prefix_matches={"e0": PrefixMatch(blocks=1_000, blocks_by_tier=(1_000, 0, 0))},
    )
    policy = TierCostPolicy()
    plain = policy.predict(request, _engine("e0", None), costs)
    assert plain.slot_s == 4 * 0.5
    priced = policy.predict(request, _engine("e0", 15.0), costs)
    assert priced.slot_s == pytest.approx(30.0)
    assert priced.total_s == pytest.approx(plain.total_s - plain.slot_s + 30.0)
    assert policy.predict(request, _engine("e0", 0.0), costs).slot_s == 0.0
    fleet = FleetView([_engine("e0", 15.0), _engine("e1", 0.0)], now=0.0, costs=costs)
    assert policy.choose(request, fleet).engine_id == "e1"
    fleet = FleetView([_engine("e0", 0.0), _engine("e1", 0.0)], now=0.0, costs=costs)
    assert policy.choose(request, fleet).engine_id == "e0"


def test_first_chunk_engines_and_the_default_are_unchanged_and_the_switch_does_something() -> None:
    """admission_wait prices only engines with vLLM's whole-sequence rule: with the rule off the run
    is the same to the last TTFT (the DES is deterministic); with it on the run changes."""

    def ttfts(admission_wait: bool, reserve_full_isl: bool) -> list[float]:
        fleet = _tight_fleet()
        for spec in fleet.engines:
            spec.profile = dataclasses.replace(spec.profile, reserve_full_isl=reserve_full_isl)
        config = SimConfig(seed=3, admission_wait=admission_wait)
        return FleetSimulator(_workload(), "tier_cost", fleet, config).run().ttfts_s

    assert ttfts(True, False) == ttfts(False, False)
    assert ttfts(True, True) != ttfts(False, True)


def test_bench_quality_reads_the_admission_suffix() -> None:
    assert admission_of("priority:20:inf:inf:overtake+admission") == (
        "priority:20:inf:inf:overtake",
        "reserved",
        None,
    )
    assert admission_of("priority:20:inf+admission:held") == ("priority:20:inf", "held", None)
    assert admission_of("priority:20:inf+admission:overtake") == ("priority:20:inf", "overtake", None)
    assert admission_of("fcfs") == ("fcfs", None, None)
    assert admission_of("priority:20:inf+admission:ahead") == ("priority:20:inf", "ahead", None)
    for bad in ("fcfs+admission:", "fcfs+admission:all", "fcfs+admissionheld"):
        with pytest.raises(ValueError, match="FORM one of reserved, held, ahead, overtake"):
            admission_of(bad)
    assert parse_scheduling("fcfs+admission") == parse_scheduling("fcfs")
    assert parse_scheduling("priority:20:40:inf:ahead+admission")[4] == "ahead"
    with pytest.raises(ValueError, match="use fcfs, priority"):
        parse_scheduling("fcfs+admit")
