"""Prometheus metrics of the router, in their own CollectorRegistry (no process globals).

``RouterMetrics`` is built per app by ``create_metrics()``; it is also a route observer
(``on_routed`` / ``on_first_byte`` / ``on_finished``), so the pipeline feeds it like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from router.routing import RouteContext

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds: from 1 ms (cached, idle) to minutes (long prefill under load).
_LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)
# Router time: from 50 us (no tokenizer) to 250 ms (a cold engine /tokenize round trip).
_ROUTER_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
NO_ENGINE = "none"


class RouterMetrics:
    """The router's counters and histograms; label values: engine id, policy name, arm name."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        labels = ("engine", "policy", "arm")
        self.requests = Counter(
            "kvroute_requests",
            "Requests answered, by HTTP status (499 = client went away)",
            (*labels, "status"),
            registry=self.registry,
        )
        self.latency_s = Histogram(
            "kvroute_request_latency_seconds",
            "Time from request arrival to the last byte sent",
            labels,
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.ttft_s = Histogram(
            "kvroute_ttft_seconds",
            "Streamed requests: request body received -> first streamed event from the engine "
            "(non-stream answers have no first token and are not counted)",
            labels,
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.router_s = Histogram(
            "kvroute_router_seconds",
            "Router time per request: parse, tokenise, route (body received -> sent to the engine)",
            ("arm",),
            buckets=_ROUTER_BUCKETS_S,
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "kvroute_upstream_errors",
            "Failures talking to an engine, by kind",
            ("engine", "kind"),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "kvroute_in_flight",
            "Requests sent to an engine and not finished",
            ("engine",),
            registry=self.registry,
        )
        self.engine_healthy = Gauge(
            "kvroute_engine_healthy",
            "1 when the engine passes health checks",
            ("engine",),
            registry=self.registry,
        )
        self.priority_requests = Counter(
            "kvroute_priority_requests",
            "Requests sent with a vLLM priority: source=router (the router's shortest-work-first "
            "deadline, engines with scheduling_policy priority) or client (the client's own, passed on)",
            ("engine", "source"),
            registry=self.registry,
        )
        self.event_source_silent = Gauge(
            "kvroute_event_source_silent",
            "1 when the engine served traffic but its KV-event source published nothing since",
            ("engine",),
            registry=self.registry,
        )

        # Labelled children cached by label tuple: labels() costs a lock and a dict build per call.
        self._children: dict[tuple[int | str, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key: tuple[int | str, ...] = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # Observer hooks (see router.routing.RouteObserver).
    def on_routed(self, ctx: RouteContext) -> None:
        return None

    def on_first_byte(self, ctx: RouteContext) -> None:
        if ctx.ttft_s is not None:
            self._child(self.ttft_s, ctx.engine_id or NO_ENGINE, ctx.policy_name, ctx.arm).observe(ctx.ttft_s)

    def on_finished(self, ctx: RouteContext) -> None:
        engine = ctx.engine_id or NO_ENGINE
        self._child(self.requests, engine, ctx.policy_name, ctx.arm, str(ctx.http_status)).inc()
        if ctx.latency_s is not None:
            self._child(self.latency_s, engine, ctx.policy_name, ctx.arm).observe(ctx.latency_s)
        router_s = ctx.router_s
        if router_s is not None:
            self._child(self.router_s, ctx.arm).observe(router_s)
        if ctx.priority is not None:
            self._child(self.priority_requests, engine, "router").inc()
        elif "priority" in ctx.body:
            self._child(self.priority_requests, engine, "client").inc()

    def set_in_flight(self, engine_id: str, count: int) -> None:
        self._child(self.in_flight, engine_id).set(count)

    def upstream_error(self, engine_id: str, kind: str) -> None:
        self.upstream_errors.labels(engine_id, kind).inc()

    def add_collector(self, collect: Callable[[], Iterable[Any]]) -> None:
        """Expose metric families computed at scrape time by ``collect`` (e.g. index sizes)."""
        self.registry.register(_CallbackCollector(collect))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CallbackCollector:
    def __init__(self, collect: Callable[[], Iterable[Any]]) -> None:
        self._collect = collect

    def describe(self) -> list[Any]:
        return []  # names are only known at scrape time; skips the registry's eager collect()

    def collect(self) -> Iterable[Any]:
        return self._collect()


def create_metrics() -> RouterMetrics:
    return RouterMetrics()
