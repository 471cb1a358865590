"""What the router knows about each engine's load and health, and the task that polls engines.

``LoadTracker`` is plain state (no I/O): health flags, drain and the models each engine serves, and
the load ledger (``kvcore.core.InMemoryLoadLedger``: in-flight requests and queued prefill tokens,
driven by the routing core's reserve / first token / finish); it produces the ``EngineView``s the
core filters.
``EnginePoller`` is the async shell: it polls GET /health (and GET /v1/models once per engine).
Scraped engine metrics (vllm:num_requests_waiting, ...) go into ``EngineState.scraped`` through
``LoadTracker.update_scraped``; the poller is the place to add that scrape.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvcore.core import InMemoryLoadLedger, LoadLedger
from policies.base import EngineView
from router.config import EngineConfig
from router.metrics import RouterMetrics

log = logging.getLogger("kvroute.load")


#: The fields of ``EngineState`` its ``EngineView`` reads (a write of a new value to one of them
#: makes ``LoadTracker.fleet_views`` build the views again).
_VIEWED_FIELDS = frozenset(
    {
        "config",
        "healthy",
        "drained",
        "breaker_open_until_s",
        "breaker_trial_until_s",
        "reported_block_size",
        "models_view",
        "extra",
        "scraped",
    }
)
#: Changes of any ``EngineState``'s viewed fields so far, in this process (``fleet_views``).
_VIEW_CHANGES = [0]
_UNSET = object()


@dataclass(slots=True)
class EngineState:
    """One engine as the router knows it. A write of a new value to a field its view reads is
    counted (``_VIEW_CHANGES``) wherever it comes from (this module, the scraper, the admin
    endpoints, tests), so ``LoadTracker.fleet_views`` knows when its views are out of date."""

    config: EngineConfig
    healthy: bool = True
    #: Model ids the engine serves (config model plus what GET /v1/models reported).
    models: set[str] = field(default_factory=set)
    #: The engine's own /v1/models entries, for the router's union.
    model_cards: list[dict[str, Any]] = field(default_factory=list)
    models_discovered: bool = False
    #: Latest scraped engine metrics by name, e.g. {"num_requests_waiting": 3.0}.
    scraped: dict[str, float] = field(default_factory=dict)
    last_error: str = ""
    #: Taken out of routing by POST /admin/engines/{id}/drain (health polls do not undo it).
    drained: bool = False
    #: Consecutive failed health polls (reset by a good one).
    poll_failures: int = 0
    #: Monotonic time of the engine's latest answer to a proxied request (0 = none yet).
    last_answer_s: float = 0.0
    #: Circuit breaker: consecutive failures (proxied requests and health polls) and the monotonic
    #: time until which the engine is out of routing (0 = closed).
    breaker_failures: int = 0
    breaker_open_until_s: float = 0.0
    #: Half-open (the open time is over, no success yet): until this monotonic time one trial
    #: request is out and the others keep away (0 = no trial out).
    breaker_trial_until_s: float = 0.0
    #: Block size the engine reports in vllm:cache_config_info (wins over the configured one).
    reported_block_size: int | None = None
    #: ``models`` as the frozenset every view shares (rebuilt when ``models`` changes).
    models_view: frozenset[str] = frozenset()
    #: ``EngineView.extra`` of this engine: tier capacities in tokens from the /metrics scrape
    #: (router.scrape.tier_capacities_tokens). Replaced whole, never mutated: views share it.
    extra: dict[str, float] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _VIEWED_FIELDS and getattr(self, name, _UNSET) is not value:
            _VIEW_CHANGES[0] += 1
        object.__setattr__(self, name, value)


class LoadTracker:
    """In-flight accounting and health per engine; the source of the policies' ``EngineView``s."""

    def __init__(
        self,
        engines: Sequence[EngineConfig],
        metrics: RouterMetrics | None = None,
        *,
        ledger: LoadLedger | None = None,
    ) -> None:
        """``ledger``: where load is accounted (default: in this process; replicas share one)."""
        self._metrics = metrics
        self.breaker_threshold, self.breaker_open_s = 3, 5.0  # configure_breaker sets the config's
        if ledger is None:  # its own accounting is the in-flight gauge's (else the caller's is)
            ledger = InMemoryLoadLedger([e.id for e in engines])
            if metrics:
                metrics.watch_in_flight(ledger)
        self.ledger: LoadLedger = ledger
        self.engines: dict[str, EngineState] = {}
        #: ``fleet_views``'s views, the ``_VIEW_CHANGES`` count they were built at and the
        #: monotonic time until which their breakers' verdicts hold.
        self._fleet_views: list[EngineView] = []
        self._fleet_views_changes = -1
        self._fleet_views_until = 0.0
        #: LoRA adapter id -> its base model, from the engines' GET /v1/models.
        self.lora_adapters: dict[str, str] = {}
        for engine in engines:
            state = EngineState(config=engine)
            if engine.model:
                state.models.add(engine.model)
            state.models_view = frozenset(state.models)
            self.engines[engine.id] = state
            if metrics:
                metrics.engine_healthy.labels(engine.id).set(1)
                metrics.in_flight.labels(engine.id).set(0)

    # -- health and models -------------------------------------------------------------------
    def set_health(self, engine_id: str, healthy: bool, reason: str = "") -> None:
        state = self.engines[engine_id]
        if state.healthy != healthy:
            log.warning(
                "engine %s is now %s%s",
                engine_id,
                "healthy" if healthy else "UNHEALTHY",
                f": {reason}" if reason else "",
            )
        state.healthy = healthy
        state.last_error = "" if healthy else reason
        if self._metrics:
            self._metrics.engine_healthy.labels(engine_id).set(1 if healthy else 0)

    # -- circuit breaker -----------------------------------------------------------------------
    def configure_breaker(self, failures: int, open_s: float) -> None:
        self.breaker_threshold = failures
        self.breaker_open_s = open_s

    def record_failure(self, engine_id: str, reason: str, now_s: float | None = None) -> None:
        """A failed exchange with the engine (refused, reset, no first byte in time, broken stream,
        failed health poll): ``breaker_threshold`` in a row open the breaker for ``breaker_open_s``."""
        state = self.engines[engine_id]
        now_s = time.monotonic() if now_s is None else now_s
        state.breaker_failures += 1
        if state.breaker_failures >= self.breaker_threshold:
            was_open = state.breaker_open_until_s > now_s
            state.breaker_open_until_s = now_s + self.breaker_open_s
            state.breaker_trial_until_s = 0.0
            if not was_open:
                log.warning(
                    "engine %s: circuit breaker OPEN for %.1f s after %d failures in a row (last: %s)",
                    engine_id,
                    state.breaker_open_until_s - now_s,
                    state.breaker_failures,
                    reason,
                )
                if self._metrics:
                    self._metrics.engine_healthy.labels(engine_id).set(0)

    def record_success(self, engine_id: str) -> None:
        """The engine answered: the breaker closes and the failure count restarts."""
        state = self.engines[engine_id]
        if state.breaker_open_until_s:
            log.warning("engine %s: circuit breaker closed (the engine answered)", engine_id)
            state.breaker_open_until_s = 0.0
            if self._metrics:
                self._metrics.engine_healthy.labels(engine_id).set(1 if state.healthy else 0)
        state.breaker_failures = 0
        state.breaker_trial_until_s = 0.0

    def claim_trial(self, engine_id: str, now_s: float | None = None) -> None:
        """A request was routed to ``engine_id``: if its breaker is half-open, this request is the
        one trial, and the engine stays out of routing until it succeeds (closed) or fails
        (open again) - or for ``breaker_open_s`` if it never reports (another trial then)."""
        state = self.engines.get(engine_id)
        if state is None or not state.breaker_open_until_s:
            return
        now_s = time.monotonic() if now_s is None else now_s
        if state.breaker_open_until_s <= now_s and state.breaker_trial_until_s <= now_s:
            state.breaker_trial_until_s = now_s + self.breaker_open_s

    @staticmethod
    def breaker_open(state: EngineState, now_s: float) -> bool:
        """Out of routing: open (for ``breaker_open_s`` after the failures), or half-open with its
        one trial request out (``claim_trial``); the trial's failure reopens it, a success closes it."""
        if not state.breaker_open_until_s:
            return False
        return state.breaker_open_until_s > now_s or state.breaker_trial_until_s > now_s

    def set_models(self, engine_id: str, cards: list[dict[str, Any]]) -> None:
        state = self.engines[engine_id]
        state.model_cards = cards
        state.models_discovered = True
        state.models |= {str(c["id"]) for c in cards if isinstance(c, dict) and "id" in c}
        state.models_view = frozenset(state.models)
        # vLLM lists each LoRA adapter as its own model with "parent" = the base model; requests
        # to it carry the adapter's name in their blocks' extra keys (kvcore.keys).
        for card in cards:
            if isinstance(card, dict) and card.get("parent") and "id" in card:
                self.lora_adapters[str(card["id"])] = str(card["parent"])

    def lora_name(self, model: str) -> str | None:
        """The LoRA adapter name a request for ``model`` runs with (None: a base model)."""
        return model if model in self.lora_adapters else None

    def update_scraped(self, engine_id: str, values: dict[str, float]) -> None:
        self.engines[engine_id].scraped.update(values)
        _VIEW_CHANGES[0] += 1  # changed in place: no attribute write counts it

    def serves(self, state: EngineState, model: str) -> bool:
        # An engine whose models are not known yet is assumed to serve anything: the engine
        # itself answers 404 for a wrong model, which the router passes through.
        return not state.models or model in state.models

    def knows_model(self, model: str) -> bool:
        return any(self.serves(s, model) for s in self.engines.values())

    def model_cards(self) -> list[dict[str, Any]]:
        """Union of the engines' models by id (first engine's card wins), then configured ones."""
        cards: dict[str, dict[str, Any]] = {}
        for state in self.engines.values():
            for card in state.model_cards:
                cards.setdefault(str(card.get("id")), card)
        for state in self.engines.values():
            for model in state.models:
                cards.setdefault(model, {"id": model, "object": "model", "created": 0, "owned_by": "kvroute"})
        return list(cards.values())

    # -- views for policies ------------------------------------------------------------------
    def load(self, engine_id: str) -> tuple[int, int]:
        """(in-flight requests, queued prefill tokens) from the ledger."""
        return self.ledger.load(engine_id)

    def drain(self, engine_id: str) -> None:
        """Take an engine out of routing until undrained (in-flight requests finish normally)."""
        self.engines[engine_id].drained = True

    def view(self, state: EngineState, now_s: float | None = None, *, with_load: bool = True) -> EngineView:
        """``state`` as policies see it; ``now_s`` (monotonic) decides whether its breaker is open.
        ``with_load=False``: in-flight and queued figures left at 0, for a caller that reads them
        itself (the routing core's ``filter`` refreshes its candidates' load)."""
        return self._views((state,), time.monotonic() if now_s is None else now_s, with_load)[0]

    def _views(self, states: Iterable[EngineState], now_s: float, with_load: bool) -> list[EngineView]:
        """``view`` of each of ``states`` (one loop for a request's whole fleet, no call per engine)."""
        views = []
        ledger_load, breaker_open = self.ledger.load, self.breaker_open
        for state in states:
            config, scraped = state.config, state.scraped
            if scraped:
                running = scraped.get("num_requests_running")
                waiting = scraped.get("num_requests_waiting")
                running_count = None if running is None else int(running)
                waiting_count = None if waiting is None else int(waiting)
                kv_cache_usage = scraped.get("kv_cache_usage_perc")
            else:
                running_count = waiting_count = kv_cache_usage = None
            in_flight, queued = ledger_load(config.id) if with_load else (0, 0)
            views.append(
                EngineView(  # positional, in field order (this runs per engine per request)
                    config.id,  # engine_id
                    config.url,  # url
                    # An open circuit breaker takes the engine out like a failed health check.
                    state.healthy and not (state.breaker_open_until_s and breaker_open(state, now_s)),
                    in_flight,
                    queued,  # queued_prefill_tokens
                    running_count,  # num_requests_running
                    waiting_count,  # num_requests_waiting
                    kv_cache_usage,
                    state.reported_block_size or config.block_size,  # block_size
                    True,  # index_trusted
                    state.drained,
                    state.models_view,  # models
                    state.extra,
                )
            )
        return views

    def serving(self) -> list[EngineState]:
        """Engines that take new requests: healthy, not drained, breaker closed (GET /ready counts)."""
        now_s = time.monotonic()
        return [
            s
            for s in self.engines.values()
            if s.healthy and not s.drained and not self.breaker_open(s, now_s)
        ]

    def fleet_views(self) -> list[EngineView]:
        """Every engine's view without its load (``all_views(with_load=False)``), built again
        only when a field a view reads has changed (any engine's, ``_VIEW_CHANGES``) or a
        breaker's open or trial time has passed since: the same list and views until then. The
        views are shared by the requests routed meanwhile: the routing core's ``filter``/``refresh``
        write each request's load and trust into its candidates before its choice, with no
        await in between."""
        now_s = time.monotonic()
        if self._fleet_views_changes != _VIEW_CHANGES[0] or now_s >= self._fleet_views_until:
            self._fleet_views_changes = _VIEW_CHANGES[0]
            states = self.engines.values()
            self._fleet_views = self._views(states, now_s, False)
            # A breaker's verdict (``breaker_open``) changes when ``now`` passes its open or trial time.
            self._fleet_views_until = min(
                (t for s in states for t in (s.breaker_open_until_s, s.breaker_trial_until_s) if t > now_s),
                default=math.inf,
            )
        return self._fleet_views

    def all_views(self, *, with_load: bool = True) -> list[EngineView]:
        """Every engine's view; the routing core's ``filter`` picks the candidates (``view``'s
        ``with_load``)."""
        return self._views(self.engines.values(), time.monotonic(), with_load)


class EnginePoller:
    """Background task polling each engine's GET /health every ``interval_s`` (owner: the app)."""

    def __init__(
        self,
        tracker: LoadTracker,
        session: aiohttp.ClientSession,
        *,
        interval_s: float,
        timeout_s: float,
        failures_before_unhealthy: int = 3,
        answer_liveness_s: float = 10.0,
    ) -> None:
        self._tracker = tracker
        self._session = session
        self._interval_s = interval_s
        self._failures_before_unhealthy = failures_before_unhealthy
        self._answer_liveness_s = answer_liveness_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvroute-engine-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            started_s = time.monotonic()
            await asyncio.gather(*(self.poll_once(s) for s in self._tracker.engines.values()))
            await asyncio.sleep(max(0.0, self._interval_s - (time.monotonic() - started_s)))

    async def poll_once(self, state: EngineState) -> None:
        """One GET /health. A refused connection marks the engine unhealthy at once (nothing
        listens); a slow or failing answer only after ``failures_before_unhealthy`` in a row, and
        not while the engine answered a proxied request within ``answer_liveness_s`` (a busy
        engine's /health can be slow while it serves fine)."""
        engine = state.config
        refused = False
        try:
            async with self._session.get(f"{engine.url}/health", timeout=self._timeout) as resp:
                await resp.read()
                healthy, reason = resp.status == 200, f"GET /health returned {resp.status}"
        except aiohttp.ClientConnectorError as exc:
            healthy, reason, refused = False, f"GET /health failed: {exc}", True
        except (TimeoutError, aiohttp.ClientError) as exc:
            healthy, reason = False, f"GET /health failed: {type(exc).__name__}: {exc}"
        if healthy:
            state.poll_failures = 0
            self._tracker.set_health(engine.id, True)
        else:
            state.poll_failures += 1
            answered_recently = time.monotonic() - state.last_answer_s < self._answer_liveness_s
            if refused or (state.poll_failures >= self._failures_before_unhealthy and not answered_recently):
                self._tracker.set_health(engine.id, False, f"{reason} ({state.poll_failures} in a row)")
            elif state.healthy:
                log.info(
                    "engine %s: %s (%d in a row%s); still routed",
                    engine.id,
                    reason,
                    state.poll_failures,
                    ", answered requests recently" if answered_recently else "",
                )
        if healthy and not state.models_discovered:
            await self._discover_models(state)

    async def _discover_models(self, state: EngineState) -> None:
        engine = state.config
        try:
            async with self._session.get(f"{engine.url}/v1/models", timeout=self._timeout) as resp:
                doc = await resp.json(content_type=None) if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.warning("engine %s: GET /v1/models failed (%s); will retry", engine.id, exc)
            return
        cards = doc.get("data") if isinstance(doc, dict) else None
        if isinstance(cards, list):
            self._tracker.set_models(engine.id, cards)
