"""parse_engine_metrics on Prometheus text in vLLM's format (names, labels, counters' _total/_created)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvcore.calibration import CostModel
from policies.base import Tier
from router.scrape import parse_engine_metrics, tier_capacities_tokens, tier_of_label
from tests.conftest import ThreadedServer

CACHE_CONFIG_INFO = (
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
    'gpu_memory_utilization="0.92",num_cpu_blocks="None",num_gpu_blocks="27852",'
    'prefix_caching_hash_algo="sha256_cbor"} 1.0'
)

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.61
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 120000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 90000.0
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 30000.0
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12000.0
# HELP vllm:prompt_tokens_cached_by_source_total Cached prompt tokens by source.
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 90000.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 12000.0
# HELP vllm:kv_offload_load_bytes_total Bytes loaded from the offload tiers.
# TYPE vllm:kv_offload_load_bytes_total counter
vllm:kv_offload_load_bytes_total{engine="0",model_name="m",tier="CPU"} 6.4e+10
vllm:kv_offload_load_bytes_total{engine="0",model_name="m",tier="1:fs"} 5.0e+09
vllm:kv_offload_load_bytes_total{engine="1",model_name="m",tier="CPU"} 3.2e+10
# HELP vllm:kv_offload_load_time_total Seconds spent loading from the offload tiers.
# TYPE vllm:kv_offload_load_time_total counter
vllm:kv_offload_load_time_total{engine="0",model_name="m",tier="CPU"} 1.0
vllm:kv_offload_load_time_total{engine="0",model_name="m",tier="1:fs"} 2.5
vllm:kv_offload_load_time_total{engine="1",model_name="m",tier="CPU"} 0.5
# HELP vllm:kv_offload_store_bytes_total Bytes stored to the offload tiers.
# TYPE vllm:kv_offload_store_bytes_total counter
vllm:kv_offload_store_bytes_total{engine="0",model_name="m"} 8.0e+10
# HELP vllm:kv_offload_store_time_total Seconds spent storing.
# TYPE vllm:kv_offload_store_time_total counter
vllm:kv_offload_store_time_total{engine="0",model_name="m"} 2.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
@CACHE_CONFIG_INFO@
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.3
""".replace("@CACHE_CONFIG_INFO@", CACHE_CONFIG_INFO)


def test_parse_vllm_text() -> None:
    m = parse_engine_metrics(VLLM_TEXT)
    assert m.num_requests_running == 5.0  # summed over data-parallel ranks
    assert m.num_requests_waiting == 7.0
    assert m.kv_cache_usage_perc == pytest.approx(0.61)  # the fullest rank
    assert m.prefix_cache_queries_total == 120_000 and m.prefix_cache_hits_total == 90_000
    assert m.external_prefix_cache_queries_total == 30_000 and m.external_prefix_cache_hits_total == 12_000
    assert m.prompt_tokens_cached_by_source == {"local_cache_hit": 90_000, "external_kv_transfer": 12_000}
    assert m.offload_load_bytes_by_tier == {Tier.CPU: 9.6e10, Tier.STORAGE: 5e9}
    assert m.offload_load_time_s_by_tier == {Tier.CPU: 1.5, Tier.STORAGE: 2.5}
    assert m.offload_store_bytes_by_tier == {Tier.CPU: 8e10}  # no tier label -> CPU
    assert m.offload_store_time_s_by_tier == {Tier.CPU: 2.0}
    assert m.block_size == 16 and m.num_gpu_blocks == 27_852
    assert m.cache_config["prefix_caching_hash_algo"] == "sha256_cbor"


def test_missing_metrics_stay_unknown() -> None:
    m = parse_engine_metrics("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n")
    assert m.num_requests_running == 1.0
    assert m.num_requests_waiting is None and m.kv_cache_usage_perc is None and m.block_size is None
    assert m.offload_load_bytes_by_tier == {}
    empty = parse_engine_metrics("")
    assert empty.num_requests_running is None


def test_text_written_by_prometheus_client_round_trips_into_cost_model() -> None:
    # An engine stand-in exporting with prometheus_client (as sim/server.py may) parses the same way.
    registry = CollectorRegistry()
    load_bytes = Counter(
        "vllm:kv_offload_load_bytes", "b", ["model_name", "engine", "transfer_type"], registry=registry
    )
    load_time = Counter(
        "vllm:kv_offload_load_time", "s", ["model_name", "engine", "transfer_type"], registry=registry
    )
    waiting = Gauge("vllm:num_requests_waiting", "w", ["model_name", "engine"], registry=registry)
    waiting.labels("m", "0").set(4)
    model = CostModel()
    for step in range(30):
        load_bytes.labels("m", "0", "CPU_to_GPU").inc(16e9)
        load_time.labels("m", "0", "CPU_to_GPU").inc(1.0)
        m = parse_engine_metrics(generate_latest(registry).decode())
        model.update_offload_counters(
            "e", m.offload_load_bytes_by_tier, m.offload_load_time_s_by_tier, float(step)
        )
    assert m.num_requests_waiting == 4
    assert model.estimates("e").load_bandwidth_bytes_per_s[Tier.CPU] == pytest.approx(16e9, rel=0.01)


@pytest.mark.parametrize(
    ("label", "tier"),
    [
        (None, Tier.CPU),
        ("CPU", Tier.CPU),
        ("cpu", Tier.CPU),
        ("GPU", Tier.GPU),
        ("STORAGE", Tier.STORAGE),
        ("CPU_to_GPU", Tier.CPU),
        ("GPU_to_CPU", Tier.CPU),
        ("1:fs", Tier.STORAGE),
        ("2:obj", Tier.STORAGE),
        # vLLM 0.32's prompt_tokens_cached_by_source (read on its CPU build with the tiers of
        # sim/vllm_host_offload.py): "device" was read as CPU before.
        ("device", Tier.GPU),
        ("host", Tier.CPU),
        ("disk", Tier.STORAGE),
    ],
)
def test_tier_labels(label: str | None, tier: Tier) -> None:
    assert tier_of_label(label) == tier


def test_malformed_text_raises() -> None:
    with pytest.raises(ValueError):
        parse_engine_metrics("vllm:num_requests_running{engine=0 3\n")


def test_tier_capacities_from_vllm_cache_config_info() -> None:
    """Real vLLM: GPU blocks known, CPU "None" (unknown, not 0), no storage labels: the router's
    configured pool size stands in for STORAGE only when the engine mounts a configured pool."""
    parsed = parse_engine_metrics(CACHE_CONFIG_INFO + "\n")
    assert parsed.num_gpu_blocks == 27852 and parsed.num_cpu_blocks is None
    assert tier_capacities_tokens(parsed, block_size=16, configured_pool_blocks=None) == {
        "gpu_capacity_tokens": 27852 * 16
    }
    assert tier_capacities_tokens(parsed, block_size=16, configured_pool_blocks=1000) == {
        "gpu_capacity_tokens": 27852 * 16,
        "storage_capacity_tokens": 1000 * 16,
    }


def test_tier_capacities_reported_by_the_engine_win_over_config() -> None:
    text = (
        'vllm:cache_config_info{block_size="64",num_gpu_blocks="100",num_cpu_blocks="300",'
        'storage_pool="p",storage_blocks="5000"} 1.0\n'
    )
    parsed = parse_engine_metrics(text)
    assert tier_capacities_tokens(parsed, block_size=64, configured_pool_blocks=7) == {
        "gpu_capacity_tokens": 6400.0,
        "cpu_capacity_tokens": 19200.0,
        "storage_capacity_tokens": 320000.0,
    }
    none = parse_engine_metrics(
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="8",num_cpu_blocks="0",'
        'storage_blocks="0"} 1.0\n'
    )
    # 0 = the engine has no such tier (evictions from it are priced as recompute), not unknown.
    assert tier_capacities_tokens(none, block_size=16, configured_pool_blocks=None) == {
        "gpu_capacity_tokens": 128.0,
        "cpu_capacity_tokens": 0.0,
        "storage_capacity_tokens": 0.0,
    }


async def test_a_measured_bandwidth_the_prior_cannot_reach_is_logged_once(
    serve_asgi: Callable[..., ThreadedServer], caplog: pytest.LogCaptureFixture
) -> None:
    """An engine whose offload counters say 1 GB/s (vLLM's CPU build's host-copy tier) behind a
    router with the default 64 GB/s CPU prior: the scraper says so once, naming the engine, the
    figure and the setting to change, instead of pricing the loads at the bound in silence."""
    import aiohttp
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    from router.config import EngineConfig, load_config
    from router.load import LoadTracker
    from router.scraper import EngineScraper

    scrapes = [0]

    app = FastAPI()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        n = scrapes[0]
        scrapes[0] += 1
        return PlainTextResponse(
            f'vllm:kv_offload_load_bytes_total{{engine="0"}} {n * 64e6}\n'
            f'vllm:kv_offload_load_time_total{{engine="0"}} {n * 0.064}\n'
        )

    server = serve_asgi(app)
    engine = EngineConfig(id="e0", url=server.url)
    config = load_config(environ={}, overrides={"engines": [{"id": "e0", "url": server.url}]})

    class Watchdog:
        def note_counters(self, engine: Any, parsed: Any) -> None:
            pass

    scraper = EngineScraper(
        config,
        tracker=LoadTracker([engine]),
        costs=CostModel(calibration=None),
        watchdog=Watchdog(),  # type: ignore[arg-type]
    )
    async with aiohttp.ClientSession() as session:
        scraper.session = session
        with caplog.at_level(logging.WARNING, logger="kvroute.scraper"):
            for _ in range(4):
                await scraper.scrape_once(engine)
    warned = [r.getMessage() for r in caplog.records if "beyond" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "engine e0" in warned[0] and "CPU" in warned[0] and "1e+09" in warned[0]
    assert "costs.priors.tiers.cpu.bandwidth_bytes_per_s" in warned[0]
