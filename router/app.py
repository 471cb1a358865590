"""The router's HTTP service: ``create_app(config, ...)`` builds a FastAPI app from its parts.

Routes: POST /v1/chat/completions, POST /v1/completions (via ``router.routing.Router``),
GET /v1/models, /health, /ready, /metrics. Components built elsewhere (index, event manager,
experiments, tokenizer, prefix annotator, observers) are passed in; objects with async
``start()``/``stop()`` are started and stopped by the app's lifespan, after/before the upstream
client and the health poller. Every error is an OpenAI-shaped JSON body plus a log line with the
request id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvcore.core import CoreConfig, RoutingCore
from policies.costs import CostModel
from router.config import RouterConfig
from router.errors import RouterError, error_body
from router.load import EnginePoller, LoadTracker
from router.metrics import CONTENT_TYPE, RouterMetrics, create_metrics
from router.proxy import UpstreamClient
from router.routing import (
    CHAT,
    COMPLETIONS,
    ArmSelector,
    PrefixAnnotator,
    RouteObserver,
    Router,
    build_arm_selector,
    new_request_id,
    parse_request,
)

log = logging.getLogger("kvroute.app")


def _error_response(err: RouterError, request_id: str) -> Response:
    return Response(
        err.body(),
        status_code=err.status,
        media_type="application/json",
        headers={"x-request-id": request_id},
    )


def create_app(
    config: RouterConfig,
    *,
    metrics: RouterMetrics | None = None,
    tracker: LoadTracker | None = None,
    index: Any = None,
    event_manager: Any = None,
    experiments: ArmSelector | None = None,
    tokenizer: Any = None,
    annotator: PrefixAnnotator | None = None,
    observers: Sequence[RouteObserver] = (),
    costs: Any = None,
    index_trusted: Callable[[str], bool] | None = None,
    core: RoutingCore | None = None,
) -> FastAPI:
    """The router app. ``experiments`` replaces the config's arm selection (and is also an observer
    if it has ``on_finished``); ``index``/``tokenizer`` are kept on ``app.state`` for the annotator
    and the explain endpoint; ``event_manager`` is started by the lifespan and asked for
    ``ready_detail()`` (dict) by GET /ready when it has one. ``costs`` (the CostModel) and
    ``index_trusted`` build the routing core when ``core`` is not given (no index, no speculation).
    The full wiring from a config is ``router.service.build_router_app``."""
    metrics = metrics or create_metrics()
    tracker = tracker or LoadTracker(config.engines, metrics)
    client = UpstreamClient(
        connect_timeout_s=config.limits.connect_timeout_s,
        read_timeout_s=config.limits.read_timeout_s,
        max_connections_per_engine=config.limits.max_connections_per_engine,
    )
    arm_selector = experiments or build_arm_selector(config)
    if core is None:
        core = RoutingCore(
            ledger=tracker.ledger,
            costs=costs if costs is not None else CostModel(),
            config=CoreConfig(speculation_ttl_s=0.0),
            recorder=arm_selector if hasattr(arm_selector, "record_turn") else None,  # type: ignore[arg-type]
            index_trusted=index_trusted,
        )
    router = Router(
        config,
        tracker=tracker,
        client=client,
        metrics=metrics,
        arm_selector=arm_selector,
        core=core,
        annotator=annotator,
        observers=list(observers),
    )
    components = [
        c
        for c in (index, tokenizer, event_manager, experiments, annotator, *observers)
        if c is not None and hasattr(c, "start") and hasattr(c, "stop")
    ]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        poller = EnginePoller(
            tracker, client.session, interval_s=config.health.interval_s, timeout_s=config.health.timeout_s
        )
        started: list[Any] = []
        try:
            poller.start()
            for component in components:
                await component.start()
                started.append(component)
            yield
        finally:
            for component in reversed(started):
                try:
                    await component.stop()
                except Exception:
                    log.exception("stopping %r failed", component)
            await poller.stop()
            await client.close()

    app = FastAPI(title="kvroute", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.router = router
    app.state.tracker = tracker
    app.state.metrics = metrics
    app.state.index = index
    app.state.tokenizer = tokenizer
    app.state.event_manager = event_manager

    max_body_bytes = config.limits.max_body_bytes

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise RouterError(
                413,
                f"request body of {declared} bytes exceeds limits.max_body_bytes ({max_body_bytes})",
                code="request_too_large",
            )
        parts: list[bytes] = []
        size_bytes = 0
        async for chunk in request.stream():
            size_bytes += len(chunk)
            if size_bytes > max_body_bytes:
                raise RouterError(
                    413,
                    f"request body exceeds limits.max_body_bytes ({max_body_bytes})",
                    code="request_too_large",
                )
            parts.append(chunk)
        return b"".join(parts)

    async def proxy(request: Request, endpoint: str) -> Response:
        request_id = request.headers.get("x-request-id") or new_request_id()
        try:
            raw_body = await read_body(request)
            # The router's clock starts once the body is in: its upload is the client's network.
            started_s = time.monotonic()
            ctx = parse_request(
                endpoint, raw_body, request.headers, request_id=request_id, started_s=started_s, config=config
            )
            return await router.handle(ctx, request.headers, request.receive)
        except RouterError as err:
            log.warning("request %s: %d %s: %s", request_id, err.status, err.code, err.message)
            if err.status < 500 or err.code == "no_healthy_engine":
                metrics.requests.labels("none", "", "", str(err.status)).inc()
            return _error_response(err, request_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, COMPLETIONS)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": tracker.model_cards()})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        engines = {
            s.config.id: {
                "healthy": s.healthy,
                "drained": s.drained,
                "in_flight": tracker.load(s.config.id)[0],
                "error": s.last_error,
            }
            for s in tracker.engines.values()
        }
        # Drained engines take no new requests: they do not make the router ready.
        healthy = len(tracker.serving())
        doc: dict[str, Any] = {"ready": healthy > 0, "healthy_engines": healthy, "engines": engines}
        if event_manager is not None and hasattr(event_manager, "ready_detail"):
            doc["events"] = event_manager.ready_detail()
        return JSONResponse(doc, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        request_id = request.headers.get("x-request-id", "-")
        log.exception("request %s: unexpected error", request_id)
        return Response(
            error_body(
                "internal router error; see the router log", type="server_error", code="internal_error"
            ),
            status_code=500,
            media_type="application/json",
        )

    return app
