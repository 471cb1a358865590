"""The request pipeline: validate -> RouteRequest -> arm/policy -> (index) -> choose -> proxy.

``Router.handle`` runs, for each chat/completion request:
  1. ``parse_request``: JSON and field checks (OpenAI-shaped 400/404/413 errors), session key,
     prompt-token estimate -> ``RouteContext`` holding a ``policies.base.RouteRequest``;
  2. ``ArmSelector.select(session_key)`` -> ``Arm`` (name, policy): ``router.experiments.Experiments``
     (one arm "default" without an experiment); the x-kvroute-arm header forces an arm;
  3. ``PrefixAnnotator.annotate(ctx)`` (when one is configured; router/service.py) fills
     ``block_keys`` and ``prefix_matches`` (tokenizer + keys + index);
  4. ``FleetView`` of healthy engines serving the model from ``router.load.LoadTracker``;
  5. ``policy.choose`` -> ``Decision``; the request goes to ``decision.engine_id``, and once more
     to the first fallback if that engine refuses the connection;
  6. the engine's answer streams back unbuffered; ``RouteObserver``s get ``on_routed``,
     ``on_first_byte`` (TTFT) and ``on_finished`` (status, usage, cached tokens). Metrics are one
     observer; the cost model and experiment statistics add theirs without touching this file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiohttp
import msgspec
import xxhash
from starlette.responses import Response, StreamingResponse

from policies.base import Decision, FleetView, NoEngineAvailable, Policy, RouteRequest
from policies.costs import predicted_prefill_tokens
from router.config import RouterConfig
from router.errors import RouterError, bad_request
from router.experiments import FORCED_ARM_HEADER, Arm, Experiments
from router.load import LoadTicket, LoadTracker
from router.metrics import RouterMetrics
from router.proxy import (
    FORWARDED_REQUEST_HEADERS,
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    iter_body,
)

log = logging.getLogger("kvroute.router")

_decode_json = msgspec.json.decode
_encode_json = msgspec.json.encode
CHAT = "chat"
COMPLETIONS = "completions"
ENDPOINT_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
STATUS_CLIENT_GONE = 499  # nginx's convention: the client closed the connection first
_USAGE_TAIL_BYTES = 16384  # the final usage chunk of a stream is well under this

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
T = TypeVar("T")


class ArmSelector(Protocol):
    def select(self, session_key: str) -> Arm:
        """The arm serving this conversation (must be sticky per session key)."""
        ...


def build_arm_selector(config: RouterConfig) -> Experiments:
    """Arms from the config: the experiment's arms when it has any, else the single policy as one
    arm named "default". ``router/experiments.py`` is the one place that assigns arms."""
    return Experiments(experiment_arms(config))


def experiment_arms(config: RouterConfig) -> list[dict[str, Any]]:
    """The config's arms in ``Experiments`` form."""
    if config.experiment.arms:
        return [
            {"name": a.name, "policy": a.policy, "params": dict(a.params), "weight": a.weight}
            for a in config.experiment.arms
        ]
    return [{"name": "default", "policy": config.policy.name, "params": dict(config.policy.params)}]


def needs_block_keys(policy: Policy) -> bool:
    """Whether ``policy`` reads ``request.block_keys``: its ``needs_block_keys`` attribute when it
    has one (approx_prefix learns from keys without using the index), else ``uses_index``."""
    return bool(getattr(policy, "needs_block_keys", policy.uses_index))


@dataclass(slots=True)
class RouteContext:
    """Everything known about one request on its way through the router (observers read it)."""

    request_id: str
    endpoint: str
    raw_body: bytes
    body: dict[str, Any]
    stream: bool
    route_request: RouteRequest
    started_s: float
    arm: str = ""
    policy_name: str = ""
    decision: Decision | None = None
    #: Engine that served (or last tried) the request; "" before routing.
    engine_id: str = ""
    #: Engine ids tried in order (2 when the first refused the connection).
    attempts: list[str] = field(default_factory=list)
    first_byte_s: float | None = None
    finished_s: float | None = None
    http_status: int = 0
    #: The engine's usage object (final stream chunk or JSON body), when it sent one.
    usage: dict[str, Any] | None = None
    error: str = ""
    #: Value of the x-kvroute-arm request header ("" = the session's own arm).
    forced_arm: str = ""
    #: The fleet view the policy chose from (for /v1/route/explain and observers).
    fleet: FleetView | None = None
    #: Prompt token ids when the annotator tokenised the prompt (else None).
    prompt_token_ids: list[int] | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_byte_s is None else self.first_byte_s - self.started_s

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.started_s

    @property
    def cached_tokens(self) -> int | None:
        """usage.prompt_tokens_details.cached_tokens (engines with --enable-prompt-tokens-details)."""
        details = (self.usage or {}).get("prompt_tokens_details")
        value = details.get("cached_tokens") if isinstance(details, dict) else None
        return value if isinstance(value, int) else None

    @property
    def ok(self) -> bool:
        return 200 <= self.http_status < 300


class RouteObserver(Protocol):
    """Hooks around each routed request; must be fast and must not raise (errors are logged)."""

    def on_routed(self, ctx: RouteContext) -> None: ...

    def on_first_byte(self, ctx: RouteContext) -> None: ...

    def on_finished(self, ctx: RouteContext) -> None: ...


class PrefixAnnotator(Protocol):
    async def annotate(self, ctx: RouteContext) -> None:
        """Fill ctx.route_request.block_keys / prefix_matches (called when policy.uses_index)."""
        ...


# -- parsing -----------------------------------------------------------------------------------


def new_request_id() -> str:
    return "kvr-" + os.urandom(8).hex()


def _check_type(body: Mapping[str, Any], key: str, types: tuple[type, ...], what: str) -> None:
    value = body.get(key)
    if value is not None and (
        not isinstance(value, types) or (bool not in types and isinstance(value, bool))
    ):
        raise bad_request(f"'{key}' must be {what}, got {type(value).__name__}", "invalid_type")


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0


def _prompt_token_estimate(endpoint: str, body: Mapping[str, Any], chars_per_token: float) -> int:
    if endpoint == CHAT:
        chars = sum(_text_chars(m.get("content")) for m in body["messages"])
        return int(chars / chars_per_token) + 4 * len(body["messages"])
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return int(len(prompt) / chars_per_token)
    if prompt and all(isinstance(p, int) for p in prompt):
        return len(prompt)
    first = prompt[0] if prompt else ""
    return len(first) if isinstance(first, list) else int(len(first) / chars_per_token)


def _validate_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    ok = (
        isinstance(prompt, list)
        and prompt
        and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
            or all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt)
        )
    )
    if not ok:
        raise bad_request(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
            "invalid_type",
        )


def session_key_of(endpoint: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> str:
    """x-session-id header, else the body's ``user``, else a hash of how the conversation starts."""
    header = headers.get("x-session-id")
    if header:
        return header
    user = body.get("user")
    if isinstance(user, str) and user:
        return user
    if endpoint == CHAT:
        start: Any = body["messages"][:2]
    else:
        prompt = body["prompt"]
        # The start of the prompt: later turns resend (and extend) the same text.
        start = prompt[:256] if isinstance(prompt, str | list) else prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            start = prompt[0][:256]
    return "h" + xxhash.xxh3_64_hexdigest(_encode_json(start))


def parse_request(
    endpoint: str,
    raw_body: bytes,
    headers: Mapping[str, str],
    *,
    request_id: str,
    started_s: float,
    config: RouterConfig,
) -> RouteContext:
    """Validate a chat/completions body; raise RouterError(400) naming the bad field."""
    try:
        body = _decode_json(raw_body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required", "missing_model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "invalid_type")
    if endpoint == CHAT:
        messages = body.get("messages")
        if messages is None:
            raise bad_request("'messages' is required", "missing_messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list of message objects", "invalid_type")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad_request(f"'messages[{i}]' must be an object with a string 'role'", "invalid_type")
    else:
        if "prompt" not in body:
            raise bad_request("'prompt' is required", "missing_prompt")
        _validate_prompt(body["prompt"])
    _check_type(body, "stream", (bool,), "a boolean")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        _check_type(body, key, (int,), "an integer")
    _check_type(body, "user", (str,), "a string")
    _check_type(body, "stream_options", (dict,), "an object")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    route_request = RouteRequest(
        request_id=request_id,
        model=model,
        session_key=session_key_of(endpoint, body, headers),
        prompt_tokens=_prompt_token_estimate(endpoint, body, config.tokenizer.chars_per_token),
        expected_output_tokens=max_tokens or config.limits.default_output_tokens,
    )
    return RouteContext(
        request_id=request_id,
        endpoint=endpoint,
        raw_body=raw_body,
        body=body,
        stream=bool(body.get("stream")),
        route_request=route_request,
        started_s=started_s,
        forced_arm=headers.get(FORCED_ARM_HEADER) or "",
    )


def usage_from_stream_tail(tail: bytes) -> dict[str, Any] | None:
    """The last ``usage`` object in the final SSE events of a stream, if any."""
    for event in reversed(tail.split(b"\n\n")):
        line = event.strip()
        if not line.startswith(b"data:") or b'"usage"' not in line:
            continue
        try:
            doc = _decode_json(line[5:].strip())
        except msgspec.DecodeError:
            continue  # the tail cut this event in half
        usage = doc.get("usage") if isinstance(doc, dict) else None
        if isinstance(usage, dict):
            return usage
    return None


def _usage_from_json(body: bytes) -> dict[str, Any] | None:
    try:
        doc = _decode_json(body)
    except msgspec.DecodeError:
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return usage if isinstance(usage, dict) else None


# -- the pipeline ------------------------------------------------------------------------------


class Router:
    """Routes and proxies one request at a time; shared state lives in the injected components."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        tracker: LoadTracker,
        client: UpstreamClient,
        metrics: RouterMetrics,
        arm_selector: ArmSelector,
        annotator: PrefixAnnotator | None = None,
        observers: Sequence[RouteObserver] = (),
        costs: Any = None,
        index_trusted: Callable[[str], bool] | None = None,
    ) -> None:
        """``costs``: the CostModel handed to policies as ``FleetView.costs``; ``index_trusted``:
        engine id -> whether its index picture is trustworthy (``EngineView.index_trusted``)."""
        self.config = config
        self.costs = costs
        self.index_trusted = index_trusted
        self.tracker = tracker
        self.client = client
        self.metrics = metrics
        self.arm_selector = arm_selector
        self.annotator = annotator
        self.observers: list[RouteObserver] = [metrics, *observers]

    def _notify(self, hook: str, ctx: RouteContext) -> None:
        for observer in self.observers:
            try:
                getattr(observer, hook)(ctx)
            except Exception:  # an observer bug must not fail the request
                log.exception("observer %r failed in %s (request %s)", observer, hook, ctx.request_id)

    async def decide(self, ctx: RouteContext) -> tuple[Arm, Decision]:
        """Steps 2-5: arm, index annotation, fleet view, policy choice (no upstream traffic)."""
        request = ctx.route_request
        arm = self._select_arm(ctx)
        ctx.arm, ctx.policy_name = arm.name, arm.policy.name
        if not self.tracker.knows_model(request.model):
            raise RouterError(
                404,
                f"model {request.model!r} is not served by any engine; see GET /v1/models",
                type="not_found_error",
                code="model_not_found",
            )
        candidates = self.tracker.candidates(request.model)
        if self.annotator is not None:
            # Annotated for every arm, not only index-aware ones: experiment statistics compare
            # the hit tokens by tier of every arm, and the trace records every request's keys.
            ctx.fleet = FleetView(candidates)
            await self.annotator.annotate(ctx)
            # Other requests were routed while this one was tokenised: choose on fresh load figures.
            candidates = self.tracker.candidates(request.model)
        if self.index_trusted is not None:
            for view in candidates:
                view.index_trusted = self.index_trusted(view.engine_id)
        if not candidates:
            raise RouterError(
                503,
                f"no healthy engine serves model {request.model!r}; see GET /ready",
                type="service_unavailable",
                code="no_healthy_engine",
            )
        try:
            fleet = FleetView(candidates, now=time.monotonic(), costs=self.costs)
            decision = arm.policy.choose(request, fleet)
        except NoEngineAvailable as exc:
            raise RouterError(503, str(exc), type="service_unavailable", code="no_healthy_engine") from None
        ctx.decision, ctx.fleet = decision, fleet
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s: arm %s policy %s -> %s (%s)",
                ctx.request_id,
                arm.name,
                arm.policy.name,
                decision.engine_id,
                decision.reason,
            )
        return arm, decision

    def _select_arm(self, ctx: RouteContext) -> Arm:
        """The session's arm, or the one the x-kvroute-arm header forces (400 when unknown)."""
        key = ctx.route_request.session_key
        if not ctx.forced_arm:
            return self.arm_selector.select(key)
        assign = getattr(self.arm_selector, "assign", None)
        if assign is None:
            raise bad_request(f"{FORCED_ARM_HEADER} is not supported by this arm selector", "unknown_arm")
        try:
            arm: Arm = assign(key, ctx.forced_arm)
        except ValueError as exc:
            raise RouterError(400, f"{FORCED_ARM_HEADER} header: {exc}", code="unknown_arm") from None
        return arm

    async def handle(self, ctx: RouteContext, headers: Mapping[str, str], receive: Receive) -> Response:
        """Route ``ctx`` and return the response to send (streaming or complete)."""
        arm, decision = await self.decide(ctx)
        # Reserve the engine's load now, with no await since the choice: requests that arrive
        # together must see each other's load, or a burst piles onto the engine that looked idle.
        tickets: list[LoadTicket] = [self._begin(ctx, decision, decision.engine_id)]
        self._notify("on_routed", ctx)
        arm.policy.on_routed(ctx.route_request, decision)
        try:
            # One disconnect watcher for the whole wait on the engine (headers, and the body of a
            # non-stream answer); once streaming, Starlette's StreamingResponse watches instead.
            return await _unless_disconnected(self._forward(ctx, arm, decision, headers, tickets), receive)
        except ClientGone:
            if tickets:
                self._finish(
                    ctx,
                    arm,
                    tickets[-1],
                    STATUS_CLIENT_GONE,
                    "client disconnected; upstream request cancelled",
                )
            return Response(status_code=STATUS_CLIENT_GONE)

    def _upstream_failure(
        self, ctx: RouteContext, arm: Arm, ticket: LoadTicket, engine_id: str, exc: UpstreamError
    ) -> RouterError:
        """Account a failed upstream exchange and the client error for it: 504 on a timeout, else 502."""
        self.metrics.upstream_error(engine_id, exc.kind)
        status = 504 if exc.kind == "timeout" else 502
        self._finish(ctx, arm, ticket, status, str(exc), log_error=False)
        return RouterError(
            status,
            f"engine {engine_id}: {exc}",
            type="timeout_error" if status == 504 else "upstream_error",
            code="upstream_timeout" if status == 504 else "upstream_error",
        )

    def _begin(self, ctx: RouteContext, decision: Decision, engine_id: str) -> LoadTicket:
        # Queue only what the engine must compute: a mostly cached prompt counted whole makes its
        # engine look busy and pushes the conversation's next turn away from its history.
        return self.tracker.begin(engine_id, predicted_prefill_tokens(ctx.route_request, decision, engine_id))

    async def _forward(
        self,
        ctx: RouteContext,
        arm: Arm,
        decision: Decision,
        headers: Mapping[str, str],
        tickets: list[LoadTicket],
    ) -> Response:
        """Send to the chosen engine (one retry on the next choice if it refuses) and build the
        response; ``tickets`` receives each attempt's load ticket for the caller's cleanup."""

        upstream_headers = {"content-type": "application/json", "x-request-id": ctx.request_id}
        for name in FORWARDED_REQUEST_HEADERS:
            value = headers.get(name)
            if value is not None:
                upstream_headers[name] = value
        path = ENDPOINT_PATHS[ctx.endpoint]
        order = [decision.engine_id, *decision.fallbacks][:2]  # the choice, then one retry
        response: aiohttp.ClientResponse | None = None
        ticket: LoadTicket | None = None
        for attempt, engine_id in enumerate(order):
            ctx.engine_id = engine_id
            ctx.attempts.append(engine_id)
            engine = self.tracker.engines[engine_id].config
            if attempt > 0:  # the first attempt's ticket was taken when the engine was chosen
                tickets.append(self._begin(ctx, decision, engine_id))
            ticket = tickets[-1]
            try:
                response = await self.client.send(engine.url + path, ctx.raw_body, upstream_headers)
                break
            except UpstreamConnectError as exc:
                self.tracker.end(ticket)  # this attempt's share; the retry takes a new ticket
                self.tracker.set_health(engine_id, False, str(exc))
                self.metrics.upstream_error(engine_id, exc.kind)
                log.warning(
                    "request %s: engine %s refused (%s)%s",
                    ctx.request_id,
                    engine_id,
                    exc,
                    "; retrying on the next choice" if attempt + 1 < len(order) else "",
                )
                if attempt + 1 >= len(order):
                    self._finish(ctx, arm, ticket, 502, str(exc), log_error=False)
                    raise RouterError(
                        502,
                        f"engine {engine_id} is unreachable: {exc}",
                        type="upstream_error",
                        code="upstream_connect_error",
                    ) from None
            except UpstreamError as exc:
                raise self._upstream_failure(ctx, arm, ticket, engine_id, exc) from None
            except BaseException:  # cancelled (server shutdown) or a bug: give the load back
                self.tracker.end(ticket)
                raise
        assert response is not None and ticket is not None
        out_headers = {
            "x-kvroute-engine": ctx.engine_id,
            "x-kvroute-policy": ctx.policy_name,
            "x-kvroute-arm": ctx.arm,
            "x-request-id": ctx.request_id,
        }
        content_type = response.headers.get("content-type", "application/json")
        if ctx.stream and response.status == 200:

            def on_close() -> None:  # runs even if the stream never started (client gone at once)
                response.close()
                self._finish(
                    ctx, arm, ticket, STATUS_CLIENT_GONE, "client disconnected before the stream began"
                )

            return _ProxyStream(
                self._stream(ctx, arm, response, ticket),
                on_close=on_close,
                status_code=200,
                headers=out_headers,
                media_type=content_type,
            )
        return await self._complete(ctx, arm, response, ticket, out_headers, content_type)

    def _first_byte(self, ctx: RouteContext, ticket: LoadTicket) -> None:
        ctx.first_byte_s = time.monotonic()
        self.tracker.first_byte(ticket)
        self._notify("on_first_byte", ctx)

    def _finish(
        self,
        ctx: RouteContext,
        arm: Arm,
        ticket: LoadTicket,
        status: int,
        error: str = "",
        *,
        log_error: bool = True,
    ) -> None:
        """Account the end of a request once (later calls are no-ops). ``log_error=False`` when the
        caller raises a RouterError, which the app logs."""
        if ctx.finished_s is not None:
            return
        self.tracker.end(ticket)
        ctx.http_status, ctx.finished_s = status, time.monotonic()
        ctx.error = error
        if error and log_error:
            log.warning(
                "request %s on engine %s: %s (status %d)", ctx.request_id, ctx.engine_id, error, status
            )
        arm.policy.on_finished(ctx.route_request, ctx.engine_id, ctx.ok)
        self._notify("on_finished", ctx)
        if log.isEnabledFor(logging.INFO):
            ttft_s = ctx.ttft_s
            log.info(
                "request %s: engine %s arm %s status %d ttft %s cached %s/%s tokens",
                ctx.request_id,
                ctx.engine_id,
                ctx.arm,
                status,
                "-" if ttft_s is None else f"{ttft_s * 1000:.1f}ms",
                ctx.cached_tokens,
                (ctx.usage or {}).get("prompt_tokens"),
            )

    async def _stream(
        self, ctx: RouteContext, arm: Arm, response: aiohttp.ClientResponse, ticket: LoadTicket
    ) -> AsyncIterator[bytes]:
        """Forward SSE bytes as they arrive; keep the tail to read the final usage chunk."""
        tail: deque[bytes] = deque()  # the last chunks, about _USAGE_TAIL_BYTES of them
        tail_bytes = 0
        status, error = 200, ""
        try:
            async for chunk in iter_body(response):
                if ctx.first_byte_s is None and b"data:" in chunk:  # not a keep-alive comment
                    self._first_byte(ctx, ticket)
                tail.append(chunk)
                tail_bytes += len(chunk)
                while tail_bytes - len(tail[0]) >= _USAGE_TAIL_BYTES:
                    tail_bytes -= len(tail.popleft())
                yield chunk
        except UpstreamError as exc:
            # Headers are sent: the client sees a truncated stream (no [DONE]); count it as 502.
            self.metrics.upstream_error(ctx.engine_id, exc.kind)
            status, error = 502, f"stream broke off: {exc}"
        except (asyncio.CancelledError, GeneratorExit):
            # A client that hangs up right after the final [DONE] got the whole answer.
            if not (tail and b"data: [DONE]" in tail[-1]):
                status, error = STATUS_CLIENT_GONE, "client disconnected; upstream request cancelled"
            raise
        finally:
            response.close()  # closing the socket is what cancels the request in the engine
            ctx.usage = usage_from_stream_tail(b"".join(tail))
            self._finish(ctx, arm, ticket, status, error)

    async def _complete(
        self,
        ctx: RouteContext,
        arm: Arm,
        response: aiohttp.ClientResponse,
        ticket: LoadTicket,
        out_headers: dict[str, str],
        content_type: str,
    ) -> Response:
        """Read a whole (non-stream or error) answer."""
        try:
            data = await self._read_all(ctx, response, ticket)
        except UpstreamError as exc:
            raise self._upstream_failure(ctx, arm, ticket, ctx.engine_id, exc) from None
        finally:
            response.close()
        if response.status >= 500:
            self.metrics.upstream_error(ctx.engine_id, f"http_{response.status}")
        if response.status == 200:
            ctx.usage = _usage_from_json(data)
        self._finish(
            ctx,
            arm,
            ticket,
            response.status,
            "" if response.status < 400 else f"engine answered {response.status}",
        )
        return Response(
            content=data, status_code=response.status, headers=out_headers, media_type=content_type
        )

    async def _read_all(
        self, ctx: RouteContext, response: aiohttp.ClientResponse, ticket: LoadTicket
    ) -> bytes:
        parts: list[bytes] = []
        async for chunk in iter_body(response):
            if ctx.first_byte_s is None:
                self._first_byte(ctx, ticket)
            parts.append(chunk)
        return b"".join(parts)


class _ProxyStream(StreamingResponse):
    """StreamingResponse that always runs ``on_close`` after sending, whatever happened."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class ClientGone(Exception):
    """The client closed its connection while the router waited for the engine."""


async def _unless_disconnected(awaitable: Awaitable[T], receive: Receive) -> T:
    """Await ``awaitable`` unless the client disconnects first: then cancel it (closing the
    upstream connection, which is what stops the engine's work) and raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves (server shutdown): take both down
        gone.cancel()
        work.cancel()
        raise
    gone.cancel()
    if not work.done():
        work.cancel()
        # Let the cancelled request unwind (its socket closes) before answering.
        await asyncio.wait((work,))
        raise ClientGone
    return work.result()


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports the client gone (the body was already read)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return
