"""tier_cost on hand-built fleets: queue vs tier trade-offs, slow storage, stale index, tiebreak, softmax."""

from __future__ import annotations

import math

import pytest

from kvcore.calibration import CostModel
from loadtest.bench_quality import extern_of, hold_of, parse_scheduling
from policies.base import EngineView, FleetView, PrefixMatch, RouteRequest, build_policy, tiebreak
from policies.costs import (
    QUEUED_TURNS_KEY,
    EngineCosts,
    PredictedParts,
    QueuedTurns,
    externality_s,
    predict_parts,
)
from policies.tier_cost import TierCostPolicy
from sim.des import FleetSimulator, SimConfig
from tests.test_admission_wait import _tight_fleet, _workload
from tests.test_deadline_floor import _fleet

BLOCK = 16
PROMPT_TOKENS = 8192
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK


def request(matches: dict[str, PrefixMatch], request_id: str = "r1") -> RouteRequest:
    return RouteRequest(
        request_id=request_id,
        prompt_tokens=PROMPT_TOKENS,
        block_keys=tuple(range(PROMPT_BLOCKS)),
        block_size=BLOCK,
        prefix_matches=matches,
    )


def gpu(blocks: int) -> PrefixMatch:
    return PrefixMatch(blocks, (blocks, 0, 0))


def cpu(blocks: int) -> PrefixMatch:
    return PrefixMatch(blocks, (0, blocks, 0))


def storage(blocks: int) -> PrefixMatch:
    return PrefixMatch(blocks, (0, 0, blocks))


def test_cpu_hit_on_idle_engine_beats_gpu_hit_behind_long_queue() -> None:
    policy = build_policy("tier_cost")
    hit = PROMPT_BLOCKS - 4
    fleet = FleetView(
        [
            EngineView("busy", in_flight=8, queued_prefill_tokens=40_000),
            EngineView("idle", in_flight=0, queued_prefill_tokens=0),
        ]
    )
    decision = policy.choose(request({"busy": gpu(hit), "idle": cpu(hit)}), fleet)
    assert decision.engine_id == "idle"
    busy, idle = decision.scores["busy"], decision.scores["idle"]
    # 40,000 queued tokens at the default 22,000 tokens/s: about 1.8 s of waiting.
    assert busy["wait_s"] == pytest.approx(40_000 / 22_000)
    assert idle["wait_s"] == 0.0
    assert idle["load_cpu_s"] > 0 and busy["load_cpu_s"] == 0
    assert idle["total_s"] == pytest.approx(idle["wait_s"] + idle["load_cpu_s"] + idle["prefill_s"])
    assert decision.fallbacks == ("busy",)
    assert "idle" in decision.reason and "load CPU" in decision.reason


def test_gpu_hit_wins_when_queue_is_short() -> None:
    policy = build_policy("tier_cost")
    hit = PROMPT_BLOCKS - 4
    fleet = FleetView(
        [
            EngineView("busy", in_flight=1, queued_prefill_tokens=100),
            EngineView("idle", in_flight=0, queued_prefill_tokens=0),
        ]
    )
    decision = policy.choose(request({"busy": gpu(hit), "idle": cpu(hit)}), fleet)
    # CPU load of 8128 tokens x 128 KiB at 64 GB/s is ~17 ms; 100 queued tokens wait ~4.5 ms.
    assert decision.engine_id == "busy"
    assert decision.scores["busy"]["total_s"] < decision.scores["idle"]["total_s"]


def test_slow_storage_bandwidth_moves_the_choice() -> None:
    hit = PROMPT_BLOCKS - 4
    fleet_engines = [
        EngineView("stor", queued_prefill_tokens=0),
        EngineView("queued", queued_prefill_tokens=2_000),
    ]
    matches = {"stor": storage(hit), "queued": gpu(hit)}
    fast = CostModel(EngineCosts(load_bandwidth_bytes_per_s=(float("inf"), 64e9, 50e9)))
    slow = CostModel(EngineCosts(load_bandwidth_bytes_per_s=(float("inf"), 64e9, 2e9)))
    policy = build_policy("tier_cost")
    # 2,000 queued tokens ~ 91 ms; loading 8128 tokens (1.07 GB) from storage takes 21 ms at 50 GB/s,
    # 530 ms at 2 GB/s.
    assert policy.choose(request(matches), FleetView(fleet_engines, costs=fast)).engine_id == "stor"
    assert policy.choose(request(matches), FleetView(fleet_engines, costs=slow)).engine_id == "queued"


def test_per_engine_prior_from_config_prices_each_engine() -> None:
    policy = build_policy(
        "tier_cost",
        {"costs": {"engines": {"slowcpu": {"tiers": {"cpu": {"bandwidth_bytes_per_s": 1e9}}}}}},
    )
    hit = PROMPT_BLOCKS - 4
    fleet = FleetView([EngineView("slowcpu"), EngineView("fastcpu")])
    decision = policy.choose(request({"slowcpu": cpu(hit), "fastcpu": cpu(hit)}, "x"), fleet)
    assert decision.engine_id == "fastcpu"
    assert decision.scores["slowcpu"]["load_cpu_s"] > 40 * decision.scores["fastcpu"]["load_cpu_s"]


def test_stale_index_discounts_hits() -> None:
    policy = build_policy("tier_cost", {"stale_hit_factor": 0.25})
    hit = PROMPT_BLOCKS - 4
    fleet = FleetView([EngineView("stale", index_trusted=False), EngineView("fresh")])
    decision = policy.choose(request({"stale": gpu(hit), "fresh": gpu(hit)}), fleet)
    assert decision.engine_id == "fresh"
    assert decision.scores["stale"]["hit_tokens_gpu"] == pytest.approx(0.25 * hit * BLOCK)
    assert decision.scores["stale"]["prefill_tokens"] == pytest.approx(PROMPT_TOKENS - 0.25 * hit * BLOCK)


def test_num_requests_waiting_corrects_router_queue() -> None:
    policy = build_policy("tier_cost")
    fleet = FleetView([EngineView("a", num_requests_waiting=5), EngineView("b", num_requests_waiting=0)])
    decision = policy.choose(request({}), fleet)
    # Router sees nothing in flight on a, but the engine has 5 queued requests (priced at this prompt's size).
    assert decision.scores["a"]["wait_tokens"] == 5 * PROMPT_TOKENS
    assert decision.engine_id == "b"


def test_full_hit_still_prefills_one_token_and_memory_pressure_counts() -> None:
    policy = build_policy("tier_cost")
    fleet = FleetView([EngineView("full", kv_cache_usage=0.99), EngineView("roomy", kv_cache_usage=0.5)])
    decision = policy.choose(request({"full": gpu(PROMPT_BLOCKS), "roomy": gpu(PROMPT_BLOCKS)}), fleet)
    assert decision.scores["full"]["prefill_tokens"] == 1
    assert decision.scores["full"]["pressure_s"] > 0 and decision.scores["roomy"]["pressure_s"] == 0
    assert decision.engine_id == "roomy"


def test_requests_waiting_on_a_full_pool_price_a_memory_wait() -> None:
    """pressure_s_per_waiting (round q30): each request waiting on an engine past the pressure
    threshold adds that many seconds; on a roomy pool, or with the term off, waiting requests add
    nothing to the pressure. "full" holds the whole prompt; "roomy" holds none of it (its prefill
    costs ~0.3 s more), so the term is what moves the turn."""
    hits = {"full": gpu(PROMPT_BLOCKS)}

    def fleet(full_usage: float) -> FleetView:
        return FleetView(
            [
                EngineView("full", kv_cache_usage=full_usage, num_requests_waiting=3),
                EngineView("roomy", kv_cache_usage=0.5, num_requests_waiting=3),
            ]
        )

    off = build_policy("tier_cost", {"pressure_s_at_full": 0.0})
    on = build_policy("tier_cost", {"pressure_s_at_full": 0.0, "pressure_s_per_waiting": 2.0})
    assert off.choose(request(hits), fleet(0.99)).engine_id == "full"
    decision = on.choose(request(hits), fleet(0.99))
    assert decision.scores["full"]["pressure_s"] == pytest.approx(6.0)
    assert decision.scores["roomy"]["pressure_s"] == 0.0
    assert decision.engine_id == "roomy"
    assert on.choose(request(hits), fleet(0.5)).engine_id == "full"  # below the threshold: no term
    with pytest.raises(ValueError, match="pressure_s_per_waiting"):
        build_policy("tier_cost", {"pressure_s_per_waiting": -1.0})


def test_ties_go_to_fewer_in_flight_then_stable_hash() -> None:
    policy = build_policy("tier_cost", {"decode_s_per_running": 0.0})
    fleet = FleetView(
        [EngineView("a", in_flight=3), EngineView("b", in_flight=1), EngineView("c", in_flight=2)]
    )
    assert policy.choose(request({}), fleet).engine_id == "b"
    even = FleetView([EngineView(f"e{i}") for i in range(4)])
    picks = {policy.choose(request({}, f"req-{i}"), even).engine_id for i in range(40)}
    assert len(picks) > 1  # the hash spreads ties
    again = [policy.choose(request({}, "same"), even).engine_id for _ in range(5)]
    assert len(set(again)) == 1  # ...deterministically per request id


def test_the_whole_order_is_cost_then_in_flight_then_hash_with_and_without_ties() -> None:
    """The choice and its fallbacks follow (cost rounded to the microsecond, in flight, hash of the
    request and engine ids), the hash computed only for ties: in a fleet where some engines tie and
    some do not, and in one where none do, for many request ids. Catches ties left in input order
    or broken only among the first engines."""
    policy = build_policy("tier_cost", {"decode_s_per_running": 0.0, "keep_unmatched": 10})
    mixed = FleetView(
        [EngineView(f"t{i}", in_flight=1) for i in range(4)]
        + [EngineView("u0", in_flight=0), EngineView("u1", in_flight=2), EngineView("hit", in_flight=1)]
    )
    distinct = FleetView([EngineView(f"d{i}", in_flight=i) for i in range(5)])
    for fleet in (mixed, distinct):
        for i in range(30):
            req = request({"hit": gpu(PROMPT_BLOCKS // 2)}, f"req-{i}")
            decision = policy.choose(req, fleet)
            costs = {e: round(s["cost_s"], 6) for e, s in decision.scores.items()}
            expected = sorted(
                fleet.engines,
                key=lambda e: (costs[e.engine_id], e.in_flight, tiebreak(req.request_id, e.engine_id)),
            )
            assert [decision.engine_id, *decision.fallbacks] == [e.engine_id for e in expected]


def test_costs_a_fraction_of_a_microsecond_apart_tie_and_in_flight_decides() -> None:
    """Catches an order taken from the raw costs: two costs 0.2 µs apart round to the same
    microsecond, so the engine with fewer requests in flight goes first although its raw cost is
    the higher one (and costs far apart keep the raw order)."""
    policy = build_policy("tier_cost")
    # "near" pays 0.2 µs of pool pressure: 0.05 s x (usage - 0.9) / 0.1.
    near = EngineView("near", in_flight=0, num_requests_running=0, kv_cache_usage=0.9 + 4e-7)
    busy = EngineView("busy", in_flight=1, num_requests_running=0)
    decision = policy.choose(request({}), FleetView([busy, near]))
    raw = {e: s["cost_s"] for e, s in decision.scores.items()}
    assert 0 < raw["near"] - raw["busy"] < 1e-6
    assert round(raw["near"], 6) == round(raw["busy"], 6)  # the test's premise
    assert (decision.engine_id, decision.fallbacks) == ("near", ("busy",))
    # 2 µs of pressure is a real difference: the raw order stands.
    far = EngineView("far", in_flight=0, num_requests_running=0, kv_cache_usage=0.9 + 4e-6)
    assert policy.choose(request({}), FleetView([busy, far])).engine_id == "busy"


def test_reason_is_written_when_read_from_the_choice_as_made() -> None:
    """Catches a reason built from scores changed after the choice (horizon_cost re-prices its
    base decision's scores in place): the reason names the chosen engine's TTFT, work and the
    runner-up's cost as compared."""
    policy = build_policy("tier_cost")
    fleet = FleetView([EngineView("idle"), EngineView("busy", in_flight=4, queued_prefill_tokens=22_000)])
    decision = policy.choose(request({"idle": gpu(PROMPT_BLOCKS // 2)}), fleet)
    s = dict(decision.scores["idle"])
    next_cost = decision.scores["busy"]["cost_s"]
    for score in decision.scores.values():
        score["total_s"] = score["work_s"] = score["cost_s"] = 99.0
    assert decision.reason == (
        f"lowest predicted cost: idle TTFT {s['total_s']:.4f} s = wait {s['wait_s']:.4f}"
        f" + load GPU {s['load_gpu_s']:.4f} + prefill {s['prefill_s']:.4f}"
        f" ({s['prefill_tokens']:.0f} tokens) + work {s['work_s']:.4f}; next busy cost {next_cost:.4f} s"
    )
    assert decision.reason is decision.reason  # written once


def test_scores_read_later_are_the_choice_as_made() -> None:
    """Catches scores built (when first read) from engine views the router has refreshed since the
    choice: they hold the load, trust and pool pressure the policy compared."""
    policy = build_policy("tier_cost")
    views = [EngineView("a", in_flight=2, kv_cache_usage=0.95), EngineView("b", index_trusted=False)]
    req = request({"a": gpu(PROMPT_BLOCKS // 2), "b": gpu(PROMPT_BLOCKS // 2)})
    now = policy.choose(req, FleetView(views)).scores
    later = policy.choose(req, FleetView(views))
    for view in views:  # the next request's refresh, in place
        view.in_flight, view.kv_cache_usage, view.index_trusted = 9, 0.2, not view.index_trusted
    assert later.scores == now
    assert now["a"]["pressure_s"] > 0 and now["a"]["decode_s"] == 0.001 and now["b"]["index_trusted"] == 0.0


def test_softmax_is_seeded_and_prefers_cheaper() -> None:
    policy = build_policy("tier_cost", {"temperature_s": 0.05, "seed": 7})
    hit = PROMPT_BLOCKS - 4
    fleet = FleetView([EngineView("hit"), EngineView("miss")])
    picks = [policy.choose(request({"hit": gpu(hit)}, f"r{i}"), fleet).engine_id for i in range(300)]
    assert picks.count("hit") > 250  # miss costs ~0.37 s more: weight exp(-7.4)
    repeat = [policy.choose(request({"hit": gpu(hit)}, f"r{i}"), fleet).engine_id for i in range(300)]
    assert picks == repeat
    hot = build_policy("tier_cost", {"temperature_s": 10.0})
    hot_picks = [hot.choose(request({"hit": gpu(hit)}, f"r{i}"), fleet).engine_id for i in range(300)]
    assert 100 < hot_picks.count("hit") < 200


def test_scores_round_trip_into_predicted_parts() -> None:
    policy = build_policy("tier_cost")
    hit = 100
    decision = policy.choose(request({"a": PrefixMatch(hit, (40, 30, 30))}), FleetView([EngineView("a")]))
    parts = PredictedParts.from_scores(decision.scores["a"])
    assert parts.hit_tokens == (40 * BLOCK, 30 * BLOCK, 30 * BLOCK)
    assert parts.total_s == pytest.approx(decision.scores["a"]["total_s"])
    assert parts.prefill_tokens == PROMPT_TOKENS - hit * BLOCK


def test_bad_params_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="stale_hit_factor"):
        build_policy("tier_cost", {"stale_hit_factor": 2})
    with pytest.raises(ValueError, match="unknown tier"):
        build_policy("tier_cost", {"costs": {"tiers": {"hbm3": {"latency_s": 0}}}})


def test_conversation_keeps_its_cpu_history_instead_of_recomputing_on_an_idle_engine() -> None:
    """24,000 history tokens in home's CPU tier, 30,000 tokens queued there; the idle engine holds
    only the 1,000-token system prompt. Greedy TTFT (work_weight 0) moves the turn: home 1.36 s wait
    + 0.05 s load + 0.18 s prefill = 1.60 s vs 1.18 s of recompute. The default prices the recompute's
    work too (home 1.60 + 0.23 = 1.83 s vs 1.18 + 1.18 = 2.36 s) and keeps the history."""
    prompt_tokens, block = 28_000, 16
    history_blocks, system_blocks = 24_000 // block, 1_000 // block
    req = RouteRequest(
        "turn-5",
        prompt_tokens=prompt_tokens,
        block_keys=tuple(range(prompt_tokens // block)),
        block_size=block,
        prefix_matches={
            "home": PrefixMatch(history_blocks, (system_blocks, history_blocks - system_blocks, 0)),
            "idle": gpu(system_blocks),
        },
    )
    fleet = FleetView(
        [
            EngineView("home", in_flight=2, queued_prefill_tokens=30_000),
            EngineView("idle", in_flight=0, queued_prefill_tokens=0),
        ]
    )
    greedy = build_policy("tier_cost", {"work_weight": 0.0, "decode_s_per_running": 0.0})
    assert greedy.choose(req, fleet).engine_id == "idle"
    decision = build_policy("tier_cost").choose(req, fleet)
    home, idle = decision.scores["home"], decision.scores["idle"]
    assert decision.engine_id == "home"
    assert home["total_s"] > idle["total_s"]  # its own TTFT is worse...
    assert home["cost_s"] < idle["cost_s"]  # ...but the recompute's work outweighs it
    assert idle["work_s"] == pytest.approx(idle["prefill_s"]) and idle["prefill_tokens"] == 28_000 - 62 * 16
    assert "work" in decision.reason
    # A really long queue still moves it: the policy trades locality against waiting, not blindly.
    swamped = FleetView([EngineView("home", in_flight=9, queued_prefill_tokens=80_000), EngineView("idle")])
    assert build_policy("tier_cost").choose(req, swamped).engine_id == "idle"


def test_large_fleet_prices_matched_engines_plus_a_few_and_picks_like_a_full_scan() -> None:
    import random

    rng = random.Random(5)
    engines = [
        EngineView(f"e{i}", in_flight=rng.randrange(0, 6), queued_prefill_tokens=rng.randrange(0, 60_000))
        for i in range(300)
    ]
    # Every engine sees the shared storage pool's copy; storage and prefill speeds differ per engine.
    costs = CostModel(
        EngineCosts(),
        {
            f"e{i}": EngineCosts(
                prefill_tokens_per_s=rng.uniform(15_000, 30_000),
                load_bandwidth_bytes_per_s=(float("inf"), 64e9, rng.uniform(1e9, 8e9)),
            )
            for i in range(0, 300, 2)
        },
    )
    fleet = FleetView(engines, costs=costs)
    fast = build_policy("tier_cost")
    full = build_policy("tier_cost", {"keep_unmatched": 1000})
    for n in range(30):
        local = {f"e{rng.randrange(300)}": gpu(rng.randrange(1, PROMPT_BLOCKS)) for _ in range(3)}
        shared = storage(rng.randrange(0, PROMPT_BLOCKS))
        matches = {**{f"e{i}": shared for i in range(300)}, **local}
        req = request(matches, f"r{n}")
        quick, slow = fast.choose(req, fleet), full.choose(req, fleet)
        assert quick.engine_id == slow.engine_id
        assert len(quick.scores) <= len(local) + 3 and len(slow.scores) == 300
        assert set(local) <= set(quick.scores)
        assert quick.fallbacks[:2] == slow.fallbacks[:2]
        assert quick.scores[quick.engine_id]["cost_s"] == pytest.approx(slow.scores[slow.engine_id]["cost_s"])
    with pytest.raises(ValueError, match="keep_unmatched"):
        build_policy("tier_cost", {"keep_unmatched": 0})


# -- round q13: what a placement costs the turns queued on the engine (policies.costs.externality_s)


def _queued(turns: list[tuple[float, float]], new_blocks: bool = False):  # type: ignore[no-untyped-def]
    """``QUEUED_TURNS_KEY``: ``turns`` queued on an engine of 100,000 tokens of KV, a lost history
    token priced at 20 x its prefill (the stretch), the turn's own deadline 20 x its service."""
    return lambda parts: QueuedTurns(turns, 20.0 * parts.service_s, 100_000.0, 20.0, new_blocks)


def _queued_fleet(e0_turns: list[tuple[float, float]]) -> tuple[RouteRequest, FleetView]:
    """test_deadline_floor's fleet (a 20,000-token turn whose history, 18,000 tokens, is on e0
    behind 30,000 queued tokens; e1 holds nothing of it and has 10,000 queued) with the turns
    queued on e0 given as ``e0_turns`` ((deadline offset s, cached tokens)) and one recompute
    (nothing cached, deadline in 5 s) queued on e1."""
    turn, fleet = _fleet(floor=False)
    fleet.engines[0].extra[QUEUED_TURNS_KEY] = _queued(e0_turns)
    fleet.engines[1].extra[QUEUED_TURNS_KEY] = _queued([(5.0, 0.0)])
    return turn, fleet


def test_externality_prices_the_histories_queued_on_the_holder_and_moves_the_turn() -> None:
    """Catches a term that does not price the harm of staying: on e0 the turn costs 3.0 s wait +
    0.2 s service + 0.2 s work; e1 1.0 + 2.0 + 2.0, so first come keeps it on e0. But e0's three
    queued turns hold 54,000 cached tokens of its 100,000: the turn's 20,000-token sequence there
    displaces 0.54 x 20,000 = 10,800 of them (1.08 s of prefill, x 20 = 21.6 s of later deadlines),
    and it overtakes all three (deadlines 10 s > its own 4 s: 3 x 0.2 s = 0.6 s): 22.2 s. On e1 the
    queued recompute has no history to lose and an earlier deadline (5 s < 40 s): 0. It moves."""
    policy = TierCostPolicy()
    turn, fleet = _queued_fleet([(10.0, 18_000.0)] * 3)
    decision = policy.choose(turn, fleet)
    scores = decision.scores
    assert decision.engine_id == "e1"
    assert scores["e0"]["cost_s"] == pytest.approx(3.0 + 0.2 + 0.2 + 22.2, abs=0.01)
    assert scores["e1"]["cost_s"] == pytest.approx(1.0 + 2.0 + 2.0, abs=0.01)
    # The parts the router keeps (calibration, the priority sent) are not changed.
    assert decision.parts is not None and decision.parts["e0"].total_s == pytest.approx(3.2)
    # The same queue with no cached histories (recomputes, nothing to lose) and earlier deadlines
    # (nothing overtaken): nothing to price, the turn stays on its history.
    turn, fleet = _queued_fleet([(1.0, 0.0)] * 3)
    assert policy.choose(turn, fleet).engine_id == "e0"


def test_the_new_blocks_footprint_prices_only_what_the_placement_writes() -> None:
    """Catches the post-hoc form pricing the whole sequence: on e0 the turn writes 2,000 tokens
    (its 18,000 cached are not new): 0.54 x 2,000 = 1,080 displaced, 0.108 s x 20 = 2.16 s, plus
    the 0.6 s delay: e0 costs 3.4 + 2.76 s; e1 (nothing cached there, no queued history) 5.0 s."""
    turn, fleet = _queued_fleet([(10.0, 18_000.0)] * 3)
    fleet.engines[0].extra[QUEUED_TURNS_KEY] = _queued([(10.0, 18_000.0)] * 3, new_blocks=True)
    decision = TierCostPolicy().choose(turn, fleet)
    assert decision.scores["e0"]["cost_s"] == pytest.approx(3.4 + 2.76, abs=0.01)
    assert decision.engine_id == "e1"
    with pytest.raises(ValueError, match="set externality too"):
        FleetSimulator(
            _workload(), "tier_cost", _tight_fleet("priority"), SimConfig(externality_new_blocks=True)
        )


def test_externality_terms() -> None:
    """Catches a wrong count or share: the delay counts only the queued turns served after the
    request (later deadline; none behind a first-come request, own offset inf); the displaced share
    is capped at the whole footprint."""
    costs = EngineCosts(prefill_tokens_per_s=10_000.0)
    parts = predict_parts(costs, (0.0, 0.0, 0.0), 5_000.0, 0.0)  # 0.5 s of service
    later, earlier = (30.0, 0.0), (1.0, 0.0)
    assert externality_s(parts, 5_000.0, QueuedTurns([later, earlier, later], 10.0, 1e5, 20.0), costs) == (
        pytest.approx(2 * 0.5)
    )
    assert externality_s(parts, 5_000.0, QueuedTurns([later], math.inf, 1e5, 1.0), costs) == 0.0
    full = QueuedTurns([(1.0, 300_000.0)], 10.0, 100_000.0, 20.0)  # histories fill more than the cache
    assert externality_s(parts, 5_000.0, full, costs) == pytest.approx(20.0 * 0.5)


def test_externality_is_off_by_default() -> None:
    """Catches the term leaking into default runs: no view carries the key unless asked, and the
    spec suffix is the only switch in bench_quality."""
    assert SimConfig().externality is False
    sim = FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), SimConfig())
    assert all(QUEUED_TURNS_KEY not in view.extra for view in sim.views)
    assert extern_of("priority:20:inf") == ("priority:20:inf", None)
    assert extern_of("priority:20:inf+floor+extern") == ("priority:20:inf+floor", "sequence")
    assert extern_of("priority:20:inf+extern:new+floor") == ("priority:20:inf+floor", "new")
    with pytest.raises(ValueError, match="FORM"):
        extern_of("priority:20:inf+extern:old")
    assert hold_of("priority:20:inf+extern+hold:0.5").wait_s == 0.5
    assert parse_scheduling("priority:20:40+extern")[:3] == ("priority", 20.0, 40.0)
    on = FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), SimConfig(externality=True))
    assert all(QUEUED_TURNS_KEY in view.extra for view in on.views)


def test_the_des_gives_the_router_s_queued_turns() -> None:
    """Catches a queue view that never empties or never fills: in a traced run with the term on,
    some decision prices a positive externality, and at the end no turn is left queued."""
    sim = FleetSimulator(
        _workload(),
        "tier_cost",
        _tight_fleet("priority"),
        SimConfig(externality=True, trace_placement=True),
    )
    result = sim.run()
    assert any(v > 0 for record in result.placement for v in record["pred_extern_s"])
    view = sim.views[0]
    assert view.extra[QUEUED_TURNS_KEY](PredictedParts()).turns == []
