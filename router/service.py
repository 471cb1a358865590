"""Builds the running router from its configuration: ``build_router_app(config, config_path)``.

Wiring only: the prefix index, the shared state of replicas or the workers' load board, the
tokenizer and annotator (router/annotate.py), the cost model, the experiments, the routing core
(``kvcore.core.RoutingCore``), the observers (router/observers.py), the background services
(router/background.py: event manager, scrapers, watchdog, reload), the scrape-time metric families
(router/families.py) and the extra endpoints (/v1/route/explain, /debug/index, /debug/costs,
/v1/experiments, /admin/*) onto ``create_app``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvcore.calibration import CostModel
from kvcore.core import CoreConfig, InMemoryLoadLedger, LoadLedger, RoutingCore, StorageReadQueue
from kvcore.index import PrefixIndex
from kvcore.keys import namespace_seed
from router import openapi
from router.annotate import IndexAnnotator, build_tokenizer
from router.app import create_app, error_response, request_id_of
from router.background import RouterServices, event_sources
from router.config import ConfigError, RouterConfig, refuse_blind_policies
from router.errors import RouterError
from router.events import debug_index_payload, explain_payload
from router.families import ttft_tally_families
from router.load import LoadTracker
from router.metrics import RouterMetrics, create_metrics
from router.observers import TraceObserver
from router.routing import CHAT, COMPLETIONS, build_arm_selector
from router.shared_state import SharedLoadLedger, SharedState, SharedStateAnnotator, SharedStateObserver
from router.worker_ledger import WorkerBoard, WorkerLoadLedger

log = logging.getLogger("kvroute.service")

#: Re-exported: tests and benchmarks import these from here.
__all__ = ["IndexAnnotator", "build_index", "build_router_app", "build_shared_state", "event_sources"]


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
        local = InMemoryLoadLedger([e.id for e in config.engines])
        metrics.watch_in_flight(local)
        ledger = SharedLoadLedger(local, shared)
    elif worker_board is not None:
        engine_ids = [e.id for e in config.engines]
        local = InMemoryLoadLedger(engine_ids)
        metrics.watch_in_flight(local)
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
    for engine in config.engines:  # (used with costs.priors.calibration.shared_storage)
        costs.set_storage_pool(engine.id, engine.storage_pool)
    experiments = build_arm_selector(config)
    experiments.bound_sessions(config.limits.session_map_bytes)
    tokenizer = build_tokenizer(config, tracker)
    refuse_blind_policies(config)  # load_config did; a config built in code may not have been
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
        storage_reads=StorageReadQueue(
            config.costs.storage_pool_bandwidth, write_through=config.costs.storage_pool_write_through
        )
        if config.costs.storage_pool_bandwidth
        else None,
    )
    metrics.add_collector(lambda: ttft_tally_families(core.ttft_tally))
    # The services object is the lifespan component (event_manager=) only; listing it among the
    # observers too made the app start it twice: two EventManagers per router.
    observers: list[Any] = [services.traffic, services.parity]
    metrics.add_collector(services.parity.collect)
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
            arm, decision = await router.decide(ctx, explain=True)
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
        body["scrape_errors"] = dict(services.scraper.scrape_errors)
        body["block_size_mismatch"] = dict(services.scraper.block_size_mismatch)
        body["core"] = dataclasses.asdict(router.core.counters)
        reads = router.core.storage_reads
        body["storage_read_queue"] = reads.snapshot(time.monotonic()) if reads is not None else {}
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
