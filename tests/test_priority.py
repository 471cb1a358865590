"""Shortest work first: vLLM's priority scheduling in the engine model, and the router sending each
request's predicted own service as its ``priority`` to engines started with
``--scheduling-policy priority``.

The truths are the engine's order of service (which request gets its first token first), vLLM's
preemption rule (the running request with the largest (priority, arrival) is the victim), an fcfs
engine ignoring a priority as vLLM does, and vLLM's X-Vllm-Priority header overriding the body, not
the router's own account of what it sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcore.core import (
    ESCALATE_PICKS,
    PRIORITY_EPOCH_S,
    PRIORITY_FCFS_FACTOR,
    PRIORITY_MAX_OVERTAKE_S,
    PRIORITY_STEP_S,
    shortest_first_priority,
)
from kvcore.sim_tokenizer import NAME, filler_text
from policies.costs import PredictedParts
from router.config import ConfigError, load_config
from router.fastpath import ProxyExchange
from router.service import build_router_app
from sim.engine import EngineCore, SimRequest
from sim.fleet import Fleet, FleetEngine, FleetProfile
from tests.conftest import OpenAIUpstream, ThreadedServer
from tests.test_des import memory_pressure_run
from tests.test_sim_engine import profile, run

# ------------------------------------------------------------------------------ the engine model


def _first_token_order(engine: EngineCore) -> list[str]:
    order: list[str] = []
    for out in run(engine):
        order.extend(rid for rid in out.new_token_ids if rid not in order)
    return order


def test_priority_engine_serves_lowest_priority_first_then_in_arrival_order() -> None:
    requests = [("late", 5), ("a", 1), ("b", 1), ("first", 0)]
    engine = EngineCore("e0", profile(max_num_seqs=1, scheduling_policy="priority"))
    for i, (rid, prio) in enumerate(requests):
        engine.add_request(SimRequest(rid, list(range(i * 100, i * 100 + 20)), max_tokens=2, priority=prio))
    assert _first_token_order(engine) == ["first", "a", "b", "late"]
    # The same requests without priorities on an fcfs engine: arrival order.
    engine = EngineCore("e0", profile(max_num_seqs=1))
    for i, (rid, _) in enumerate(requests):
        engine.add_request(SimRequest(rid, list(range(i * 100, i * 100 + 20)), max_tokens=2))
    assert _first_token_order(engine) == ["late", "a", "b", "first"]


def test_fcfs_engine_accepts_and_ignores_a_priority_as_vllm_does() -> None:
    """vLLM's V1 input processor no longer refuses a priority on an fcfs engine (older engines
    answered "Got priority N but Priority scheduling is not enabled." with a 400); its fcfs queue
    never reads it. The queue stays in arrival order and the victim of a preemption the newest."""
    engine = EngineCore("e0", profile(max_num_seqs=1))
    for i, prio in enumerate((5, 3, -2)):
        engine.add_request(
            SimRequest(f"r{i}", list(range(i * 100, i * 100 + 20)), max_tokens=2, priority=prio)
        )
    assert _first_token_order(engine) == ["r0", "r1", "r2"]
    with pytest.raises(ValueError, match="scheduling_policy 'lifo' is unknown"):
        profile(scheduling_policy="lifo")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim_is_the_largest_priority_not_the_newest(policy: str) -> None:
    """a (priority 9) runs first; b (priority 0) joins; the pool of 4 blocks holds one of them.
    fcfs preempts the newest running request (b), priority the largest (priority, arrival) (a)."""
    engine = EngineCore("e0", profile(num_gpu_blocks=4, scheduling_policy=policy))
    engine.add_request(
        SimRequest("a", list(range(16)), max_tokens=40, priority=9 if policy == "priority" else 0)
    )
    outs = [engine.step()]
    engine.add_request(SimRequest("b", list(range(100, 116)), max_tokens=40))
    outs += run(engine)
    order = [f.request_id for out in outs for f in out.finished]
    assert engine.stats().num_preemptions >= 1
    assert order == (["a", "b"] if policy == "fcfs" else ["b", "a"])
    assert all(len(f.output_token_ids) == 40 for out in outs for f in out.finished)
    assert engine.gpu.num_used() == 0


def test_priority_is_a_deadline_stretched_by_the_predicted_own_service_and_capped() -> None:
    parts = PredictedParts(wait_s=9.0, slot_s=4.0, load_s=(0.0, 0.25, 0.25), prefill_s=0.5)  # own 1 s
    # Deadline = now + min(stretch x own, bound): (10 + 20 x 1) / 0.5; the waits ahead are not
    # the request's work.
    inf = float("inf")
    assert shortest_first_priority(parts, 0.5, now_s=10.0, stretch=20, max_overtake_s=inf) == 60
    assert shortest_first_priority(parts, 0.5, now_s=10.0, stretch=20, max_overtake_s=5.0) == 30
    assert shortest_first_priority(parts, 0.5, now_s=10.0, stretch=3, max_overtake_s=5.0) == 26
    # stretch 0 is arrival order (the deadline is the placement time), whatever the work.
    assert shortest_first_priority(parts, 0.05, now_s=3.0, stretch=0) == 60
    assert shortest_first_priority(PredictedParts(prefill_s=inf), 0.05, now_s=3.0, stretch=0) == 60
    # Larger stretch, more shortest-first: the window in which a 50 ms request overtakes a 1 s one
    # grows with it (monotonic), and never beyond the bound.
    small = PredictedParts(prefill_s=0.05)

    def overtaken_within_s(stretch: float, bound: float) -> float:
        big = shortest_first_priority(parts, 0.05, now_s=0.0, stretch=stretch, max_overtake_s=bound)
        later = [t / 10 for t in range(0, 400)]
        return max(
            (
                t
                for t in later
                if shortest_first_priority(small, 0.05, now_s=t, stretch=stretch, max_overtake_s=bound) < big
            ),
            default=0.0,
        )

    windows = [overtaken_within_s(s, inf) for s in (0, 5, 10, 20, 30)]
    assert windows == sorted(windows) and windows[0] == 0.0 and 18.9 <= windows[3] <= 19.0
    assert all(overtaken_within_s(s, 10.0) < 10.0 for s in (5, 20, 1000))
    assert shortest_first_priority(PredictedParts(prefill_s=inf), 0.05, max_overtake_s=inf) == 1 << 62
    assert shortest_first_priority(PredictedParts(prefill_s=float("nan")), 0.5, now_s=3.0) == 6


def test_the_relative_bound_caps_the_deadline_at_k_times_the_predicted_first_come_ttft() -> None:
    """fcfs = parts.total_s (the waits ahead plus own): wait 1 s + slot 0.5 s + own 0.5 s = 2 s.
    At stretch 20 (10 s) the deadline is now + min(10, H, K x 2); K = inf (the default) is off. A
    NaN or negative wait counts as none (fcfs = own), never as no cap."""
    inf = float("inf")
    parts = PredictedParts(wait_s=1.0, slot_s=0.5, prefill_s=0.5)
    assert PRIORITY_FCFS_FACTOR == inf
    assert shortest_first_priority(parts, 0.5, now_s=10.0, stretch=20, max_overtake_s=inf) == 40
    assert (
        shortest_first_priority(parts, 0.5, now_s=10.0, stretch=20, max_overtake_s=inf, fcfs_factor=3) == 32
    )
    assert (
        shortest_first_priority(parts, 0.5, now_s=10.0, stretch=20, max_overtake_s=4.0, fcfs_factor=3) == 28
    )
    # K x fcfs above stretch x own: the stretch decides (a cached turn still jumps the queue).
    assert shortest_first_priority(parts, 0.5, now_s=10.0, stretch=2, max_overtake_s=inf, fcfs_factor=3) == 22
    nan_wait = PredictedParts(wait_s=float("nan"), prefill_s=0.5)
    assert (
        shortest_first_priority(nan_wait, 0.5, now_s=10.0, stretch=20, max_overtake_s=inf, fcfs_factor=2)
        == 22
    )
    negative = PredictedParts(wait_s=-5.0, prefill_s=0.5)
    assert (
        shortest_first_priority(negative, 0.5, now_s=10.0, stretch=20, max_overtake_s=inf, fcfs_factor=2)
        == 22
    )
    # The property over many parts: no deadline beyond now + K x fcfs (one level of rounding down).
    for k in range(2000):
        wait, own = (k % 37) * 0.31, (k % 11) * 0.07 + (k % 5) * 0.011
        p = PredictedParts(wait_s=wait, slot_s=(k % 3) * 0.2, prefill_s=own)
        for factor in (1.0, 1.5, 3.0):
            level = shortest_first_priority(
                p, 0.05, now_s=k * 0.013, stretch=40, max_overtake_s=inf, fcfs_factor=factor
            )
            assert level * 0.05 <= k * 0.013 + factor * p.total_s + 1e-9


def _drive(engine: EngineCore, arrivals: list[tuple[float, SimRequest]]) -> dict[str, float]:
    """Add each request at its virtual arrival time, stepping the engine in between; each
    request's first-token time on the engine's clock."""
    first: dict[str, float] = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= engine.now_s:
            engine.add_request(pending.pop(0)[1])
        if not engine.has_unfinished():
            engine.now_s = pending[0][0]
            continue
        out = engine.step()
        for rid in out.new_token_ids:
            first.setdefault(rid, engine.now_s)
    return first


@pytest.mark.parametrize("bound_s", [5.0, float("inf")])
def test_no_request_is_overtaken_by_one_placed_more_than_the_bound_after_it(bound_s: float) -> None:
    """The bound, in the engine model's virtual time: a 1 s prompt runs from t=0, a 2 s prompt is
    placed at 0.5 s, a 0.1 s prompt every 0.1 s for 40 s, on a priority engine serving one request
    at a time (the queue of short ones never empties). Each gets the router's
    shortest_first_priority at stretch 20 from its own prefill time. With the bound (5 s) the long
    prompt is served before every short one placed more than 5 s after it (by about 5 s of their
    work plus its own); without it (inf) it waits behind everything placed in the next 38 s
    (stretch x own = 40 s)."""
    engine = EngineCore("e0", profile(num_gpu_blocks=400, max_num_seqs=1, scheduling_policy="priority"))
    per_token_s = 1 / 1000  # tests/test_sim_engine.py's profile: 1,000 prefill tokens per second

    def request(rid: str, tokens: int, at_s: float, seed: int) -> tuple[float, SimRequest]:
        own = PredictedParts(prefill_s=tokens * per_token_s)
        prio = shortest_first_priority(own, 0.05, now_s=at_s, stretch=20, max_overtake_s=bound_s)
        return at_s, SimRequest(rid, list(range(seed, seed + tokens)), max_tokens=1, priority=prio)

    arrivals = [request("running", 1000, 0.0, 2 * 10**6), request("long", 2000, 0.5, 10**6)]
    arrivals += [request(f"s{k}", 100, 0.05 + 0.1 * k, 1000 * k) for k in range(400)]
    first = _drive(engine, arrivals)
    placed = {req.request_id: at for at, req in arrivals}
    ahead = [rid for rid in first if first[rid] < first["long"] and rid != "running"]
    overtaken_by_placed_after_s = max(placed[rid] for rid in ahead) - placed["long"]
    if bound_s < float("inf"):
        assert overtaken_by_placed_after_s <= bound_s
        # Its first-come wait: the running request (0.5 s) and the shorts placed before it (~0.5 s);
        # then the window's shorts (5 s of them, ~0.11 s each) and its own 2 s.
        assert first["long"] - placed["long"] < 1.0 + 1.15 * (bound_s + 0.5) + 2.5
    else:
        assert overtaken_by_placed_after_s > 30.0


def _one_at_a_time_arrivals(
    stretch: float, fcfs_factor: float
) -> tuple[list[tuple[float, SimRequest]], dict[str, float]]:
    """The bound test's arrivals (a 1 s prompt at 0, a 2 s prompt at 0.5 s, a 0.1 s prompt every
    0.1 s for 40 s) with each request's exact predicted first-come TTFT on a one-at-a-time engine
    (the queue ahead of it, then its own prefill) in its parts; their first-come TTFTs."""
    per_token_s = 1 / 1000
    specs = [("running", 1000, 0.0, 2 * 10**6), ("long", 2000, 0.5, 10**6)]
    specs += [(f"s{k}", 100, 0.05 + 0.1 * k, 1000 * k) for k in range(400)]
    specs.sort(key=lambda spec: spec[2])
    free_at_s = 0.0
    arrivals: list[tuple[float, SimRequest]] = []
    fcfs: dict[str, float] = {}
    for rid, tokens, at_s, seed in specs:
        own_s = tokens * per_token_s
        wait_s = max(free_at_s - at_s, 0.0)
        free_at_s = at_s + wait_s + own_s
        fcfs[rid] = wait_s + own_s
        parts = PredictedParts(wait_s=wait_s, prefill_s=own_s)
        prio = shortest_first_priority(
            parts, 0.05, now_s=at_s, stretch=stretch, max_overtake_s=float("inf"), fcfs_factor=fcfs_factor
        )
        arrivals.append(
            (at_s, SimRequest(rid, list(range(seed, seed + tokens)), max_tokens=1, priority=prio))
        )
    return arrivals, fcfs


@pytest.mark.parametrize("fcfs_factor", [1.5, 3.0, float("inf")])
def test_no_request_is_overtaken_by_one_placed_more_than_k_times_its_fcfs_ttft_after_it(
    fcfs_factor: float,
) -> None:
    """The relative bound in the engine model's virtual time, on the bound test's engine and
    arrivals, unbounded H, stretch 20, the predictions exact: the long prompt's first-come TTFT
    is ~3 s (0.5 s of the running one, ~0.5 s of shorts, its own 2 s). With K it is served before
    every short placed more than K x that after it, so its TTFT stays within K x its first-come
    one plus the work of that window; off (inf) it waits behind everything placed in the next
    38 s (stretch x own = 40 s)."""
    engine = EngineCore("e0", profile(num_gpu_blocks=400, max_num_seqs=1, scheduling_policy="priority"))
    arrivals, fcfs = _one_at_a_time_arrivals(20.0, fcfs_factor)
    first = _drive(engine, arrivals)
    placed = {req.request_id: at for at, req in arrivals}
    assert 2.9 <= fcfs["long"] <= 3.1
    ahead = [rid for rid in first if first[rid] < first["long"] and rid != "running"]
    overtaken_by_placed_after_s = max(placed[rid] for rid in ahead) - placed["long"]
    if fcfs_factor < float("inf"):
        assert overtaken_by_placed_after_s <= fcfs_factor * fcfs["long"]
        # Its first-come wait (~1 s), the window's shorts (~0.11 s of work per 0.1 s), its own 2 s.
        ttft_s = first["long"] - placed["long"]
        assert ttft_s < 1.0 + 1.15 * (fcfs_factor * fcfs["long"] + 0.5) + 2.5
    else:
        assert overtaken_by_placed_after_s > 30.0


def test_k_1_with_exact_predictions_serves_in_arrival_order() -> None:
    """K = 1 with a stretch past every first-come TTFT: each deadline is the request's own
    first-come completion, which rises with arrival, so the priority engine serves in arrival
    order; without K (pure shortest work first) the long prompt is served after later shorts."""
    for fcfs_factor, in_order in ((1.0, True), (float("inf"), False)):
        engine = EngineCore("e0", profile(num_gpu_blocks=400, max_num_seqs=1, scheduling_policy="priority"))
        arrivals, _ = _one_at_a_time_arrivals(1e6, fcfs_factor)
        first = _drive(engine, arrivals)
        served = sorted(first, key=lambda rid: first[rid])
        arrived = [req.request_id for _, req in arrivals]
        assert (served == arrived) is in_order, served[:8]


@pytest.mark.slow
def test_des_priority_engines_keep_hits_that_fcfs_engines_evict_while_they_queue() -> None:
    """64 conversations on 2 engines whose GPU pools hold ~5 running requests each (the memory
    pressure of tests/test_des.py's calibration test, whose fcfs run this shares). With fcfs engines
    a turn whose history is cached waits behind recomputes that evict it; with priority engines (the
    DES sends each request's shortest_first_priority, as the router does) it runs first. The hit
    rate is the engines' own count of cached prompt tokens, the TTFTs the engines' timelines."""
    fcfs = memory_pressure_run("fcfs")[1]
    pure = memory_pressure_run("priority", 1e6, float("inf"))[1]  # shortest work first, unbounded
    aged = memory_pressure_run("priority")[1]  # the defaults: stretch 20, bounded overtaking
    print({"fcfs": fcfs, "pure": pure, "aged": aged})
    assert 1.0 - pure.miss > (1.0 - fcfs.miss) + 0.1
    assert pure.ttft_p50_s < 0.7 * fcfs.ttft_p50_s
    assert 1.0 - aged.miss > (1.0 - fcfs.miss) + 0.05
    assert aged.ttft_p50_s < 0.85 * fcfs.ttft_p50_s


def test_router_config_checks_the_scheduling_policy() -> None:
    engine = {"id": "e0", "url": "http://127.0.0.1:9"}
    with pytest.raises(ConfigError, match="scheduling_policy 'sjf' unknown"):
        load_config(environ={}, overrides={"engines": [{**engine, "scheduling_policy": "sjf"}]})
    with pytest.raises(ConfigError, match="priority_step_s must be positive"):
        load_config(environ={}, overrides={"engines": [engine], "costs": {"priority_step_s": 0}})
    with pytest.raises(ConfigError, match="priority_stretch must be >= 0"):
        load_config(environ={}, overrides={"engines": [engine], "costs": {"priority_stretch": -1}})
    for bad in (0, -5, "nan"):
        with pytest.raises(
            ConfigError, match=r"costs.priority_max_overtake_s must be > 0 seconds \(inf = no"
        ):
            load_config(
                environ={}, overrides={"engines": [engine], "costs": {"priority_max_overtake_s": bad}}
            )
    with pytest.raises(ConfigError, match="priority_max_overtake_s"):
        load_config(environ={"KVROUTE_COSTS_PRIORITY_MAX_OVERTAKE_S": "ten"}, overrides={"engines": [engine]})
    for bad in (0, 0.5, -1, "nan"):
        with pytest.raises(ConfigError, match=r"costs.priority_fcfs_factor must be >= 1 \(1 = first-come"):
            load_config(environ={}, overrides={"engines": [engine], "costs": {"priority_fcfs_factor": bad}})
    assert load_config(environ={}, overrides={"engines": [engine]}).costs.priority_fcfs_factor == float("inf")
    relative = load_config(
        environ={"KVROUTE_COSTS_PRIORITY_FCFS_FACTOR": "1.5"}, overrides={"engines": [engine]}
    )
    assert relative.costs.priority_fcfs_factor == 1.5
    unbounded = load_config(
        environ={"KVROUTE_COSTS_PRIORITY_MAX_OVERTAKE_S": "inf"}, overrides={"engines": [engine]}
    )
    assert unbounded.costs.priority_max_overtake_s == float("inf")
    assert (
        load_config(environ={}, overrides={"engines": [engine]}).costs.priority_max_overtake_s
        == PRIORITY_MAX_OVERTAKE_S
    )


def _priority_sent(
    serve_asgi: Callable[..., ThreadedServer], engine: OpenAIUpstream, engine_url: str, costs: dict[str, Any]
) -> tuple[float, float, int]:
    """One completion through a round_robin router with ``costs`` in front of the recording
    engine: (placement window start, end, in seconds of the priority epoch; the priority the
    engine received)."""
    config = load_config(
        environ={},
        overrides={
            "engines": [
                {"id": "e0", "url": engine_url, "model": "test-model", "scheduling_policy": "priority"}
            ],
            "policy": {"name": "round_robin"},
            "health": {"interval_s": 0},
            "costs": costs,
        },
    )
    router = serve_asgi(build_router_app(config))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    before_s = time.time() - PRIORITY_EPOCH_S
    client.completions.create(model="test-model", prompt="a prompt of some words", max_tokens=1)
    after_s = time.time() - PRIORITY_EPOCH_S
    return before_s, after_s, int(json.loads(engine.bodies[-1])["priority"])


@pytest.mark.parametrize("bound_s", [None, 2.0, 25.0])
def test_the_configured_bound_sets_the_priority_the_router_sends(
    bound_s: float | None,
    serve_asgi: Callable[..., ThreadedServer],
    upstreams: Callable[[int], list[tuple[OpenAIUpstream, str]]],
) -> None:
    """A priors' prefill rate of 1 token/s makes a prompt's own service seconds per token, so
    stretch x own is past every bound here and the deadline the router sends is placement time plus
    the bound exactly: costs.priority_max_overtake_s when set, else the 10 s default. The recording
    engine sees the priority in the body."""
    ((engine, engine_url),) = upstreams(1)
    costs: dict[str, Any] = {"scrape_interval_s": 0, "priors": {"prefill_tokens_per_s": 1.0}}
    if bound_s is not None:
        costs["priority_max_overtake_s"] = bound_s
    before_s, after_s, sent = _priority_sent(serve_asgi, engine, engine_url, costs)
    bound = PRIORITY_MAX_OVERTAKE_S if bound_s is None else bound_s
    step = PRIORITY_STEP_S
    assert math.floor((before_s + bound) / step) <= sent <= math.floor((after_s + bound) / step), (
        sent * step - before_s,
        bound,
    )


def test_the_configured_fcfs_factor_caps_the_deadline_the_router_sends(
    serve_asgi: Callable[..., ThreadedServer],
    upstreams: Callable[[int], list[tuple[OpenAIUpstream, str]]],
) -> None:
    """One idle engine: the predicted first-come TTFT is the own service (nothing queued, nothing
    in flight), so with no bound the router's deadline is now + 20 x own, with
    costs.priority_fcfs_factor 2 it is now + 2 x own: a tenth (a prefill rate of 1 token/s makes
    own seconds per prompt token, far above the 0.05 s levels)."""
    ((engine, engine_url),) = upstreams(1)
    offsets: list[float] = []
    for factor in (float("inf"), 2.0):
        costs = {
            "scrape_interval_s": 0,
            "priors": {"prefill_tokens_per_s": 1.0},
            "priority_max_overtake_s": float("inf"),
            "priority_fcfs_factor": factor,
        }
        before_s, _, sent = _priority_sent(serve_asgi, engine, engine_url, costs)
        offsets.append(sent * PRIORITY_STEP_S - before_s)
    unbounded, relative = offsets
    assert unbounded > 20.0, offsets
    assert relative == pytest.approx(unbounded / 10, abs=0.5), offsets


# ------------------------------------------------------------------- live: router + engine process

PREFILL_TOKENS_PER_S = 10_000.0  # model time; the engine runs in real time (time_scale 1)
BIG_TOKENS = 6_000  # 0.6 s of prefill each
SMALL_TOKENS = 150


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FleetEngine]]:
    """Two engine processes that run one request at a time: one fcfs, one priority."""
    overrides = json.dumps({"prefill_tokens_per_s": PREFILL_TOKENS_PER_S, "max_num_seqs": 1})
    out: dict[str, FleetEngine] = {}
    with Fleet(tmp_path_factory.mktemp("priority")) as fleet:
        for policy in ("fcfs", "priority"):
            fleet_profile = FleetProfile(
                gpu_blocks=2048,
                time_scale=1.0,
                default_max_tokens=1,
                scheduling_policy=policy,
                extra_args=("--profile-overrides", overrides),
            )
            (out[policy],) = fleet.start(1, fleet_profile)
        yield out


def _router(
    serve_asgi: Callable[..., ThreadedServer], engine: FleetEngine, callback_path: bool = False, **costs: Any
) -> str:
    config = load_config(
        environ={},
        overrides={
            "engines": [engine.fleet_entry()],  # with the engine's scheduling_policy
            "policy": {"name": "tier_cost"},
            "tokenizer": {"backend": "sim"},
            "health": {"interval_s": 0.5},
            "costs": {"scrape_interval_s": 0, **costs},
            "proxy": {"callback_path": callback_path},
        },
    )
    server = serve_asgi(build_router_app(config))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/ready").status_code == 200:
            return server.url
        time.sleep(0.1)
    raise AssertionError("router not ready")


def _prompt(tokens: int, seed: int) -> str:
    return filler_text(tokens, seed)


#: Output tokens of the first request: its decode (~4 ms a step) keeps the engine's one slot for
#: ~2 s while the others queue behind it.
HOLD_TOKENS = 500


async def _queue(engine_url: str) -> tuple[float, float]:
    """The engine's (running, waiting) requests, from its /metrics."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(engine_url + "/metrics")).text
    values = {
        family.name: sum(sample.value for sample in family.samples)
        for family in text_string_to_metric_families(text)
    }
    return values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]


async def _held(engine_url: str) -> float:
    """Requests the engine holds (running + waiting), from its /metrics."""
    return sum(await _queue(engine_url))


async def _engine_holds(engine_url: str, n: int) -> None:
    """Wait until the engine holds ``n`` requests (running + waiting, from its /metrics)."""
    deadline = time.monotonic() + 30
    while (held := await _held(engine_url)) != n:
        assert time.monotonic() < deadline, f"the engine holds {held:g} requests, not {n}"
        await asyncio.sleep(0.01)


async def _first_tokens(
    url: str,
    engine_url: str,
    sends: list[tuple[str, str, dict[str, Any]]],
    headers: dict[str, dict[str, str]] | None = None,
    hold_tokens: int = HOLD_TOKENS,
) -> dict[str, float]:
    """Send each (name, prompt, extra body), streamed, with ``headers[name]`` if given, once the
    engine holds every one sent before (the first one decodes ``hold_tokens`` tokens, so the others
    queue behind it in sending order however slowly this machine runs); the time each one's first
    content chunk arrived."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    seen: dict[str, float] = {}

    async def one(max_tokens: int, name: str, prompt: str, extra: dict[str, Any]) -> None:
        stream = await client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            extra_body=extra or None,
            extra_headers=(headers or {}).get(name),
        )
        async for _ in stream:
            seen.setdefault(name, time.monotonic())

    tasks: list[asyncio.Task[None]] = []
    try:
        for i, send in enumerate(sends):
            tasks.append(asyncio.create_task(one(hold_tokens if i == 0 else 1, *send)))
            await _engine_holds(engine_url, i + 1)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    return seen


def _counts(url: str, family_name: str, label: str) -> dict[str, float]:
    """The router's counter ``family_name`` (its ``_total`` samples) by ``label``, from its /metrics."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name == family_name:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels[label]
                    counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def _priority_counts(url: str) -> dict[str, float]:
    """kvroute_priority_requests_total by source."""
    return _counts(url, "kvroute_priority_requests", "source")


@pytest.mark.slow
def test_a_queued_stream_whose_client_leaves_is_dropped_at_once(engines: dict[str, FleetEngine]) -> None:
    """As vLLM 0.32 does (measured: docs/results/q25/abort_check.py): on the one-slot engine A
    decodes 2,000 tokens (~8 s), B streams queued behind it; B's client closes its connection and
    B leaves the engine's queue while A still runs. Before, the sim server kept B queued until its
    first token, found the closed connection only when it wrote, and so ran B's prefill for
    nobody (the escalation's first attempts stayed queued)."""
    url = engines["fcfs"].url

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        async def a() -> None:
            stream = await client.completions.create(
                model=NAME, prompt=_prompt(SMALL_TOKENS, 31), max_tokens=2_000, stream=True
            )
            async for _ in stream:
                pass

        async def until(state: tuple[float, float]) -> None:
            deadline = time.monotonic() + 30
            while (now := await _queue(url)) != state:
                assert time.monotonic() < deadline, f"the engine's (running, waiting) is {now}, not {state}"
                await asyncio.sleep(0.01)

        task = asyncio.create_task(a())
        writer = None
        try:
            await until((1.0, 0.0))
            host, port = url.removeprefix("http://").rsplit(":", 1)
            _, writer = await asyncio.open_connection(host, int(port))
            data = json.dumps(
                {"model": NAME, "prompt": _prompt(SMALL_TOKENS, 32), "max_tokens": 5, "stream": True}
            ).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: e\r\ncontent-type: application/json\r\n"
                + b"content-length: %d\r\n\r\n" % len(data)
                + data
            )
            await until((1.0, 1.0))
            writer.close()
            await until((1.0, 0.0))
            assert not task.done(), "A ended before B left the queue: the check proves nothing"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if writer is not None:
                writer.close()
            await client.close()
        await until((0.0, 0.0))  # A's own abort, as it is running: found when its next chunk is written

    asyncio.run(run())


def _escalations(url: str) -> float:
    """kvroute_escalations_total over engines."""
    return sum(_counts(url, "kvroute_escalations", "engine").values())


@pytest.mark.slow
def test_router_sends_priorities_and_the_engine_serves_the_short_request_first(
    engines: dict[str, FleetEngine], serve_asgi: Callable[..., ThreadedServer]
) -> None:
    """A long request runs; another long one and then a short one queue behind it. Through a
    router that knows the engine schedules by priority, the short one is served before the
    long one that arrived earlier; on an fcfs engine (no priority sent: it would ignore one) they
    are served in arrival order."""
    sends: list[tuple[str, str, dict[str, Any]]] = [
        ("running", _prompt(BIG_TOKENS, 1), {}),
        ("long", _prompt(BIG_TOKENS, 2), {}),
        ("short", _prompt(SMALL_TOKENS, 3), {}),
    ]
    for policy in ("fcfs", "priority"):
        url = _router(serve_asgi, engines[policy])
        seen = asyncio.run(_first_tokens(url, engines[policy].url, sends))
        assert set(seen) == {"running", "long", "short"}
        assert seen["running"] < min(seen["long"], seen["short"])
        sent = _priority_counts(url)
        if policy == "fcfs":
            assert seen["long"] < seen["short"]
            assert sent == {}
        else:
            assert sent == {"router": 3.0}
            assert seen["short"] < seen["long"], seen
            # The short one waited for the running request only, not for the queued long one.
            assert seen["long"] - seen["short"] > 0.3


@pytest.mark.slow
def test_a_client_priority_is_passed_on_not_replaced(
    engines: dict[str, FleetEngine], serve_asgi: Callable[..., ThreadedServer]
) -> None:
    """The client puts its long request first (priority -1): the router must not overwrite it
    with the predicted service, which would put the short one first."""
    url = _router(serve_asgi, engines["priority"])
    seen = asyncio.run(
        _first_tokens(
            url,
            engines["priority"].url,
            [
                ("running", _prompt(BIG_TOKENS, 4), {}),
                ("short", _prompt(SMALL_TOKENS, 5), {}),
                ("long", _prompt(BIG_TOKENS, 6), {"priority": -1}),
            ],
        )
    )
    assert seen["long"] < seen["short"], seen
    assert _priority_counts(url) == {"router": 2.0, "client": 1.0}
    # And an fcfs engine accepts a client's priority and ignores it, as vLLM does (no 400).
    fcfs_url = _router(serve_asgi, engines["fcfs"])
    client = openai.OpenAI(base_url=fcfs_url + "/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model=NAME, prompt="hello", max_tokens=1, extra_body={"priority": 2})
    assert answer.choices[0].finish_reason == "length"


def test_the_x_vllm_priority_header_overrides_the_body(engines: dict[str, FleetEngine]) -> None:
    """Straight to the priority engine, each request sent once the engine holds the ones before
    it: "a" says priority 5 in its body and -5 in vLLM's X-Vllm-Priority header, "b" 0 in its
    body. The header wins, so a is served before b (by the body alone b would be). A header that
    is not an integer is a 400."""
    url = engines["priority"].url
    sends: list[tuple[str, str, dict[str, Any]]] = [
        ("running", _prompt(BIG_TOKENS, 21), {}),
        ("b", _prompt(SMALL_TOKENS, 22), {"priority": 0}),
        ("a", _prompt(SMALL_TOKENS, 23), {"priority": 5}),
    ]
    seen = asyncio.run(_first_tokens(url, url, sends, headers={"a": {"X-Vllm-Priority": "-5"}}))
    assert seen["running"] < seen["a"] < seen["b"], seen
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="X-Vllm-Priority' must be an integer"):
        client.completions.create(
            model=NAME, prompt="hello", max_tokens=1, extra_headers={"X-Vllm-Priority": "high"}
        )


#: Escalation after 1.5 s: the running request's first token comes after its ~0.6 s of prefill,
#: the two queued behind its ~4 s of decode (ESCALATE_HOLD_TOKENS) wait longer, also when sending
#: them takes seconds on a loaded machine (seen with HOLD_TOKENS' ~2 s, at load 4 on 2 cores: the
#: short one, sent late, started before its deadline and was not escalated).
ESCALATE_AFTER_S = 1.5
ESCALATE_HOLD_TOKENS = 1000


@pytest.mark.slow
@pytest.mark.parametrize("pick", ESCALATE_PICKS)
def test_a_stream_with_no_first_token_in_time_is_sent_again_at_priority_0(
    engines: dict[str, FleetEngine], serve_asgi: Callable[..., ThreadedServer], pick: str
) -> None:
    """As above (running, then long, then short, on the one-slot priority engine) with
    costs.priority_escalate_after_s: long and short have no first token 1.5 s after they arrived,
    so each is cancelled (its connection closed) and sent again with priority 0, where the two are
    served first come: long before short, the other way round from without escalation. Both answers
    are whole; the router counts two escalations. PICK route asks the policy again and PICK other
    asks it among the other engines (one engine here: the same for both). The first attempts leave
    the engine's queue when their connections close (as on vLLM 0.32; the test above)."""
    url = _router(
        serve_asgi,
        engines["priority"],
        priority_escalate_after_s=ESCALATE_AFTER_S,
        priority_escalate_pick=pick,
    )
    sends: list[tuple[str, str, dict[str, Any]]] = [
        ("running", _prompt(BIG_TOKENS, 11), {}),
        ("long", _prompt(BIG_TOKENS, 12), {}),
        ("short", _prompt(SMALL_TOKENS, 13), {}),
    ]
    seen = asyncio.run(_first_tokens(url, engines["priority"].url, sends, hold_tokens=ESCALATE_HOLD_TOKENS))
    assert set(seen) == {"running", "long", "short"}
    assert seen["running"] < seen["long"] < seen["short"], seen
    assert _escalations(url) == 2


@pytest.mark.slow
def test_escalation_on_the_callback_path(
    engines: dict[str, FleetEngine], serve_asgi: Callable[..., ThreadedServer], task_starts: list[object]
) -> None:
    """The test above with proxy.callback_path: the three streams are sent from the protocol's
    callbacks (each one's prompt tokenised already and an idle connection waiting: no task), the
    long and short ones with the escalation's deadline as their first-byte timeout. Each timeout
    hands its request over to a task, which escalates it: long before short, two escalations, and
    exactly two tasks. Sent with the first-byte budget instead (before this was built), neither
    escalates (and with their prompts cached by the warm-up, the order alone would not tell)."""
    url = _router(
        serve_asgi, engines["priority"], callback_path=True, priority_escalate_after_s=ESCALATE_AFTER_S
    )
    sends: list[tuple[str, str, dict[str, Any]]] = [
        ("running", _prompt(BIG_TOKENS, 31), {}),
        ("long", _prompt(BIG_TOKENS, 32), {}),
        ("short", _prompt(SMALL_TOKENS, 33), {}),
    ]

    async def warm() -> None:  # three pooled connections, and every prompt's tokens known
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            await asyncio.gather(
                *(client.completions.create(model=NAME, prompt=p, max_tokens=1) for _, p, _ in sends)
            )
        finally:
            await client.close()

    asyncio.run(warm())
    task_starts.clear()
    seen = asyncio.run(_first_tokens(url, engines["priority"].url, sends, hold_tokens=ESCALATE_HOLD_TOKENS))
    assert seen["running"] < seen["long"] < seen["short"], seen
    assert _escalations(url) == 2
    proxied = [cycle for cycle in task_starts if isinstance(cycle, ProxyExchange)]  # (not /metrics)
    assert len(proxied) == 2, "not sent from the callbacks (or escalated twice)"


def test_router_config_checks_the_escalation() -> None:
    base = {"engines": [{"id": "e0", "url": "http://127.0.0.1:9", "scheduling_policy": "priority"}]}
    for costs, message in [
        ({"priority_escalate_after_s": -1.0}, "costs.priority_escalate_after_s must be >= 0 seconds"),
        ({"priority_escalate_after_s": math.inf}, "costs.priority_escalate_after_s must be >= 0 seconds"),
        ({"priority_escalate_pick": "far"}, "costs.priority_escalate_pick must be one of same, route, other"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(environ={}, overrides={**base, "costs": costs})
    config = load_config(environ={}, overrides={**base, "costs": {"priority_escalate_after_s": 5.0}})
    assert (config.costs.priority_escalate_after_s, config.costs.priority_escalate_pick) == (5.0, "same")


@pytest.mark.parametrize("engines_n", [1, 3])
def test_escalation_pick_other_routes_among_the_other_engines(engines_n: int) -> None:
    """PICK other in the router: ``_escalate`` asks the policy among every engine but the one the
    stream was on (``decide(exclude=...)``), and in a one-engine fleet it stays there. Engines are
    never called (nothing is sent)."""
    from router.app import create_app
    from router.routing import CHAT, parse_request

    ids = [f"e{i}" for i in range(engines_n)]
    entries = [
        {"id": e, "url": f"http://127.0.0.1:{9 + i}", "model": "m", "scheduling_policy": "priority"}
        for i, e in enumerate(ids)
    ]
    config = load_config(
        environ={},
        overrides={
            "engines": entries,
            "policy": {"name": "round_robin"},  # would come back to any engine in turn
            "tokenizer": {"backend": "sim"},
            "costs": {"priority_escalate_after_s": 5.0, "priority_escalate_pick": "other"},
        },
    )
    router = create_app(config).state.router
    raw = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    for attempt in range(2 * engines_n):
        was_on = ids[attempt % engines_n]
        ctx = parse_request(CHAT, raw, {}, request_id=f"r{attempt}", started_s=0.0, config=config)
        target = asyncio.run(router._escalate(ctx, was_on))
        offered = [view.engine_id for view in ctx.fleet.engines]
        assert ctx.escalated
        if engines_n == 1:
            assert target == was_on and offered == [was_on]
        else:
            assert target != was_on and offered == [e for e in ids if e != was_on]
    if engines_n > 1:  # no other engine healthy: back to the one it was on, its candidates kept
        for other in ids[1:]:
            router.tracker.set_health(other, False, "down for the test")
        ctx = parse_request(CHAT, raw, {}, request_id="down", started_s=0.0, config=config)
        asyncio.run(router.decide(ctx))
        assert ctx.fleet is not None and [view.engine_id for view in ctx.fleet.engines] == ["e0"]
        fleet = ctx.fleet
        assert asyncio.run(router._escalate(ctx, "e0")) == "e0"
        assert ctx.fleet is fleet


@pytest.mark.slow
def test_an_fcfs_engine_gets_no_escalation(
    engines: dict[str, FleetEngine], serve_asgi: Callable[..., ThreadedServer]
) -> None:
    """The same queue on the fcfs engine, with escalation configured: the router sends no priority
    there, so nothing is escalated (a re-send would only go to the back of its queue) and the
    engine serves in arrival order."""
    url = _router(serve_asgi, engines["fcfs"], priority_escalate_after_s=ESCALATE_AFTER_S)
    sends: list[tuple[str, str, dict[str, Any]]] = [
        ("running", _prompt(BIG_TOKENS, 21), {}),
        ("long", _prompt(BIG_TOKENS, 22), {}),
        ("short", _prompt(SMALL_TOKENS, 23), {}),
    ]
    seen = asyncio.run(_first_tokens(url, engines["fcfs"].url, sends, hold_tokens=ESCALATE_HOLD_TOKENS))
    assert seen["running"] < seen["long"] < seen["short"], seen
    assert seen["long"] - seen["running"] > ESCALATE_AFTER_S  # it did wait longer than E
    assert _escalations(url) == 0
