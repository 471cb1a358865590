"""kv_fixed_credit and approx_prefix on hand-built fleets and requests."""

from __future__ import annotations

import pytest

from kvcore.keys import block_keys
from policies.approx_prefix import ApproxPrefixPolicy
from policies.base import Decision, EngineView, FleetView, PrefixMatch, RouteRequest, build_policy

BLOCK = 16


def req(
    keys: list[int], request_id: str = "r", matches: dict[str, PrefixMatch] | None = None
) -> RouteRequest:
    return RouteRequest(
        request_id=request_id,
        prompt_tokens=len(keys) * BLOCK,
        block_keys=tuple(keys),
        block_size=BLOCK,
        prefix_matches=matches or {},
    )


# -- kv_fixed_credit ---------------------------------------------------------------------------


def test_fixed_credit_picks_by_credits() -> None:
    policy = build_policy("kv_fixed_credit")
    keys = list(range(100))
    fleet = FleetView([EngineView("g"), EngineView("c"), EngineView("s")])
    # 50 GPU blocks (credit 50) beat 60 CPU blocks (48) and 100 STORAGE blocks (30).
    matches = {
        "g": PrefixMatch(50, (50, 0, 0)),
        "c": PrefixMatch(60, (0, 60, 0)),
        "s": PrefixMatch(100, (0, 0, 100)),
    }
    decision = policy.choose(req(keys, matches=matches), fleet)
    assert decision.engine_id == "g"
    assert decision.scores["c"]["credited_blocks"] == pytest.approx(48.0)
    assert decision.scores["s"]["cost_blocks"] == pytest.approx(70.0)
    assert decision.fallbacks == ("c", "s")
    # 70 CPU blocks (56) now beat 50 GPU blocks.
    matches["c"] = PrefixMatch(70, (0, 70, 0))
    assert policy.choose(req(keys, matches=matches), fleet).engine_id == "c"


def test_fixed_credit_configurable_and_load_term() -> None:
    policy = build_policy("kv_fixed_credit", {"credits": {"STORAGE": 0.9}, "decode_blocks_per_request": 4})
    keys = list(range(100))
    fleet = FleetView([EngineView("g", in_flight=0), EngineView("s", in_flight=0)])
    matches = {"g": PrefixMatch(50, (50, 0, 0)), "s": PrefixMatch(100, (0, 0, 100))}
    assert policy.choose(req(keys, matches=matches), fleet).engine_id == "s"
    # 11 in flight on s: 4 x 11 = 44 load blocks outweigh the 40-block credit advantage.
    busy = FleetView([EngineView("g", in_flight=0), EngineView("s", in_flight=11)])
    decision = policy.choose(req(keys, matches=matches), busy)
    assert decision.engine_id == "g"
    assert decision.scores["s"]["load_blocks"] == 44
    with pytest.raises(ValueError, match="unknown tier"):
        build_policy("kv_fixed_credit", {"credits": {"disk": 0.2}})


# -- approx_prefix -----------------------------------------------------------------------------


def approx(params: dict[str, float] | None = None) -> ApproxPrefixPolicy:
    policy = build_policy("approx_prefix", params)
    assert isinstance(policy, ApproxPrefixPolicy)
    return policy


def route(policy, request: RouteRequest, fleet: FleetView) -> Decision:  # type: ignore[no-untyped-def]
    decision = policy.choose(request, fleet)
    policy.on_routed(request, decision)
    return decision


def conversation_keys(turn_tokens: list[int]) -> list[int]:
    return block_keys(turn_tokens, BLOCK)


def test_second_turn_goes_where_the_first_went() -> None:
    policy = approx()
    assert policy.uses_index is False
    fleet = FleetView([EngineView(f"e{i}") for i in range(4)], now=0.0)
    firsts = {}
    for conv in range(8):
        tokens = [conv * 100_000 + t for t in range(320)]
        firsts[conv] = (tokens, route(policy, req(conversation_keys(tokens), f"c{conv}t1"), fleet).engine_id)
    assert len(set(e for _, e in firsts.values())) > 1  # new conversations spread (hash tiebreak)
    later = FleetView(fleet.engines, now=10.0)
    for conv, (tokens, first_engine) in firsts.items():
        turn2 = tokens + [conv * 100_000 + 50_000 + t for t in range(160)]
        decision = route(policy, req(conversation_keys(turn2), f"c{conv}t2"), later)
        assert decision.engine_id == first_engine
        assert decision.scores[first_engine]["matched_blocks"] == 20
        assert "longest learned prefix" in decision.reason


def test_entries_expire_by_ttl() -> None:
    policy = approx({"ttl_s": 60.0})
    engines = [EngineView("a"), EngineView("b")]
    keys = conversation_keys(list(range(160)))
    first = route(policy, req(keys, "t1"), FleetView(engines, now=0.0)).engine_id
    within = policy.choose(req(keys, "t2"), FleetView(engines, now=59.0))
    assert within.engine_id == first and within.scores[first]["matched_blocks"] == 10
    expired = policy.choose(req(keys, "t3"), FleetView(engines, now=61.0))
    assert expired.scores[first]["matched_blocks"] == 0
    assert "no learned prefix" in expired.reason
    # Routing something else at t=61 purges the stale entries.
    route(policy, req(conversation_keys(list(range(1000, 1016))), "t4"), FleetView(engines, now=61.0))
    assert len(policy) == 1


def test_capacity_evicts_least_recently_used() -> None:
    policy = approx({"capacity_blocks": 25})
    engines = [EngineView("a"), EngineView("b")]
    old = conversation_keys(list(range(160)))  # 10 blocks
    mid = conversation_keys(list(range(5000, 5160)))
    new = conversation_keys(list(range(9000, 9160)))
    route(policy, req(old, "old"), FleetView(engines, now=1.0))
    route(policy, req(mid, "mid"), FleetView(engines, now=2.0))
    assert len(policy) == 20
    route(policy, req(new, "new"), FleetView(engines, now=3.0))
    assert len(policy) == 25
    fleet = FleetView(engines, now=4.0)
    # The 5 oldest entries (the first blocks of "old") went: its chain no longer matches from block 0.
    assert (
        max(policy.choose(req(old, "q1"), fleet).scores[e.engine_id]["matched_blocks"] for e in engines) == 0
    )
    assert (
        max(policy.choose(req(mid, "q2"), fleet).scores[e.engine_id]["matched_blocks"] for e in engines) == 10
    )


def test_imbalance_guard_overrides_prefix() -> None:
    policy = approx({"balance_abs_threshold": 4, "balance_rel_threshold": 1.5})
    keys = conversation_keys(list(range(320)))
    engines = [EngineView("a"), EngineView("b")]
    home = route(policy, req(keys, "t1"), FleetView(engines, now=0.0)).engine_id
    other = "b" if home == "a" else "a"
    # 5 more in flight on home than on other (abs 5 > 4, rel 6 > 1.5 x 1): guard routes away.
    loaded = [EngineView(home, in_flight=6), EngineView(other, in_flight=1)]
    decision = policy.choose(req(keys, "t2"), FleetView(loaded, now=1.0))
    assert decision.engine_id == other
    assert "imbalance guard" in decision.reason
    # abs difference 4 is not above the threshold: the prefix wins.
    mild = [EngineView(home, in_flight=5), EngineView(other, in_flight=1)]
    assert policy.choose(req(keys, "t3"), FleetView(mild, now=1.0)).engine_id == home
    # rel: 20 vs 14 differs by 6 > 4 but 20 < 1.5 x 14: the prefix wins.
    rel = [EngineView(home, in_flight=20), EngineView(other, in_flight=14)]
    assert policy.choose(req(keys, "t4"), FleetView(rel, now=1.0)).engine_id == home


def test_forget_engine_drops_its_entries() -> None:
    policy = approx()
    engines = [EngineView("a"), EngineView("b")]
    keys = conversation_keys(list(range(64)))
    home = route(policy, req(keys, "t1"), FleetView(engines, now=0.0)).engine_id
    policy.forget_engine(home)
    assert len(policy) == 0
    assert policy.choose(req(keys, "t2"), FleetView(engines, now=1.0)).scores[home]["matched_blocks"] == 0


# -- kv_fixed_credit with capacity-aware homing (policies.homing) ------------------------------


def test_homing_keeps_home_only_what_fits_and_sends_the_rest_to_the_last_engine() -> None:
    """Three engines of 100 local tokens (the CPU tier, larger than the GPU's 50), home_fill 1:
    a and b home conversations while their current lengths fit 100 tokens, the last engine o homes
    none and takes every other turn. Catches: a new conversation not placed by fewest homed tokens,
    a grown conversation kept home past the room (s3's third turn), a session that left home
    coming back, the overflow engine homing, and state changed by a choice never routed."""
    policy = build_policy("kv_fixed_credit", {"home_fill": 1.0})
    capacity = {"gpu_capacity_tokens": 50.0, "cpu_capacity_tokens": 100.0}
    fleet = FleetView([EngineView(e, extra=dict(capacity)) for e in ("a", "b", "o")])

    def turn(n: int, session: str, tokens: int) -> str:
        r = RouteRequest(f"r{n}", prompt_tokens=tokens, block_size=BLOCK, session_key=session)
        decision = policy.choose(r, fleet)
        assert decision.reason.startswith("homing:")
        policy.on_routed(r, decision)
        return decision.engine_id

    plan = [("s1", 40), ("s2", 40), ("s3", 40), ("s4", 40), ("s5", 40), ("s1", 50), ("s3", 60), ("s3", 70)]
    assert [turn(n, s, t) for n, (s, t) in enumerate(plan)] == ["a", "b", "a", "b", "o", "a", "o", "o"]
    # a now holds s1 (50): a new 40-token conversation fits there (90), not on b (80 + 40)
    probe = RouteRequest("probe", prompt_tokens=60, block_size=BLOCK, session_key="s6")
    assert policy.choose(probe, fleet).engine_id == "o"  # 50 + 60 > 100: overflow; never routed
    assert turn(9, "s6", 40) == "a"
    assert turn(10, "s5", 10) == "o"  # once away, always away


def test_homing_is_off_by_default_and_needs_capacities() -> None:
    """Without home_fill the credits decide; with it but no tier capacities (the live router's
    views) too: homing needs the local cache size."""
    keys = list(range(10))
    matches = {"a": PrefixMatch(10, (10, 0, 0))}
    request = req(keys, matches=matches)
    request.session_key = "s"
    fleet = FleetView([EngineView("a"), EngineView("b")])
    for params in ({}, {"home_fill": 1.0}):
        decision = build_policy("kv_fixed_credit", params).choose(request, fleet)
        assert decision.engine_id == "a"
        assert decision.reason.startswith("lowest fixed-credit cost")
    with pytest.raises(ValueError, match="home_fill"):
        build_policy("kv_fixed_credit", {"home_fill": -1.0})


def test_homing_without_a_dedicated_engine_leaves_the_overflow_to_the_credits() -> None:
    """home_dedicated=0: every engine homes (the last one too) and a turn that does not fit is
    placed by the credits. Catches the last engine kept out of homing, and an overflow turn still
    pinned somewhere by homing."""
    policy = build_policy("kv_fixed_credit", {"home_fill": 1.0, "home_dedicated": 0})
    capacity = {"gpu_capacity_tokens": 50.0, "cpu_capacity_tokens": 100.0}
    fleet = FleetView([EngineView(e, extra=dict(capacity)) for e in ("a", "b")])
    reasons = []
    for n, (session, tokens) in enumerate([("s1", 60), ("s2", 60), ("s3", 60), ("s1", 120)]):
        r = RouteRequest(f"r{n}", prompt_tokens=tokens, block_size=BLOCK, session_key=session)
        decision = policy.choose(r, fleet)
        policy.on_routed(r, decision)
        reasons.append(decision.reason.split(";")[0] if decision.reason.startswith("homing") else "credits")
    assert reasons == ["homing: new (a)", "homing: new (b)", "credits", "credits"]
