"""The background parts of a wired router (``RouterServices``), started and stopped by the app's
lifespan: the HTTP session for discovery, scrapes and the engine tokenizer; the one EventManager;
one /metrics scraper per engine (router/scraper.py); the silent-source watchdog
(router/watchdog.py); config reload (/admin/reload, SIGHUP)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvcore.calibration import CostModel
from kvcore.index import PrefixIndex
from router.annotate import HealthyEngineTokenizer
from router.config import ConfigError, EngineConfig, RouterConfig, load_config
from router.errors import RouterError
from router.events import EventManager, EventSource, sources_for_engine
from router.experiments import Experiments
from router.families import service_families
from router.load import LoadTracker
from router.metrics import RouterMetrics
from router.observers import TrafficCounter
from router.parity import PromptParity
from router.routing import experiment_arms
from router.scraper import EngineScraper
from router.watchdog import SilentSourceWatchdog

log = logging.getLogger("kvroute.service")


class RouterServices:
    """The background parts of a router, started and stopped by the app's lifespan: the HTTP
    session for discovery/scrapes/tokenize, the one EventManager, one /metrics scraper per engine,
    the silent-source watchdog and the SIGHUP handler. ``traffic`` is its routing observer."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        config_path: str | Path | None,
        tracker: LoadTracker,
        metrics: RouterMetrics,
        index: PrefixIndex | None,
        costs: CostModel,
        experiments: Experiments,
        tokenizer: Any,
        install_sighup: bool = False,
        reload_config: Callable[[], RouterConfig] | None = None,
    ) -> None:
        """``reload_config``: re-reads every layer the router started with (file, env, command
        line, fleet file); default: the file at ``config_path`` alone."""
        self.config = config
        self.config_path = config_path
        self.reload_config = reload_config
        self.tracker = tracker
        self.metrics = metrics
        self.index = index
        self.costs = costs
        self.experiments = experiments
        self.tokenizer = tokenizer
        self.install_sighup = install_sighup
        self.manager: EventManager | None = None
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sighup_installed = False
        self.traffic = TrafficCounter()
        #: The engines' usage.prompt_tokens against the router's tokenizer (router/parity.py).
        self.parity = PromptParity(
            tail_tokens=config.tokenizer.parity_tail_tokens,
            window=config.tokenizer.parity_window,
            min_mismatches=config.tokenizer.parity_min_mismatches,
        )
        self._started = False
        self.watchdog = SilentSourceWatchdog(config, tracker=tracker, metrics=metrics, traffic=self.traffic)
        self.scraper = EngineScraper(config, tracker=tracker, costs=costs, watchdog=self.watchdog)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            # Two starts would mean two EventManagers: two SUB sockets per engine, every batch
            # applied twice, a second bind failing with "Address already in use".
            raise RuntimeError("RouterServices.start() called twice")
        self._started = True
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0))
        if isinstance(self.tokenizer, HealthyEngineTokenizer):
            self.tokenizer.session = self.session
        if self.index is not None:
            sources, discover = event_sources(self.config.engines, discover=self.config.events.discover)
            self.manager = EventManager(
                self.index,
                sources,
                discover=discover or None,
                http_session=self.session,
                silent_after_s=self.config.events.silent_after_s,
                replay_timeout_s=self.config.events.replay_timeout_s,
                block_sizes={engine.id: engine.block_size for engine in self.config.engines},
            )
            await self.manager.start()
            self.watchdog.manager = self.manager
            self._tasks.append(asyncio.create_task(self.watchdog.run(), name="kvroute-events-watchdog"))
        self.scraper.session = self.session
        if self.config.costs.scrape_interval_s > 0:
            for state in self.tracker.engines.values():
                self._tasks.append(
                    asyncio.create_task(
                        self.scraper.run(state.config), name=f"kvroute-scrape:{state.config.id}"
                    )
                )
        if self.install_sighup:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup_installed = True

    async def stop(self) -> None:
        if self._sighup_installed:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup_installed = False
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.manager is not None:
            await self.manager.stop()
        if self.session is not None:
            await self.session.close()
            self.session = None
            self.scraper.session = None

    # -- introspection --------------------------------------------------------------------------

    def ready_detail(self) -> dict[str, Any]:
        """The ``events`` part of GET /ready."""
        if self.manager is None:
            return {"index": "disabled" if self.index is None else "not started"}
        health = self.manager.health()
        silent = self.watchdog.silent_engines()
        problems = {
            name: s["status"]
            for name, s in health["sources"].items()
            if s["status"] in ("stale", "disconnected")
        }
        prompt_token_mismatch = self.parity.ready_detail()
        return {
            "ok": not silent
            and not problems
            and not health["discovery_errors"]
            and not prompt_token_mismatch,
            "prompt_token_mismatch": prompt_token_mismatch,
            "block_size_mismatch": dict(self.scraper.block_size_mismatch),
            "silent_engines": silent,
            "source_problems": problems,
            "discovery_errors": health["discovery_errors"],
            "sources": {
                name: {
                    k: s[k]
                    for k in (
                        *("engine_id", "status", "last_seq", "seconds_since_last_event", "gaps"),
                        *("trusted", "trust_reason", "unknown_media", "block_size_mismatches"),
                    )
                }
                for name, s in health["sources"].items()
            },
        }

    def index_trusted(self, engine_id: str) -> bool:
        """The shell's distrust of an engine's index (the routing core's ``index_trusted``; the
        core applies the cost model's self-check verdict itself, before asking this)."""
        if engine_id in self.parity.distrusted_ids:  # its prompt tokens are not the router's
            return False
        manager = self.manager
        return manager is None or manager.trusts(engine_id)

    # -- reload ---------------------------------------------------------------------------------

    def reload(self) -> dict[str, Any]:
        """Re-read the config file and switch the experiment arms (sessions keep theirs)."""
        if not self.config_path:
            raise RouterError(
                409,
                "this router was started without --config; there is no file to reload",
                code="no_config_file",
            )
        try:
            new_config = self.reload_config() if self.reload_config else load_config(self.config_path)
        except ConfigError as exc:
            raise RouterError(400, f"reload failed, old config kept: {exc}", code="invalid_config") from None
        self.experiments.reload(experiment_arms(new_config))
        log.warning(
            "config reloaded from %s: arms %s", self.config_path, [a.name for a in self.experiments.arms]
        )
        return {
            "reloaded": True,
            "config": str(self.config_path),
            "arms": [a.name for a in self.experiments.arms],
        }

    def _on_sighup(self) -> None:
        try:
            self.reload()
        except RouterError as err:
            log.error("SIGHUP reload failed: %s", err.message)

    # -- metrics --------------------------------------------------------------------------------

    def collect(self) -> list[Any]:
        """Prometheus families computed at scrape time: event ingestion, index size, cost estimates."""
        return service_families(self.manager, self.index, self.costs)


def event_sources(
    engines: Sequence[EngineConfig], *, discover: bool
) -> tuple[list[EventSource], dict[str, str]]:
    """Configured publishers, and engine id -> URL of engines to ask GET /kv_event_sources."""
    sources: list[EventSource] = []
    to_discover: dict[str, str] = {}
    for engine in engines:
        if engine.kv_events_endpoint:
            sources += sources_for_engine(
                engine.id,
                urlsplit(engine.url).hostname or "127.0.0.1",
                engine.kv_events_endpoint,
                engine.kv_replay_endpoint or None,
                topic=engine.kv_events_topic,
                data_parallel_size=engine.data_parallel_size,
                bind={"auto": None, "bind": True, "connect": False}[engine.kv_events_mode],
            )
        elif discover:
            to_discover[engine.id] = engine.url
    return sources, to_discover
