"""Placement priced by the deadline a priority engine serves by (issue 27, round q12;
``policies.costs.deadline_floor_s``, ``SimConfig.deadline_floor``, ``+floor`` on a scheduling spec).

The diagnosis (docs/results/q12.md): tier_cost prices a turn's wait as the prefill queued on the
engine now (first come) on every engine. On an engine serving the earliest deadline first, a turn
recomputed away from its history gets a late deadline (its long prefill, stretched) and waits for
everything placed before that deadline, while on the engine holding its history it is a short job
served almost at once. So tier_cost moved conversations off their history when the holder's queue was
long, and the moved turns landed in the tail."""

from __future__ import annotations

import math

import pytest

from loadtest.bench_quality import floor_of, hold_of, parse_scheduling
from loadtest.placement_diag import annotate
from policies.base import EngineView, FleetView, PrefixMatch, RouteRequest
from policies.costs import DEADLINE_OFFSET_KEY, EngineCosts, PriorCosts, deadline_floor_s, predict_parts
from policies.tier_cost import TierCostPolicy
from sim.des import FleetSimulator, SimConfig
from sim.engine import EngineProfile
from sim.fleets import EngineSpec, FleetSpec
from sim.workloads import LadderConfig, Workload, ladder_workload
from tests.test_admission_wait import _tight_fleet, _workload

_COSTS = PriorCosts(EngineCosts(prefill_tokens_per_s=10_000.0))


def _offset(stretch: float):  # type: ignore[no-untyped-def]
    """The deadline offset the router sends: stretch x the request's own service (no bound)."""
    return lambda parts: stretch * parts.service_s


def _fleet(floor: bool) -> tuple[RouteRequest, FleetView]:
    """A 20,000-token turn whose history (18,000 tokens) is on e0, behind 30,000 queued tokens;
    e1 holds nothing and has 10,000 queued."""
    request = RouteRequest(
        request_id="c#3",
        prompt_tokens=20_000,
        block_size=1_000,
        block_keys=list(range(20)),
        prefix_matches={"e0": PrefixMatch(18, (18, 0, 0))},
    )
    extra = {DEADLINE_OFFSET_KEY: _offset(20.0)} if floor else {}
    views = [
        EngineView("e0", in_flight=3, queued_prefill_tokens=30_000, extra=dict(extra)),
        EngineView("e1", in_flight=1, queued_prefill_tokens=10_000, extra=dict(extra)),
    ]
    return request, FleetView(views, now=0.0, costs=_COSTS)


def test_first_come_pricing_moves_the_turn_off_its_history_and_the_deadline_floor_keeps_it() -> None:
    """First come, with 60,000 tokens queued on e0: e0 costs 6.0 s wait + 0.2 s service + 0.2 s work,
    e1 1.0 + 2.0 + 2.0 (the recompute): the turn moves to e1. With the floor the move is priced at
    its deadline offset (20 x 2.0 s = 40 s): it stays on e0. The cached turn on e0 is not floored."""
    policy = TierCostPolicy()
    request, fleet = _fleet(floor=False)
    fleet.engines[0].queued_prefill_tokens = 60_000
    decision = policy.choose(request, fleet)
    parts = decision.parts
    assert parts is not None and decision.engine_id == "e1"
    assert parts["e0"].total_s == pytest.approx(6.0 + 0.2) and parts["e1"].total_s == pytest.approx(1.0 + 2.0)
    request, fleet = _fleet(floor=True)
    fleet.engines[0].queued_prefill_tokens = 60_000
    decision = policy.choose(request, fleet)
    assert decision.engine_id == "e0"
    scores = decision.scores
    assert scores["e1"]["cost_s"] == pytest.approx(40.0 + 2.0, abs=0.01)  # floored total + work (+ decode)
    assert scores["e0"]["cost_s"] == pytest.approx(6.2 + 0.2, abs=0.01)  # not a move: first come
    # The parts the router keeps are the first-come ones (calibration, the priority sent).
    assert decision.parts is not None and decision.parts["e1"].total_s == pytest.approx(1.0 + 2.0)


def test_the_floor_prices_only_a_move_to_an_engine_with_a_queue() -> None:
    costs = EngineCosts(prefill_tokens_per_s=10_000.0)
    view = EngineView("e", extra={DEADLINE_OFFSET_KEY: _offset(20.0)})
    queued = predict_parts(costs, (0.0, 0.0, 0.0), 5_000.0, 2_000.0)
    idle = predict_parts(costs, (0.0, 0.0, 0.0), 5_000.0, 0.0)
    assert deadline_floor_s(queued, view, 5_000, 0.9) == pytest.approx(20 * 0.5)
    assert deadline_floor_s(idle, view, 5_000, 0.9) == idle.total_s == pytest.approx(0.5)  # served at once
    assert deadline_floor_s(queued, view, 5_000, 0.1) == queued.total_s  # held nowhere: not a move
    assert deadline_floor_s(queued, EngineView("e"), 5_000, 0.9) == queued.total_s  # no key: first come
    cached_here = predict_parts(costs, (4_000.0, 0.0, 0.0), 1_000.0, 2_000.0)
    assert deadline_floor_s(cached_here, view, 5_000, 0.9) == cached_here.total_s  # it stays: no floor
    long_queue = predict_parts(costs, (0.0, 0.0, 0.0), 5_000.0, 200_000.0)
    assert deadline_floor_s(long_queue, view, 5_000, 0.9) == long_queue.total_s  # never below first come


def test_the_spec_suffix_and_the_des_switch() -> None:
    assert floor_of("priority:20:inf+floor") == ("priority:20:inf", True)
    assert floor_of("priority:20:inf") == ("priority:20:inf", False)
    assert parse_scheduling("priority:20:inf+floor")[:3] == ("priority", 20.0, math.inf)
    assert hold_of("priority:20:inf+floor+hold:0.5").wait_s == 0.5
    with pytest.raises(ValueError, match="the fleet has none"):
        FleetSimulator(_workload(), "tier_cost", _tight_fleet("fcfs"), SimConfig(deadline_floor=True))


def _busy_workload() -> Workload:
    """24 conversations of 6,000-token first prompts on two engines: queues long enough that
    first-come pricing moves turns off their history."""
    return ladder_workload(
        LadderConfig(
            first_prompt_tokens=6_000,
            system_prefix_tokens=400,
            tokens_per_turn=600,
            turns=4,
            answer_min_tokens=40,
            answer_max_tokens=120,
            think_time_mean_s=1.0,
            concurrency=24,
            total_conversations=24,
            block_size=16,
            seed=3,
        )
    )


def _priority_fleet() -> FleetSpec:
    engine = EngineProfile(
        block_size=16, num_gpu_blocks=3_000, num_cpu_blocks=3_000, scheduling_policy="priority"
    )
    return FleetSpec([EngineSpec(f"e{i}", engine) for i in range(2)])


def test_in_virtual_time_the_floor_stops_moves_off_the_history() -> None:
    """The same seeded run on priority engines with and without the floor (true values from the
    placement trace): without it tier_cost moves turns off the engine holding their history, with
    it fewer (4 and 2 here). On the simulator before 2026-12-05, whose CPU tier kept less history
    (it evicted a conversation's first blocks first), the floor left none; two of the histories
    it keeps now are moved off anyway. Catches a floor that changes nothing."""
    moved = {}
    for floor in (False, True):
        result = FleetSimulator(
            _busy_workload(),
            "tier_cost",
            _priority_fleet(),
            SimConfig(seed=3, split_ttft=True, trace_placement=True, deadline_floor=floor),
        ).run()
        records = annotate(result.placement)
        moved[floor] = [r for r in records if r["class"] == "moved off its history"]
        assert all(not math.isnan(r["ttft_s"]) for r in records)
    assert len(moved[False]) >= 2 and len(moved[True]) < len(moved[False])
    # Every move was a recompute where it went (it held less than a quarter of the prompt there).
    assert all(r["recompute"] for r in moved[False])
