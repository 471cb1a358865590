"""Per-engine GET /metrics scrapes (``costs.scrape_interval_s``): the engine's queue and KV usage into
the load tracker, its tier capacities into its views, offload counters into the cost model, its
real block size (a configured one that differs is reported), and its prefix-cache counters to the
silent-source watchdog."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from kvcore.calibration import CostModel
from policies.base import Tier
from router.config import EngineConfig, RouterConfig
from router.load import LoadTracker
from router.scrape import EngineMetrics, parse_engine_metrics, tier_capacities_tokens
from router.watchdog import SilentSourceWatchdog

log = logging.getLogger("kvroute.scraper")


class EngineScraper:
    """Scrapes engines with the services' HTTP ``session`` (set when they start)."""

    def __init__(
        self, config: RouterConfig, *, tracker: LoadTracker, costs: CostModel, watchdog: SilentSourceWatchdog
    ) -> None:
        self.config = config
        self.tracker = tracker
        self.costs = costs
        self.watchdog = watchdog
        self.session: aiohttp.ClientSession | None = None
        self.scrape_errors: dict[str, str] = {}
        #: Engine id -> why its configured block size was overridden by the one it reports.
        self.block_size_mismatch: dict[str, str] = {}
        #: (engine id, tier) whose measured load bandwidth lay beyond the prior's reach (logged once).
        self._beyond_drift: set[tuple[str, Tier]] = set()

    async def run(self, engine: EngineConfig) -> None:
        interval_s = self.config.costs.scrape_interval_s
        while True:
            started_s = time.monotonic()
            await self.scrape_once(engine)
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started_s)))

    async def scrape_once(self, engine: EngineConfig) -> None:
        """One GET /metrics of ``engine`` into the load tracker and the cost model."""
        session = self.session
        assert session is not None
        try:
            async with session.get(f"{engine.url}/metrics") as resp:
                if resp.status != 200:
                    raise ValueError(f"GET /metrics answered {resp.status}")
                text = await resp.text()
            parsed = await asyncio.to_thread(parse_engine_metrics, text)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            if self.scrape_errors.get(engine.id) is None:
                log.warning("engine %s: metrics scrape failed: %s", engine.id, exc)
            self.scrape_errors[engine.id] = f"{type(exc).__name__}: {exc}"
            return
        self.scrape_errors.pop(engine.id, None)
        self._check_block_size(engine, parsed.block_size)
        self.watchdog.note_counters(engine, parsed)
        values = {
            name: value
            for name, value in (
                ("num_requests_running", parsed.num_requests_running),
                ("num_requests_waiting", parsed.num_requests_waiting),
                ("kv_cache_usage_perc", parsed.kv_cache_usage_perc),
            )
            if value is not None
        }
        self.tracker.update_scraped(engine.id, values)
        self._note_capacities(engine, parsed)
        beyond = self.costs.update_offload_counters(
            engine.id, parsed.offload_load_bytes_by_tier, parsed.offload_load_time_s_by_tier, time.monotonic()
        )
        for tier, measured, bound in beyond:
            if (engine.id, tier) not in self._beyond_drift:
                self._beyond_drift.add((engine.id, tier))
                log.warning(
                    "engine %s: measured %s load bandwidth %.3g B/s (vLLM's offload counters) is beyond"
                    " what the cost model may learn from its prior (calibration.max_drift): it prices"
                    " these loads at %.3g B/s; set costs.priors.tiers.%s.bandwidth_bytes_per_s near the"
                    " hardware's",
                    engine.id,
                    tier.name,
                    measured,
                    bound,
                    tier.name.lower(),
                )

    def _note_capacities(self, engine: EngineConfig, parsed: EngineMetrics) -> None:
        """Tier capacities (tokens) into the engine's views, for policies that price evictions."""
        state = self.tracker.engines[engine.id]
        pool_blocks = (
            self.config.index.pools.get(engine.storage_pool, self.config.index.storage_pool_blocks)
            if engine.storage_pool
            else None
        )
        capacities = tier_capacities_tokens(
            parsed,
            block_size=parsed.block_size or state.reported_block_size or engine.block_size,
            configured_pool_blocks=pool_blocks,
        )
        if any(state.extra.get(key) != value for key, value in capacities.items()):
            log.info("engine %s: tier capacities (tokens) %s", engine.id, capacities)
            state.extra = {**state.extra, **capacities}

    def _check_block_size(self, engine: EngineConfig, reported: int | None) -> None:
        """The engine's real block size (vllm:cache_config_info) wins over the configured one:
        keys in the wrong block size would match nothing, silently."""
        if reported is None or reported <= 0:
            return
        state = self.tracker.engines[engine.id]
        if state.reported_block_size == reported:
            return
        state.reported_block_size = reported
        if reported != engine.block_size:
            self.block_size_mismatch[engine.id] = (
                f"engine reports block_size {reported} (vllm:cache_config_info) but its config says "
                f"{engine.block_size}; prefix keys use {reported}: fix engines[].block_size"
            )
            log.error("engine %s: %s", engine.id, self.block_size_mismatch[engine.id])
        else:
            self.block_size_mismatch.pop(engine.id, None)

    # -- reload ---------------------------------------------------------------------------------
