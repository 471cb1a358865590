"""Escalation in the simulator (issue 27, round q24): a turn on a priority engine with no first token
``SimConfig.escalate_after_s`` after it arrived is aborted there and sent again at priority 0.
Virtual time, the real DES, engines and policies; a wrapping policy only records each route."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from kvcore.core import ESCALATE_PICKS
from loadtest.bench_quality import Cell, escalate_of, hold_of, parse_scheduling, sim_config
from loadtest.frontier import _beyond_bound
from policies.base import build_policy
from sim.des import ESCALATE_ABORTS, FleetSimulator, SimConfig
from sim.engine import EngineProfile
from sim.fleets import EngineSpec, FleetSpec
from sim.frontend import ServerStage
from sim.workloads import Conversation, Turn, Workload
from tests.test_admission_wait import _tight_fleet, _workload
from tests.test_des_hold import _Recorder
from tests.test_des_hold import _run as _run_with


def _one_at_a_time(engines: int = 1) -> FleetSpec:
    """Priority engines that run one request at a time (``max_num_seqs`` 1): a waiting turn is
    admitted only when the running one finishes, the most urgent first."""
    profile = EngineProfile(block_size=16, num_gpu_blocks=8192, max_num_seqs=1, scheduling_policy="priority")
    return FleetSpec([EngineSpec(f"e{i}", profile) for i in range(engines)])


def _starved() -> Workload:
    """c0 (100 blocks) takes the engine; c1, a long recompute (1,000 blocks, 16,000 tokens: its
    deadline the bound H, 10 s, away), arrives 1 ms later; from 0.04 s on, a short turn (50 blocks,
    ~0.06 s of service, its deadline ~0.7 s away) arrives every 0.04 s for 3 s: a backlog that
    grows, each short turn more urgent than c1."""

    def single(name: str, first_id: int, blocks: int, at_s: float) -> Conversation:
        ids = list(range(first_id, first_id + blocks))
        return Conversation(name, [Turn(blocks * 16, 4, ids, at_s=0.0)], start_s=at_s)

    convs = [single("c0", 10_000, 100, 0.0), single("c1", 20_000, 1_000, 0.001)]
    convs += [single(f"s{i:02d}", 100_000 + 1_000 * i, 50, 0.04 * (i + 1)) for i in range(75)]
    return Workload("starved", 16, convs)


def _run(wl: Workload, fleet: FleetSpec, **config: object) -> tuple[_Recorder, object]:
    """``tests.test_des_hold._run`` with kv_fixed_credit."""
    return _run_with(wl, fleet, "kv_fixed_credit", **config)


@pytest.mark.parametrize("abort", ESCALATE_ABORTS)
def test_a_starved_turn_is_re_sent_at_the_top_and_served_next(abort: str) -> None:
    """Without escalation c1 waits until the short turns stop (each is more urgent when it comes);
    escalated at 1 s it is aborted, routed again on its engine (the only one offered) at 1 s, and
    admitted when the running short turn ends: its first token comes before every short turn that
    arrived after its escalation. Its TTFT counts from its arrival and is recorded under its first
    id; every turn finishes once; the engine counts the abort."""
    wl = _starved()
    _, plain = _run(wl, _one_at_a_time())
    ttfts = plain.ttft_by_request_s  # type: ignore[attr-defined]
    first_token = {rid: wl_start + ttfts[rid] for rid, wl_start in _arrivals(wl).items()}
    assert first_token["c1#0"] > max(t for rid, t in first_token.items() if rid.startswith("s"))
    assert plain.escalations == 0  # type: ignore[attr-defined]

    recorder, run = _run(wl, _one_at_a_time(), escalate_after_s=1.0, escalate_abort=abort)
    routes = [(rid, t, engines) for rid, t, engines in recorder.routes if rid.startswith("c1")]
    assert [rid for rid, _, _ in routes] == ["c1#0", "c1#0!1"]
    assert routes[1][1] == pytest.approx(0.001 + 1.0) and routes[1][2] == ("e0",)
    ttfts = run.ttft_by_request_s  # type: ignore[attr-defined]
    assert sorted(ttfts) == sorted(_arrivals(wl))  # every turn once, under its first id
    first_token = {rid: at + ttfts[rid] for rid, at in _arrivals(wl).items()}
    after = [rid for rid, at in _arrivals(wl).items() if rid.startswith("s") and at > 1.001]
    assert after and all(first_token["c1#0"] < first_token[rid] for rid in after)
    # Served next: after the short turn running at 1 s (~0.06 s) and its own ~0.8 s of prefill.
    assert first_token["c1#0"] < 1.001 + 0.1 + 0.9
    # Only turns with no first token 1 s after they arrived were escalated (the backlog's too), once.
    resent = [rid.partition("!")[0] for rid, _, _ in recorder.routes if "!" in rid]
    assert len(resent) == len(set(resent)) == run.escalations  # type: ignore[attr-defined]
    assert all(ttfts[rid] > 1.0 for rid in resent)
    assert run.requests == len(wl.conversations)  # type: ignore[attr-defined]
    assert ttfts["c1#0"] < plain.ttft_by_request_s["c1#0"]  # type: ignore[attr-defined]


def test_escalated_to_another_engine_the_policy_routes_it_among_all() -> None:
    """PICK route: the re-sent turn is offered every engine (the policy chooses again)."""
    recorder, run = _run(_starved(), _one_at_a_time(engines=2), escalate_after_s=0.05, escalate_pick="route")
    resent = [engines for rid, _, engines in recorder.routes if "!" in rid]
    assert resent and all(engines == ("e0", "e1") for engines in resent)
    assert run.escalations == len(resent)  # type: ignore[attr-defined]
    assert run.requests == len(_starved().conversations)  # type: ignore[attr-defined]


def test_an_escalation_that_never_fires_is_the_run_without_it() -> None:
    """E longer than any wait: nothing is escalated and the run is the one without it to the digit."""
    fleet = _tight_fleet("priority")
    plain = FleetSimulator(_workload(), "tier_cost", fleet, SimConfig(seed=3)).run()
    for pick in ESCALATE_PICKS:
        config = SimConfig(seed=3, escalate_after_s=1e6, escalate_pick=pick)
        run = FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), config).run()
        assert run.escalations == 0
        assert run.ttft_by_request_s == plain.ttft_by_request_s and run.hit == plain.hit


@pytest.mark.parametrize("abort", ESCALATE_ABORTS)
def test_escalation_on_a_busy_fleet_keeps_every_turn_and_its_id(abort: str) -> None:
    """A short E on the tight fleet escalates several turns: each turn still ends once and keeps its
    first id, and each first request is aborted by its engine (at once, or at its first token)."""
    config = SimConfig(seed=3, escalate_after_s=0.05, escalate_abort=abort)
    sim = FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), config)
    run = sim.run()
    plain = FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), SimConfig(seed=3)).run()
    assert run.escalations > 3
    assert sorted(run.ttft_by_request_s) == sorted(plain.ttft_by_request_s)
    assert run.requests == plain.requests
    assert sum(c.stats().num_aborted for c in sim.cores) == run.escalations


def _arrivals(wl: Workload) -> dict[str, float]:
    return {f"{c.conversation_id}#0": c.start_s for c in wl.conversations}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"escalate_after_s": 0.0}, "escalate_after_s must be > 0 seconds"),
        ({"escalate_after_s": math.nan}, "escalate_after_s must be > 0 seconds"),
        (
            {"escalate_after_s": 1.0, "escalate_pick": "far"},
            "escalate_pick 'far' is unknown; accepted: same, route",
        ),
    ],
)
def test_the_simulator_refuses_a_bad_escalation(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), SimConfig(**config))  # type: ignore[arg-type]


def test_escalation_is_refused_without_priority_engines_or_with_server_stages() -> None:
    with pytest.raises(ValueError, match="the fleet has no priority engine"):
        FleetSimulator(_workload(), "tier_cost", _tight_fleet("fcfs"), SimConfig(escalate_after_s=1.0))
    fleet = dataclasses.replace(_tight_fleet("priority"), api_server=ServerStage())
    with pytest.raises(ValueError, match="escalate_after_s needs a fleet without server stages"):
        FleetSimulator(_workload(), "tier_cost", fleet, SimConfig(escalate_after_s=1.0))


def test_bench_quality_reads_the_escalation() -> None:
    assert escalate_of("priority:20:inf") == ("priority:20:inf", None, "same", "now")
    assert escalate_of("priority:20:inf+escalate:50") == ("priority:20:inf", 50.0, "same", "now")
    assert escalate_of("priority:20:40+escalate:30:route+hold:2") == (
        "priority:20:40+hold:2",
        30.0,
        "route",
        "now",
    )
    assert escalate_of("priority:20:40+escalate:30:same:first_token").abort == "first_token"
    assert parse_scheduling("priority:20:40+escalate:30") == ("priority", 20.0, 40.0, math.inf, "all")
    assert hold_of("priority:20:40+escalate:30+hold:2").wait_s == 2.0
    cell = Cell("b1", "none", "tier_cost", 1, scheduling="priority:20:40+escalate:30:route")
    config = sim_config(cell)
    assert (config.escalate_after_s, config.escalate_pick, config.escalate_abort) == (
        30.0,
        "route",
        "now",
    )
    assert sim_config(dataclasses.replace(cell, scheduling="priority:20:40")).escalate_after_s is None


@pytest.mark.parametrize(
    "spec",
    [
        "fcfs+escalate:30",
        "priority+escalate",
        "priority+escalate:",
        "priority+escalate:0",
        "priority+escalate:-1",
        "priority+escalate:inf",
        "priority+escalate:x",
        "priority+escalate:30:far",
        "priority+escalate:30:same:later",
        "priority+escalate:30:same:now:more",
    ],
)
def test_bench_quality_refuses_a_bad_escalation(spec: str) -> None:
    with pytest.raises(ValueError, match=r"\+escalate:E\[:PICK\[:ABORT\]\]"):
        escalate_of(spec)


def test_the_frontier_tells_points_apart_by_their_suffixes() -> None:
    """A point's row shows what its spec sets past S:H, suffixes included (``+floor`` and
    ``+escalate`` were dropped before round q24: two points read as one)."""
    assert _beyond_bound("priority:20:inf") == ""
    assert _beyond_bound("priority:20:inf:2") == " (+ :2)"
    assert _beyond_bound("priority:20:inf+escalate:50") == " (+ +escalate:50)"
    assert _beyond_bound("priority:20:30+floor") == " (+ +floor)"


def test_an_escalated_turns_first_request_stays_queued_until_its_first_token() -> None:
    """ABORT first_token (a server that finds the closed connection only when it writes): c1's
    first request stays in the engine after its
    escalation, is admitted after the short turns (its priority is the latest), produces a token and
    is aborted then; with ABORT now it is gone at once. Either way one abort, and the turn's own
    first token is the re-sent request's."""
    aborted_at: dict[str, float] = {}
    for abort in ESCALATE_ABORTS:
        sim = FleetSimulator(
            _starved(),
            build_policy("kv_fixed_credit", {}),
            _one_at_a_time(),
            SimConfig(seed=1, calibrate=False, escalate_after_s=1.0, escalate_abort=abort),
        )
        core = sim.cores[0]
        original = core.abort_request

        def spy(request_id: str, core=core, original=original, abort=abort) -> None:
            if request_id == "c1#0":
                aborted_at[abort] = core.now_s
            original(request_id)

        core.abort_request = spy  # type: ignore[method-assign]
        run = sim.run()
        assert core.stats().num_aborted == run.escalations
    # At the escalation (the engine's clock: the step under way).
    assert aborted_at["now"] == pytest.approx(1.001, abs=0.1)
    assert aborted_at["first_token"] > 3.0  # after the 3 s of short turns ahead of its priority


def test_the_simulator_refuses_an_unknown_abort() -> None:
    with pytest.raises(ValueError, match="escalate_abort 'later' is unknown; accepted: now, first_token"):
        FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), SimConfig(escalate_abort="later"))


def test_the_placement_trace_records_an_escalated_re_send_under_its_turn() -> None:
    """``SimConfig.trace_placement`` with escalation (round q28's diagnosis): each re-send is one
    more record, its request id the turn's with "!N", its turn number the turn's (the tracer used to
    fail on the suffix), and the run routes as without the trace."""
    config: dict[str, Any] = {"escalate_after_s": 0.05, "escalate_pick": "route"}
    plain = FleetSimulator(
        _starved(), "kv_fixed_credit", _one_at_a_time(engines=2), SimConfig(**config)
    ).run()
    traced = FleetSimulator(
        _starved(), "kv_fixed_credit", _one_at_a_time(engines=2), SimConfig(trace_placement=True, **config)
    ).run()
    resent = [r for r in traced.placement if "!" in r["rid"]]
    assert resent and len(resent) == traced.escalations == plain.escalations
    assert all(r["turn"] == 0 and r["rid"].partition("!")[0] == r["conv"] + "#0" for r in resent)
    assert traced.ttft_by_request_s == plain.ttft_by_request_s


def test_escalated_elsewhere_the_policy_routes_it_among_the_other_engines() -> None:
    """PICK other: the re-sent turn is offered every engine but the one it was on (read from the
    placement trace: an engine not offered has no prediction); with one engine it goes back to
    that one (the only one there is)."""
    config = SimConfig(escalate_after_s=0.05, escalate_pick="other", trace_placement=True)
    run = FleetSimulator(_starved(), "kv_fixed_credit", _one_at_a_time(engines=3), config).run()
    on = {r["rid"]: r["engine"] for r in run.placement}
    resent = [r for r in run.placement if "!" in r["rid"]]
    assert resent and run.escalations == len(resent)
    for r in resent:
        offered = [
            e for e, pred in zip(("e0", "e1", "e2"), r["pred_total_s"], strict=True) if not math.isnan(pred)
        ]
        before = on[r["rid"].rpartition("!")[0]] if r["rid"].count("!") == 1 else None
        if before is not None:
            assert before not in offered and len(offered) == 2, (r["rid"], before, offered)
        assert r["engine"] in offered
    assert run.requests == len(_starved().conversations)
    recorder, run = _run(_starved(), _one_at_a_time(engines=1), escalate_after_s=0.05, escalate_pick="other")
    resent_to = [engines for rid, _, engines in recorder.routes if "!" in rid]
    assert resent_to and all(engines == ("e0",) for engines in resent_to)
