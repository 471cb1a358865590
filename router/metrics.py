"""Prometheus metrics of the router, in their own CollectorRegistry (no process globals).

``RouterMetrics`` is built per app by ``create_metrics()``; it is also a route observer
(``on_routed`` / ``on_first_byte`` / ``on_finished``), so the pipeline feeds it like any other.

The metrics written on every request (requests, latency, router time, TTFT, in flight) are
``LoopCounter``/``LoopHistogram``/``LoopGauge``: plain numbers written from the event loop only
and turned into metric families when /metrics is scraped. prometheus_client's own take a lock per
value they touch and cost about a tenth of the router's CPU per request (B3, docs/results). A
finished request's counts (requests, latency, router time) are kept as one tuple and folded in
bulk every ``FOLD_EVERY`` requests and before each scrape.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial, reduce
from operator import add, itemgetter
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from kvcore.core import InMemoryLoadLedger
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
#: Finished requests kept before they are counted in bulk (``RouterMetrics._fold``; every scrape
#: counts them too, so /metrics is never behind).
FOLD_EVERY = 256


class _LoopMetric:
    """A labelled metric kept as plain numbers per label tuple, written from the event loop only
    (no lock), exposed as a metric family at scrape time (``collect``)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._values: dict[tuple[str, ...], Any] = {}
        #: Runs before every scrape: writers that batch their observations fold them in here.
        self.before_collect: Callable[[], None] | None = None
        registry.register(self)

    def labels(self, *values: str) -> _LoopChild:
        """prometheus_client's calling form, for the occasional writer (errors, startup)."""
        return _LoopChild(self, tuple(values))

    def _family(self) -> Any:
        raise NotImplementedError

    def describe(self) -> list[Any]:
        return [self._family()]

    def collect(self) -> Iterator[Any]:
        if self.before_collect is not None:
            self.before_collect()
        family = self._family()
        for labels, value in list(self._values.items()):
            self._add(family, labels, value)
        yield family

    def _add(self, family: Any, labels: tuple[str, ...], value: Any) -> None:
        family.add_metric(list(labels), value)


class LoopCounter(_LoopMetric):
    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def inc_counts(self, counts: Mapping[tuple[str, ...], int]) -> None:
        """``inc`` by ``count`` for each (labels, count), in the order given: a batch's counts
        (a count added at once equals that many additions of 1.0: whole numbers are exact)."""
        values = self._values
        for key, count in counts.items():
            values[key] = values.get(key, 0.0) + count

    def _family(self) -> Any:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)


class LoopGauge(_LoopMetric):
    def set(self, labels: tuple[str, ...], value: float) -> None:
        self._values[labels] = value

    def _family(self) -> Any:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)


class LoopHistogram(_LoopMetric):
    """Per label tuple a list of bucket counts (the last bucket is +Inf) and the sum: an observation
    is one bisect and two additions."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        self.bounds = [float(b) for b in buckets]
        self._names = [floatToGoString(b) for b in self.bounds]
        super().__init__(name, documentation, labelnames, registry)

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        self.observe_all(((labels, value),))

    def observe_all(self, observations: Iterable[tuple[tuple[str, ...], float]]) -> None:
        """``observe`` for each (labels, value), in one call (a batch's observations)."""
        values, bounds, width = self._values, self.bounds, len(self.bounds) + 2
        for labels, value in observations:
            row = values.get(labels)
            if row is None:
                row = values[labels] = [0.0] * width
            row[bisect_left(bounds, value)] += 1  # the first bucket whose bound is >= value
            row[-1] += value

    def observe_many(self, labels: tuple[str, ...], observed: Sequence[float]) -> None:
        """``observe`` of each value in ``observed`` (non-empty) under one label tuple, with the
        steps per value in C: the bucket of each value (``bisect_left``, as ``observe_all``)
        counted, and the sum added up in the same order (``reduce``: the same float result as
        adding them one by one)."""
        values = self._values
        row = values.get(labels)
        if row is None:
            row = values[labels] = [0.0] * (len(self.bounds) + 2)
        for bucket, count in Tally(map(partial(bisect_left, self.bounds), observed)).items():
            row[bucket] += count
        row[-1] = reduce(add, observed, row[-1])

    def _family(self) -> Any:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _add(self, family: Any, labels: tuple[str, ...], value: Any) -> None:
        buckets, total = [], 0.0
        for name, count in zip([*self._names, "+Inf"], value[:-1], strict=True):
            total += count
            buckets.append((name, total))
        family.add_metric(list(labels), buckets, value[-1])


class _LoopChild:
    __slots__ = ("labels", "metric")

    def __init__(self, metric: _LoopMetric, labels: tuple[str, ...]) -> None:
        self.metric, self.labels = metric, labels

    def inc(self, amount: float = 1.0) -> None:
        assert isinstance(self.metric, LoopCounter)
        self.metric.inc(self.labels, amount)

    def set(self, value: float) -> None:
        assert isinstance(self.metric, LoopGauge)
        self.metric.set(self.labels, value)

    def observe(self, value: float) -> None:
        assert isinstance(self.metric, LoopHistogram)
        self.metric.observe(self.labels, value)


class RouterMetrics:
    """The router's counters and histograms; label values: engine id, policy name, arm name."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        labels = ("engine", "policy", "arm")
        self.requests = LoopCounter(
            "kvroute_requests",
            "Requests answered, by HTTP status (499 = client went away)",
            (*labels, "status"),
            self.registry,
        )
        self.latency_s = LoopHistogram(
            "kvroute_request_latency_seconds",
            "Time from request arrival to the last byte sent",
            labels,
            self.registry,
            _LATENCY_BUCKETS_S,
        )
        self.ttft_s = LoopHistogram(
            "kvroute_ttft_seconds",
            "Streamed requests: request body received -> first streamed event from the engine "
            "(non-stream answers have no first token and are not counted)",
            labels,
            self.registry,
            _LATENCY_BUCKETS_S,
        )
        self.router_s = LoopHistogram(
            "kvroute_router_seconds",
            "Router time per request: parse, tokenise, route (body received -> sent to the engine)",
            ("arm",),
            self.registry,
            _ROUTER_BUCKETS_S,
        )
        self.upstream_errors = Counter(
            "kvroute_upstream_errors",
            "Failures talking to an engine, by kind",
            ("engine", "kind"),
            registry=self.registry,
        )
        self.in_flight = LoopGauge(
            "kvroute_in_flight", "Requests sent to an engine and not finished", ("engine",), self.registry
        )
        self.client_write_timeouts = LoopCounter(
            "kvroute_client_write_timeouts",
            "Client connections aborted because the client took none of the answer bytes waiting "
            "for it for limits.client_write_timeout_s, by the answer's engine",
            ("engine",),
            self.registry,
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
        self.escalations = Counter(
            "kvroute_escalations",
            "Streams with no first event costs.priority_escalate_after_s after they arrived, cancelled"
            " on this engine and sent again with priority 0",
            ("engine",),
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
        #: Finished requests not yet counted: (engine, policy, arm, status, latency s, router s),
        #: folded into requests/latency/router time in bulk (``_fold``) every ``FOLD_EVERY``
        #: requests and before each scrape, instead of three metric writes per request.
        self._finished: list[tuple[str, str, str, int, float | None, float | None]] = []
        for metric in (self.requests, self.latency_s, self.router_s):
            metric.before_collect = self._fold

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
        ttft_s = ctx.ttft_s
        if ttft_s is not None:
            self.ttft_s.observe((ctx.engine_id or NO_ENGINE, ctx.policy_name, ctx.arm), ttft_s)

    def on_finished(self, ctx: RouteContext) -> None:
        engine = ctx.engine_id or NO_ENGINE
        finished = self._finished
        finished.append((engine, ctx.policy_name, ctx.arm, ctx.http_status, ctx.latency_s, ctx.router_s))
        if len(finished) >= FOLD_EVERY:
            self._fold()
        if ctx.priority is not None:
            self._child(self.priority_requests, engine, "router").inc()
        elif "priority" in ctx.body:
            self._child(self.priority_requests, engine, "client").inc()

    def _fold(self) -> None:
        """Count the finished requests not yet counted (the same figures ``on_finished`` wrote one
        by one before: requests by status, latency and router time). The requests are grouped
        by their labels (a batch is mostly a few label tuples) and each group's values observed
        at once; the groups go in the order their labels first occur."""
        finished, self._finished = self._finished, []
        if not finished:
            return
        self.requests.inc_counts(
            {(e, p, a, str(status)): n for (e, p, a, status), n in Tally(map(_STATUS_KEY, finished)).items()}
        )
        _observe_grouped(self.latency_s, finished, _ROUTE_KEY, _LATENCY, lambda key: key)
        _observe_grouped(self.router_s, finished, _ARM_KEY, _ROUTER_TIME, lambda arm: (arm,))

    def watch_in_flight(self, ledger: InMemoryLoadLedger) -> None:
        """``kvroute_in_flight`` read from ``ledger`` (this process's own accounting, not another
        replica's or worker's) when scraped, not written per change."""
        gauge = self.in_flight

        def read() -> None:
            for engine_id, count in ledger.in_flight_by_engine().items():
                gauge.set((engine_id,), count)

        gauge.before_collect = read

    def escalated(self, engine_id: str) -> None:
        self.escalations.labels(engine_id).inc()

    def upstream_error(self, engine_id: str, kind: str) -> None:
        self.upstream_errors.labels(engine_id, kind).inc()

    def add_collector(self, collect: Callable[[], Iterable[Any]]) -> None:
        """Expose metric families computed at scrape time by ``collect`` (e.g. index sizes)."""
        self.registry.register(_CallbackCollector(collect))

    def render(self) -> bytes:
        return generate_latest(self.registry)


#: Fields of a finished-request tuple (``RouterMetrics._finished``).
_STATUS_KEY = itemgetter(0, 1, 2, 3)
_ROUTE_KEY = itemgetter(0, 1, 2)
_ARM_KEY = itemgetter(2)
_LATENCY = itemgetter(4)
_ROUTER_TIME = itemgetter(5)


def _observe_grouped(
    histogram: LoopHistogram,
    finished: list[tuple[str, str, str, int, float | None, float | None]],
    key: Callable[[Any], Any],
    value: Callable[[Any], float | None],
    labels: Callable[[Any], tuple[str, ...]],
) -> None:
    """``histogram.observe`` of each finished request's ``value`` (None: not observed) under
    ``labels(key(request))``: grouped in one pass (label tuples in the order they first occur,
    each group's values in request order), each group observed at once."""
    groups: dict[Any, list[float]] = {}
    for request in finished:
        observed = value(request)
        if observed is not None:
            groups.setdefault(key(request), []).append(observed)
    for k, values in groups.items():
        histogram.observe_many(labels(k), values)


class _CallbackCollector:
    def __init__(self, collect: Callable[[], Iterable[Any]]) -> None:
        self._collect = collect

    def describe(self) -> list[Any]:
        return []  # names are only known at scrape time; skips the registry's eager collect()

    def collect(self) -> Iterable[Any]:
        return self._collect()


def create_metrics() -> RouterMetrics:
    return RouterMetrics()
