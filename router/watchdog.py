"""The silent-KV-event-source rule: an engine whose own prefix-cache counters prove it stored new
blocks, but whose KV-event source published nothing for ``events.silent_after_s`` since, is
reported (log line, ``kvroute_event_source_silent{engine}``, GET /ready)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from router.config import EngineConfig, RouterConfig
from router.load import LoadTracker
from router.metrics import RouterMetrics
from router.observers import TrafficCounter
from router.scrape import EngineMetrics

log = logging.getLogger("kvroute.watchdog")


@dataclass(slots=True)
class _CounterSample:
    """One scrape's figures the silent-source rule compares with the next one."""

    at_s: float
    missed_tokens: float
    routed: int
    in_flight: int
    engine_requests: float | None


class SilentSourceWatchdog:
    """Fed each engine scrape (``note_counters``); ``manager`` (the EventManager) is set once the
    router's services have started it, and ``run`` checks periodically while it is."""

    def __init__(
        self, config: RouterConfig, *, tracker: LoadTracker, metrics: RouterMetrics, traffic: TrafficCounter
    ) -> None:
        self.config = config
        self.tracker = tracker
        self.metrics = metrics
        self.traffic = traffic
        self.manager: Any = None
        #: Engine id -> its previous scrape's counters, and -> (monotonic time from which the
        #: engine must have published, what proves it): set when its prefix-cache counters moved
        #: more than requests without new blocks can explain.
        self._counters: dict[str, _CounterSample] = {}
        self._evidence: dict[str, tuple[float, str]] = {}
        self._silent: dict[str, str] = {}

    def note_counters(self, engine: EngineConfig, parsed: EngineMetrics) -> None:
        """Compare the engine's prefix-cache counters with its previous scrape. A request that
        stores no new full block misses at most one block of tokens (a partial last block, or the
        recomputed last block of a fully cached prompt), so more missed tokens than block_size x
        requests prove that the engine stored blocks and must have published BlockStored.
        Short answers, repeated prompts, prompts under one block and rejected requests prove
        nothing (they were the false alarms of the old "no event for a while" rule)."""
        queries, hits = parsed.prefix_cache_queries_total, parsed.prefix_cache_hits_total
        if queries is None or hits is None:
            return
        now = time.monotonic()
        in_flight, _queued = self.tracker.ledger.load(engine.id)
        sample = _CounterSample(
            at_s=now,
            missed_tokens=queries - hits,
            routed=self.traffic.routed.get(engine.id, 0),
            in_flight=int(in_flight),
            engine_requests=parsed.request_success_total,
        )
        prev = self._counters.get(engine.id)
        self._counters[engine.id] = sample
        if prev is None or sample.missed_tokens < prev.missed_tokens:
            return  # first look, or the engine restarted (counters reset)
        requests = sample.routed - prev.routed + prev.in_flight
        if sample.engine_requests is not None and prev.engine_requests is not None:
            requests = max(requests, int(sample.engine_requests - prev.engine_requests) + prev.in_flight)
        if requests <= 0:
            return  # traffic the router did not see and the engine does not count: no evidence
        missed = sample.missed_tokens - prev.missed_tokens
        if missed > engine.block_size * requests and engine.id not in self._evidence:
            self._evidence[engine.id] = (
                prev.at_s,
                f"its prefix-cache counters show {missed:.0f} newly computed prompt tokens over "
                f"{requests} request(s) (more than {engine.block_size} per request: new blocks were "
                "cached)",
            )

    def silent_engines(self) -> dict[str, str]:
        """Engine id -> why it is reported: the engine's own counters prove it cached new blocks,
        but no KV-event batch arrived for events.silent_after_s after that."""
        if self.manager is None:
            return {}
        now = time.monotonic()
        limit_s = self.config.events.silent_after_s
        with_source = {h.source.engine_id for h in self.manager.source_health().values()}
        out: dict[str, str] = {}
        for engine_id, (since, proof) in list(self._evidence.items()):
            last_batch = self.manager.last_batch_at(engine_id)
            if last_batch is not None and last_batch >= since:
                del self._evidence[engine_id]  # the events came: no alarm
                continue
            waited_s = now - since
            if waited_s <= limit_s:
                continue
            if engine_id in with_source:
                out[engine_id] = (
                    f"{proof}, but its KV-event source published nothing for {waited_s:.1f} s "
                    f"(events.silent_after_s = {limit_s:g}); check kv_events_endpoint and the engine's "
                    "--kv-events-config"
                )
            else:
                out[engine_id] = (
                    f"{proof}, but it has no KV-event source (no kv_events_endpoint configured and "
                    "discovery found none); its cache is invisible to the index"
                )
        return out

    async def run(self) -> None:
        period_s = max(0.05, min(1.0, self.config.events.silent_after_s / 2))
        while True:
            await asyncio.sleep(period_s)
            self.check()

    def check(self) -> None:
        silent = self.silent_engines()
        for engine_id, reason in silent.items():
            if engine_id not in self._silent:
                log.warning("engine %s: %s", engine_id, reason)
        for engine_id in self._silent.keys() - silent.keys():
            log.info("engine %s: KV events arrive again", engine_id)
        self._silent = silent
        for engine_id in self.tracker.engines:
            self.metrics.event_source_silent.labels(engine_id).set(1 if engine_id in silent else 0)
