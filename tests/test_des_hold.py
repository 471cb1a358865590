"""Late binding in the simulator (issue 27, round q10): the router holds turns in one queue while
no engine has room (``policies.costs.has_room``) and routes them when one has. Virtual time, the
real DES, engines and policies; a wrapping policy only records when and among which engines each
turn was routed."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvcore.core import HOLD_ORDERS, HOLD_PICKS, PRIORITY_RECOMPUTE_BELOW, hold_parts
from loadtest.bench_quality import Cell, Hold, hold_of, parse_scheduling, run_cell
from policies.base import Decision, EngineView, FleetView, PrefixMatch, RouteRequest, build_policy
from policies.costs import EngineCosts, PriorCosts, has_room, predict_parts, queue_wait_s
from sim.des import FleetSimulator, SimConfig
from sim.engine import EngineProfile
from sim.fleets import EngineSpec, FleetSpec
from sim.frontend import ServerStage
from sim.workloads import Conversation, Turn, Workload
from tests.test_admission_wait import _tight_fleet, _workload
from tests.test_sim_cli import assert_sim_refuses


class _Recorder:
    """A real policy that also records (request id, virtual time, engines offered) per route."""

    def __init__(self, name: str = "least_loaded") -> None:
        self.inner = build_policy(name, {})
        self.name = self.inner.name
        self.uses_index = self.inner.uses_index
        self.routes: list[tuple[str, float, tuple[str, ...]]] = []

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        self.routes.append((request.request_id, fleet.now, tuple(e.engine_id for e in fleet.engines)))
        return self.inner.choose(request, fleet)

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        self.inner.on_routed(request, decision)

    def on_finished(self, request: RouteRequest, engine_id: str, ok: bool) -> None:
        self.inner.on_finished(request, engine_id, ok)


def _one_engine() -> FleetSpec:
    return FleetSpec([EngineSpec("e0", EngineProfile(block_size=16, num_gpu_blocks=4096))])


def _single_turns(*blocks: int) -> Workload:
    """Open loop: one single-turn conversation per entry, ``blocks[i]`` 16-token blocks of its own,
    arriving 1 ms apart (c0 first)."""
    convs = []
    for i, n in enumerate(blocks):
        ids = list(range(10_000 * (i + 1), 10_000 * (i + 1) + n))
        convs.append(Conversation(f"c{i}", [Turn(n * 16, 4, ids, at_s=0.0)], start_s=0.001 * i))
    return Workload("singles", 16, convs)


def _run(
    wl: Workload, fleet: FleetSpec, policy: str = "least_loaded", **config: object
) -> tuple[_Recorder, object]:
    recorder = _Recorder(policy)
    sim = FleetSimulator(wl, recorder, fleet, SimConfig(seed=1, calibrate=False, **config))  # type: ignore[arg-type]
    return recorder, sim.run()


# ------------------------------------------------------------------------------ the room rule


def test_the_room_rule_is_the_priced_wait_below_w() -> None:
    """The wait is predict_parts' wait + slot part of a new turn (queued prefill at the prefill
    rate, in flight x slot seconds), the rule strict; an idle engine always has room."""
    costs = EngineCosts(prefill_tokens_per_s=1_000.0, slot_s_per_request=0.25)
    busy = EngineView("e", in_flight=4, queued_prefill_tokens=1_500)
    parts = predict_parts(costs, (0.0, 0.0, 0.0), 0.0, 1_500.0, 4.0)
    assert queue_wait_s(costs, busy) == parts.wait_s + parts.slot_s == 2.5
    assert not has_room(costs, busy, 2.5) and has_room(costs, busy, 2.5001)
    # Scraped waiting requests the router did not send count at its mean queued size.
    assert queue_wait_s(costs, dataclasses.replace(busy, num_requests_waiting=6)) == 6 * 375 / 1_000 + 1.0
    assert has_room(costs, EngineView("idle", num_requests_waiting=3), 1e-9)


def test_hold_parts_price_the_turn_where_its_own_service_is_shortest() -> None:
    """No queue, the engine holding most of the prompt: its deadline before it is bound."""
    request = RouteRequest(
        "r",
        prompt_tokens=1_600,
        block_size=16,
        prefix_matches={
            "a": PrefixMatch(blocks=10, blocks_by_tier=(10, 0, 0)),
            "b": PrefixMatch(80, (80, 0, 0)),
        },
    )
    parts = hold_parts(request, PriorCosts(EngineCosts(prefill_tokens_per_s=1_000.0)), ["a", "b", "c"])
    assert parts.wait_s == parts.slot_s == 0.0
    assert parts.prefill_tokens == 1_600 - 80 * 16 and parts.total_s == parts.service_s == 0.32


# ----------------------------------------------------------------------------------- the DES


def test_a_turn_arriving_to_a_busy_fleet_is_held_and_routed_at_the_first_room() -> None:
    """c0 takes the idle engine; c1 arrives while c0's prefill is queued (no room below W) and is
    routed when c0's first token empties the queue, not when it arrives. Without the hold both are
    routed on arrival."""
    wl = _single_turns(100, 100)
    plain, plain_result = _run(wl, _one_engine())
    assert [(rid, t) for rid, t, _ in plain.routes] == [("c0#0", 0.0), ("c1#0", 0.001)]
    held, result = _run(wl, _one_engine(), hold_wait_s=0.01)
    first_token_s = result.ttft_by_request_s["c0#0"]  # type: ignore[attr-defined]
    assert [(rid, t) for rid, t, _ in held.routes] == [("c0#0", 0.0), ("c1#0", first_token_s)]
    # One engine: c1 would have waited behind c0's prefill anyway, so its TTFT, counted from its
    # arrival, is the unheld run's (counted from its release it would be ~c0's TTFT shorter).
    assert result.ttft_by_request_s == plain_result.ttft_by_request_s  # type: ignore[attr-defined]
    assert result.ttft_by_request_s["c1#0"] > first_token_s  # type: ignore[attr-defined]


@pytest.mark.parametrize("order", HOLD_ORDERS)
def test_the_priority_order_releases_the_earlier_deadline_first(order: str) -> None:
    """c1 (a long prompt, a late deadline) and c2 (short, early) both wait behind c0: fcfs releases
    c1 first, priority c2 (though it arrived later); each when the engine has room again."""
    recorder, result = _run(_single_turns(100, 1_200, 20), _one_engine(), hold_wait_s=0.01, hold_order=order)
    order_routed = [rid for rid, _, _ in recorder.routes]
    expected = ["c0#0", "c1#0", "c2#0"] if order == "fcfs" else ["c0#0", "c2#0", "c1#0"]
    assert order_routed == expected
    times = [t for _, t, _ in recorder.routes]
    assert times == sorted(times) and times[1] > 0.002 and times[2] > times[1]
    assert sorted(result.ttft_by_request_s) == ["c0#0", "c1#0", "c2#0"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
@pytest.mark.parametrize(("order", "pick"), [("fcfs", "all"), ("priority", "room")])
def test_every_turn_is_routed_and_finishes_once(scheduling: str, order: str, pick: str) -> None:
    """A busy closed-loop run (KV-tight engines, W small enough that turns are held): every turn of
    the workload is routed once and finishes once, none refused; with PICK room the policy is
    offered only the engines with room at some releases, with PICK all always every engine."""
    wl = _workload()
    recorder = _Recorder()
    config = SimConfig(seed=3, hold_wait_s=0.05, hold_order=order, hold_pick=pick)
    result = FleetSimulator(wl, recorder, _tight_fleet(scheduling), config).run()  # type: ignore[arg-type]
    ids = [rid for rid, _, _ in recorder.routes]
    expected = {f"{c.conversation_id}#{k}" for c in wl.conversations for k in range(len(c.turns))}
    assert len(ids) == len(set(ids)) == wl.num_requests and set(ids) == expected
    assert result.requests == wl.num_requests and result.rejected == 0
    assert set(result.ttft_by_request_s) == expected and len(result.ttfts_s) == wl.num_requests
    offered = {len(engines) for _, _, engines in recorder.routes}
    assert offered == ({1, 2} if pick == "room" else {2})
    plain = FleetSimulator(wl, "least_loaded", _tight_fleet(scheduling), SimConfig(seed=3)).run()
    assert result.ttft_by_request_s != plain.ttft_by_request_s  # the hold did hold


def test_a_recompute_only_hold_lets_a_cached_turn_past_the_held_recompute() -> None:
    """c0 warms the engine with prompt X; c1 (a long recompute) fills it; c2 (a recompute) arrives to
    a busy fleet and is held; c3 resends X (cached): with ``hold_recompute_below`` it is routed the
    moment it arrives, past c2; without it, it waits in the queue behind c2."""
    warm = _single_turns(100)
    t0 = _run(warm, _one_engine())[1].ttft_by_request_s["c0#0"]  # type: ignore[attr-defined]
    x = warm.conversations[0].turns[0].block_ids

    def turn(name: str, ids: list[int], at_s: float) -> Conversation:
        return Conversation(name, [Turn(len(ids) * 16, 4, ids, at_s=0.0)], start_s=at_s)

    arrive = t0 + 0.05
    wl = Workload(
        "cached past recompute",
        16,
        [
            turn("c0", x, 0.0),
            turn("c1", list(range(50_000, 51_200)), arrive),
            turn("c2", list(range(60_000, 60_300)), arrive + 0.001),
            turn("c3", x, arrive + 0.002),
        ],
    )
    gated, _ = _run(wl, _one_engine(), hold_wait_s=0.01, hold_recompute_below=PRIORITY_RECOMPUTE_BELOW)
    routed = {rid: t for rid, t, _ in gated.routes}
    assert routed["c1#0"] == arrive and routed["c3#0"] == arrive + 0.002
    assert routed["c2#0"] > routed["c3#0"]  # the recompute was held
    every, _ = _run(wl, _one_engine(), hold_wait_s=0.01)
    order = [rid for rid, _, _ in every.routes]
    assert (
        order.index("c2#0") < order.index("c3#0")
        and dict((rid, t) for rid, t, _ in every.routes)["c3#0"] > arrive + 0.002
    )


def test_the_hold_bound_routes_a_turn_held_that_long_room_or_not() -> None:
    """c1 and c2 wait behind c0 on one engine; with a bound shorter than c0's TTFT each is routed
    exactly the bound after it arrived (no room yet), without it at c0's first token; every turn
    finishes once either way."""
    wl = _single_turns(400, 100, 100)
    plain, first = _run(wl, _one_engine(), hold_wait_s=0.01)
    t0 = first.ttft_by_request_s["c0#0"]  # type: ignore[attr-defined]
    assert [t for _, t, _ in plain.routes][1] == t0
    bound = t0 / 4
    bounded, result = _run(wl, _one_engine(), hold_wait_s=0.01, hold_max_s=bound)
    routed = {rid: t for rid, t, _ in bounded.routes}
    assert routed["c1#0"] == pytest.approx(0.001 + bound) and routed["c2#0"] == pytest.approx(0.002 + bound)
    assert len(bounded.routes) == 3
    assert sorted(result.ttft_by_request_s) == ["c0#0", "c1#0", "c2#0"]  # type: ignore[attr-defined]


def test_a_held_turn_released_at_its_bound_keeps_its_place_with_an_aged_deadline() -> None:
    """One priority engine (deadline bound H 1 s): c1 (a long recompute) takes it; c2 (a recompute)
    arrives to the busy fleet, is held and routed at its bound M 0.5 s onto the busy engine; c3
    (cached: c0's prompt plus 480 new tokens) arrives after that and is routed on arrival past the
    hold (``hold_recompute_below``). c3's deadline (its arrival + 20 x its 22 ms of prefill, ~1.47 s)
    lies after c2's counted from c2's arrival (~1.28 s) and before c2's counted from its release
    (~1.78 s). Without ``hold_aged`` c2's deadline counts from its release, and c3 overtakes it on
    the engine (its first token comes first); with it, c2 is served first."""

    def fleet() -> FleetSpec:
        profile = EngineProfile(block_size=16, num_gpu_blocks=8192, scheduling_policy="priority")
        return FleetSpec([EngineSpec("e0", profile)])

    warm = _single_turns(100)
    t0 = _run(warm, fleet())[1].ttft_by_request_s["c0#0"]  # type: ignore[attr-defined]
    x = warm.conversations[0].turns[0].block_ids

    def turn(name: str, ids: list[int], at_s: float) -> Conversation:
        return Conversation(name, [Turn(len(ids) * 16, 4, ids, at_s=0.0)], start_s=at_s)

    arrive = {"c0": 0.0, "c1": t0 + 0.2, "c2": t0 + 0.201, "c3": t0 + 0.951}
    wl = Workload(
        "aged",
        16,
        [
            turn("c0", x, arrive["c0"]),
            turn("c1", list(range(50_000, 52_750)), arrive["c1"]),  # 44,000 tokens, ~2 s of prefill
            turn("c2", list(range(60_000, 60_300)), arrive["c2"]),
            turn("c3", x + list(range(70_000, 70_030)), arrive["c3"]),
        ],
    )
    config = {
        "hold_wait_s": 0.01,
        "hold_recompute_below": PRIORITY_RECOMPUTE_BELOW,
        "hold_max_s": 0.5,
        "priority_max_overtake_s": 1.0,
    }
    first_token: dict[bool, dict[str, float]] = {}
    for aged in (False, True):
        recorder, result = _run(wl, fleet(), "kv_fixed_credit", hold_aged=aged, **config)
        routed = {rid: t for rid, t, _ in recorder.routes}
        assert routed["c2#0"] == pytest.approx(arrive["c2"] + 0.5)  # at its bound, not at a room
        assert routed["c3#0"] == arrive["c3"] > routed["c2#0"]  # on arrival, after c2 was routed
        ttfts = result.ttft_by_request_s  # type: ignore[attr-defined]
        first_token[aged] = {rid[:2]: arrive[rid[:2]] + ttft for rid, ttft in ttfts.items()}
        assert first_token[aged]["c1"] > routed["c3#0"]  # c1's prefill still ran when both waited
    assert first_token[False]["c3"] < first_token[False]["c2"]  # overtaken: deadline from release
    assert first_token[True]["c2"] < first_token[True]["c3"]  # keeps its place: from arrival
    assert first_token[True]["c2"] < first_token[False]["c2"]


def test_a_hold_that_never_binds_is_the_run_without_it() -> None:
    """W = inf: every engine always has room, so no turn is held: the run is the one without the
    hold to the digit (the arrival path is unchanged), in each order and pick, aged or not (a turn
    routed on arrival has the same deadline either way)."""
    fleet = _tight_fleet("priority")
    plain = FleetSimulator(_workload(), "tier_cost", fleet, SimConfig(seed=3)).run()
    for order in HOLD_ORDERS:
        for pick in HOLD_PICKS:
            for aged in (False, True):
                config = SimConfig(
                    seed=3, hold_wait_s=math.inf, hold_order=order, hold_pick=pick, hold_aged=aged
                )
                run = FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), config).run()
                assert run.ttft_by_request_s == plain.ttft_by_request_s and run.hit == plain.hit


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hold_wait_s": 0.0}, "hold_wait_s must be > 0 seconds"),
        ({"hold_wait_s": -1.0}, "hold_wait_s must be > 0 seconds"),
        ({"hold_wait_s": math.nan}, "hold_wait_s must be > 0 seconds"),
        (
            {"hold_wait_s": 1.0, "hold_order": "lifo"},
            "hold_order 'lifo' is unknown; accepted: fcfs, priority",
        ),
        ({"hold_wait_s": 1.0, "hold_pick": "best"}, "hold_pick 'best' is unknown; accepted: all, room"),
        ({"hold_order": "priority"}, "set hold_wait_s too"),
        ({"hold_pick": "room"}, "set hold_wait_s too"),
        ({"hold_recompute_below": 0.25}, "set hold_wait_s too"),
        ({"hold_max_s": 10.0}, "set hold_wait_s too"),
        ({"hold_aged": True}, "hold_aged order, route, pick, bound and age held turns: set hold_wait_s too"),
        ({"hold_wait_s": 1.0, "hold_max_s": 0.0}, "hold_max_s must be > 0 seconds"),
        ({"hold_wait_s": 1.0, "hold_recompute_below": 1.5}, "hold_recompute_below must be in \\(0, 1\\]"),
    ],
)
def test_the_simulator_refuses_a_bad_hold(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetSimulator(_workload(), "tier_cost", _tight_fleet(), SimConfig(**config))  # type: ignore[arg-type]


def test_an_aged_hold_is_refused_without_priority_engines() -> None:
    with pytest.raises(
        ValueError, match="hold_aged ages the priority sent to priority engines: the fleet has none"
    ):
        FleetSimulator(
            _workload(), "tier_cost", _tight_fleet("fcfs"), SimConfig(hold_wait_s=1.0, hold_aged=True)
        )


def test_the_hold_is_refused_on_a_server_staged_fleet() -> None:
    fleet = dataclasses.replace(_tight_fleet(), api_server=ServerStage())
    with pytest.raises(ValueError, match="hold_wait_s needs a fleet without server stages"):
        FleetSimulator(_workload(), "tier_cost", fleet, SimConfig(hold_wait_s=1.0))


# ------------------------------------------------------------------------------ the specs


def test_bench_quality_reads_the_hold() -> None:
    assert hold_of("priority:20:inf:inf:overtake") == Hold("priority:20:inf:inf:overtake")
    assert hold_of("fcfs+hold:2") == Hold("fcfs", 2.0, "fcfs", "all")
    assert hold_of("priority:10:inf:inf:ahead+admission+hold:0.5:priority:room") == Hold(
        "priority:10:inf:inf:ahead+admission", 0.5, "priority", "room"
    )
    assert hold_of("fcfs+hold:2:fcfs:all:recompute") == Hold(
        "fcfs", 2.0, "fcfs", "all", PRIORITY_RECOMPUTE_BELOW
    )
    assert hold_of("fcfs+hold:2:priority:all:recompute:0.5").recompute_below == 0.5
    assert hold_of("fcfs+hold:2:fcfs:all:recompute:max:15") == Hold(
        "fcfs", 2.0, "fcfs", "all", PRIORITY_RECOMPUTE_BELOW, 15.0
    )
    assert hold_of("fcfs+hold:2:fcfs:all:max:15") == Hold("fcfs", 2.0, "fcfs", "all", None, 15.0)
    assert hold_of("priority+hold:0.5:fcfs:all:recompute:max:20:aged") == Hold(
        "priority", 0.5, "fcfs", "all", PRIORITY_RECOMPUTE_BELOW, 20.0, True
    )
    assert hold_of("priority+hold:0.5:fcfs:all:aged") == Hold("priority", 0.5, "fcfs", "all", aged=True)
    assert hold_of("priority+hold:0.5:fcfs:all:recompute:0.5:aged").recompute_below == 0.5
    assert not hold_of("priority+hold:0.5:fcfs:all:recompute:max:20").aged
    assert parse_scheduling("priority:20:40:inf:overtake+hold:2:priority") == (
        "priority",
        20.0,
        40.0,
        math.inf,
        "overtake",
    )
    for bad, message in (
        ("fcfs+hold", "end it in \\+hold:W"),
        ("fcfs+hold:", "W, X and M must be numbers"),
        ("fcfs+hold:x", "W, X and M must be numbers"),
        ("fcfs+hold:0", "the hold's W must be > 0 seconds"),
        ("fcfs+hold:nan", "the hold's W must be > 0 seconds"),
        ("fcfs+hold:1:lifo", "ORDER one of fcfs, priority"),
        ("fcfs+hold:1:fcfs:best", "PICK one of all, room"),
        ("fcfs+hold:1:fcfs:all:x", "end it in \\+hold:W"),
        ("fcfs+hold:1:fcfs:all:recompute:x", "W, X and M must be numbers"),
        ("fcfs+hold:1:fcfs:all:max:x", "W, X and M must be numbers"),
        ("fcfs+hold:1:fcfs:all:max:0", "the hold's bound M must be > 0 seconds"),
        ("fcfs+hold:1:fcfs:all:max", "end it in \\+hold:W"),
        ("fcfs+hold:1:fcfs:all:recompute:0", "the hold's recompute fraction X must be in \\(0, 1\\]"),
        ("fcfs+hold:1:fcfs:all:recompute:0.5:1", "end it in \\+hold:W"),
        ("fcfs+hold:1:fcfs:all:aged:max:3", "end it in \\+hold:W.*\\[:aged\\]"),
        ("fcfs+hold:1:fcfs:all:aged:aged", "end it in \\+hold:W"),
        ("fcfs+hold:1:aged", "ORDER one of fcfs, priority"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_scheduling(bad)


def test_the_spec_reaches_the_bench_run() -> None:
    """``+hold:inf`` is the run without it; a small W is not; the order and ``:aged`` reach the run."""
    base = Cell("t", "none", "tier_cost", seed=3, concurrency=32, conversations=1.0, block_size=256)

    def ttfts(spec: str) -> object:
        return run_cell(dataclasses.replace(base, scheduling=spec))["ttft_by_request_s"]

    plain = ttfts("priority:1000:inf")
    assert ttfts("priority:1000:inf+hold:inf:priority:room") == plain
    fcfs_held = ttfts("priority:1000:inf+hold:0.05")
    assert fcfs_held != plain
    assert ttfts("priority:1000:inf+hold:0.05:priority") not in (plain, fcfs_held)
    # Aged: busier (96 conversations), so that a held turn meets earlier deadlines on its engine.
    busy = dataclasses.replace(base, concurrency=96, scheduling="priority:20:inf+hold:0.05:fcfs:all")
    aged = dataclasses.replace(busy, scheduling=busy.scheduling + ":aged")
    assert run_cell(busy)["ttft_by_request_s"] != run_cell(aged)["ttft_by_request_s"]


def test_kvroute_sim_refuses_a_bad_hold() -> None:
    for args, message in (
        (["--hold-wait-s", "0"], "--hold-wait-s must be > 0 seconds"),
        (
            ["--hold-order", "priority"],
            "--hold-order, --hold-pick, --hold-recompute-below, --hold-max-s and --hold-aged order, route,",
        ),
        (["--hold-aged"], "set --hold-wait-s too"),
        (["--hold-wait-s", "1", "--hold-recompute-below", "0"], "--hold-recompute-below must be in"),
    ):
        assert_sim_refuses(args, message)
