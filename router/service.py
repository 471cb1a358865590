"""Builds the running router from its configuration: ``build_router_app(config, config_path)``.

Wires the prefix index, the KV-event manager, the tokenizer, the cost model, the experiments, the
routing core (``kvcore.core.RoutingCore``: load, speculation, calibration, self-check, experiment
recording), the annotator (prompt -> block keys -> index matches), the trace observer,
per-engine /metrics scrapers, the silent-event-source watchdog and the extra endpoints
(/v1/route/explain, /debug/index, /debug/costs, /v1/experiments, /admin/*) onto ``create_app``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from fastapi import FastAPI, Request
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import JSONResponse, Response

from kvcore import sim_tokenizer
from kvcore.core import CoreConfig, InMemoryLoadLedger, LoadLedger, RoutingCore, TtftTally
from kvcore.index import PrefixIndex
from kvcore.keys import KeyChainCache, block_keys, namespace_seed, request_extra_keys
from policies.base import TIERS
from policies.costs import CostModel
from router import openapi
from router.app import create_app, error_response, request_id_of
from router.config import ConfigError, EngineConfig, RouterConfig, load_config
from router.errors import RouterError
from router.events import (
    EventManager,
    EventSource,
    debug_index_payload,
    explain_payload,
    sources_for_engine,
)
from router.experiments import Experiments
from router.load import LoadTracker
from router.metrics import RouterMetrics, create_metrics
from router.routing import (
    CHAT,
    COMPLETIONS,
    RouteContext,
    build_arm_selector,
    experiment_arms,
    needs_block_keys,
)
from router.scrape import EngineMetrics, parse_engine_metrics, tier_capacities_tokens
from router.shared_state import SharedLoadLedger, SharedState, SharedStateAnnotator, SharedStateObserver
from router.tokenize import EngineChatTokenizer, HfChatTokenizer, PromptNames, SimChatTokenizer
from router.worker_ledger import WorkerBoard, WorkerLoadLedger

log = logging.getLogger("kvroute.service")

#: Prompts longer than this are hashed into block keys in a worker thread, off the event loop.
_INLINE_KEY_TOKENS = 8192


# ----------------------------------------------------------------------------- tokenizers


class HealthyEngineTokenizer:
    """Backend "engine": the first healthy engine's POST /tokenize (one cached client per engine).

    The aiohttp session is set by ``RouterServices.start`` (it lives on the event loop)."""

    def __init__(self, tracker: LoadTracker, *, cache_max_bytes: int) -> None:
        self._tracker = tracker
        self.cache_max_bytes = cache_max_bytes
        self.session: aiohttp.ClientSession | None = None
        self._clients: dict[str, EngineChatTokenizer] = {}

    async def chat_tokens(
        self, messages: Sequence[Any], *, model: str = "", names: PromptNames | None = None
    ) -> list[int]:
        if self.session is None:
            raise RuntimeError("engine tokenizer used before the router started")
        for state in self._tracker.engines.values():
            if state.healthy and self._tracker.serves(state, model):
                client = self._clients.get(state.config.id)
                if client is None:
                    client = self._clients[state.config.id] = EngineChatTokenizer(
                        self.session,
                        state.config.url,
                        model=state.config.model,
                        cache_max_bytes=self.cache_max_bytes // max(1, len(self._tracker.engines)),
                    )
                return await client.chat_tokens(messages, model=model, names=names)
        raise RuntimeError(f"no healthy engine serving {model!r} to tokenise with")

    def cache_stats(self) -> dict[str, int]:
        total = {"entries": 0, "bytes": 0, "max_bytes": 0, "hits": 0, "misses": 0}
        for client in self._clients.values():
            for key, value in client.cache_stats().items():
                total[key] = total.get(key, 0) + value
        return total


def build_tokenizer(config: RouterConfig, tracker: LoadTracker) -> Any:
    """The configured chat tokenizer, or None for backend "none"."""
    backend = config.tokenizer.backend
    cache_max_bytes = config.tokenizer.cache_max_bytes
    if backend == "sim":
        return SimChatTokenizer(cache_max_bytes=cache_max_bytes)
    if backend == "hf":
        if not config.tokenizer.path:
            raise ConfigError('tokenizer.backend "hf" needs tokenizer.path (a tokenizer directory)')
        try:
            return HfChatTokenizer.from_dir(config.tokenizer.path, cache_max_bytes=cache_max_bytes)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"tokenizer.path {config.tokenizer.path!r}: {exc}") from None
    if backend == "engine":
        return HealthyEngineTokenizer(tracker, cache_max_bytes=cache_max_bytes)
    return None


# ----------------------------------------------------------------------------- annotation


class IndexAnnotator:
    """Prompt -> token ids -> router block keys (engine block size, cache_salt) -> index matches."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Any,
        index: PrefixIndex | None,
        *,
        namespace: int,
        lora_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self._config = config
        self._lora_of = lora_of
        self._tokenizer = tokenizer
        self._index = index
        self._namespace = namespace
        self._sim = config.tokenizer.backend == "sim"
        self._default_block_size = config.engines[0].block_size if config.engines else 16
        self._key_cache = KeyChainCache(config.tokenizer.cache_max_bytes)
        self.failures = 0

    async def _token_ids(self, ctx: RouteContext, names: PromptNames | None) -> list[int] | None:
        body = ctx.body
        if ctx.endpoint == CHAT:
            if self._tokenizer is None:
                return None
            # Every back-end returns a list of its own (the prefix key cache keeps it by reference).
            return await self._tokenizer.chat_tokens(
                body["messages"], model=ctx.route_request.model, names=names
            )
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # token ids are used as sent
        if isinstance(prompt, str) and self._sim:
            return sim_tokenizer.encode_prompt(prompt)
        return None  # batches of prompts and text prompts without a completion tokenizer

    async def _keys(
        self,
        names: PromptNames | None,
        scope: tuple[int, str | None, str | None],
        tokens: list[int],
        block_size: int,
        extra: list[Any] | None,
    ) -> list[int]:
        """Block keys of ``tokens``: the blocks a cached turn of the same conversation already
        hashed are reused (verified token by token), only the rest are hashed."""
        lookup, file_under = (names.anchors, names.file_under) if names is not None else ([], [])
        reused, extended = self._key_cache.reusable(lookup, scope, tokens, block_size)
        start = len(reused)
        parent = reused[-1] if reused else self._namespace
        rest = tokens[start * block_size :] if start else tokens
        rest_extra = extra[start:] if extra is not None and start else extra
        if len(rest) > _INLINE_KEY_TOKENS:  # hashing a long prompt would stall every request
            new = await asyncio.to_thread(block_keys, rest, block_size, parent=parent, extra_keys=rest_extra)
        else:
            new = block_keys(rest, block_size, parent=parent, extra_keys=rest_extra)
        keys = reused + new if reused else new
        self._key_cache.put(file_under, scope, tokens, keys, reused_blocks=start, replaces=extended)
        return keys

    def key_cache_stats(self) -> dict[str, int]:
        return self._key_cache.stats()

    def collect(self) -> list[Any]:
        """``kvroute_prompt_blocks_total{source}``: prompt blocks whose keys the conversation cache
        gave (reused) or that were hashed; a low reused share on multi-turn traffic means the
        cache is too small or the chat template is not prefix-stable."""
        stats = self._key_cache.stats()
        family = CounterMetricFamily(
            "kvroute_prompt_blocks", "Prompt blocks keyed, by where the key came from", labels=["source"]
        )
        family.add_metric(["reused"], stats["reused_blocks"])
        family.add_metric(["hashed"], stats["hashed_blocks"])
        return [family]

    async def annotate(self, ctx: RouteContext) -> None:
        request = ctx.route_request
        try:
            # A chat prompt is named by its message prefixes (and its last message's content cuts),
            # once for the tokenizer and the key cache, so the next turn finds this one's work.
            names = PromptNames.of(ctx.body["messages"]) if ctx.endpoint == CHAT else None
            tokens = await self._token_ids(ctx, names)
        except Exception as exc:  # routing goes on without keys; counted and logged
            self.failures += 1
            log.warning(
                "request %s: tokenising failed (%s); routing without prefix keys", ctx.request_id, exc
            )
            return
        if tokens is None:
            return
        ctx.prompt_token_ids = tokens
        engines = ctx.fleet.engines if ctx.fleet is not None else ()
        # Keys per block size: an engine's events are keyed in its own (reported) block size.
        by_size: dict[int, list[str]] = {}
        for view in engines:
            by_size.setdefault(view.block_size, []).append(view.engine_id)
        if not by_size:
            by_size[self._default_block_size] = []
        salt = ctx.body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        lora = self._lora_of(request.model) if self._lora_of is not None else None
        request.prompt_tokens = len(tokens)
        matches: dict[str, Any] = {}
        for i, (block_size, engine_ids) in enumerate(by_size.items()):
            n_blocks = len(tokens) // block_size
            extra = request_extra_keys(n_blocks, lora_name=lora, cache_salt=salt)
            keys = await self._keys(names, (block_size, lora, salt), tokens, block_size, extra)
            if i == 0:  # speculation, trace and pricing use the first group's chain
                request.block_size = block_size
                request.block_keys = keys
            if self._index is not None and keys:
                matches.update(self._index.match(keys, engine_ids, now=time.monotonic()))
        if self._index is not None:
            request.prefix_matches = matches


# ----------------------------------------------------------------------------- observers


class TraceObserver:
    """Writes every successful request as a Mooncake JSONL line (loadtest.workloads.TraceRecorder)."""

    def __init__(self, path: str, key_block_size: int, trace_block_tokens: int) -> None:
        self._path = path
        self._key_block_size = key_block_size
        self._trace_block_tokens = trace_block_tokens
        self._recorder: Any = None

    async def start(self) -> None:
        from kvcore.trace import TraceRecorder

        self._recorder = TraceRecorder(
            Path(self._path), key_block_size=self._key_block_size, trace_block_size=self._trace_block_tokens
        )

    async def stop(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None

    def on_routed(self, ctx: RouteContext) -> None:
        return None

    def on_first_byte(self, ctx: RouteContext) -> None:
        return None

    def on_finished(self, ctx: RouteContext) -> None:
        if self._recorder is None or not ctx.ok:
            return
        usage = ctx.usage or {}
        prompt_tokens = usage.get("prompt_tokens") or ctx.route_request.prompt_tokens
        output_tokens = usage.get("completion_tokens") or 0
        self._recorder.record(int(prompt_tokens), int(output_tokens), ctx.route_request.block_keys)


# ----------------------------------------------------------------------------- services


class TrafficCounter:
    """Observer counting requests routed to each engine (the silent-source rule needs how many
    requests an engine's prefix-cache counters moved for). No start/stop: only the services
    object is a lifespan component, so exactly one EventManager exists."""

    def __init__(self) -> None:
        self.routed: dict[str, int] = {}

    def on_routed(self, ctx: RouteContext) -> None:
        if ctx.decision is not None:
            engine_id = ctx.decision.engine_id
            self.routed[engine_id] = self.routed.get(engine_id, 0) + 1

    def on_first_byte(self, ctx: RouteContext) -> None:
        return None

    def on_finished(self, ctx: RouteContext) -> None:
        return None


@dataclass(slots=True)
class _CounterSample:
    """One scrape's figures the silent-source rule compares with the next one."""

    at_s: float
    missed_tokens: float
    routed: int
    in_flight: int
    engine_requests: float | None


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
        self._started = False
        #: Engine id -> its previous scrape's counters, and -> (monotonic time from which the
        #: engine must have published, what proves it): set when its prefix-cache counters moved
        #: more than requests without new blocks can explain.
        self._counters: dict[str, _CounterSample] = {}
        self._evidence: dict[str, tuple[float, str]] = {}
        self._silent: dict[str, str] = {}
        self.scrape_errors: dict[str, str] = {}
        #: Engine id -> why its configured block size was overridden by the one it reports.
        self.block_size_mismatch: dict[str, str] = {}

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
            )
            await self.manager.start()
            self._tasks.append(asyncio.create_task(self._watchdog(), name="kvroute-events-watchdog"))
        if self.config.costs.scrape_interval_s > 0:
            for state in self.tracker.engines.values():
                self._tasks.append(
                    asyncio.create_task(
                        self._scrape_loop(state.config), name=f"kvroute-scrape:{state.config.id}"
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

    # -- silent sources -------------------------------------------------------------------------

    def _note_counters(self, engine: EngineConfig, parsed: EngineMetrics) -> None:
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

    async def _watchdog(self) -> None:
        period_s = max(0.05, min(1.0, self.config.events.silent_after_s / 2))
        while True:
            await asyncio.sleep(period_s)
            self._check_silent()

    def _check_silent(self) -> None:
        silent = self.silent_engines()
        for engine_id, reason in silent.items():
            if engine_id not in self._silent:
                log.warning("engine %s: %s", engine_id, reason)
        for engine_id in self._silent.keys() - silent.keys():
            log.info("engine %s: KV events arrive again", engine_id)
        self._silent = silent
        for engine_id in self.tracker.engines:
            self.metrics.event_source_silent.labels(engine_id).set(1 if engine_id in silent else 0)

    def ready_detail(self) -> dict[str, Any]:
        """The ``events`` part of GET /ready."""
        if self.manager is None:
            return {"index": "disabled" if self.index is None else "not started"}
        health = self.manager.health()
        silent = self.silent_engines()
        problems = {
            name: s["status"]
            for name, s in health["sources"].items()
            if s["status"] in ("stale", "disconnected")
        }
        return {
            "ok": not silent and not problems and not health["discovery_errors"],
            "block_size_mismatch": dict(self.block_size_mismatch),
            "silent_engines": silent,
            "source_problems": problems,
            "discovery_errors": health["discovery_errors"],
            "sources": {
                name: {
                    k: s[k] for k in ("engine_id", "status", "last_seq", "seconds_since_last_event", "gaps")
                }
                for name, s in health["sources"].items()
            },
        }

    def index_trusted(self, engine_id: str) -> bool:
        untrusted = self.manager.untrusted_engines() if self.manager is not None else set()
        return engine_id not in untrusted and self.costs.index_trusted(engine_id)

    # -- scraping -------------------------------------------------------------------------------

    async def _scrape_loop(self, engine: EngineConfig) -> None:
        interval_s = self.config.costs.scrape_interval_s
        while True:
            started_s = time.monotonic()
            await self.scrape_once(engine)
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started_s)))

    async def scrape_once(self, engine: EngineConfig) -> None:
        """One GET /metrics of ``engine`` into the load tracker and the cost model."""
        assert self.session is not None
        try:
            async with self.session.get(f"{engine.url}/metrics") as resp:
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
        self._note_counters(engine, parsed)
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
        self.costs.update_offload_counters(
            engine.id, parsed.offload_load_bytes_by_tier, parsed.offload_load_time_s_by_tier, time.monotonic()
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
        families: list[Any] = []
        if self.manager is not None:
            per_engine: dict[str, dict[str, float]] = {}
            for h in self.manager.source_health().values():
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
        if self.index is not None:
            entries = GaugeMetricFamily(
                "kvroute_index_blocks",
                "Blocks the index holds per engine and tier",
                labels=["engine", "tier"],
            )
            for engine_id, row in sorted(self.index.stats()["engines"].items()):
                for tier in TIERS:
                    entries.add_metric([engine_id, tier.name], row[f"{tier.name.lower()}_blocks"])
            families.append(entries)
        grouped: dict[str, GaugeMetricFamily] = {}
        for name, labels, value in self.costs.gauge_values():
            gauge = grouped.get(name)
            if gauge is None:
                gauge = grouped[name] = GaugeMetricFamily(
                    name, "Cost model estimate (see /debug/costs)", labels=list(labels)
                )
            if math.isfinite(value):
                gauge.add_metric(list(labels.values()), value)
        families.extend(grouped.values())
        families.extend(prior_families(self.costs.snapshot()))
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


def build_index(config: RouterConfig) -> PrefixIndex | None:
    """The prefix index with one pool per ``storage_pool`` the engines mount (None when disabled)."""
    if not config.index.enabled:
        return None
    pools = {e.storage_pool for e in config.engines if e.storage_pool}
    return PrefixIndex(
        storage_pools={p: config.index.pools.get(p, config.index.storage_pool_blocks) for p in sorted(pools)},
        engine_storage_pool={e.id: e.storage_pool for e in config.engines if e.storage_pool},
        namespace=namespace_seed(config.tokenizer.namespace),
    )


def build_shared_state(config: RouterConfig, metrics: RouterMetrics) -> SharedState | None:
    """The replicas' shared state when ``shared.redis_url`` is set (else None: one replica)."""
    shared = config.shared
    if not shared.redis_url:
        return None
    return SharedState(
        shared.redis_url,
        cluster=shared.cluster,
        replica_id=shared.replica_id,
        ttl_s=shared.ttl_s,
        timeout_s=shared.timeout_s,
        retention_s=shared.retention_s,
        registry=metrics.registry,
    )


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


def build_router_app(
    config: RouterConfig,
    config_path: str | Path | None = None,
    *,
    install_sighup: bool = False,
    reload_config: Callable[[], RouterConfig] | None = None,
    worker_board: tuple[int, int] | None = None,
) -> FastAPI:
    """The full router used by ``kvroute serve``. /admin/reload and SIGHUP call ``reload_config``
    (``kvroute serve`` passes one that re-applies the environment and its command-line flags
    over the re-read file), else re-read ``config_path`` alone. ``worker_board`` = (file descriptor, worker
    index) of the load board shared by ``--workers`` processes (router/worker_ledger.py)."""
    metrics = create_metrics()
    shared = build_shared_state(config, metrics)
    ledger: LoadLedger | None = None
    if shared is not None:
        # This replica's own accounting (its in-flight gauge) plus the other replicas' load.
        local = InMemoryLoadLedger([e.id for e in config.engines], on_change=metrics.set_in_flight)
        ledger = SharedLoadLedger(local, shared)
    elif worker_board is not None:
        engine_ids = [e.id for e in config.engines]
        local = InMemoryLoadLedger(engine_ids, on_change=metrics.set_in_flight)
        try:
            board = WorkerBoard(worker_board[0], worker_board[1], engine_ids)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--workers: cannot share load between the workers: {exc}") from None
        ledger = WorkerLoadLedger(local, board)
    tracker = LoadTracker(config.engines, metrics, ledger=ledger)
    index = build_index(config)
    try:
        costs = CostModel.from_config(config.costs.priors)
    except ValueError as exc:
        raise ConfigError(f"costs.priors: {exc}") from None
    experiments = build_arm_selector(config)
    experiments.bound_sessions(config.limits.session_map_bytes)
    tokenizer = build_tokenizer(config, tracker)
    for arm in experiments.arms:
        if needs_block_keys(arm.policy) and tokenizer is None:
            # Without keys such a policy would silently fall back to its load tiebreak.
            raise ConfigError(
                f"experiment arm {arm.name!r}: policy {arm.policy.name!r} needs prompt block keys but "
                'tokenizer.backend is "none"; set tokenizer.backend to "sim", "hf" or "engine"'
            )
    services = RouterServices(
        config,
        config_path=config_path,
        tracker=tracker,
        metrics=metrics,
        index=index,
        costs=costs,
        experiments=experiments,
        tokenizer=tokenizer,
        install_sighup=install_sighup,
        reload_config=reload_config,
    )
    metrics.add_collector(services.collect)
    annotator: Any = IndexAnnotator(
        config,
        tokenizer,
        index,
        namespace=namespace_seed(config.tokenizer.namespace),
        lora_of=tracker.lora_name,
    )
    metrics.add_collector(annotator.collect)
    core = RoutingCore(
        ledger=tracker.ledger,
        costs=costs,
        index=index,
        config=CoreConfig(speculation_ttl_s=config.index.speculation_ttl_s if index is not None else 0.0),
        recorder=experiments,
        index_trusted=services.index_trusted,
    )
    metrics.add_collector(lambda: ttft_tally_families(core.ttft_tally))
    # The services object is the lifespan component (event_manager=) only; listing it among the
    # observers too made the app start it twice: two EventManagers per router.
    observers: list[Any] = [services.traffic]
    if shared is not None:
        # The read of the other replicas' load is the last await before the choice.
        annotator = SharedStateAnnotator(annotator, shared)
        observers.append(
            SharedStateObserver(
                shared,
                engine_ids=[e.id for e in config.engines],
                index=index,
                speculation_ttl_s=config.index.speculation_ttl_s,
                policies=lambda: [arm.policy for arm in experiments.arms],
            )
        )
    if config.trace.path:
        observers.append(
            TraceObserver(config.trace.path, config.engines[0].block_size, config.trace.block_tokens)
        )
    app = create_app(
        config,
        metrics=metrics,
        tracker=tracker,
        index=None,  # started by nobody: the services own the event manager
        event_manager=services,
        experiments=experiments,
        tokenizer=None,
        annotator=annotator,
        observers=observers,
        core=core,
    )
    app.state.index = index
    app.state.tokenizer = tokenizer
    app.state.services = services
    app.state.shared_state = shared
    if isinstance(ledger, WorkerLoadLedger):
        # GET /ready says which worker answered and that the load it shows is the workers' sum.
        app.state.worker = {"index": ledger.board.worker, "workers": ledger.board.workers, "pid": os.getpid()}
    app.state.costs = costs
    app.state.experiments = experiments
    app.state.core = core
    _add_endpoints(app, config, services)
    return app


def _add_endpoints(app: FastAPI, config: RouterConfig, services: RouterServices) -> None:
    router = app.state.router

    @app.post("/v1/route/explain", openapi_extra=openapi.operation(openapi.EXPLAIN_BODY))
    async def explain(request: Request) -> Response:
        """Where a chat or completion body would go and why; nothing is sent upstream."""
        request_id = request_id_of(request.headers)
        reader = app.state.reader
        try:
            # The same door as the chat path: content type, size and time limits, validation.
            raw = await reader.body(request.headers, request.receive)
            endpoint = CHAT if b'"messages"' in raw else COMPLETIONS
            ctx = reader.parse(endpoint, raw, request.headers, request.scope, request_id)
            arm, decision = await router.decide(ctx)
        except RouterError as err:
            return error_response(err, request_id)
        body = explain_payload(ctx.route_request, ctx.fleet, decision, arm.policy.name)
        body["arm"] = arm.name
        body["session_key"] = ctx.route_request.session_key
        return JSONResponse(body, headers={"x-kvroute-arm": arm.name})

    @app.get("/debug/index", openapi_extra=openapi.GUARDED_OPERATION)
    async def debug_index() -> Response:
        if services.index is None:
            return JSONResponse({"index": None, "reason": "index.enabled is false"})
        return JSONResponse(debug_index_payload(services.index, services.manager))

    @app.get("/debug/costs", openapi_extra=openapi.GUARDED_OPERATION)
    async def debug_costs() -> Response:
        body = services.costs.snapshot()
        body["scrape_errors"] = dict(services.scrape_errors)
        body["block_size_mismatch"] = dict(services.block_size_mismatch)
        body["core"] = dataclasses.asdict(router.core.counters)
        return JSONResponse(body)

    @app.get("/v1/experiments", openapi_extra=openapi.GUARDED_OPERATION)
    async def experiments_report() -> Response:
        # The bootstrap is CPU work (numpy): copy on the loop, compute in a thread.
        snapshot = services.experiments.snapshot()
        return JSONResponse(await asyncio.to_thread(services.experiments.report, snapshot))

    # /admin/* is authenticated by router.guard (admin.token, constant-time, failures rate-limited).

    @app.post("/admin/reload", openapi_extra=openapi.GUARDED_OPERATION)
    async def admin_reload(request: Request) -> Response:
        try:
            return JSONResponse(services.reload())
        except RouterError as err:
            return error_response(err)

    def engine_state(engine_id: str) -> Any:
        state = services.tracker.engines.get(engine_id)
        if state is None:
            raise RouterError(
                404,
                f"unknown engine {engine_id!r}; engines: {', '.join(services.tracker.engines)}",
                type="not_found_error",
                code="engine_not_found",
            )
        return state

    @app.post("/admin/engines/{engine_id}/drain", openapi_extra=openapi.GUARDED_OPERATION)
    async def admin_drain(engine_id: str, request: Request) -> Response:
        """Take an engine out of routing until undrained; in-flight requests finish normally."""
        try:
            engine_state(engine_id)
        except RouterError as err:
            return error_response(err)
        services.tracker.drain(engine_id)
        log.warning("engine %s drained by admin: no new requests go there", engine_id)
        return JSONResponse({"drained": engine_id})

    @app.post("/admin/engines/{engine_id}/undrain", openapi_extra=openapi.GUARDED_OPERATION)
    async def admin_undrain(engine_id: str, request: Request) -> Response:
        """Put a drained engine back into routing (health checks still apply)."""
        try:
            engine_state(engine_id).drained = False
        except RouterError as err:
            return error_response(err)
        log.warning("engine %s undrained by admin: it takes new requests again", engine_id)
        return JSONResponse({"undrained": engine_id})
