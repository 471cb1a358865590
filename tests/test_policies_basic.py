"""Choice logic of the load- and session-based policies, as pure functions of a FleetView."""

from __future__ import annotations

from collections import Counter

import pytest

from policies.base import EngineView, FleetView, NoEngineAvailable, RouteRequest, build_policy


def fleet(*loads: int, prefill: tuple[int, ...] = ()) -> FleetView:
    return FleetView(
        [
            EngineView(f"e{i}", in_flight=n, queued_prefill_tokens=prefill[i] if prefill else 0)
            for i, n in enumerate(loads)
        ]
    )


def req(session: str = "s", i: int = 0) -> RouteRequest:
    return RouteRequest(request_id=f"r{i}", session_key=session)


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "power_of_two", "session_affinity"])
def test_empty_fleet_raises_and_decision_is_complete(name: str) -> None:
    policy = build_policy(name)
    with pytest.raises(NoEngineAvailable):
        policy.choose(req(), FleetView([]))
    decision = policy.choose(req(), fleet(0, 0, 0))
    assert decision.policy == name and decision.reason
    assert sorted([decision.engine_id, *decision.fallbacks]) == ["e0", "e1", "e2"]
    assert decision.engine_id in decision.scores


def test_round_robin_cycles() -> None:
    policy = build_policy("round_robin")
    chosen = [policy.choose(req(i=i), fleet(5, 0, 0)).engine_id for i in range(6)]
    assert chosen == ["e0", "e1", "e2", "e0", "e1", "e2"]
    assert policy.choose(req(), fleet(0, 0, 0)).fallbacks == ("e1", "e2")  # 7th request: e0 first
    # Its scores are each engine's position, written when read; it prices no engine.
    decision = policy.choose(req(), fleet(0, 0, 0))
    assert decision.engine_id == "e1" and decision.reason == "turn 1 of 3 engines"
    assert decision.scores == {"e1": {"position": 0.0}, "e2": {"position": 1.0}, "e0": {"position": 2.0}}
    assert decision.parts is not None and not decision.parts


def test_least_loaded_picks_min_in_flight_then_prefill() -> None:
    policy = build_policy("least_loaded", {"seed": 1})
    decision = policy.choose(req(), fleet(3, 1, 2))
    assert decision.engine_id == "e1" and decision.fallbacks == ("e2", "e0")
    assert decision.scores["e0"]["in_flight"] == 3
    assert policy.choose(req(), fleet(1, 1, 1, prefill=(900, 100, 500))).engine_id == "e1"


def test_least_loaded_spreads_ties() -> None:
    policy = build_policy("least_loaded", {"seed": 7})
    counts = Counter(policy.choose(req(i=i), fleet(0, 0, 0, 0)).engine_id for i in range(400))
    assert set(counts) == {"e0", "e1", "e2", "e3"} and min(counts.values()) > 50


def test_power_of_two_never_picks_the_worse_of_its_pair() -> None:
    policy = build_policy("power_of_two", {"seed": 3})
    loads = (0, 5, 10, 15)
    counts = Counter(policy.choose(req(i=i), fleet(*loads)).engine_id for i in range(2000))
    # The most loaded engine only wins when both samples are itself: impossible (distinct samples).
    assert counts["e3"] == 0
    # e0 wins every pair it is in: 3 of the 6 pairs.
    assert 0.4 < counts["e0"] / 2000 < 0.6
    assert counts["e0"] > counts["e1"] > counts["e2"]
    two = policy.choose(req(), fleet(4, 2))
    assert two.engine_id == "e1" and two.fallbacks == ("e0",)


def test_session_affinity_is_sticky_and_spreads_sessions() -> None:
    policy = build_policy("session_affinity")
    view = fleet(0, 0, 0, 0)
    owners = {f"conv-{i}": policy.choose(req(f"conv-{i}"), view).engine_id for i in range(400)}
    for session, owner in list(owners.items())[:50]:
        assert policy.choose(req(session), fleet(0, 0, 0, 0)).engine_id == owner
    counts = Counter(owners.values())
    assert len(counts) == 4 and min(counts.values()) > 40


def test_session_affinity_moves_about_one_nth_when_an_engine_joins() -> None:
    policy = build_policy("session_affinity")
    sessions = [f"session-{i}" for i in range(2000)]
    before = {s: policy.choose(req(s), fleet(0, 0, 0, 0)).engine_id for s in sessions}
    after = {s: policy.choose(req(s), fleet(0, 0, 0, 0, 0)).engine_id for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    n = 5
    assert len(moved) / len(sessions) < 1.6 / n
    assert len(moved) > 0.5 * len(sessions) / n  # the new engine does get its share
    assert all(after[s] == "e4" for s in moved)  # sessions only move to the new engine
    # Removing it again restores every original owner.
    assert all(policy.choose(req(s), fleet(0, 0, 0, 0)).engine_id == before[s] for s in sessions)


def test_session_affinity_bounded_load_spills_to_next_on_ring() -> None:
    policy = build_policy("session_affinity", {"epsilon": 0.25})
    owner = policy.choose(req("hot"), fleet(0, 0, 0, 0)).engine_id
    owner_index = int(owner[1:])
    loads = [2, 2, 2, 2]
    loads[owner_index] = 10  # bound = ceil(1.25 * 19 / 4) = 6: the owner is over it
    decision = policy.choose(req("hot"), fleet(*loads))
    assert decision.engine_id != owner
    assert decision.scores[owner]["ring_rank"] == 0 and decision.scores[owner]["load_bound"] == 6
    assert decision.fallbacks[-1] == owner  # over-bound engines are the last resort
    loads[owner_index] = 3  # bound = ceil(1.25 * 10 / 4) = 4 >= 3 + 1: the session stays home
    assert policy.choose(req("hot"), fleet(*loads)).engine_id == owner


def test_session_affinity_rejects_bad_params() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        build_policy("session_affinity", {"epsilon": -1})
    with pytest.raises(ValueError, match="'round_robin' has no parameter nope; valid parameters: none"):
        build_policy("round_robin", {"nope": 1})
    with pytest.raises(ValueError, match=r"has no parameter nope; valid parameters: epsilon \(default"):
        build_policy("session_affinity", {"nope": 1})


def test_hit_tokens_by_tier_takes_each_tier_up_to_what_is_left() -> None:
    """Per tier, cheapest first: min(blocks x block size, what the cheaper tiers left of prompt - 1),
    never below 0; the GPU-only match (the usual one) the same as any other."""
    import random

    from policies.base import PrefixMatch, hit_tokens_by_tier

    rng = random.Random(19)
    for _ in range(5000):
        by_tier = tuple(rng.choice((0, 0, rng.randrange(1, 80))) for _ in range(3))
        block_size, prompt_tokens = rng.choice((1, 16, 32)), rng.randrange(0, 2000)
        left = float(max(0, prompt_tokens - 1))
        expected = []
        for blocks in by_tier:
            took = min(float(blocks * block_size), left)
            expected.append(took)
            left -= took
        got = hit_tokens_by_tier(PrefixMatch(sum(by_tier), by_tier), block_size, prompt_tokens)  # type: ignore[arg-type]
        assert got == tuple(expected), (by_tier, block_size, prompt_tokens)
        assert all(type(t) is float for t in got)
