"""kv_gpu policy fed by a real PrefixIndex, and the explain / debug payload builders."""

from __future__ import annotations

import json

import pytest

from policies.base import EngineView, FleetView, NoEngineAvailable, RouteRequest, build_policy
from router.events import BlockStored, debug_index_payload, explain_payload
from router.index import PrefixIndex
from router.keys import block_keys

TOKENS = list(range(5000, 5000 + 16 * 8))
KEYS = block_keys(TOKENS, 16)


def hashes(start: int, n: int) -> list[int]:
    return [900 + i for i in range(start, start + n)]


def indexed_fleet() -> PrefixIndex:
    index = PrefixIndex()
    # a: 6 blocks on GPU; b: 8 blocks on CPU; c: 3 on GPU.
    index.apply_batch("a", [BlockStored(hashes(0, 6), None, TOKENS[: 16 * 6], 16, medium="GPU")])
    index.apply_batch("b", [BlockStored(hashes(0, 8), None, TOKENS, 16, medium="CPU")])
    index.apply_batch("c", [BlockStored(hashes(0, 3), None, TOKENS[:48], 16, medium="GPU")])
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
