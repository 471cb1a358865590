"""kv_gpu policy fed by a real PrefixIndex, and the explain / debug payload builders."""

from __future__ import annotations

import json

import pytest

from kvcore.index import PrefixIndex
from kvcore.keys import block_keys
from policies.base import EngineView, FleetView, NoEngineAvailable, PrefixMatch, RouteRequest, build_policy
from router.events import BlockStored, debug_index_payload, explain_payload

TOKENS = list(range(5000, 5000 + 16 * 8))
KEYS = block_keys(TOKENS, 16)


def hashes(start: int, n: int) -> list[int]:
    return [900 + i for i in range(start, start + n)]


def indexed_fleet() -> PrefixIndex:
    index = PrefixIndex()
    # a: 6 blocks on GPU; b: 8 blocks on CPU; c: 3 on GPU.
    index.apply_batch("a", [BlockStored(hashes(0, 6), None, TOKENS[: 16 * 6], 16, None, "GPU", None)])
    index.apply_batch("b", [BlockStored(hashes(0, 8), None, TOKENS, 16, None, "CPU", None)])
    index.apply_batch("c", [BlockStored(hashes(0, 3), None, TOKENS[:48], 16, None, "GPU", None)])
    return index


def request(index: PrefixIndex, engines: list[EngineView]) -> RouteRequest:
    return RouteRequest(
        "r1",
        prompt_tokens=len(TOKENS),
        block_keys=KEYS,
        prefix_matches=index.match(KEYS, [e.engine_id for e in engines]),
    )


def test_kv_gpu_prefers_longest_gpu_prefix_then_load() -> None:
    index = indexed_fleet()
    engines = [EngineView("a", in_flight=3), EngineView("b"), EngineView("c"), EngineView("d")]
    policy = build_policy("kv_gpu", {"seed": 1})
    assert policy.uses_index
    decision = policy.choose(request(index, engines), FleetView(engines))
    assert decision.engine_id == "a" and decision.scores["a"]["gpu_blocks"] == 6.0
    assert decision.scores["b"]["gpu_blocks"] == 0.0 and decision.scores["b"]["prefix_blocks"] == 8.0
    assert decision.fallbacks[0] == "c"
    # Equal GPU prefix (none): fewest in flight wins.
    cold = RouteRequest("r2", block_keys=block_keys(list(range(16)), 16))
    loaded = [EngineView("a", in_flight=2), EngineView("b", in_flight=1), EngineView("c", in_flight=5)]
    assert policy.choose(cold, FleetView(loaded)).engine_id == "b"


def test_kv_gpu_skips_overloaded_unless_all_are() -> None:
    index = indexed_fleet()
    engines = [EngineView("a", in_flight=40), EngineView("b", in_flight=2), EngineView("c", in_flight=3)]
    policy = build_policy("kv_gpu", {"overload_factor": 2.0, "min_in_flight": 4})
    decision = policy.choose(request(index, engines), FleetView(engines))
    assert decision.engine_id == "c" and decision.scores["a"]["overloaded"] == 1.0
    assert "overloaded" in decision.reason
    alone = [EngineView("a", in_flight=40)]
    assert policy.choose(request(index, alone), FleetView(alone)).engine_id == "a"
    with pytest.raises(NoEngineAvailable):
        policy.choose(request(index, []), FleetView([]))
    with pytest.raises(ValueError, match="overload_factor"):
        build_policy("kv_gpu", {"overload_factor": 0.5})


def test_explain_and_debug_payloads_are_json() -> None:
    index = indexed_fleet()
    engines = [EngineView("a", in_flight=1), EngineView("b")]
    req = request(index, engines)
    decision = build_policy("kv_gpu").choose(req, FleetView(engines))
    body = json.loads(json.dumps(explain_payload(req, FleetView(engines), decision)))
    by_id = {e["engine_id"]: e for e in body["engines"]}
    assert body["choice"] == "a" and body["prompt_blocks"] == 8 and by_id["a"]["chosen"]
    assert by_id["a"]["prefix_blocks_by_tier"] == {"gpu": 6, "cpu": 0, "storage": 0}
    assert by_id["b"]["prefix_blocks_by_tier"] == {"gpu": 0, "cpu": 8, "storage": 0}
    assert by_id["b"]["prefix_tokens"] == 128 and by_id["a"]["scores"]["gpu_blocks"] == 6.0
    debug = json.loads(json.dumps(debug_index_payload(index)))
    assert debug["index"]["keys"] == 8
    assert (
        debug["index"]["engines"]["c"]["gpu_blocks"] == 3
        and debug["index"]["engines"]["b"]["cpu_blocks"] == 8
    )


def _burst(policy_name: str, params: dict[str, object], engines: int, hot_blocks: int, n: int) -> list[int]:
    """Route ``n`` back-to-back requests (none finishes) whose first ``hot_blocks`` of 8 are on e0's
    GPU, updating the load view as the router does; returns in-flight per engine."""
    views = [EngineView(f"e{i}") for i in range(engines)]
    by_id = {v.engine_id: v for v in views}
    policy = build_policy(policy_name, params)
    from policies.costs import predicted_prefill_tokens

    for k in range(n):
        req = RouteRequest(
            f"burst-{k}",
            prompt_tokens=len(TOKENS),
            block_keys=KEYS,
            prefix_matches={"e0": PrefixMatch(hot_blocks, (hot_blocks, 0, 0))},
        )
        decision = policy.choose(req, FleetView(views))
        view = by_id[decision.engine_id]
        view.in_flight += 1
        view.queued_prefill_tokens += predicted_prefill_tokens(req, decision)
    return [v.in_flight for v in views]


def test_kv_gpu_balances_a_skewed_burst() -> None:
    # Only a short shared prefix (1 of 8 blocks) on e0: not a useful hit, so least loaded wins.
    assert max(_burst("kv_gpu", {"seed": 3}, 4, 1, 40)) <= 11
    # A useful hit (6 of 8 blocks) pulls requests to e0 only until it is 1.5x the mean in flight.
    spread = _burst("kv_gpu", {"seed": 3}, 4, 6, 40)
    assert spread[0] > max(spread[1:]) and spread[0] <= 1.5 * 40 / 4 + 1
    assert min(spread[1:]) >= 6
    # The old rule (no useful-hit threshold, 2x guard) herds: the guard only stops e0 at 2x the mean.
    herded = _burst("kv_gpu", {"seed": 3, "overload_factor": 2.0, "min_hit_fraction": 0.0}, 4, 1, 40)
    assert herded[0] >= 16


def test_kv_gpu_skips_engines_with_a_long_prefill_queue() -> None:
    index = indexed_fleet()
    engines = [
        EngineView("a", in_flight=1, queued_prefill_tokens=200_000),
        EngineView("b", in_flight=1, queued_prefill_tokens=1_000),
        EngineView("c", in_flight=1, queued_prefill_tokens=2_000),
    ]
    decision = build_policy("kv_gpu").choose(request(index, engines), FleetView(engines))
    assert decision.engine_id == "c" and decision.scores["a"]["overloaded"] == 1.0
    with pytest.raises(ValueError, match="min_hit_fraction"):
        build_policy("kv_gpu", {"min_hit_fraction": 1.5})


def test_kv_fixed_credit_guard_spreads_a_long_shared_prefix() -> None:
    # 4 of 8 blocks shared on e0 worth 80 requests' load term (the agentic trace's 15K-token system +
    # tool prompt is 234 blocks of 64 against 8 per request): without the guard everything lands on
    # e0; with it e0 stays within 3x the mean in flight.
    light = {"decode_blocks_per_request": 0.05}
    unguarded = _burst("kv_fixed_credit", {**light, "overload_factor": 1000.0}, 8, 4, 48)
    assert unguarded[0] == 48
    guarded = _burst("kv_fixed_credit", light, 8, 4, 48)
    assert guarded[0] <= 3 * 48 / 8 + 1 and min(guarded) >= 4
