"""CostModel: priors from config, convergence to a simulated engine's true costs, tracking a change,
learning from offload counters, and the index self-check."""

from __future__ import annotations

import math
import random

import pytest

from kvcore.calibration import CostModel, IndexSelfCheck
from policies.base import Tier
from policies.costs import DEFAULT_LOAD_BANDWIDTH_BYTES_PER_S, EngineCosts, PredictedParts, predict_parts

INF = math.inf


def synthetic_request(rng: random.Random) -> tuple[tuple[float, float, float], float, float]:
    """A mix of misses, GPU, CPU and STORAGE hits over 2K-16K-token prompts, sometimes queued."""
    prompt = rng.randint(2_000, 16_000)
    kind = rng.random()
    hits = [0.0, 0.0, 0.0]
    if kind < 0.2:
        hits[Tier.GPU] = int(prompt * rng.uniform(0.3, 0.9))
    elif kind < 0.5:
        hits[Tier.CPU] = int(prompt * rng.uniform(0.3, 0.95))
    elif kind < 0.8:
        hits[Tier.STORAGE] = int(prompt * rng.uniform(0.3, 0.95))
    wait = rng.choice([0, 0, rng.randint(0, 8_000)])
    return (hits[0], hits[1], hits[2]), prompt - sum(hits), wait


def feed(model: CostModel, truth: EngineCosts, rng: random.Random, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        hits, prefill, wait = synthetic_request(rng)
        parts = predict_parts(model.estimates("e"), hits, prefill, wait)
        observed = predict_parts(truth, hits, prefill, wait).total_s * math.exp(rng.gauss(0.0, 0.05))
        model.observe("e", parts, observed, cached_tokens=sum(hits), now=float(i))


def test_estimates_converge_then_follow_slower_storage() -> None:
    rng = random.Random(42)
    model = CostModel()  # priors: 22,000 tok/s, CPU 64 GB/s, STORAGE 5 GB/s
    truth = EngineCosts(prefill_tokens_per_s=15_000.0, load_bandwidth_bytes_per_s=(INF, 20e9, 2e9))
    feed(model, truth, rng, 2_000)
    est = model.estimates("e")
    assert est.prefill_tokens_per_s == pytest.approx(15_000, rel=0.08)
    assert est.load_bandwidth_bytes_per_s[Tier.CPU] == pytest.approx(20e9, rel=0.15)
    assert est.load_bandwidth_bytes_per_s[Tier.STORAGE] == pytest.approx(2e9, rel=0.08)
    # A noisy neighbour makes storage 4x slower mid-stream.
    slower = EngineCosts(prefill_tokens_per_s=15_000.0, load_bandwidth_bytes_per_s=(INF, 20e9, 0.5e9))
    feed(model, slower, rng, 500, start=2_000)
    est = model.estimates("e")
    assert est.load_bandwidth_bytes_per_s[Tier.STORAGE] == pytest.approx(0.5e9, rel=0.1)
    assert est.prefill_tokens_per_s == pytest.approx(15_000, rel=0.08)
    assert model.snapshot()["engines"]["e"]["observations"] == 2_500


def test_outliers_are_clipped_and_estimates_bounded() -> None:
    model = CostModel.from_config({"calibration": {"max_drift": 4.0}})
    parts = predict_parts(model.estimates("e"), (0.0, 0.0, 0.0), 10_000, 0)
    model.observe("e", parts, observed_ttft_s=1_000.0, cached_tokens=0, now=1.0)  # a 2,000x outlier
    one_step = model.estimates("e").prefill_tokens_per_s
    assert one_step >= 22_000 / 4 * 0.999  # clipped to ratio 4: at most a 4x move
    for i in range(200):
        model.observe("e", parts, observed_ttft_s=1_000.0, cached_tokens=0, now=float(i))
    assert model.estimates("e").prefill_tokens_per_s == pytest.approx(22_000 / 4)
    # Non-positive or non-finite TTFTs teach nothing.
    before = model.estimates("e")
    model.observe("e", parts, observed_ttft_s=float("nan"), cached_tokens=0, now=2.0)
    model.observe("e", parts, observed_ttft_s=0.0, cached_tokens=0, now=2.0)
    assert model.estimates("e") == before


def test_cached_tokens_shortfall_moves_hits_to_prefill() -> None:
    # The engine only had half the predicted storage hit: the slow TTFT is a miss, not slow storage.
    rng = random.Random(3)
    truth = EngineCosts()
    model = CostModel()
    for i in range(300):
        predicted_hits = (0.0, 0.0, 8_000.0)
        parts = predict_parts(model.estimates("e"), predicted_hits, 2_000, 0)
        real = predict_parts(truth, (0.0, 0.0, 4_000.0), 6_000, 0).total_s * math.exp(rng.gauss(0, 0.03))
        model.observe("e", parts, real, cached_tokens=4_000, now=float(i))
    est = model.estimates("e")
    assert est.load_bandwidth_bytes_per_s[Tier.STORAGE] == pytest.approx(5e9, rel=0.1)
    assert est.prefill_tokens_per_s == pytest.approx(22_000, rel=0.1)
    # ...and the self-check saw a persistent 50% shortfall on this engine.
    assert model.index_trusted("e") is False


def test_offload_counters_give_measured_bandwidth_per_tier() -> None:
    model = CostModel(calibration=None)
    model.update_offload_counters(
        "e", {Tier.CPU: 0.0, Tier.STORAGE: 0.0}, {Tier.CPU: 0.0, Tier.STORAGE: 0.0}, 0
    )
    for step in range(1, 40):
        model.update_offload_counters(
            "e",
            {Tier.CPU: step * 10e9, Tier.STORAGE: step * 1e9},
            {Tier.CPU: step * 1.0, Tier.STORAGE: step * 1.0},  # 10 GB/s and 1 GB/s
            float(step),
        )
    est = model.estimates("e")
    assert est.load_bandwidth_bytes_per_s[Tier.CPU] == pytest.approx(10e9, rel=0.01)
    assert est.load_bandwidth_bytes_per_s[Tier.STORAGE] == pytest.approx(1e9, rel=0.01)
    # Counter reset (engine restart): the baseline restarts, no bogus sample.
    model.update_offload_counters("e", {Tier.CPU: 1e6}, {Tier.CPU: 5.0}, 50.0)
    assert model.estimates("e").load_bandwidth_bytes_per_s[Tier.CPU] == pytest.approx(10e9, rel=0.01)
    # Tiny deltas accumulate instead of being timed on their own.
    model.update_offload_counters("e", {Tier.CPU: 1e6 + 1e3}, {Tier.CPU: 6.0}, 51.0)
    assert model.estimates("e").load_bandwidth_bytes_per_s[Tier.CPU] == pytest.approx(10e9, rel=0.01)


def test_a_measured_bandwidth_beyond_the_priors_reach_is_reported() -> None:
    """The default CPU prior (64 GB/s) may drift 50x: vLLM's CPU build loads its host-copy tier at
    ~1 GB/s (docs/results/cpu-tier.md), under the 1.28 GB/s floor. Such a sample is reported with
    the bound (the router logs it), and still moves the estimate as far as the bound; a sample
    within reach is not reported. Catches a prior mismatch priced silently at the bound."""
    model = CostModel(calibration=None)
    floor = DEFAULT_LOAD_BANDWIDTH_BYTES_PER_S[Tier.CPU] / model.calibration.max_drift
    assert model.update_offload_counters("e", {Tier.CPU: 0.0}, {Tier.CPU: 0.0}, 0.0) == []
    beyond: list[tuple[Tier, float, float]] = []
    for step in range(1, 30):
        beyond += model.update_offload_counters(
            "e", {Tier.CPU: step * 1e9}, {Tier.CPU: float(step)}, float(step)
        )
    assert beyond and all(b == (Tier.CPU, pytest.approx(1e9), pytest.approx(floor)) for b in beyond)
    assert model.estimates("e").load_bandwidth_bytes_per_s[Tier.CPU] == pytest.approx(floor)
    within = CostModel(calibration=None)
    within.update_offload_counters("e", {Tier.CPU: 0.0}, {Tier.CPU: 0.0}, 0.0)
    assert within.update_offload_counters("e", {Tier.CPU: 10e9}, {Tier.CPU: 1.0}, 1.0) == []


def _pool_of_a_and_b(model: CostModel, *, with_cpu: bool) -> None:
    """a, b and "late" mount pool "p"; 30 counter samples each from a (STORAGE 0.5 GB/s) and b
    (4 GB/s), and with ``with_cpu`` CPU loads at 10 GB/s (a) and 5 GB/s (b)."""
    for engine in ("a", "b", "late"):
        model.set_storage_pool(engine, "p")
    for step in range(0, 30):
        for engine, rate in {"a": 0.5e9, "b": 4e9}.items():
            loads, times = {Tier.STORAGE: step * rate}, {Tier.STORAGE: float(step)}
            if with_cpu:
                loads[Tier.CPU] = step * 10e9
                times[Tier.CPU] = step * (1.0 if engine == "a" else 2.0)
            model.update_offload_counters(engine, loads, times, float(step))


@pytest.mark.parametrize("shared", [False, True])
def test_a_shared_storage_pool_has_one_measured_bandwidth(shared: bool) -> None:
    """calibration.shared_storage (round q31): a and b mount pool "p", c mounts none. a's STORAGE
    counters say 0.5 GB/s (it loaded while the pool was busy), b's 4 GB/s; with the pool shared
    every member reads the pool's one figure, the EWMA of both engines' samples (between the
    two, the same for a, b and a member that appears later), and c keeps its prior. Off: each
    engine's own figure, as before. The CPU tier is per engine either way."""
    model = CostModel.from_config({"calibration": {"shared_storage": shared}})
    prior = model.estimates("c").load_bandwidth_bytes_per_s[Tier.STORAGE]
    model.set_storage_pool("c", "")
    _pool_of_a_and_b(model, with_cpu=True)
    storage = {
        e: model.estimates(e).load_bandwidth_bytes_per_s[Tier.STORAGE] for e in ("a", "b", "late", "c")
    }
    cpu = {e: model.estimates(e).load_bandwidth_bytes_per_s[Tier.CPU] for e in ("a", "b")}
    assert cpu == pytest.approx({"a": 10e9, "b": 5e9}, rel=0.01)
    assert storage["c"] == prior
    if shared:
        assert storage["a"] == storage["b"] == storage["late"]
        assert 0.5e9 * 1.5 < storage["a"] < 4e9 / 1.5
    else:
        assert storage["a"] == pytest.approx(0.5e9, rel=0.01) and storage["b"] == pytest.approx(4e9, rel=0.01)
        assert storage["late"] == prior


def test_a_storage_spread_bounds_each_member_around_the_pool() -> None:
    """calibration.storage_spread (round q32): a's counters say 0.5 GB/s, b's 4 GB/s, one pool. The
    pool's figure is the EWMA of both (between them). With spread 2 a member prices with its own
    figure held within [pool / 2, pool x 2]: a is lifted to pool / 2, b cut to pool x 2, and a
    member with no samples of its own reads the pool's. With spread 16 the bound does not bind:
    each member's own figure, as with no pool. Spread 1 is shared_storage's one figure. A spread
    below 1 is refused."""

    def run(spread: float) -> dict[str, float]:
        model = CostModel.from_config({"calibration": {"storage_spread": spread}})
        _pool_of_a_and_b(model, with_cpu=False)
        return {e: model.estimates(e).load_bandwidth_bytes_per_s[Tier.STORAGE] for e in ("a", "b", "late")}

    pool = run(1.0)["late"]
    assert 0.5e9 * 1.5 < pool < 4e9 / 1.5
    assert run(1.0) == {"a": pool, "b": pool, "late": pool}
    shared = CostModel.from_config({"calibration": {"shared_storage": True}})
    assert shared.calibration.pool_spread == 1.0
    bounded = run(2.0)
    assert bounded["a"] == pytest.approx(pool / 2) and bounded["b"] == pytest.approx(pool * 2)
    assert bounded["late"] == pytest.approx(pool)
    loose = run(16.0)
    assert loose["a"] == pytest.approx(0.5e9, rel=0.01) and loose["b"] == pytest.approx(4e9, rel=0.01)
    with pytest.raises(ValueError, match="storage_spread"):
        CostModel.from_config({"calibration": {"storage_spread": 0.5}})


def test_priors_from_config_per_fleet_and_engine() -> None:
    model = CostModel.from_config(
        {
            "prefill_tokens_per_s": 10_000,
            "tiers": {"storage": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0.01}},
            "engines": {
                "slow": {"prefill_tokens_per_s": 5_000, "tiers": {"cpu": {"bandwidth_bytes_per_s": 16e9}}}
            },
        }
    )
    fast, slow = model.estimates("fast"), model.estimates("slow")
    assert fast.prefill_tokens_per_s == 10_000 and slow.prefill_tokens_per_s == 5_000
    assert slow.load_bandwidth_bytes_per_s[Tier.STORAGE] == 1e9  # inherits the fleet override
    assert slow.load_bandwidth_bytes_per_s[Tier.CPU] == 16e9
    assert fast.load_time_s(Tier.STORAGE, 1_000) == pytest.approx(1_000 * 131_072 / 1e9 + 0.01)
    assert fast.load_time_s(Tier.GPU, 1_000) == 0.0
    snap = model.snapshot()["engines"]["fast"]["estimate"]
    assert snap["tiers"]["gpu"]["bandwidth_bytes_per_s"] is None
    rows = {(n, tuple(sorted(lbl.items()))): v for n, lbl, v in model.gauge_values()}
    assert rows[("kvroute_cost_prefill_tokens_per_second", (("engine", "slow"),))] == 5_000
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        CostModel.from_config({"prefil_tokens_per_s": 1})
    with pytest.raises(ValueError, match=r"costs\.engines\.x\.prefill_tokens_per_s must be > 0"):
        CostModel.from_config({"engines": {"x": {"prefill_tokens_per_s": 0}}})


def test_selfcheck_untrusts_on_persistent_shortfall_and_recovers() -> None:
    check = IndexSelfCheck(min_samples=5, untrust_above=0.3, trust_below=0.1, weight=0.3)
    for _ in range(4):
        assert check.observe("e", 1_000, 0) is True  # not enough samples yet
    assert check.observe("e", 1_000, 0) is False
    assert check.observe("other", 1_000, 1_000) is True
    assert check.observe("e", 8, 0) is False  # too small a prediction to count either way
    states = []
    for _ in range(15):
        states.append(check.observe("e", 1_000, 1_000))
    assert states[0] is False and states[-1] is True  # hysteresis, then recovery
    check.observe("e", 1_000, 0)
    assert check.snapshot()["e"]["samples"] == 21
    check.forget("e")
    assert check.trusted("e") and "e" not in check.snapshot()


def test_parts_round_trip() -> None:
    parts = predict_parts(EngineCosts(slot_s_per_request=0.03), (16.0, 32.0, 48.0), 100.0, 50.0, 4.0)
    assert parts.slot_s == pytest.approx(0.12)
    again = PredictedParts.from_scores(parts.as_scores())
    assert again == parts


def test_queued_requests_teach_the_slot_wait_not_the_rates() -> None:
    """An engine bound by KV memory: every request placed behind n others waits n x 40 ms for a slot
    on top of its service time. The rates must come out of the unqueued requests (the truth's
    15,000 tok/s, not a rate slowed down by the wait) and the slot wait out of the queued ones."""
    rng = random.Random(7)
    truth = EngineCosts(prefill_tokens_per_s=15_000.0, load_bandwidth_bytes_per_s=(INF, 20e9, 2e9))
    slot_true_s = 0.04
    model = CostModel()
    for i in range(3_000):
        hits, prefill, wait = synthetic_request(rng)
        in_flight = 0 if rng.random() < 0.3 else rng.randint(1, 12)
        parts = predict_parts(model.estimates("e"), hits, prefill, wait, in_flight)
        service_s = predict_parts(truth, hits, prefill, wait).total_s
        observed = (service_s + slot_true_s * in_flight) * math.exp(rng.gauss(0.0, 0.05))
        model.observe("e", parts, observed, cached_tokens=sum(hits), now=float(i))
    est = model.estimates("e")
    assert est.prefill_tokens_per_s == pytest.approx(15_000, rel=0.08)
    assert est.load_bandwidth_bytes_per_s[Tier.STORAGE] == pytest.approx(2e9, rel=0.1)
    assert est.slot_s_per_request == pytest.approx(slot_true_s, rel=0.15)
    snap = model.snapshot()["engines"]["e"]
    assert 0 < snap["slot_observations"] < snap["observations"] == 3_000
    # One long wait behind 20 requests moves the slot estimate, never the prefill rate.
    before = model.estimates("e")
    parts = predict_parts(before, (0.0, 0.0, 0.0), 4_000, 0, 20)
    after = model.observe("e", parts, 30.0, cached_tokens=0, now=3_000.0)
    assert after.prefill_tokens_per_s == before.prefill_tokens_per_s
    assert after.slot_s_per_request > before.slot_s_per_request


def test_predicted_prefill_tokens_is_what_the_load_tracker_should_queue() -> None:
    from policies.base import Decision, EngineView, FleetView, PrefixMatch, RouteRequest, build_policy
    from policies.costs import predicted_prefill_tokens

    req = RouteRequest(
        "r",
        prompt_tokens=10_000,
        block_keys=tuple(range(625)),
        block_size=16,
        prefix_matches={"a": PrefixMatch(600, (100, 400, 100)), "b": PrefixMatch(625, (625, 0, 0))},
    )
    # tier_cost reports its own prediction (prompt - hits of every tier).
    decision = build_policy("tier_cost").choose(req, FleetView([EngineView("a")]))
    assert predicted_prefill_tokens(req, decision) == 10_000 - 600 * 16
    # A policy without predictions: the chosen engine's match in any tier, at least one token.
    assert predicted_prefill_tokens(req, Decision("a", "kv_gpu")) == 10_000 - 600 * 16
    assert predicted_prefill_tokens(req, Decision("b", "kv_gpu")) == 1
    # Nothing known about the engine: the whole prompt.
    assert predicted_prefill_tokens(req, Decision("c", "round_robin")) == 10_000
    # A retry on a fallback engine is priced for that engine.
    assert predicted_prefill_tokens(req, Decision("c", "kv_gpu"), "b") == 1


def test_predict_parts_is_the_documented_ttft_formula() -> None:
    """predict_parts (the one TTFT formula) against the formula of docs/routing.md written out here:
    wait / rate + in_flight x slot + sum over tiers with hits of (latency + hit x kv_bytes / bw)
    + prefill / rate."""
    costs = EngineCosts(
        prefill_tokens_per_s=9_000.0,
        load_bandwidth_bytes_per_s=(INF, 16e9, 1e9),
        load_latency_s=(0.0, 0.001, 0.004),
        slot_s_per_request=0.02,
    )
    rng = random.Random(9)
    for _ in range(200):
        hits, prefill, wait = synthetic_request(rng)
        in_flight = rng.randint(0, 9)
        loads = 0.0
        for tier, bw in ((1, 16e9), (2, 1e9)):
            if hits[tier] > 0:
                loads += costs.load_latency_s[tier] + hits[tier] * costs.kv_bytes_per_token / bw
        expected = wait / 9_000.0 + in_flight * 0.02 + loads + prefill / 9_000.0
        parts = predict_parts(costs, hits, prefill, wait, in_flight)
        assert parts.total_s == pytest.approx(expected, rel=1e-12)
        assert parts.service_s == pytest.approx(loads + prefill / 9_000.0, rel=1e-12)


def test_prompts_of_one_size_teach_the_rate_and_a_fixed_overhead_is_still_learned() -> None:
    """Prompts all of one size cannot tell a per-request overhead from the prefill rate: the priors
    decide. The engine's true rate is 10,000 tok/s (prior 30,000) and its true overhead 10 ms.
    With the intercept's prior at 1 s (std) it took ~70% of every correction: after 60 requests the
    rate read 15,600 tok/s and, as the predicted TTFT leaves the intercept out, every prediction
    was 1.6x low (1.9x live). At 0.1 s the rate must come within 10% of the truth and the
    predictions within 15%; with varied sizes a true 40 ms overhead must still be found."""
    rng = random.Random(1)
    model = CostModel(EngineCosts(prefill_tokens_per_s=30_000.0))
    ratio = math.nan
    for i in range(20):
        parts = predict_parts(model.estimates("e"), (0.0, 0.0, 0.0), 2_000, 0)
        observed = (2_000 / 10_000 + 0.01) * math.exp(rng.gauss(0.0, 0.05))
        ratio = observed / parts.total_s
        model.observe("e", parts, observed, cached_tokens=0, now=float(i))
    assert model.estimates("e").prefill_tokens_per_s == pytest.approx(10_000, rel=0.1)
    assert ratio == pytest.approx(1.0, rel=0.15)

    model = CostModel(EngineCosts(prefill_tokens_per_s=30_000.0))
    for i in range(300):
        tokens = rng.randint(600, 4_000)
        parts = predict_parts(model.estimates("e"), (0.0, 0.0, 0.0), tokens, 0)
        observed = (tokens / 10_000 + 0.04) * math.exp(rng.gauss(0.0, 0.05))
        model.observe("e", parts, observed, cached_tokens=0, now=float(i))
    assert model.estimates("e").prefill_tokens_per_s == pytest.approx(10_000, rel=0.05)
    assert model.overhead_s("e") == pytest.approx(0.04, rel=0.25)


def test_the_router_tells_the_cost_model_which_engines_share_a_storage_pool() -> None:
    """build_router_app registers each engine's ``storage_pool``: with
    costs.priors.calibration.shared_storage, e0's STORAGE counters set e1's figure (same pool) and
    not e2's (none)."""
    from router.config import load_config
    from router.service import build_router_app

    engines = [
        {"id": f"e{i}", "url": f"http://127.0.0.1:{9 + i}", "storage_pool": pool}
        for i, pool in enumerate(("p", "p", ""))
    ]
    config = load_config(
        environ={},
        overrides={"engines": engines, "costs": {"priors": {"calibration": {"shared_storage": True}}}},
    )
    costs = build_router_app(config).state.costs
    prior = costs.estimates("e2").load_bandwidth_bytes_per_s[Tier.STORAGE]
    for e in ("e1", "e2"):
        costs.estimates(e)  # known to the model before e0's counters arrive
    for step in (0, 1):
        costs.update_offload_counters(
            "e0", {Tier.STORAGE: step * 1e9}, {Tier.STORAGE: float(step)}, float(step)
        )
    assert costs.estimates("e1").load_bandwidth_bytes_per_s[Tier.STORAGE] == pytest.approx(1e9)
    assert costs.estimates("e2").load_bandwidth_bytes_per_s[Tier.STORAGE] == prior != pytest.approx(1e9)
