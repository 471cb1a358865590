"""The admission wait priced only for turns that are recomputes on every engine anyway (issue 27,
round q8): ``policies.costs.ADMISSION_RECOMPUTE_BELOW_KEY`` / ``SimConfig.admission_recompute_below``
/ ``+admission:FORM:recompute[:X]``. A turn some engine holds keeps the learned slot term on every
engine; a turn no engine holds gets the admission wait on every engine."""

from __future__ import annotations

import math

import pytest

from loadtest.bench_quality import admission_of, split_by_recompute
from policies.base import EngineView, FleetView, PrefixMatch, RouteRequest
from policies.costs import (
    ADMISSION_RECOMPUTE_BELOW_KEY,
    ADMISSION_WAIT_KEY,
    RECOMPUTE_BELOW,
    EngineCosts,
    PriorCosts,
    best_cached_fraction,
)
from policies.tier_cost import TierCostPolicy
from sim.des import SPLIT_CACHED_FRACTION_KEY, FleetSimulator, SimConfig
from tests.test_admission_wait import _tight_fleet, _workload
from tests.test_sim_cli import assert_sim_refuses

COSTS = PriorCosts(EngineCosts(prefill_tokens_per_s=10_000.0, slot_s_per_request=0.5))
#: The learned slot term of the engines below: 4 in flight x 0.5 s.
LEARNED_SLOT_S = 2.0


def _engine(engine_id: str, wait_s: float | None, below: float | None) -> EngineView:
    """An engine with 4 in flight whose admission wait (when priced) is ``wait_s`` per 10,000
    prompt tokens."""
    view = EngineView(engine_id=engine_id, in_flight=4)
    if wait_s is not None:
        view.extra[ADMISSION_WAIT_KEY] = lambda prompt_tokens, parts: wait_s * prompt_tokens / 10_000
        if below is not None:
            view.extra[ADMISSION_RECOMPUTE_BELOW_KEY] = below
    return view


def _request(held_blocks: int, *, tier: int = 0, engine_id: str = "e0") -> RouteRequest:
    """A 20,000-token prompt (1,250 blocks of 16) of which ``engine_id`` holds ``held_blocks``."""
    by_tier = [0, 0, 0]
    by_tier[tier] = held_blocks
    matches = {
        engine_id: PrefixMatch(blocks=held_blocks, blocks_by_tier=(by_tier[0], by_tier[1], by_tier[2]))
    }
    return RouteRequest(request_id="r", prompt_tokens=20_000, block_size=16, prefix_matches=matches)


def test_best_cached_fraction_is_the_longest_match_over_engines_in_any_tier_capped() -> None:
    request = RouteRequest(
        request_id="r",
        prompt_tokens=20_000,
        block_size=16,
        prefix_matches={
            "e0": PrefixMatch(blocks=100, blocks_by_tier=(100, 0, 0)),
            "e1": PrefixMatch(blocks=500, blocks_by_tier=(0, 0, 500)),  # the storage pool's copy
            "e2": PrefixMatch(blocks=300, blocks_by_tier=(200, 100, 0)),
        },
    )
    assert best_cached_fraction(request, 20_000) == pytest.approx(500 * 16 / 20_000)
    # A whole-prompt match is capped at all but the last token (vLLM computes it).
    assert best_cached_fraction(_request(1_250), 20_000) == pytest.approx(19_999 / 20_000)
    assert best_cached_fraction(_request(0), 20_000) == 0.0
    assert best_cached_fraction(RouteRequest(request_id="r", prompt_tokens=0), 0) == 0.0


def test_a_turn_cached_on_some_engine_is_priced_as_without_the_admission_wait_on_every_engine() -> None:
    """e0 holds 60% of the prompt and its KV is full for 30 s; e1 holds nothing and admits at once.
    Gated (below 0.25), the turn is priced on both engines exactly as with no admission wait at all
    (the learned slot term) and stays on its history, where the ungated pricing moves it to e1.
    Catches: a gate read from each engine's own hits (e1 holds nothing, so it would price e1's
    admission wait, 0 s, and pull the cached turn off e0)."""
    request = _request(750)  # 12,000 of 20,000 tokens on e0's GPU
    policy = TierCostPolicy()
    for engine_id, wait_s in (("e0", 15.0), ("e1", 0.0)):
        plain = policy.predict(request, _engine(engine_id, None, None), COSTS)
        gated = policy.predict(request, _engine(engine_id, wait_s, 0.25), COSTS)
        assert gated == plain
        assert gated.slot_s == LEARNED_SLOT_S
    plain_choice = policy.choose(
        request, FleetView([_engine("e0", None, None), _engine("e1", None, None)], now=0.0, costs=COSTS)
    )
    gated_choice = policy.choose(
        request, FleetView([_engine("e0", 15.0, 0.25), _engine("e1", 0.0, 0.25)], now=0.0, costs=COSTS)
    )
    ungated_choice = policy.choose(
        request, FleetView([_engine("e0", 15.0, None), _engine("e1", 0.0, None)], now=0.0, costs=COSTS)
    )
    assert gated_choice.engine_id == plain_choice.engine_id == "e0"
    assert gated_choice.scores == plain_choice.scores
    assert ungated_choice.engine_id == "e1"  # what the gate prevents


def test_a_turn_cached_nowhere_gets_the_admission_wait_on_every_engine_and_goes_where_admitted_soonest() -> (
    None
):
    """Only the shared system prefix (5% of the prompt) is held, on e0: below 0.25 everywhere, so
    each engine's slot term is its admission wait, and the long recompute goes to e1, admitted at
    once, rather than e0 (full for 30 s). Catches: the gate shut for a turn below the threshold."""
    request = _request(62)  # 992 tokens of 20,000 on e0
    policy = TierCostPolicy()
    assert policy.predict(request, _engine("e0", 15.0, 0.25), COSTS).slot_s == pytest.approx(30.0)
    assert policy.predict(request, _engine("e1", 3.0, 0.25), COSTS).slot_s == pytest.approx(6.0)
    assert policy.predict(request, _engine("e1", 3.0, 0.25), COSTS) == policy.predict(
        request, _engine("e1", 3.0, None), COSTS
    )
    fleet = FleetView([_engine("e0", 15.0, 0.25), _engine("e1", 0.0, 0.25)], now=0.0, costs=COSTS)
    assert policy.choose(request, fleet).engine_id == "e1"
    # With the learned slot term the two engines are priced alike and the 992 held tokens keep it on e0.
    fleet = FleetView([_engine("e0", None, None), _engine("e1", None, None)], now=0.0, costs=COSTS)
    assert policy.choose(request, fleet).engine_id == "e0"


@pytest.mark.parametrize("tier", [0, 1, 2])
def test_the_threshold_edge_a_turn_held_at_exactly_the_fraction_keeps_the_learned_slot(tier: int) -> None:
    """250 blocks of 16 = 4,000 of 20,000 tokens = 0.2 of the prompt, in any tier: at below 0.2 the
    turn is not a recompute (held >= the fraction), just above it is; below 1 prices every turn
    (a hit never covers the last token). Catches: <= for <, or a gate that ignores CPU / storage
    hits (a turn the storage pool holds is not a recompute either)."""
    request = _request(250, tier=tier)
    policy = TierCostPolicy()
    assert policy.predict(request, _engine("e0", 15.0, 0.2), COSTS).slot_s == LEARNED_SLOT_S
    assert policy.predict(request, _engine("e0", 15.0, math.nextafter(0.2, 1.0)), COSTS).slot_s == 30.0
    whole = _request(1_250, tier=tier)
    assert policy.predict(whole, _engine("e0", 15.0, 1.0), COSTS) == policy.predict(
        whole, _engine("e0", 15.0, None), COSTS
    )


# ------------------------------------------------------------------ the simulator and the specs


def _ttfts(below: float | None, *, admission_wait: bool = True) -> list[float]:
    config = SimConfig(
        seed=3,
        priority_wait="ahead",
        admission_wait=admission_wait,
        admission_form="ahead",
        admission_recompute_below=below,
    )
    return FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), config).run().ttfts_s


def test_the_gate_in_the_des_prices_every_turn_at_1_and_changes_the_run_below_it() -> None:
    """below 1 gates every turn in (the same run as the ungated admission wait, to the digit); a
    small fraction gates the cached turns out (a different run from both the ungated one and the
    learned slot term alone, since the recomputes still get their admission wait)."""
    ungated = _ttfts(None)
    assert _ttfts(1.0) == ungated
    gated = _ttfts(0.25)
    assert gated != ungated
    assert gated != _ttfts(None, admission_wait=False)


@pytest.mark.parametrize("below", [0.0, -0.1, 1.5, math.nan])
def test_a_threshold_outside_0_1_or_without_the_admission_wait_is_refused(below: float) -> None:
    config = SimConfig(admission_wait=True, admission_recompute_below=below)
    with pytest.raises(ValueError, match=r"admission_recompute_below must be in \(0, 1\]"):
        FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), config)
    with pytest.raises(ValueError, match="set admission_wait too"):
        FleetSimulator(
            _workload(), "tier_cost", _tight_fleet("priority"), SimConfig(admission_recompute_below=0.5)
        )


def test_bench_quality_reads_the_recompute_gate() -> None:
    assert admission_of("priority:20:inf:inf:overtake+admission:ahead:recompute") == (
        "priority:20:inf:inf:overtake",
        "ahead",
        RECOMPUTE_BELOW,
    )
    assert admission_of("priority:20:inf+admission:overtake:recompute:0.5") == (
        "priority:20:inf",
        "overtake",
        0.5,
    )
    assert admission_of("fcfs+admission:reserved:recompute:1") == ("fcfs", "reserved", 1.0)
    for bad, message in (
        ("fcfs+admission:ahead:", "nothing after the last ':'"),
        ("fcfs+admission:ahead:recomp", "only :recompute"),
        ("fcfs+admission:ahead:recompute:", "must be a number"),
        ("fcfs+admission:ahead:recompute:x", "must be a number"),
        ("fcfs+admission:ahead:recompute:0", r"must be in \(0, 1\]"),
        ("fcfs+admission:ahead:recompute:2", r"must be in \(0, 1\]"),
        ("fcfs+admission:recompute", "FORM one of reserved"),
    ):
        with pytest.raises(ValueError, match=message):
            admission_of(bad)


def test_kvroute_sim_refuses_a_gate_without_the_admission_wait_or_out_of_range() -> None:
    for args, message in (
        (["--admission-recompute-below", "0.25"], "add --admission-wait"),
        (["--admission-wait", "--admission-recompute-below", "0"], r"must be in (0, 1]"),
    ):
        assert_sim_refuses(args, message)


def test_the_split_records_what_the_fleet_held_of_each_turn_when_routed() -> None:
    """A first turn can find at most the shared system prefix (400 of 2,000 tokens) held; a later
    turn of a conversation whose history stayed somewhere finds more; recording it changes no
    TTFT. Catches: the fraction read after placement (the turn's own blocks) or from one engine."""
    config = SimConfig(seed=3, split_ttft=True)
    result = FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), config).run()
    assert (
        result.ttfts_s
        == FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), SimConfig(seed=3)).run().ttfts_s
    )
    fractions = {rid: s[SPLIT_CACHED_FRACTION_KEY] for rid, s in result.ttft_split_by_request.items()}
    assert all(0.0 <= f < 1.0 for f in fractions.values())
    first = [f for rid, f in fractions.items() if rid.endswith("#0")]
    later = [f for rid, f in fractions.items() if not rid.endswith("#0")]
    assert len(first) == 24 and max(first) <= 400 / 2_000
    assert max(first) > 0.0  # the system prefix is found once some conversation has run
    assert max(later) > 0.5


def test_split_by_recompute_classes_turns_and_counts_the_tail_in_each() -> None:
    """100 turns at 1..100 s; the 10 longest are recomputes (fraction 0.1), the rest cached (0.9).
    The p99 (99.01 s) leaves one turn above it, a recompute; 70 turns are over 30 s. The edge:
    a turn at exactly the threshold is cached."""
    splits = {
        f"c{i}#1": {"ttft_s": float(i), SPLIT_CACHED_FRACTION_KEY: 0.1 if i > 90 else 0.9}
        for i in range(1, 101)
    }
    splits["c1#1"][SPLIT_CACHED_FRACTION_KEY] = RECOMPUTE_BELOW
    out = split_by_recompute(splits)
    recompute, cached = out["recompute"], out["cached"]
    assert recompute["n"] == 10 and cached["n"] == 90
    assert recompute["mean TTFT s"] == pytest.approx(95.5) and recompute["max TTFT s"] == 100.0
    assert cached["p50 TTFT s"] == pytest.approx(45.5) and cached["max TTFT s"] == 90.0
    assert recompute["of the run's turns above p99"] == 1 and cached["of the run's turns above p99"] == 0
    assert recompute["over 30 s"] == 10 and cached["over 30 s"] == 60
    assert split_by_recompute(splits, below=0.95)["recompute"]["n"] == 100
    empty = split_by_recompute({})["recompute"]
    assert empty["n"] == 0 and math.isnan(empty["mean TTFT s"])
