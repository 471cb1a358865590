"""The router's HTTP service: ``create_app(config, ...)`` builds a FastAPI app from its parts.

Routes: POST /v1/chat/completions, POST /v1/completions (via ``router.routing.Router``),
GET /v1/models, /health, /ready, /metrics, /openapi.json. Components built elsewhere (index, event
manager, experiments, tokenizer, prefix annotator, observers) are passed in; objects with async
``start()``/``stop()`` are started and stopped by the app's lifespan, after/before the upstream
client and the health poller. Every error is an OpenAI-shaped JSON body plus a log line with the
request id. ``RequestReader`` is the one way a body gets in (JSON content type, size and time
limits, validation, prompt-size limit, tenant cache_salt); ``router.guard`` sits in front.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import operator
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence, Sized
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from kvcore.calibration import CostModel
from kvcore.core import CoreConfig, RoutingCore
from router import __version__, openapi
from router.after_answer import AfterAnswer
from router.config import RouterConfig, callback_path_below
from router.errors import FieldRules, RouterError, bad_request
from router.guard import TENANT_STATE_KEY, AccessGuard, Authenticator, error_headers, send_error
from router.load import EnginePoller, LoadTracker
from router.metrics import CONTENT_TYPE, RouterMetrics, create_metrics
from router.proxy import UpstreamClient
from router.routing import (
    CHAT,
    COMPLETIONS,
    ArmSelector,
    PrefixAnnotator,
    RouteContext,
    RouteObserver,
    Router,
    build_arm_selector,
    new_request_id,
    parse_request,
)

log = logging.getLogger("kvroute.app")

_encode_json = msgspec.json.encode
STATUS_CLIENT_GONE = 499
#: Longest client-sent x-request-id kept (it is echoed in answers and logs); else a new id.
_MAX_REQUEST_ID_CHARS = 128


Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
#: The proxied paths -> endpoint kind; ``KvrouteApp`` answers their POSTs directly.
PROXY_PATHS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}


_latin1 = operator.methodcaller("decode", "latin-1")
_name_of = operator.itemgetter(0)
_value_of = operator.itemgetter(1)


def header_map(raw: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    """ASGI's raw headers (lower-case names) as a dict; the first value of a repeated name wins."""
    # Built in C; only a request that repeats a name (fewer keys than lines) is built again by the
    # loop below, where the first value wins (dict() keeps the last).
    names, values = map(_latin1, map(_name_of, raw)), map(_latin1, map(_value_of, raw))
    out: dict[str, str] = dict(zip(names, values, strict=True))
    if len(out) == len(raw):
        return out
    out = {}
    for name, value in raw:
        key = name.decode("latin-1")
        if key not in out:
            out[key] = value.decode("latin-1")
    return out


class KvrouteApp(FastAPI):
    """FastAPI for every endpoint but the two proxied ones: their POSTs go straight to
    ``proxy_app`` (the guarded proxy), skipping the framework's routing, middleware and dependency
    machinery, which cost about as much CPU per request as all of the routing did. kvroute's own
    HTTP protocol (router/fastpath.py) calls ``proxy_app`` itself for the ``proxy_paths``, without
    an ASGI request cycle; any other ASGI server comes through ``__call__``."""

    proxy_app: Callable[[dict[str, Any], Receive, Send], Awaitable[None]] | None = None
    #: The callback path (proxy.callback_path, router/fastpath.py); None = off.
    proxy_now: Callable[[Any], bool] | None = None
    #: The callback path's entry whether or not it is on (tests switch it on for a whole run).
    callback_proxy: Callable[[Any], bool] | None = None
    #: With ``proxy_now``: a request goes the callback path only while this holds fewer than
    #: ``callback_below`` (the upstream exchanges in progress with proxy.callback_path "idle" or
    #: N; an empty tuple: always).
    callback_busy: Sized = ()
    callback_below = 1
    #: Counts a client connection cut by limits.client_write_timeout_s (router/guard.py), by the
    #: engine of its answer ("none": no engine's).
    on_client_write_timeout: Callable[[str], None] | None = None
    #: Raw request path -> ASGI path, of the routes ``proxy_app`` answers.
    proxy_paths: dict[bytes, str] = {path.encode(): path for path in PROXY_PATHS}
    #: The router's deferred accounting (proxy.defer_accounting), drained before every other
    #: endpoint answers (/metrics, /debug/*, the explain endpoint, /ready read what it writes).
    after_answer: AfterAnswer | None = None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:  # type: ignore[override]
        if (
            self.proxy_app is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in PROXY_PATHS
        ):
            await self.proxy_app(scope, receive, send)
            return
        if self.after_answer is not None:
            self.after_answer.drain()
        await super().__call__(scope, receive, send)


class _HandedOver:
    """A request the callback path handed over to a task, how far it got, and its client (a
    stream goes back to callbacks once its first event is in: ``Router.serve``)."""

    __slots__ = ("client", "ctx", "deciding", "headers", "sent")

    def __init__(
        self, ctx: RouteContext, headers: Mapping[str, str], deciding: Any, sent: Any, client: _CallbackClient
    ) -> None:
        self.ctx, self.headers, self.deciding, self.sent = ctx, headers, deciding, sent
        self.client = client


class _CallbackClient:
    """``router.routing.CallbackClient`` on router/fastpath.py's exchange."""

    __slots__ = ("_refused", "ctx", "exchange", "headers", "request_id", "resume_app")

    def __init__(self, exchange: Any, request_id: str, refused: Callable[[RouterError, str], None]) -> None:
        self.exchange = exchange
        self.request_id = request_id
        self._refused = refused
        self.ctx: RouteContext | None = None
        self.headers: Mapping[str, str] = {}
        self.resume_app: Callable[[_HandedOver], Any] | None = None

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.exchange.answer_now(status, headers, body)

    def refuse(self, err: RouterError) -> None:
        self._refused(err, self.request_id)
        self.exchange.answer_now(err.status, error_headers(err, self.request_id), err.body())

    def hand_over(self, deciding: Any, sent: Any) -> None:
        assert self.ctx is not None and self.resume_app is not None
        self.exchange.run_as_task(self.resume_app(_HandedOver(self.ctx, self.headers, deciding, sent, self)))

    def watch_disconnect(self, on_disconnect: Callable[[], None] | None) -> bool:
        return bool(self.exchange.disconnect_watcher(on_disconnect))

    def watch_writable(self, on_writable: Callable[[bool], None] | None) -> bool:
        return bool(self.exchange.writable_watcher(on_writable))

    def cut_reason(self) -> str:
        return str(self.exchange.cut_reason)

    def stream_start(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.exchange.stream_start(headers)

    def stream_write(self, data: bytes) -> None:
        self.exchange.stream_write(data)

    def stream_end(self, data: bytes) -> None:
        self.exchange.stream_end(data)

    def stream_whole(self, headers: list[tuple[bytes, bytes]], data: bytes) -> None:
        self.exchange.stream_now(headers, data)

    def stream_abort(self, data: bytes) -> None:
        self.exchange.stream_abort(data)


class _AsgiResponse(Response):
    """A Response that hands the exchange to an ASGI callable (the OpenAPI-documented routes)."""

    def __init__(self, asgi: Callable[[dict[str, Any], Receive, Send], Awaitable[None]]) -> None:
        self._asgi = asgi
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._asgi(scope, receive, send)


def error_response(err: RouterError, request_id: str = "") -> Response:
    headers = dict(err.headers or {})
    if request_id:
        headers["x-request-id"] = request_id
    return Response(err.body(), status_code=err.status, media_type="application/json", headers=headers)


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's x-request-id when it is short printable ASCII, else a new id."""
    value = headers.get("x-request-id")
    if value and len(value) <= _MAX_REQUEST_ID_CHARS and value.isascii() and value.isprintable():
        return value
    return new_request_id()


def _is_json_type(content_type: str) -> bool:
    if content_type == "application/json":  # what nearly every client sends
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _check_number(body: Mapping[str, Any], key: str, low: float, high: float, what: str) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad_request(f"'{key}' must be {what}, got {str(value)[:40]}", "invalid_value")


#: Numeric body fields with a range: (key, lowest, highest, what the error calls it).
_NUMBER_FIELDS: tuple[tuple[str, float, float, str], ...] = (
    ("max_tokens", 1, 2**31 - 1, "an integer >= 1"),
    ("max_completion_tokens", 1, 2**31 - 1, "an integer >= 1"),
    ("n", 1, 2**31 - 1, "an integer >= 1"),
    ("temperature", 0.0, 1e6, "a number >= 0"),
    ("top_p", 1e-9, 1.0, "a number in (0, 1]"),
)
#: A JSON number decodes to int or float (``_check_number`` checks any other value itself).
_NUMBERS = FieldRules(
    _NUMBER_FIELDS,
    _check_number,
    exact={key: (int, float, type(None)) for key, *_ in _NUMBER_FIELDS},
    ranges={key: (low, high) for key, low, high, _ in _NUMBER_FIELDS},
)


def validate_body(endpoint: str, body: Mapping[str, Any]) -> None:
    """Checks beyond ``parse_request`` that an engine would also make, so the explain endpoint and
    the router's own prompt estimate never work on values the engine rejects: message content is
    a string, a list of parts with string text, or null; counts and sampling values in range."""
    if endpoint == CHAT:
        messages = body.get("messages")
        for i, message in enumerate(messages if isinstance(messages, list) else ()):
            if not isinstance(message, dict):
                continue  # parse_request names it
            content = message.get("content")
            if content is None or isinstance(content, str):
                continue
            if not isinstance(content, list):
                raise bad_request(
                    f"'messages[{i}].content' must be a string, a list of content parts or null",
                    "invalid_type",
                )
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type", ""), str):
                    raise bad_request(
                        f"'messages[{i}].content[{j}]' must be an object with a string 'type'", "invalid_type"
                    )
                if "text" in part and not isinstance(part["text"], str):
                    raise bad_request(f"'messages[{i}].content[{j}].text' must be a string", "invalid_type")
    _NUMBERS.check(body)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("'cache_salt' must be a non-empty string", "invalid_type")


class LivenessObserver:
    """Each engine answer is proof of life: it feeds the health poller's liveness window and closes
    the engine's circuit breaker (a stream's first token, or any complete answer from the engine)."""

    def __init__(self, tracker: LoadTracker) -> None:
        self._tracker = tracker
        self._engines = tracker.engines

    def _answered(self, engine_id: str) -> None:
        state = self._engines.get(engine_id)
        if state is not None:
            state.last_answer_s = time.monotonic()
            if state.breaker_failures:
                self._tracker.record_success(engine_id)

    def on_routed(self, ctx: RouteContext) -> None:
        # A half-open breaker lets one request through. The decision names the engine: on_routed
        # runs before the request is sent, so ``ctx.engine_id`` is not set yet.
        if ctx.decision is not None:
            self._tracker.claim_trial(ctx.decision.engine_id)

    def on_first_byte(self, ctx: RouteContext) -> None:
        self._answered(ctx.engine_id)

    def on_finished(self, ctx: RouteContext) -> None:
        # 2xx and 4xx come from a working engine; 5xx, 499 and router-made errors say nothing good.
        error = ctx.error
        if (
            ctx.engine_id
            and 200 <= ctx.http_status < 500
            and not (error and error.startswith("stream broke"))
        ):
            self._answered(ctx.engine_id)


class RequestReader:
    """Reads and validates a chat/completions body into a ``RouteContext`` (chat path and explain):
    JSON content type only (415: a browser's cross-site "simple request" cannot send one), body
    size (413) and time (408) limits, validation (400, never a crash), the prompt-size limit before
    any tokenising (400), and the tenant's cache_salt."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.max_body_bytes = config.limits.max_body_bytes
        self.body_timeout_s = config.limits.body_timeout_s
        self.max_prompt_tokens = config.limits.max_prompt_tokens
        source = config.tenancy.source
        if source == "auto":
            source = "api_key" if config.auth.api_keys else "none"
        self.tenancy = source
        self.tenant_header = config.tenancy.header.lower()

    async def body(self, headers: Mapping[str, str], receive: Receive) -> bytes:
        """The request body from ASGI ``receive`` (JSON only, within the size and time limits);
        ClientDisconnect when the client goes away during the upload."""
        body = self.body_now(headers, receive)
        return body if body is not None else await self.wait_body(receive)

    def body_now(self, headers: Mapping[str, str], receive: Receive) -> bytes | None:
        """``body``'s checks and the body when the server holds all of it already (no await: the
        usual case, a body that came with its headers), else None: ``body`` waits for it."""
        content_type = headers.get("content-type", "")
        if not _is_json_type(content_type):
            raise RouterError(
                415,
                f"Content-Type must be application/json, got {content_type[:80]!r}",
                code="unsupported_media_type",
                headers={"connection": "close"},
            )
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise RouterError(
                413,
                f"request body of {declared} bytes exceeds limits.max_body_bytes ({self.max_body_bytes})",
                code="request_too_large",
                headers={"connection": "close"},
            )
        cycle = getattr(receive, "__self__", None)
        if getattr(cycle, "more_body", True) is False:
            # uvicorn's request cycle holds the whole body already: the read cannot wait, so it
            # needs no timeout (the common case: a body that came with its headers). kvroute's
            # own exchange (router/fastpath.py) hands it over without an ASGI message.
            complete_body = getattr(cycle, "complete_body", None)
            body = complete_body() if complete_body is not None else None
            if body is not None and len(body) > self.max_body_bytes:
                raise self._too_large()
            return body
        return None

    async def wait_body(self, receive: Receive) -> bytes:
        """The body read message by message (within the time limit unless the server holds all
        of it already)."""
        cycle = getattr(receive, "__self__", None)
        if getattr(cycle, "more_body", True) is False:
            return await self._read(receive)
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await self._read(receive)
        except TimeoutError:
            raise RouterError(
                408,
                f"request body not received within limits.body_timeout_s ({self.body_timeout_s} s)",
                code="body_timeout",
                headers={"connection": "close"},
            ) from None

    async def _read(self, receive: Receive) -> bytes:
        parts: list[bytes] = []
        size_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size_bytes += len(chunk)
            if size_bytes > self.max_body_bytes:
                raise self._too_large()
            if not message.get("more_body", False):
                if not parts:
                    return chunk  # the usual case: the whole body in one message
                parts.append(chunk)
                return b"".join(parts)
            parts.append(chunk)

    def _too_large(self) -> RouterError:
        return RouterError(
            413,
            f"request body exceeds limits.max_body_bytes ({self.max_body_bytes})",
            code="request_too_large",
            headers={"connection": "close"},
        )

    def tenant(self, headers: Mapping[str, str], scope: Mapping[str, Any]) -> str | None:
        """The tenant whose cache_salt this request gets, or None without tenancy."""
        if self.tenancy == "none":
            return None
        if self.tenancy == "header":
            return headers.get(self.tenant_header) or "_anonymous"
        return str(scope.get("state", {}).get(TENANT_STATE_KEY) or "_anonymous")

    def parse(
        self,
        endpoint: str,
        raw_body: bytes,
        headers: Mapping[str, str],
        scope: Mapping[str, Any],
        request_id: str,
    ) -> RouteContext:
        try:
            ctx = parse_request(
                endpoint,
                raw_body,
                headers,
                request_id=request_id,
                started_s=time.monotonic(),
                config=self.config,
            )
        except RecursionError:
            raise bad_request("request body is nested too deeply", "invalid_json") from None
        except RouterError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # parse_request is a validator of client input: a crash in it is a bad request. Name
            # the field when the router's own checks can (only on this error path: decode again).
            doc = msgspec.json.decode(raw_body)
            if isinstance(doc, dict):
                validate_body(endpoint, doc)
            raise bad_request(
                f"request body is malformed ({type(exc).__name__})", "invalid_request"
            ) from None
        validate_body(endpoint, ctx.body)
        prompt_tokens = ctx.route_request.prompt_tokens
        if self.max_prompt_tokens and prompt_tokens > self.max_prompt_tokens:
            raise bad_request(
                f"prompt of about {prompt_tokens} tokens exceeds limits.max_prompt_tokens "
                f"({self.max_prompt_tokens})",
                "prompt_too_long",
            )
        tenant = self.tenant(headers, scope)
        if tenant is not None:
            # The tenant's salt first: whatever cache_salt a client sends, it can only ever match
            # blocks of its own tenant. (The digest keeps tenant names out of the engines' logs.)
            salt = "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:32]
            client_salt = ctx.body.get("cache_salt")
            ctx.body["cache_salt"] = f"{salt}:{client_salt}" if client_salt else salt
            ctx.raw_body = _encode_json(ctx.body)
        return ctx


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
) -> KvrouteApp:
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
    tracker.configure_breaker(config.health.breaker_failures, config.health.breaker_open_s)
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
        observers=[LivenessObserver(tracker), *observers],
    )
    reader = RequestReader(config)
    # Each once, by identity: one object may fill two roles (the router's services are both the
    # event manager and an observer); a second start() would leak the first start's HTTP session.
    components = list(
        {
            id(c): c
            for c in (index, tokenizer, event_manager, experiments, annotator, *observers)
            if c is not None and hasattr(c, "start") and hasattr(c, "stop")
        }.values()
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        poller = EnginePoller(
            tracker,
            client.session,
            interval_s=config.health.interval_s,
            timeout_s=config.health.timeout_s,
            failures_before_unhealthy=config.health.failures_before_unhealthy,
            answer_liveness_s=config.health.answer_liveness_s,
        )
        started: list[Any] = []
        thresholds = gc.get_threshold()
        try:
            poller.start()
            for component in components:
                await component.start()
                started.append(component)
            # Everything built so far (config, index, policies, tokenizer tables) lives as long as
            # the router: out of the collector's sight, so that a collection triggered by the
            # requests' short-lived objects does not walk it every time.
            gc.freeze()
            # A young-generation collection every 10,000 allocations instead of 700: a request
            # allocates hundreds of container objects, nearly all freed by reference counting, so
            # the frequent collections mostly re-scan the requests in flight (2-4% of the CPU).
            gc.set_threshold(10_000, *thresholds[1:])
            yield
        finally:
            if router.after_answer is not None:  # what waits is accounted before the components stop
                router.after_answer.close()
            gc.set_threshold(*thresholds)  # the process's own again (tests run many apps in one)
            for component in reversed(started):
                try:
                    await component.stop()
                except Exception:
                    log.exception("stopping %r failed", component)
            await poller.stop()
            await client.close()

    auth = Authenticator(config)
    app = KvrouteApp(
        title="kvroute",
        summary="Cache-aware router for vLLM fleets (OpenAI-compatible)",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.add_middleware(AccessGuard, auth=auth)
    app.state.config = config
    app.state.reader = reader
    app.state.router = router
    app.after_answer = router.after_answer
    app.state.tracker = tracker
    app.state.metrics = metrics
    app.state.index = index
    app.state.tokenizer = tokenizer
    app.state.event_manager = event_manager

    def refused(err: RouterError, request_id: str) -> None:
        """The log line and count of a request answered with ``err``."""
        log.warning("request %s: %d %s: %s", request_id, err.status, err.code, err.message)
        if err.status < 500 or err.code == "no_healthy_engine":
            metrics.requests.labels("none", "", "", str(err.status)).inc()

    async def proxy(
        scope: dict[str, Any], receive: Receive, send: Send, resume: _HandedOver | None = None
    ) -> None:
        """POST /v1/chat/completions and /v1/completions, straight from the ASGI server (no
        framework routing, dependency solving or response objects on the hot path). ``resume``:
        a request the callback path (``proxy_now``) handed over, parsed and maybe decided."""
        if resume is not None:
            try:
                await router.serve(
                    resume.ctx,
                    resume.headers,
                    receive,
                    send,
                    deciding=resume.deciding,
                    sent=resume.sent,
                    client=resume.client,
                )
            except RouterError as err:
                refused(err, resume.ctx.request_id)
                await send_error(send, err, resume.ctx.request_id)
            return
        endpoint = PROXY_PATHS[scope["path"]]
        headers = header_map(scope["headers"])
        request_id = request_id_of(headers)
        try:
            raw_body = reader.body_now(headers, receive)
            if raw_body is None:
                raw_body = await reader.wait_body(receive)
            # The router's clock starts once the body is in: its upload is the client's network.
            started_s = time.monotonic()
            ctx = reader.parse(endpoint, raw_body, headers, scope, request_id)
            ctx.started_s = started_s
            await router.serve(ctx, headers, receive, send)
        except RouterError as err:
            refused(err, request_id)
            await send_error(send, err, request_id)
        except ClientDisconnect:
            # The client went away while sending its body: counted, no traceback (a flood of
            # aborted uploads must not flood the log). Nobody is left to answer.
            log.debug("request %s: client disconnected during the upload", request_id)
            metrics.requests.labels("none", "", "", str(STATUS_CLIENT_GONE)).inc()

    # The hot path, behind the same guard (authentication, a JSON 500 for anything unhandled).
    app.proxy_app = AccessGuard(proxy, auth=auth, paths=PROXY_PATHS)
    needs_auth = any(auth.required(path) for path in PROXY_PATHS)

    def proxy_now(exchange: Any) -> bool:
        """The callback path (proxy.callback_path): a proxied request whose body is in, answered
        from callbacks (``Router.serve_now``); False: run it as a task (``proxy_app``) instead -
        an API key to check, a body that is not JSON or too large."""
        scope = exchange.scope
        headers = header_map(scope["headers"])
        if (
            needs_auth
            or not _is_json_type(headers.get("content-type", ""))
            or exchange.body_size > reader.max_body_bytes
        ):
            return False
        raw_body = exchange.complete_body()
        if raw_body is None:
            return False
        request_id = request_id_of(headers)
        client = _CallbackClient(exchange, request_id, refused)
        try:
            started_s = time.monotonic()
            ctx = reader.parse(PROXY_PATHS[scope["path"]], raw_body, headers, scope, request_id)
            ctx.started_s = started_s
            client.ctx, client.headers = ctx, headers
            client.resume_app = resume_app
            router.serve_now(ctx, headers, client)
        except RouterError as err:
            client.refuse(err)
        return True

    def resume_app(handed: _HandedOver) -> Callable[[dict[str, Any], Receive, Send], Awaitable[None]]:
        """The guarded proxy going on with ``handed`` (a JSON 500 for anything unhandled)."""

        async def resumed(scope: dict[str, Any], receive: Receive, send: Send) -> None:
            await proxy(scope, receive, send, handed)

        return AccessGuard(resumed, auth=auth)

    app.callback_proxy = proxy_now
    app.on_client_write_timeout = lambda engine: metrics.client_write_timeouts.inc((engine,))
    below = callback_path_below(config.proxy.callback_path)
    if below != 0:
        app.proxy_now = proxy_now
        if below is not None:
            app.callback_busy, app.callback_below = client.exchanges, below

    @app.post("/v1/chat/completions", openapi_extra=openapi.operation(openapi.CHAT_BODY, streams=True))
    async def chat_completions(request: Request) -> Response:
        return _AsgiResponse(proxy)  # documentation: KvrouteApp.__call__ answers this path

    @app.post("/v1/completions", openapi_extra=openapi.operation(openapi.COMPLETION_BODY, streams=True))
    async def completions(request: Request) -> Response:
        return _AsgiResponse(proxy)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": tracker.model_cards()})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        # vLLM's benchmark client probes GET /version; the same shape as vLLM's own answer.
        return JSONResponse({"version": __version__})

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
        # Ready = some engine would take a new request: healthy, not drained, breaker closed.
        healthy = len(tracker.serving())
        doc: dict[str, Any] = {"ready": healthy > 0, "healthy_engines": healthy, "engines": engines}
        if event_manager is not None and hasattr(event_manager, "ready_detail"):
            doc["events"] = event_manager.ready_detail()
        worker = getattr(app.state, "worker", None)
        if worker is not None:
            doc["worker"] = worker
        shared = getattr(app.state, "shared_state", None)
        if shared is not None:
            # Redis away is a degraded mode (local knowledge), not unreadiness: requests still work.
            doc["shared_state"] = shared.ready_detail()
        return JSONResponse(doc, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
