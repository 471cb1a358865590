"""Shortest work first: vLLM's priority scheduling in the engine model, and the router sending each
request's predicted own service as its ``priority`` to engines started with
``--scheduling-policy priority``.

The truths are the engine's order of service (which request gets its first token first), vLLM's
preemption rule (the running request with the largest (priority, arrival) is the victim) and
vLLM's refusal of a non-zero priority on an fcfs engine, not the router's own account of what it
sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcore.core import PRIORITY_STRETCH, shortest_first_priority
from kvcore.sim_tokenizer import NAME, filler_text
from policies.costs import PredictedParts
from router.config import ConfigError, load_config
from router.service import build_router_app
from sim.engine import EngineCore, SimRequest
from sim.fleet import Fleet, FleetEngine, FleetProfile
from tests.conftest import ThreadedServer
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


def test_fcfs_engine_refuses_a_priority_in_vllms_words() -> None:
    engine = EngineCore("e0", profile())
    with pytest.raises(ValueError, match=r"^Got priority 3 but Priority scheduling is not enabled\.$"):
        engine.add_request(SimRequest("r", list(range(20)), max_tokens=2, priority=3))
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


def test_priority_is_a_deadline_stretched_by_the_predicted_own_service() -> None:
    parts = PredictedParts(wait_s=9.0, slot_s=4.0, load_s=(0.0, 0.25, 0.25), prefill_s=0.5)  # own 1 s
    # Pure shortest work first: own service in levels; the waits ahead are not the request's work.
    assert shortest_first_priority(parts, 0.5, stretch=0) == 2
    assert shortest_first_priority(PredictedParts(), 0.05, stretch=0) == 0
    # Deadline = now + stretch x own: (10 + 20 x 1) / 0.5.
    assert shortest_first_priority(parts, 0.5, now_s=10.0, stretch=20) == 60
    # A 1 s request placed at t=0 is overtaken by a 50 ms one placed until ~19 s later, not after.
    big = shortest_first_priority(parts, 0.05, now_s=0.0, stretch=20)
    small = PredictedParts(prefill_s=0.05)
    assert shortest_first_priority(small, 0.05, now_s=18.9, stretch=20) < big
    assert shortest_first_priority(small, 0.05, now_s=19.1, stretch=20) > big
    assert shortest_first_priority(PredictedParts(prefill_s=float("inf")), 0.05) == 1 << 62
    assert shortest_first_priority(PredictedParts(prefill_s=float("nan")), 0.5, now_s=3.0) == 6


@pytest.mark.slow
def test_des_priority_engines_keep_hits_that_fcfs_engines_evict_while_they_queue() -> None:
    """64 conversations on 2 engines whose GPU pools hold ~5 running requests each (the memory
    pressure of tests/test_des.py's calibration test, whose fcfs run this shares). With fcfs engines
    a turn whose history is cached waits behind recomputes that evict it; with priority engines (the
    DES sends each request's shortest_first_priority, as the router does) it runs first. The hit
    rate is the engines' own count of cached prompt tokens, the TTFTs the engines' timelines."""
    fcfs = memory_pressure_run("fcfs")[1]
    pure = memory_pressure_run("priority", 0.0)[1]
    aged = memory_pressure_run("priority", PRIORITY_STRETCH)[1]
    # Measured here: hit 0.193 (fcfs) -> 0.401 (pure) / 0.334 (stretch 20); TTFT p50 2.09 -> 0.85 /
    # 1.62 s. The aged deadline gives part of it back: in this short run the longest own service
    # is ~0.1 s, so a stretch of 20 reorders only within ~2 s.
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


def _router(serve_asgi: Callable[..., ThreadedServer], engine: FleetEngine) -> str:
    config = load_config(
        environ={},
        overrides={
            "engines": [engine.fleet_entry()],  # with the engine's scheduling_policy
            "policy": {"name": "tier_cost"},
            "tokenizer": {"backend": "sim"},
            "health": {"interval_s": 0.5},
            "costs": {"scrape_interval_s": 0},
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


async def _engine_holds(engine_url: str, n: int) -> None:
    """Wait until the engine holds ``n`` requests (running + waiting, from its /metrics)."""
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient() as http:
        while True:
            held = 0.0
            for family in text_string_to_metric_families((await http.get(engine_url + "/metrics")).text):
                if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                    held += sum(sample.value for sample in family.samples)
            if held == n:
                return
            assert time.monotonic() < deadline, f"the engine holds {held:g} requests, not {n}"
            await asyncio.sleep(0.01)


async def _first_tokens(
    url: str, engine_url: str, sends: list[tuple[str, str, dict[str, Any]]]
) -> dict[str, float]:
    """Send each (name, prompt, extra body), streamed, once the engine holds every one sent before
    (the first one decodes HOLD_TOKENS tokens, so the others queue behind it in sending order
    however slowly this machine runs); the time each one's first content chunk arrived."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    seen: dict[str, float] = {}

    async def one(max_tokens: int, name: str, prompt: str, extra: dict[str, Any]) -> None:
        stream = await client.completions.create(
            model=NAME, prompt=prompt, max_tokens=max_tokens, stream=True, extra_body=extra or None
        )
        async for _ in stream:
            seen.setdefault(name, time.monotonic())

    tasks: list[asyncio.Task[None]] = []
    try:
        for i, send in enumerate(sends):
            tasks.append(asyncio.create_task(one(HOLD_TOKENS if i == 0 else 1, *send)))
            await _engine_holds(engine_url, i + 1)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    return seen


def _priority_counts(url: str) -> dict[str, float]:
    """kvroute_priority_requests_total by source, from the router's /metrics."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name == "kvroute_priority_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    source = sample.labels["source"]
                    counts[source] = counts.get(source, 0.0) + sample.value
    return counts


@pytest.mark.slow
def test_router_sends_priorities_and_the_engine_serves_the_short_request_first(
    engines: dict[str, FleetEngine], serve_asgi: Callable[..., ThreadedServer]
) -> None:
    """A long request runs; another long one and then a short one queue behind it. Through a
    router that knows the engine schedules by priority, the short one is served before the
    long one that arrived earlier; on an fcfs engine (no priority sent: it would refuse one with
    a 400) they are served in arrival order."""
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
    # And an fcfs engine refuses a client's priority with vLLM's 400, passed on by the router.
    fcfs_url = _router(serve_asgi, engines["fcfs"])
    client = openai.OpenAI(base_url=fcfs_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="Priority scheduling is not enabled"):
        client.completions.create(model=NAME, prompt="hello", max_tokens=1, extra_body={"priority": 2})
