"""Live calibration: the real router in front of a simulated engine whose true costs are known.

Streamed requests (fresh prompts, histories reloaded from CPU, and from STORAGE) must bring the
router's prefill-rate and per-tier bandwidth estimates from priors 3x off to within 25% of the
engine's true values (40% below them on a loaded machine, where delays only add time); the same
traffic without streaming (no first token is seen) must leave the estimates exactly at the priors.
The offload-counter scrape is off so only the TTFT path learns.

True values as the router sees them: the engine's model-time figures x ``TIME_SCALE`` (the engine
runs that much faster than its model time); STORAGE's is the rate of a read into the CPU tier
followed by a load from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from kvcore.sim_tokenizer import NAME
from loadtest.bench_quality_live import scrape_ttft_sums
from router.config import load_config
from router.service import build_router_app
from sim.fleet import Fleet, FleetEngine, FleetProfile
from tests.conftest import ThreadedServer

TIME_SCALE = 1.0  # real time: the engine's own CPU work per token stays small next to the model's
MODEL_PREFILL_TOKENS_PER_S = 10_000.0
MODEL_CPU_BYTES_PER_S = 1.0e9
MODEL_STORAGE_BYTES_PER_S = 0.4e9
TRUE_PREFILL = MODEL_PREFILL_TOKENS_PER_S * TIME_SCALE
TRUE_CPU = MODEL_CPU_BYTES_PER_S * TIME_SCALE
#: A STORAGE hit is read into the CPU tier, then loaded from there (vLLM's tiering manager, which
#: the engine follows): its bytes cross both links one after the other.
TRUE_STORAGE = 1 / (1 / MODEL_STORAGE_BYTES_PER_S + 1 / MODEL_CPU_BYTES_PER_S) * TIME_SCALE
PROMPT_BLOCKS = 125  # 2,000 tokens: the GPU pool holds one prompt, the CPU tier two
ROUNDS = 10


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetEngine]:
    """One engine process (its own interpreter: no GIL shared with the router under test)."""
    overrides = {
        "prefill_tokens_per_s": MODEL_PREFILL_TOKENS_PER_S,
        "cpu_load_bytes_per_s": MODEL_CPU_BYTES_PER_S,
        "storage_load_bytes_per_s": MODEL_STORAGE_BYTES_PER_S,
        "cpu_latency_s": 0.0,
        "storage_latency_s": 0.0,
        "step_overhead_s": 0.0002,
    }
    profile = FleetProfile(
        gpu_blocks=PROMPT_BLOCKS + 8,
        cpu_blocks=2 * PROMPT_BLOCKS + 16,
        storage_blocks=8192,
        shared_storage=False,
        time_scale=TIME_SCALE,
        default_max_tokens=1,
        extra_args=("--profile-overrides", json.dumps(overrides)),
    )
    with Fleet(tmp_path_factory.mktemp("calibration")) as fleet:
        yield fleet.start(1, profile)[0]


def _router(serve_asgi: Callable[..., ThreadedServer], engine: FleetEngine) -> str:
    config = load_config(
        environ={},
        overrides={
            "engines": [engine.fleet_entry()],
            "policy": {"name": "tier_cost"},
            "tokenizer": {"backend": "sim"},
            # Speculative GPU entries would hide the CPU/STORAGE placement the test needs.
            "index": {"speculation_ttl_s": 0},
            "health": {"interval_s": 0.5},
            # Priors 3x too optimistic; no /metrics scrape: only observed TTFTs may move them.
            "costs": {
                "scrape_interval_s": 0,
                "priors": {
                    "prefill_tokens_per_s": 3 * TRUE_PREFILL,
                    "tiers": {
                        "cpu": {"bandwidth_bytes_per_s": 3 * TRUE_CPU, "latency_s": 0.0},
                        "storage": {"bandwidth_bytes_per_s": 3 * TRUE_STORAGE, "latency_s": 0.0},
                    },
                },
            },
            "log_level": "warning",
        },
    )
    return serve_asgi(build_router_app(config)).url


def _prompt(seed: int, blocks: int = PROMPT_BLOCKS) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 20000 for i in range(blocks * 16)]


def _fresh(seed: int) -> list[int]:
    """A new prompt of 40 to 125 blocks: varied sizes separate the per-token rate from the
    fixed per-request overhead."""
    return _prompt(seed, 40 + (seed * 37) % (PROMPT_BLOCKS - 40 + 1))


def _wait_indexed(url: str, prompt: list[int]) -> None:
    """Wait until the router's index holds ``prompt``'s full blocks on the engine's GPU: its KV
    events have arrived (the engine keeps the latest prompt on GPU)."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": 1}
    deadline = time.monotonic() + 30
    while True:
        (engine,) = httpx.post(f"{url}/v1/route/explain", json=body).json()["engines"]
        if engine["prefix_blocks_by_tier"]["gpu"] == len(prompt) // 16:
            return
        assert time.monotonic() < deadline, engine
        time.sleep(0.01)


def _drive(url: str, *, stream: bool, rounds: int = ROUNDS) -> list[int]:
    """Rounds of: fresh P, fresh Q, P again (its history now in CPU), fresh R, S and T, P again
    (pushed wholly out of CPU: in STORAGE; with part of it still in CPU, promoting the rest would
    evict that part, which is then read again, as vLLM does: more time than its bytes). Returns
    the cached tokens the engine reported per request."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    cached: list[int] = []

    def send(prompt: list[int]) -> None:
        if stream:
            chunks = client.completions.create(
                model=NAME, prompt=prompt, max_tokens=1, stream=True, stream_options={"include_usage": True}
            )
            usage: Any = None
            for chunk in chunks:
                usage = chunk.usage or usage
        else:
            usage = client.completions.create(model=NAME, prompt=prompt, max_tokens=1).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens or 0)
        _wait_indexed(url, prompt)  # the next choice is priced with this request's blocks

    for r in range(rounds):
        base = 10 * r
        p = _fresh(base)
        send(p)
        send(_prompt(base + 1))
        send(p + _prompt(base + 2, 1))
        send(_prompt(base + 3))
        send(_prompt(base + 4))
        send(_prompt(base + 6))
        send(p + _prompt(base + 5, 1))
    return cached


def _estimate(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/debug/costs").json()["engines"]["e0"]


@pytest.mark.slow
def test_streaming_traffic_calibrates_to_the_true_costs_and_non_stream_does_not(
    serve_asgi: Callable[..., ThreadedServer], engine: FleetEngine
) -> None:
    streamed = _router(serve_asgi, engine)
    cached = _drive(streamed, stream=True)
    assert sum(cached) > 0
    entry = _estimate(streamed)
    est = entry["estimate"]
    prefill = est["prefill_tokens_per_s"]
    cpu = est["tiers"]["cpu"]["bandwidth_bytes_per_s"]
    storage = est["tiers"]["storage"]["bandwidth_bytes_per_s"]
    print(
        f"after {entry['observations']} streamed requests: prefill {prefill:,.0f} tok/s "
        f"(true {TRUE_PREFILL:,.0f}), cpu {cpu / 1e9:.2f} GB/s (true {TRUE_CPU / 1e9:.2f}), "
        f"storage {storage / 1e9:.2f} GB/s (true {TRUE_STORAGE / 1e9:.2f})"
    )
    # Within 25% above the truth and 40% below it: on a loaded machine the engine's steps and the
    # router's reads run late, which only adds time to what the router measures, so the estimates
    # can only come out slower (seen: storage at 0.65x with the load average at 12-19 on 2 cores).
    # Either bound still tells a calibrated estimate from the 3x prior.
    for name, value, truth in (
        ("prefill", prefill, TRUE_PREFILL),
        ("cpu", cpu, TRUE_CPU),
        ("storage", storage, TRUE_STORAGE),
    ):
        assert 0.6 * truth <= value <= 1.25 * truth, (name, value, truth)

    # One round: a fresh prompt and reloads from CPU and from STORAGE, none of which may count (a
    # non-stream answer taken for a first token counts on its first request).
    still = _router(serve_asgi, engine)
    _drive(still, stream=False, rounds=1)
    entry = _estimate(still)
    assert entry["observations"] == 0
    assert entry["estimate"] == entry["prior"]


@pytest.mark.slow
def test_ttft_prediction_metrics_show_a_prior_three_times_too_fast_and_its_calibration(
    serve_asgi: Callable[..., ThreadedServer], engine: FleetEngine
) -> None:
    """The router starts from a prefill rate 3x the engine's true one (its profile, the independent
    truth): the first streamed fresh prompt takes ~3x its predicted TTFT, and the metrics must say
    so. After calibration the same kind of request takes about what was predicted. Non-stream
    requests have no first token and must not count."""
    url = _router(serve_asgi, engine)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

    def stream(prompt: list[int]) -> None:
        for _ in client.completions.create(model=NAME, prompt=prompt, max_tokens=1, stream=True):
            pass

    # Non-stream first (it also opens the router's connection to the engine): counted nowhere.
    client.completions.create(model=NAME, prompt=_prompt(5001), max_tokens=1)
    assert scrape_ttft_sums(url) == (0.0, 0.0)
    # A full-size fresh prompt (2,000 tokens, 0.2 s of true prefill): the fixed per-request
    # overhead (HTTP, scheduling) stays small next to the prefill.
    stream(_prompt(5000))
    measured, predicted = scrape_ttft_sums(url)
    tokens = PROMPT_BLOCKS * 16
    # Nothing learned yet: the prediction is the prior's prefill time, the measurement at least the
    # engine's true one (HTTP and scheduling only add to it).
    assert predicted == pytest.approx(tokens / (3 * TRUE_PREFILL), rel=0.02)
    assert measured >= 0.95 * tokens / TRUE_PREFILL
    assert 2.7 <= measured / predicted <= 4.5
    # Varied sizes let the calibration tell the per-token rate from the per-request overhead.
    for seed in range(5002, 5032):
        stream(_fresh(seed))
    before = scrape_ttft_sums(url)
    for seed in range(5032, 5042):
        stream(_fresh(seed))
    after = scrape_ttft_sums(url)
    ratio = (after[0] - before[0]) / (after[1] - before[1])
    print(f"measured / predicted TTFT: first request {measured / predicted:.2f}, after 31: {ratio:.2f}")
    assert 0.75 <= ratio <= 1.35  # the fitted per-request intercept is not in the prediction
