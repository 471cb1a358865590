"""horizon_cost on hand-built fleets: the learned gap distribution, LRU residence, the eviction,
next-turn and queueing terms against hand-computed values, and the choices they change."""

from __future__ import annotations

import math

import pytest

from policies.base import EngineView, FleetView, PrefixMatch, RouteRequest, build_policy
from policies.horizon_cost import HorizonCostPolicy

BLOCK = 16
PROMPT_TOKENS = 8192
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK
PREFILL_TOKENS_PER_S = 22_000.0  # costs.py default prior
KV_BYTES = 131_072
CPU_BW = 64e9


def request(matches: dict[str, PrefixMatch], request_id: str = "r1", session: str = "s") -> RouteRequest:
    return RouteRequest(
        request_id=request_id,
        session_key=session,
        prompt_tokens=PROMPT_TOKENS,
        block_keys=tuple(range(PROMPT_BLOCKS)),
        block_size=BLOCK,
        expected_output_tokens=0,
        prefix_matches=matches,
    )


def cpu(blocks: int) -> PrefixMatch:
    return PrefixMatch(blocks, (0, blocks, 0))


def teach_gaps(policy: HorizonCostPolicy, gap_s: float, sessions: int, turns: int) -> None:
    """Feed ``sessions`` sessions of ``turns`` turns each, ``gap_s`` apart, through choose/on_routed
    on a one-engine fleet (the policy learns gaps from what it routes)."""
    fleet_engine = EngineView("learn")
    t = 0.0
    for s in range(sessions):
        for k in range(turns):
            req = RouteRequest(f"l{s}#{k}", session_key=f"learn{s}", prompt_tokens=16, block_size=BLOCK)
            decision = policy.choose(req, FleetView([fleet_engine], now=t + k * gap_s))
            policy.on_routed(req, decision)
        t += turns * gap_s + 10_000.0  # sessions far apart: gaps are only within a session


def test_gap_distribution_is_learned_from_routed_sessions() -> None:
    policy = HorizonCostPolicy()
    assert policy.survival(5.0) == 1.0 and policy.reuse_density(5.0) == 0.0  # nothing learned yet
    teach_gaps(policy, gap_s=10.0, sessions=5, turns=4)
    # 5 sessions x 4 turns: 15 gaps of 10 s; 5 of 20 turns were a session's last.
    assert policy.last_turn_share() == pytest.approx(5 / 20)
    assert policy.survival(1.0) == 1.0
    assert policy.survival(100.0) == 0.0
    # All gaps in one log2 bin [8, 16): its density per ln-second is 1 / ln 2 at the bin's centre.
    centre = 8.0 * math.sqrt(2.0)
    assert policy.reuse_density(centre) == pytest.approx((1 - 5 / 20) / math.log(2.0), rel=1e-6)
    assert policy.reuse_density(1_000.0) == 0.0  # evicting blocks nobody returns to costs nothing


def test_next_turn_cost_is_zero_on_a_quiet_engine_and_a_recompute_on_a_thrashing_one() -> None:
    # GPU 100K tokens, CPU 200K; gaps of 10 s.
    policy = HorizonCostPolicy(
        gpu_capacity_tokens=100_000, cpu_capacity_tokens=200_000, storage_capacity_tokens=0, future_weight=1.0
    )
    teach_gaps(policy, gap_s=10.0, sessions=4, turns=5)
    quiet, hot = EngineView("quiet"), EngineView("hot")
    # The hot engine took 2.4M new tokens in the last moments: its CPU tier turns over in < 10 s.
    t = 100_000.0
    for i in range(40):
        req = RouteRequest(f"h{i}", session_key=f"h{i}", prompt_tokens=60_000, block_size=BLOCK)
        d = policy.choose(req, FleetView([hot], now=t))
        policy.on_routed(req, d)
    policy._now = t
    q = policy.last_turn_share()  # 4 + 40 sessions over 20 + 40 turns
    assert q == pytest.approx(44 / 60)
    t_gpu, t_cpu, t_storage = policy.residences_s(hot)
    assert t_cpu < 10.0 and t_gpu < t_cpu and t_storage == 0.0
    assert policy.residences_s(quiet)[0] == math.inf
    req = request({})
    costs = policy._own_costs
    assert policy.future_s(req, quiet, costs) == 0.0
    # Every return (gap 10 s > T_CPU) finds nothing: the whole history is recomputed next turn.
    assert policy.future_s(req, hot, costs) == pytest.approx(
        (1 - q) * PROMPT_TOKENS / PREFILL_TOKENS_PER_S, rel=1e-6
    )


def test_eviction_cost_is_the_hand_computed_marginal_loss() -> None:
    policy = HorizonCostPolicy(
        gpu_capacity_tokens=100_000, cpu_capacity_tokens=200_000, storage_capacity_tokens=0, evict_weight=1.0
    )
    teach_gaps(policy, gap_s=10.0, sessions=4, turns=5)
    engine = EngineView("e")
    load = policy._load("e")
    # A full engine whose GPU turns over in 8 s x sqrt 2 (the gap bin's centre) and CPU in 1000 s.
    t_gpu = 8.0 * math.sqrt(2.0)
    load.gpu_written_tokens = load.cpu_written_tokens = 10**9
    load.gpu_in.acc = 100_000 / t_gpu * load.gpu_in.window_s
    load.cpu_in.acc = 200_000 / 1_000.0 * load.cpu_in.window_s
    policy._now = load.gpu_in.t = load.cpu_in.t = 0.0
    scores = {"hit_tokens_gpu": 0.0, "hit_tokens_cpu": 0.0, "hit_tokens_storage": 0.0}
    phi = (1 - policy.last_turn_share()) / math.log(2.0)
    # GPU: 8192 new tokens x phi(T_GPU) x a CPU reload each; CPU: phi(1000 s) = 0.
    expected = PROMPT_TOKENS * phi * KV_BYTES / CPU_BW
    got = policy.evict_s(request({}), engine, scores, policy._own_costs)
    assert got == pytest.approx(expected, rel=1e-6)
    # A tier with free space evicts nothing.
    load.gpu_written_tokens = 0.0
    assert policy.evict_s(request({}), engine, scores, policy._own_costs) == 0.0


def test_queue_weight_follows_the_requests_queued_ahead() -> None:
    policy = HorizonCostPolicy(max_work_weight=3.0)
    engine = EngineView("e", in_flight=10, queued_prefill_tokens=5 * PROMPT_TOKENS)
    for i in range(50):
        req = request({}, request_id=f"q{i}", session=f"q{i}")
        d = policy.choose(req, FleetView([engine], now=float(i)))
        policy.on_routed(req, d)
    # 5 prompts queued ahead -> L ~ 5, capped at 3 (work_weight 1 + L, at most max_work_weight).
    assert policy.queue_weight(engine) == pytest.approx(3.0)
    assert policy.queue_weight(EngineView("idle")) == pytest.approx(1.0)


def test_with_nothing_learned_it_routes_as_tier_cost() -> None:
    """No gaps, queue or capacities learned: only the in-flight price differs (off here)."""
    horizon, tier = build_policy("horizon_cost", {"in_flight_s": 0.0}), build_policy("tier_cost")
    hit = PROMPT_BLOCKS - 4
    for queued in (0, 10_000, 40_000, 80_000):
        fleet = FleetView([EngineView("home", in_flight=4, queued_prefill_tokens=queued), EngineView("idle")])
        req = request({"home": cpu(hit)}, request_id=f"r{queued}")
        assert horizon.choose(req, fleet).engine_id == tier.choose(req, fleet).engine_id


def test_a_busy_fleet_keeps_the_turn_where_its_history_is() -> None:
    """The home engine's queue makes moving look faster for this turn; with requests queued on every
    engine the recompute elsewhere delays them, so horizon_cost stays and tier_cost moves."""
    horizon = HorizonCostPolicy(max_work_weight=8.0, overload_factor=None, in_flight_s=0.0)
    tier = build_policy("tier_cost")
    hit = PROMPT_BLOCKS - 16  # 7936 tokens of history in home's CPU tier
    home = EngineView("home", in_flight=12, queued_prefill_tokens=30_000)
    other = EngineView("other", in_flight=6, queued_prefill_tokens=2_000)
    # Teach the queue: both engines have had ~3 requests queued ahead for a while.
    for i in range(40):
        for e in (home, other):
            req = request({}, request_id=f"w{e.engine_id}{i}", session=f"w{e.engine_id}{i}")
            busy = EngineView(e.engine_id, in_flight=8, queued_prefill_tokens=3 * PROMPT_TOKENS)
            d = horizon.choose(req, FleetView([busy], now=float(i)))
            horizon.on_routed(req, d)
    fleet = FleetView([home, other], now=40.0)
    req = request({"home": cpu(hit)}, request_id="turn")
    assert tier.choose(req, fleet).engine_id == "other"
    decision = horizon.choose(req, fleet)
    assert decision.engine_id == "home"
    s = decision.scores
    assert s["other"]["work_weight"] > 3.0
    assert s["home"]["cost_s"] == pytest.approx(
        s["home"]["total_s"]
        + s["home"]["work_s"]
        + s["home"]["evict_s"]
        + s["home"]["future_s"]
        + s["home"]["footprint_s"]
        + s["home"]["in_flight_s"]
        + s["home"]["slot_wait_s"]
        + s["home"]["decode_s"]
        + s["home"]["pressure_s"]
    )
    assert "horizon cost" in decision.reason


def test_guard_skips_overloaded_engines_like_kv_fixed_credit() -> None:
    policy = HorizonCostPolicy(overload_factor=1.5, min_in_flight=1, min_queued_tokens=0)
    hot = EngineView("hot", in_flight=20, queued_prefill_tokens=200_000)
    cold = EngineView("cold", in_flight=1, queued_prefill_tokens=0)
    req = request({"hot": PrefixMatch(PROMPT_BLOCKS - 1, (PROMPT_BLOCKS - 1, 0, 0))})
    decision = policy.choose(req, FleetView([hot, cold]))
    assert decision.engine_id == "cold" and decision.scores["hot"]["overloaded"] == 1.0
    assert decision.fallbacks == ("hot",)


def test_bad_params_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="max_work_weight"):
        build_policy("horizon_cost", {"max_work_weight": 0.5})
    with pytest.raises(ValueError, match="cpu_capacity_tokens"):
        build_policy("horizon_cost", {"cpu_capacity_tokens": -1})
    with pytest.raises(ValueError, match="overload_factor"):
        build_policy("horizon_cost", {"overload_factor": 0.5})


def _footprint_policy() -> HorizonCostPolicy:
    """Local capacity 20,000 tokens per engine (CPU tier), no pool; gaps of 10 s, q = 4 / 20."""
    policy = HorizonCostPolicy(
        footprint_weight=1.0,
        evict_weight=0.0,
        in_flight_s=0.0,
        gpu_capacity_tokens=10_000,
        cpu_capacity_tokens=20_000,
        storage_capacity_tokens=0,
    )
    teach_gaps(policy, gap_s=10.0, sessions=4, turns=5)
    return policy


def test_alive_horizon_is_the_learned_gap_quantile() -> None:
    assert HorizonCostPolicy(rate_window_s=30.0).alive_horizon_s() == 300.0  # prior: 10 x window
    policy = _footprint_policy()
    # All gaps in the bin [8, 16) s: S(H) = 0.05 at 95% of the way through it.
    assert policy.alive_horizon_s() == pytest.approx(8.0 + 8.0 * 0.95)


def test_footprint_cost_is_the_hand_computed_overflow_change() -> None:
    """Three 8,192-token histories homed on A (24,576 > 20,000 tokens): a new conversation there
    overflows by all its 8,192 tokens, on empty B by none; moving one of A's conversations to B
    relieves A's overflow (4,576 tokens) and costs B nothing: a negative price."""
    policy = _footprint_policy()
    a, b = EngineView("A"), EngineView("B")
    t = 100_000.0
    for i in range(3):
        req = request({}, request_id=f"x{i}", session=f"x{i}")
        policy.on_routed(req, policy.choose(req, FleetView([a], now=t)))
    per_token_s = (1 - policy.last_turn_share()) / PREFILL_TOKENS_PER_S
    new = policy.choose(request({}, request_id="n", session="new"), FleetView([a, b], now=t + 1))
    assert new.scores["A"]["footprint_s"] == pytest.approx(PROMPT_TOKENS * per_token_s, rel=1e-9)
    assert new.scores["B"]["footprint_s"] == 0.0
    assert new.engine_id == "B"  # everything else equal, the engine with room
    again = policy.choose(request({}, request_id="x0#2", session="x0"), FleetView([a, b], now=t + 2))
    assert again.scores["A"]["footprint_s"] == 0.0  # same size history, same home: no change
    assert again.scores["B"]["footprint_s"] == pytest.approx(-(3 * PROMPT_TOKENS - 20_000) * per_token_s)
    # Sessions unseen for longer than the alive horizon no longer count.
    late = policy.choose(request({}, request_id="l", session="late"), FleetView([a, b], now=t + 60))
    assert late.scores["A"]["footprint_s"] == 0.0


def test_slot_wait_is_waiting_requests_over_the_finish_rate() -> None:
    policy = HorizonCostPolicy(slot_wait_weight=1.0, in_flight_s=0.25, overload_factor=None)
    busy = EngineView("busy", in_flight=14, num_requests_waiting=10)
    idle = EngineView("idle")
    policy._now = 100.0
    for i in range(30):  # 30 finishes on "busy" just now: mu = 30 / rate_window_s (60 s) = 0.5 / s
        policy.on_finished(request({}, request_id=f"f{i}"), "busy", True)
    decision = policy.choose(request({}, request_id="r"), FleetView([busy, idle], now=100.0))
    s = decision.scores["busy"]
    assert s["slot_wait_s"] == pytest.approx(10 / 0.5 - s["wait_s"], rel=1e-9)
    assert s["in_flight_s"] == pytest.approx(14 * 0.25)
    assert decision.scores["idle"]["slot_wait_s"] == 0.0  # nothing learned, nobody waiting
    assert decision.engine_id == "idle"
    off = HorizonCostPolicy(overload_factor=None).choose(request({}), FleetView([busy], now=100.0))
    assert off.scores["busy"]["slot_wait_s"] == 0.0
