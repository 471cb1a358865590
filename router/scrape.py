"""Parse an engine's Prometheus /metrics text (vLLM names) into the numbers the router routes by.

Pure parsing, no I/O: the caller fetches the text. Samples of one metric over several ``engine``
labels (data-parallel ranks of one server) are summed (gauges of usage: the maximum is kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from policies.base import Tier

#: Labels an offload metric may carry to say which tier the transfer touched, most specific first.
_TIER_LABELS = ("tier", "medium", "source", "transfer_type")
_STORAGE_WORDS = ("storage", "fs", "obj", "disk", "nvme", "file", "lmcache", "remote")


def tier_of_label(value: str | None) -> Tier:
    """Tier named by an offload metric's label value; no label -> CPU (the only single-tier offload).

    Accepts "GPU"/"CPU"/"STORAGE" in any case, vLLM's ``transfer_type`` values like "CPU_to_GPU"
    (the side that is not GPU), secondary tier names like "1:fs" or "obj" (STORAGE), and the
    sources of vLLM's ``prompt_tokens_cached_by_source`` ("device", "host", "disk"; "p2p" and
    "external_unspecified" read as CPU).
    """
    if not value:
        return Tier.CPU
    text = value.lower()
    if "_to_" in text:
        src, dst = text.split("_to_", 1)
        text = dst if src == "gpu" else src
    text = text.split(":", 1)[-1]
    if text in ("gpu", "hbm", "device"):
        return Tier.GPU
    if text in ("cpu", "host", "dram"):
        return Tier.CPU
    if any(word in text for word in _STORAGE_WORDS):
        return Tier.STORAGE
    return Tier.CPU


@dataclass(slots=True)
class EngineMetrics:
    """One scrape of one engine. None / empty = the engine did not export that metric."""

    num_requests_running: float | None = None
    num_requests_waiting: float | None = None
    kv_cache_usage_perc: float | None = None
    #: Tokens (counters).
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    external_prefix_cache_queries_total: float | None = None
    external_prefix_cache_hits_total: float | None = None
    #: Finished requests (all finish reasons summed).
    request_success_total: float | None = None
    prompt_tokens_cached_by_source: dict[str, float] = field(default_factory=dict)
    #: Cumulative counters per tier, bytes and seconds.
    offload_load_bytes_by_tier: dict[Tier, float] = field(default_factory=dict)
    offload_load_time_s_by_tier: dict[Tier, float] = field(default_factory=dict)
    offload_store_bytes_by_tier: dict[Tier, float] = field(default_factory=dict)
    offload_store_time_s_by_tier: dict[Tier, float] = field(default_factory=dict)
    #: From ``vllm:cache_config_info`` labels.
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    #: CPU tier blocks (0 = no CPU tier; None = not reported, e.g. vLLM's "None").
    num_cpu_blocks: int | None = None
    #: Shared STORAGE pool the engine mounts and its size in blocks (labels ``storage_pool``,
    #: ``storage_blocks``; None = not reported).
    storage_pool: str | None = None
    storage_blocks: int | None = None
    cache_config: dict[str, str] = field(default_factory=dict)


_SUMMED = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total": "external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total": "external_prefix_cache_hits_total",
    "vllm:request_success_total": "request_success_total",
}
_PER_TIER = {
    "vllm:kv_offload_load_bytes_total": "offload_load_bytes_by_tier",
    "vllm:kv_offload_load_time_total": "offload_load_time_s_by_tier",
    "vllm:kv_offload_store_bytes_total": "offload_store_bytes_by_tier",
    "vllm:kv_offload_store_time_total": "offload_store_time_s_by_tier",
}


def _optional_int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "") else None
    except ValueError:
        return None


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Parse Prometheus exposition text; ValueError (from the parser) when the text is malformed."""
    out = EngineMetrics()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name in _SUMMED:
                attr = _SUMMED[name]
                setattr(out, attr, (getattr(out, attr) or 0.0) + value)
            elif name == "vllm:kv_cache_usage_perc":
                out.kv_cache_usage_perc = max(out.kv_cache_usage_perc or 0.0, value)
            elif name in _PER_TIER:
                label = next((labels[k] for k in _TIER_LABELS if k in labels), None)
                per_tier: dict[Tier, float] = getattr(out, _PER_TIER[name])
                tier = tier_of_label(label)
                per_tier[tier] = per_tier.get(tier, 0.0) + value
            elif name == "vllm:prompt_tokens_cached_by_source_total":
                source = labels.get("source", "")
                out.prompt_tokens_cached_by_source[source] = (
                    out.prompt_tokens_cached_by_source.get(source, 0.0) + value
                )
            elif name == "vllm:cache_config_info":
                out.cache_config = {k: v for k, v in labels.items() if k not in ("engine", "model_name")}
                out.block_size = _optional_int(labels.get("block_size"))
                out.num_gpu_blocks = _optional_int(labels.get("num_gpu_blocks"))
                out.num_cpu_blocks = _optional_int(labels.get("num_cpu_blocks"))
                out.storage_pool = labels.get("storage_pool")
                out.storage_blocks = _optional_int(labels.get("storage_blocks"))
    return out


def tier_capacities_tokens(
    parsed: EngineMetrics, *, block_size: int, configured_pool_blocks: int | None
) -> dict[str, float]:
    """Capacity of each tier in tokens, as ``EngineView.extra`` keys (``gpu_capacity_tokens``,
    ``cpu_capacity_tokens``, ``storage_capacity_tokens``) for cost policies (horizon_cost prices
    the evictions a placement causes from them). Only what is known is returned.

    GPU and CPU: the engine's ``cache_config_info`` blocks x ``block_size`` (the engine's own).
    STORAGE: the pool size the engine reports (``storage_blocks`` > 0) or else, when the router's
    config names a shared pool for the engine, ``configured_pool_blocks`` (what the index ages the
    pool with); an engine that reports ``storage_blocks`` 0 has none (0)."""
    out: dict[str, float] = {}
    if parsed.num_gpu_blocks is not None:
        out["gpu_capacity_tokens"] = float(parsed.num_gpu_blocks * block_size)
    if parsed.num_cpu_blocks is not None:
        out["cpu_capacity_tokens"] = float(parsed.num_cpu_blocks * block_size)
    if parsed.storage_blocks:
        out["storage_capacity_tokens"] = float(parsed.storage_blocks * block_size)
    elif configured_pool_blocks is not None:
        out["storage_capacity_tokens"] = float(configured_pool_blocks * block_size)
    elif parsed.storage_blocks == 0:
        out["storage_capacity_tokens"] = 0.0
    return out
