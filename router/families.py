"""Prometheus metric families the router computes at scrape time (from the event manager, the index,
the cost model and the routing core), registered with ``RouterMetrics.add_collector``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvcore.calibration import CostModel
from kvcore.core import TtftTally
from kvcore.index import PrefixIndex
from policies.base import TIERS


def service_families(manager: Any, index: PrefixIndex | None, costs: CostModel) -> list[Any]:
    """Prometheus families computed at scrape time: event ingestion, index size, cost estimates."""
    families: list[Any] = []
    if manager is not None:
        per_engine: dict[str, dict[str, float]] = {}
        for h in manager.source_health().values():
            row = per_engine.setdefault(h.source.engine_id, {})
            for name in ("batches", "events", "decode_errors", "gaps", "replays", "replay_failures"):
                row[name] = row.get(name, 0.0) + getattr(h, name)
        for name, text in (
            ("batches", "KV-event batches applied"),
            ("events", "KV events applied"),
            ("decode_errors", "KV-event payloads that could not be decoded"),
            ("gaps", "Sequence gaps in an engine's KV-event stream"),
            ("replays", "Replay requests after a gap or a late join"),
            ("replay_failures", "Replays that failed or could not reach back far enough"),
        ):
            family = CounterMetricFamily(f"kvroute_kv_event_{name}", text, labels=["engine"])
            for engine_id, row in sorted(per_engine.items()):
                family.add_metric([engine_id], row[name])
            families.append(family)
    if index is not None:
        entries = GaugeMetricFamily(
            "kvroute_index_blocks",
            "Blocks the index holds per engine and tier",
            labels=["engine", "tier"],
        )
        for engine_id, row in sorted(index.stats()["engines"].items()):
            for tier in TIERS:
                entries.add_metric([engine_id, tier.name], row[f"{tier.name.lower()}_blocks"])
        families.append(entries)
    grouped: dict[str, GaugeMetricFamily] = {}
    for name, labels, value in costs.gauge_values():
        gauge = grouped.get(name)
        if gauge is None:
            gauge = grouped[name] = GaugeMetricFamily(
                name, "Cost model estimate (see /debug/costs)", labels=list(labels)
            )
        if math.isfinite(value):
            gauge.add_metric(list(labels.values()), value)
    families.extend(grouped.values())
    families.extend(prior_families(costs.snapshot()))
    return families


def prior_families(snapshot: dict[str, Any]) -> list[GaugeMetricFamily]:
    """The cost model's configured priors per engine, to plot next to the calibrated estimates."""
    prefill = GaugeMetricFamily(
        "kvroute_cost_prior_prefill_tokens_per_second", "Configured prefill-rate prior", labels=["engine"]
    )
    bandwidth = GaugeMetricFamily(
        "kvroute_cost_prior_load_bandwidth_bytes_per_second",
        "Configured tier load-bandwidth prior",
        labels=["engine", "tier"],
    )
    for engine_id, row in sorted(snapshot.get("engines", {}).items()):
        prior = row["prior"]
        prefill.add_metric([engine_id], prior["prefill_tokens_per_s"])
        for tier, values in prior["tiers"].items():
            if values["bandwidth_bytes_per_s"] is not None:
                bandwidth.add_metric([engine_id, tier.upper()], values["bandwidth_bytes_per_s"])
    return [prefill, bandwidth]


def ttft_tally_families(tally: Mapping[str, TtftTally]) -> list[Any]:
    """``kvroute_ttft_engine_seconds_total`` / ``kvroute_ttft_predicted_seconds_total{engine}``: the
    core's measured and predicted TTFTs of streamed requests, summed; the rate ratio says how true
    the figures the policies compare are (1 = unbiased; 2 = requests wait twice as long)."""
    measured = CounterMetricFamily(
        "kvroute_ttft_engine_seconds",
        "Streamed requests: measured TTFT from sending to the engine to its first streamed event"
        " (sum; compare with kvroute_ttft_predicted_seconds)",
        labels=["engine"],
    )
    predicted = CounterMetricFamily(
        "kvroute_ttft_predicted_seconds",
        "Streamed requests: TTFT the cost model predicted on the engine that served them (sum)",
        labels=["engine"],
    )
    for engine_id, t in sorted(tally.items()):
        measured.add_metric([engine_id], t.measured_s)
        predicted.add_metric([engine_id], t.predicted_s)
    return [measured, predicted]
