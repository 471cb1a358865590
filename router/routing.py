"""The request pipeline, the async shell around the routing core (``kvcore.core.RoutingCore``).

``Router.handle`` runs, for each chat/completion request:
  1. ``parse_request``: JSON and field checks (OpenAI-shaped 400/404/413 errors), session key
     (stable from turn 1), prompt-token estimate -> ``RouteContext`` with a ``RouteRequest``;
  2. ``ArmSelector.select(session_key)`` -> ``Arm`` (name, policy); x-kvroute-arm forces an arm;
  3. ``PrefixAnnotator.annotate(ctx)`` fills ``block_keys`` and ``prefix_matches``;
  4. core.filter -> core.score (the arm's policy) -> core.reserve, with no await in between;
  5. the request goes to the chosen engine (once more to the first fallback if it refuses the
     connection); streams ask the engine for usage (``stream_options.include_usage``) and the
     extra usage chunk is removed again when the client did not ask for it;
  6. core.on_first_token at the first streamed event (the only TTFT there is: a non-stream body
     comes when generation is over, so non-stream requests record latency, no TTFT), and
     core.on_finished with the engine's usage: load, calibration, self-check, experiments.
     The client's bytes go first: that accounting runs right after the write it is about (the
     first event's, the answer's last), in the same step of the event loop (a client's next
     request and a /metrics scrape see it done); the times stay those of the arrival
     (``first_token_s``) and the end of the answer (``finished_s``). An error in it is logged, and
     the answer, already out, stays as it went (``_AFTER_ANSWER``). With
     ``proxy.defer_accounting`` (on by default) only the load is released there; the learning, the observers
     and the log line wait in ``Router.after_answer`` (router/after_answer.py), drained when the
     next request has gone upstream (the engine's time), by a timer, at a cap, before the
     non-proxied endpoints answer and at shutdown.
``RouteObserver``s (metrics, trace, event watchdog) see ``on_routed``/``on_first_byte``/``on_finished``.
"""

from __future__ import annotations

import asyncio
import dis
import heapq
import itertools
import logging
import operator
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import xxhash

from kvcore.core import (
    PRIORITY_EPOCH_S,
    Outcome,
    Reservation,
    RoutingCore,
    other_engines,
    priority_fcfs_factor_for,
    shortest_first_priority,
)
from policies.base import Decision, FleetView, NoEngineAvailable, RouteRequest
from router.after_answer import AfterAnswer
from router.config import RouterConfig
from router.errors import FieldRules, RouterError, bad_request, sse_error_event
from router.experiments import FORCED_ARM_HEADER, Arm, Experiments
from router.first_byte import FirstByteBudget
from router.load import LoadTracker
from router.metrics import RouterMetrics
from router.proxy import (
    FORWARDED_REQUEST_HEADERS,
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamFirstByteTimeout,
    UpstreamResponse,
    encode_headers,
)
from router.tokenize import prefix_hashes

log = logging.getLogger("kvroute.router")

_decode_json = msgspec.json.decode
_encode_json = msgspec.json.encode
_encode_msgpack = msgspec.msgpack.encode
CHAT = "chat"
COMPLETIONS = "completions"
ENDPOINT_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
STATUS_CLIENT_GONE = 499  # nginx's convention: the client closed the connection first
#: The log line of an accounting that failed after the client's bytes went out (the answer stands).
_AFTER_ANSWER = "request %s: the accounting after the answer failed (the answer went out as it was)"
CLIENT_GONE = "client disconnected; upstream request cancelled"


def client_gone_error(cut_reason: str) -> str:
    """The error of a request whose client connection was lost: the client went away, or the
    router cut it for ``cut_reason`` (limits.client_write_timeout_s, router/guard.py)."""
    return f"{cut_reason}; upstream request cancelled" if cut_reason else CLIENT_GONE


#: Escalation: the shortest wait for a first event given to an attempt whose escalation time is
#: already past when it is sent (a fail-over's): it still gets this long before it is escalated.
MIN_ESCALATE_WAIT_S = 0.05
_USAGE_TAIL_BYTES = 16384  # the final usage chunk of a stream is well under this
_FORWARDED = frozenset(FORWARDED_REQUEST_HEADERS)

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Any], Awaitable[None]]


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


class RouteContext(msgspec.Struct):
    """Everything known about one request on its way through the router (observers read it)."""

    request_id: str
    endpoint: str
    raw_body: bytes
    body: dict[str, Any]
    stream: bool
    route_request: RouteRequest
    #: Monotonic time the whole request body had arrived (the router's clock starts here).
    started_s: float
    arm: str = ""
    policy_name: str = ""
    decision: Decision | None = None
    #: Engine that served (or last tried) the request; "" before routing.
    engine_id: str = ""
    #: Engine ids tried in order (2 when the first refused the connection).
    attempts: list[str] = msgspec.field(default_factory=list)
    #: When the request was handed to the engine (the last attempt's send).
    sent_s: float | None = None
    #: First streamed event from the engine; None for non-stream answers (no token is seen).
    first_token_s: float | None = None
    finished_s: float | None = None
    #: The core's reservation of the engine serving (or last tried for) the request.
    reservation: Reservation | None = None
    #: The router added stream_options.include_usage: the usage chunk is removed for the client.
    strip_usage: bool = False
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
    #: vLLM ``priority`` the router sent (a priority engine's shortest-work-first level); None = none.
    priority: int | None = None
    #: Escalated (``costs.priority_escalate_after_s``): sent again with priority 0 after its first
    #: attempt showed no first event in time.
    escalated: bool = False
    #: The attempt in flight was sent with the escalation's first-event deadline, not the budget
    #: (``Router._first_event_deadline``): its first-byte timeout escalates it.
    escalating: bool = False
    #: The conversation start's message-prefix hashes when the session key was made from them
    #: (``session_key_and_start``): the prompt names go on from them. Empty otherwise.
    start_prefixes: Sequence[int] = ()

    @property
    def ttft_s(self) -> float | None:
        """Body received -> first streamed token (what the client waits through the router);
        None for non-stream requests."""
        return None if self.first_token_s is None else self.first_token_s - self.started_s

    @property
    def router_s(self) -> float | None:
        """Router time: parse, tokenise, route (body received -> sent upstream)."""
        return None if self.sent_s is None else self.sent_s - self.started_s

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


class _RequestIds:
    """Request ids: a random per-process prefix (new in a forked child) and a counter, unique
    without a getrandom() syscall per request."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = "kvr-" + os.urandom(6).hex() + "-"
        self.counter = itertools.count(1)


_request_ids = _RequestIds()


def new_request_id() -> str:
    return f"{_request_ids.prefix}{next(_request_ids.counter):x}"


def _check_type(body: Mapping[str, Any], key: str, types: tuple[type, ...], what: str) -> None:
    value = body.get(key)
    if value is not None and (
        not isinstance(value, types) or (bool not in types and isinstance(value, bool))
    ):
        raise bad_request(f"'{key}' must be {what}, got {type(value).__name__}", "invalid_type")


#: Optional body fields with a required JSON type: (key, Python types, what the error calls it).
_TYPED_FIELDS: tuple[tuple[str, tuple[type, ...], str], ...] = (
    ("stream", (bool,), "a boolean"),
    ("max_tokens", (int,), "an integer"),
    ("max_completion_tokens", (int,), "an integer"),
    ("n", (int,), "an integer"),
    ("user", (str,), "a string"),
    ("stream_options", (dict,), "an object"),
)
#: Per typed field, the exact types that pass ``_check_type`` (None, or one of its types, as JSON
#: decodes it).
_TYPED_EXACT = {key: (*types, type(None)) for key, types, _ in _TYPED_FIELDS}
_TYPED = FieldRules(_TYPED_FIELDS, _check_type, _TYPED_EXACT)


_content_of = operator.methodcaller("get", "content")


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0


def _prompt_token_estimate(endpoint: str, body: Mapping[str, Any], chars_per_token: float) -> int:
    if endpoint == CHAT:
        messages = body["messages"]
        chars = sum(map(_text_chars, map(_content_of, messages)))
        return int(chars / chars_per_token) + 4 * len(messages)
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


def conversation_start(messages: Sequence[Any]) -> list[Any]:
    """The messages up to and including the first user message: what every turn of a chat
    resends unchanged (system/developer prompt, first question). Turn 1 ([user1]) and turn 2
    ([user1, assistant1, user2]) share it, so the key does not change between turns."""
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return list(messages[: i + 1])
    return list(messages[:1])


def session_key_of(endpoint: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> str:
    """x-session-id header, else the body's ``user``, else a hash of how the conversation starts:
    for chat the messages up to the first user message plus ``tools`` when present."""
    return session_key_and_start(endpoint, body, headers)[0]


def session_key_and_start(
    endpoint: str, body: Mapping[str, Any], headers: Mapping[str, str]
) -> tuple[str, Sequence[int]]:
    """(``session_key_of``, the conversation start's message-prefix hashes when the key was made
    from them: ``router.tokenize.prefix_hashes`` of the chat's messages up to the first user
    message, which the annotator's prompt names go on from instead of encoding and hashing those
    messages again - a 16K-token first message once, not twice; else ())."""
    header = headers.get("x-session-id")
    if header:
        return header, ()
    user = body.get("user")
    if isinstance(user, str) and user:
        return user, ()
    if endpoint == CHAT:
        start: Any = conversation_start(body["messages"])
        tools = body.get("tools")
        try:
            # MessagePack, not JSON: a 16K-token first message is copied, not scanned for escapes
            # (5 µs against 50); the key only has to be stable, and it names the same things.
            prefixes = prefix_hashes(start)
            key = prefixes[-1]
            if tools:
                key = xxhash.xxh3_64_intdigest(_encode_msgpack(tools), key)
            return f"h{key:016x}", prefixes
        except OverflowError:  # JSON takes what MessagePack cannot hold (an integer beyond 64 bits)
            return "h" + xxhash.xxh3_64_hexdigest(_encode_json([start, tools] if tools else start)), ()
    prompt = body["prompt"]
    # The start of the prompt: later turns resend (and extend) the same text.
    start = prompt[:256] if isinstance(prompt, str | list) else prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        start = prompt[0][:256]
    try:
        encoded = _encode_msgpack(start)
    except OverflowError:
        encoded = _encode_json(start)
    return "h" + xxhash.xxh3_64_hexdigest(encoded), ()


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
    _TYPED.check(body)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    session_key, start_prefixes = session_key_and_start(endpoint, body, headers)
    route_request = RouteRequest(
        request_id=request_id,
        model=model,
        session_key=session_key,
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
        start_prefixes=start_prefixes,
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


class _UsageOnly(msgspec.Struct):
    """The ``usage`` of an answer; its other fields are skipped unread (half the time of a full decode)."""

    usage: Any = None


_decode_usage = msgspec.json.Decoder(_UsageOnly).decode


def _usage_from_json(body: bytes) -> dict[str, Any] | None:
    try:
        usage = _decode_usage(body).usage
    except msgspec.DecodeError:  # not JSON, or not an object (ValidationError is a DecodeError)
        return None
    return usage if isinstance(usage, dict) else None


# -- the pipeline ------------------------------------------------------------------------------


_EMPTY_BODIES = ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


def does_nothing(method: Callable[..., Any]) -> bool:
    """True when ``method``'s body is empty (``return None``, ``pass`` or a docstring only)."""
    code = getattr(getattr(method, "__func__", method), "__code__", None)
    if code is None:
        return False
    body = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in ("RESUME", "NOP")]
    return body in _EMPTY_BODIES


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
        core: RoutingCore,
        annotator: PrefixAnnotator | None = None,
        observers: Sequence[RouteObserver] = (),
    ) -> None:
        """``core``: the routing core (load ledger, cost model, index, experiment recorder)."""
        self.config = config
        self.core = core
        self.tracker = tracker
        self.client = client
        self.metrics = metrics
        self.arm_selector = arm_selector
        self.annotator = annotator
        self.first_byte = FirstByteBudget(config.limits.first_byte_timeout_s)
        #: ``costs.priority_escalate_after_s`` (0 = off): ``_forward``'s escalation of streams.
        self._escalate_after_s = config.costs.priority_escalate_after_s
        self._prefill_releases = _DueCalls(core.release_prefill)
        #: ``proxy.defer_accounting``: the learning, observers and log line after an answer, run
        #: later (router/after_answer.py); None = right after the write, as it goes out.
        self.after_answer: AfterAnswer | None = AfterAnswer() if config.proxy.defer_accounting else None
        self.observers: list[RouteObserver] = [metrics, self.first_byte, *observers]
        # Each hook's bound methods, looked up once (not per request and observer); the hooks an
        # observer leaves empty (``return None``) are not called at all.
        #: ``decide`` may be stepped outside a task (``serve_now``): its only await is the annotator's.
        self._decides_outside_task = annotator is None or bool(
            getattr(annotator, "steps_outside_task", False)
        )
        self._hooks: dict[str, list[tuple[RouteObserver, Callable[[RouteContext], None]]]] = {
            hook: [(o, getattr(o, hook)) for o in self.observers if not does_nothing(getattr(o, hook))]
            for hook in ("on_routed", "on_first_byte", "on_finished")
        }

    @property
    def costs(self) -> Any:
        return self.core.costs

    def _notify(self, hook: str, ctx: RouteContext) -> None:
        for observer, method in self._hooks[hook]:
            try:
                method(ctx)
            except Exception:  # an observer bug must not fail the request
                log.exception("observer %r failed in %s (request %s)", observer, hook, ctx.request_id)

    async def decide(
        self, ctx: RouteContext, *, explain: bool = False, exclude: str | None = None
    ) -> tuple[Arm, Decision]:
        """Steps 2-4 up to the policy's choice (no load taken, no upstream traffic). ``explain``:
        the candidates' index trust is asked whatever the policy (the explain endpoint shows it;
        otherwise only a policy that reads the index has it asked). ``exclude``: an engine not to
        choose unless it is the fleet's only one (escalation's PICK other)."""
        request = ctx.route_request
        # The session's arm, or the one the x-kvroute-arm header forces.
        arm = self._forced_arm(ctx) if ctx.forced_arm else self.arm_selector.select(request.session_key)
        ctx.arm, ctx.policy_name = arm.name, arm.policy.name
        uses_index = arm.policy.uses_index
        trust = uses_index or explain
        # The fleet's views, built once per change of the fleet and without their load:
        # ``filter``/``refresh`` write the candidates' load figures and index trust in place
        # (after the annotator's await: the load of that moment), right before the choice.
        views = self.tracker.fleet_views()
        if exclude is not None:
            views = other_engines(views, exclude)
        annotator = self.annotator
        if annotator is None:
            candidates = self.core.filter(request, views, uses_index=uses_index, trust=trust)
        else:  # the annotator reads the candidates' ids and block sizes; load and trust come below
            candidates = self.core.filter(request, views, refresh=False)
        if not candidates:
            # An unknown model leaves no candidate (every engine lists its models and not this
            # one), so the fleet is asked only then, before any tokenising.
            self._check_model(request.model)
        fleet = FleetView(candidates)  # one per request: the annotator's, then the policy's
        if annotator is not None:
            # Annotated for every arm, not only index-aware ones: the index self-check, the
            # experiments' predicted tier split and the trace need every request's keys.
            ctx.fleet = fleet
            await annotator.annotate(ctx)
            # No await from here to reserve: other requests' load is what it is at the choice.
            # (The views' health, drain and models are those of before the await: the candidates
            # are what filtering the views again would give, so only their load and trust are read.)
            fleet.engines = candidates = self.core.refresh(
                request, candidates, uses_index=uses_index, trust=trust
            )
        ctx.fleet = fleet
        fleet.now = now = time.monotonic()
        fleet.costs = self.core.costs
        if not candidates:
            raise RouterError(
                503,
                f"no healthy engine serves model {request.model!r}; see GET /ready",
                type="service_unavailable",
                code="no_healthy_engine",
            )
        try:
            decision = self.core.score(arm.policy, request, candidates, now, fleet=fleet)
        except NoEngineAvailable as exc:
            raise RouterError(503, str(exc), type="service_unavailable", code="no_healthy_engine") from None
        ctx.decision = decision
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

    def _check_model(self, model: str) -> None:
        """404 when no engine serves ``model``."""
        if not self.tracker.knows_model(model):
            raise RouterError(
                404,
                f"model {model!r} is not served by any engine; see GET /v1/models",
                type="not_found_error",
                code="model_not_found",
            )

    def _forced_arm(self, ctx: RouteContext) -> Arm:
        """The arm the x-kvroute-arm header forces (400 when unknown)."""
        key = ctx.route_request.session_key
        assign = getattr(self.arm_selector, "assign", None)
        if assign is None:
            raise bad_request(f"{FORCED_ARM_HEADER} is not supported by this arm selector", "unknown_arm")
        try:
            arm: Arm = assign(key, ctx.forced_arm)
        except ValueError as exc:
            raise RouterError(400, f"{FORCED_ARM_HEADER} header: {exc}", code="unknown_arm") from None
        return arm

    async def serve(
        self,
        ctx: RouteContext,
        headers: Mapping[str, str],
        receive: Receive,
        send: Send,
        *,
        deciding: Awaitable[tuple[Arm, Decision]] | None = None,
        sent: UpstreamResponse | None = None,
        client: CallbackClient | None = None,
    ) -> None:
        """Route ``ctx``, proxy it and send the answer through ASGI ``send`` (streaming or
        complete). RouterErrors raised before any byte was sent are the caller's to answer.
        The callback path (``serve_now``) hands a request over from where it stopped: the rest of
        its ``decide`` (``deciding``), its reservation taken (``ctx.reservation``), or its request
        sent on a pooled connection as well (``sent``); with its ``client``, a stream is relayed
        from the upstream connection's callbacks once its first event is in (``_CallbackStream``):
        this returns then, the answer still going out."""
        if ctx.reservation is None:
            arm, decision = await (deciding if deciding is not None else self.decide(ctx))
            # Reserve the engine's load now, with no await since the choice: requests that arrive
            # together must see each other's load, or a burst piles onto the engine that looked idle.
            fleet = ctx.fleet.engines if ctx.fleet is not None else ()
            ctx.reservation = self.core.reserve(
                arm.policy, ctx.route_request, decision, time.monotonic(), arm=arm.name, candidates=fleet
            )
            self._notify("on_routed", ctx)
        else:
            assert ctx.decision is not None
            decision = ctx.decision
        # One disconnect watcher for the whole exchange (the wait for the engine, a non-stream
        # body, every streamed chunk): a client that goes away cancels the upstream request,
        # which is what stops the engine's work.
        watcher = watch_disconnect(receive)
        relayed: _StreamAnswer | None = None
        try:
            answer = await self._forward(ctx, decision, headers, sent)
            if client is not None and type(answer) is _StreamAnswer:
                relayed = answer  # (no await from here: the relay watches the client from now on)
            else:
                await answer.send(send, watcher)
        except asyncio.CancelledError:
            if not watcher.uncancel_if_fired():
                raise
            self._finish(ctx, STATUS_CLIENT_GONE, client_gone_error(watcher.cut_reason()))
        finally:
            watcher.stop()
        if relayed is not None:
            assert client is not None
            _CallbackStream(relayed.relay, client).start(relayed.headers)

    def serve_now(self, ctx: RouteContext, headers: Mapping[str, str], client: CallbackClient) -> None:
        """The callback path (``proxy.callback_path``): route ``ctx`` and send it upstream without
        an await, then relay the answer from the upstream connection's callbacks (``_Relay``; a
        stream's from its first event on: ``_CallbackStream``). Where that cannot go on without
        waiting - a ``decide`` that suspends (a tokenizer or key-cache miss), no idle connection
        to the chosen engine, an engine failing before its answer or a stream's first event
        (stale connection, first-byte budget, fail-over) - the request goes on as a task through
        ``serve`` from the point reached (``client.hand_over``). RouterErrors raised here are the
        caller's to answer."""
        if not self._decides_outside_task:
            client.hand_over(None, None)
            return
        deciding = self.decide(ctx)
        try:
            yielded = deciding.send(None)
        except StopIteration as done:
            arm, decision = done.value
        else:  # suspended: a task resumes it where it stopped
            client.hand_over(_Resumed(deciding, yielded), None)
            return
        fleet = ctx.fleet.engines if ctx.fleet is not None else ()
        reservation = ctx.reservation = self.core.reserve(
            arm.policy, ctx.route_request, decision, time.monotonic(), arm=arm.name, candidates=fleet
        )
        self._notify("on_routed", ctx)
        engine_id = decision.engine_id
        engine = self.tracker.engines[engine_id].config
        upstream_headers, body = self._upstream_request(ctx, headers)
        body = self._engine_body(ctx, engine, reservation, body)
        ctx.sent_s = reservation.sent_s = time.monotonic()
        stream = ctx.stream
        response = self.client.send_on_idle(
            engine.url + ENDPOINT_PATHS[ctx.endpoint],
            body,
            upstream_headers,
            # A stream's first-byte budget (or escalation deadline) covers its first event, as
            # ``_forward``'s; a timeout goes on in ``serve`` (``_Relay`` hands it over).
            first_byte_timeout_s=self._first_event_deadline(ctx, engine, self.first_byte.budget_s())
            if stream
            else None,
            until_event=stream,
        )
        if response is None:
            client.hand_over(None, None)
            return
        ctx.engine_id = engine_id
        ctx.attempts.append(engine_id)
        if self.after_answer is not None:  # the engine's time: run what waits
            self.after_answer.drain()
        relay = _Relay(self, ctx, response, client)
        response.on_event = relay.on_event
        if client.watch_disconnect(relay.on_disconnect):
            relay.on_disconnect()

    def _upstream_failure(self, ctx: RouteContext, engine_id: str, exc: UpstreamError) -> RouterError:
        """Account a failed upstream exchange and the client error for it: 504 on a timeout, else 502."""
        self.metrics.upstream_error(engine_id, exc.kind)
        status = 504 if exc.kind == "timeout" else 502
        self._finish(ctx, status, str(exc), log_error=False)
        return RouterError(
            status,
            f"engine {engine_id}: {exc}",
            type="timeout_error" if status == 504 else "upstream_error",
            code="upstream_timeout" if status == 504 else "upstream_error",
        )

    def _upstream_body(self, ctx: RouteContext) -> bytes:
        """The body to send: the client's bytes, plus ``stream_options.include_usage`` for a
        stream whose client did not ask for usage (the router needs cached_tokens of every
        request; the extra chunk is removed from the client's stream again)."""
        if not ctx.stream:
            return ctx.raw_body
        options = ctx.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            return ctx.raw_body
        ctx.strip_usage = True
        if "stream_options" not in ctx.body:
            # Splice instead of re-encoding: the body is a JSON object without that key. (A
            # present key, even null, is replaced below: JSON with the key twice is read by vLLM
            # as its last value, which would drop the usage the router asked for.)
            start = ctx.raw_body.index(b"{") + 1
            return ctx.raw_body[:start] + b'"stream_options":{"include_usage":true},' + ctx.raw_body[start:]
        body = dict(ctx.body)
        body["stream_options"] = {**(options or {}), "include_usage": True}
        return _encode_json(body)

    def _upstream_request(self, ctx: RouteContext, headers: Mapping[str, str]) -> tuple[bytes, bytes]:
        """The upstream request's header lines and body (before any priority splice)."""
        # The header lines encoded once per request (not once per attempt, nor from a dict).
        upstream_headers = b"content-type: application/json\r\nx-request-id: %s\r\n" % ctx.request_id.encode(
            "latin-1"
        )
        if not _FORWARDED.isdisjoint(headers):  # (in C: most requests have none of them)
            forwarded = {name: headers[name] for name in FORWARDED_REQUEST_HEADERS if name in headers}
            upstream_headers += encode_headers(forwarded)
        return upstream_headers, self._upstream_body(ctx)

    def _engine_body(self, ctx: RouteContext, engine: Any, reservation: Reservation, body: bytes) -> bytes:
        """``body`` for ``engine``: a priority engine gets the request's shortest-work-first
        priority unless the client set one."""
        if engine.scheduling_policy != "priority" or "priority" in ctx.body:
            return body
        if ctx.escalated:  # sent again after no first event in time: ahead of every deadline
            ctx.priority = 0
        else:
            costs = self.config.costs
            ctx.priority = shortest_first_priority(
                reservation.parts,
                costs.priority_step_s,
                now_s=time.time() - PRIORITY_EPOCH_S,
                stretch=costs.priority_stretch,
                max_overtake_s=costs.priority_max_overtake_s,
                fcfs_factor=priority_fcfs_factor_for(
                    ctx.route_request,
                    costs.priority_fcfs_factor,
                    costs.priority_recompute_fcfs_factor,
                    costs.priority_recompute_below,
                ),
            )
        start = body.index(b"{") + 1  # splice, as for stream_options: the key is absent
        return b'%s"priority":%d,%s' % (body[:start], ctx.priority, body[start:])

    async def _forward(
        self,
        ctx: RouteContext,
        decision: Decision,
        headers: Mapping[str, str],
        sent: UpstreamResponse | None = None,
    ) -> _Answer:
        """Send to the chosen engine (one retry on the next choice if it refuses) and build the
        response. ``sent``: the first attempt's request is out already (the callback path)."""
        upstream_headers, base_body = self._upstream_request(ctx, headers)
        path = ENDPOINT_PATHS[ctx.endpoint]
        order = [decision.engine_id, *decision.fallbacks][:2]  # the choice, then one retry
        response: UpstreamResponse | None = None
        budget_s = self.first_byte.budget_s()
        for attempt, engine_id in enumerate(order):
            if attempt == 0 and sent is not None:  # (``ctx.escalating`` set when it was sent)
                reservation = ctx.reservation
                assert reservation is not None
                waiting = self.client.headers_of(sent)
            else:
                ctx.engine_id = engine_id
                ctx.attempts.append(engine_id)
                engine = self.tracker.engines[engine_id].config
                if attempt > 0:  # the first attempt's load was reserved when the engine was chosen
                    assert ctx.reservation is not None
                    # Observers heard on_routed for the first choice only: a half-open engine taking
                    # the fail-over is its breaker's one trial all the same.
                    self.tracker.claim_trial(engine_id)
                    ctx.reservation = self.core.reserve(
                        ctx.reservation.policy,
                        ctx.route_request,
                        decision,
                        time.monotonic(),
                        engine_id=engine_id,
                        arm=ctx.arm,
                        candidates=ctx.fleet.engines if ctx.fleet is not None else (),
                    )
                reservation = ctx.reservation
                assert reservation is not None
                body = self._engine_body(ctx, engine, reservation, base_body)
                ctx.sent_s = reservation.sent_s = time.monotonic()
                timeout_s = self._first_event_deadline(ctx, engine, budget_s)
                # Streams: the time-to-first-byte budget covers the headers and the first event
                # (the long read timeout only applies once tokens flow). Until that event nothing
                # is sent to the client, so a hung engine is left for the next choice.
                waiting = self.client.send(
                    engine.url + path,
                    body,
                    upstream_headers,
                    first_byte_timeout_s=timeout_s if ctx.stream else None,
                    until_event=ctx.stream,
                )
                if self.after_answer is not None:  # once the request is out (the await below
                    self.after_answer.drain_soon()  # writes it): the engine's time runs what waits
            try:
                response = await waiting
                if ctx.stream and response.status == 200:
                    if not response.event_seen and not response.done:  # (usually in: no coroutine)
                        try:  # the budget's deadline is the client's (until_event)
                            await response.first_event()
                        except BaseException:
                            response.close()
                            raise
                    if response.event_seen:  # (the body so far holds a ``data:`` event)
                        # Its arrival time; accounted once it is sent on (``StreamRelay.sent``).
                        ctx.first_token_s = time.monotonic()
                break
            except UpstreamConnectError as exc:
                self.core.abandon(reservation)  # this attempt's share; the retry reserves anew
                if ctx.escalating and exc.kind == UpstreamFirstByteTimeout.kind:  # not the engine's fault
                    order.insert(attempt + 1, await self._escalate(ctx, engine_id))
                    continue
                if exc.kind == "connect":  # nothing listens, or the connection broke: poll again
                    self.tracker.set_health(engine_id, False, str(exc))
                self.tracker.record_failure(engine_id, str(exc))
                self.metrics.upstream_error(engine_id, exc.kind)
                log.warning(
                    "request %s: engine %s failed before answering (%s)%s",
                    ctx.request_id,
                    engine_id,
                    exc,
                    "; retrying on the next choice" if attempt + 1 < len(order) else "",
                )
                if attempt + 1 >= len(order):
                    timed_out = exc.kind == "first_byte_timeout"
                    status = 504 if timed_out else 502
                    what = "sent no first byte in time" if timed_out else "is unreachable"
                    self._finish(ctx, status, str(exc), log_error=False)
                    raise RouterError(
                        status,
                        f"engine {engine_id} {what}: {exc}",
                        type="timeout_error" if timed_out else "upstream_error",
                        code="upstream_first_byte_timeout" if timed_out else "upstream_connect_error",
                    ) from None
            except UpstreamError as exc:
                raise self._upstream_failure(ctx, engine_id, exc) from None
            except BaseException:  # cancelled (server shutdown) or a bug: give the load back
                self.core.abandon(reservation)
                raise
        assert response is not None
        if ctx.stream and response.status == 200:
            return self._stream_answer(ctx, response)
        self._answer_started(ctx, response.done)
        try:  # a whole (non-stream or error) answer, read here (not in one more coroutine)
            data = await response.read()
        except UpstreamError as exc:
            raise self._upstream_failure(ctx, ctx.engine_id, exc) from None
        finally:
            response.close()
        # Accounted once it is out (``_answered``).
        return _BodyAnswer(response.status, _answer_headers(ctx, response.content_type), data, self, ctx)

    def _first_event_deadline(self, ctx: RouteContext, engine: Any, budget_s: float) -> float:
        """The first-byte timeout of an attempt sent now (``ctx.sent_s``): the escalation's
        (``costs.priority_escalate_after_s``, counted from the request's arrival) for a stream
        with a priority on a priority engine not escalated yet, when it comes before the budget;
        else the budget. Sets ``ctx.escalating`` to which one it is."""
        ctx.escalating = False
        escalate_s, sent_s = self._escalate_after_s, ctx.sent_s
        if (
            escalate_s
            and ctx.stream
            and ctx.priority
            and not ctx.escalated
            and engine.scheduling_policy == "priority"
            and sent_s is not None
        ):
            left_s = escalate_s - (sent_s - ctx.started_s)
            if left_s < budget_s:
                ctx.escalating = True
                return max(left_s, MIN_ESCALATE_WAIT_S)
        return budget_s

    async def _escalate(self, ctx: RouteContext, engine_id: str) -> str:
        """Escalation (``costs.priority_escalate_after_s``): ``ctx``'s stream showed no first event
        on ``engine_id`` in time; its connection is closed (the engine aborts the request and keeps
        its computed blocks cached). The engine it goes to next, with priority 0
        (``costs.priority_escalate_pick``): the same, the policy's choice now, or its choice among
        the others (the same when none of them can take it)."""
        ctx.escalated = True
        self.metrics.escalated(engine_id)
        target = engine_id
        pick = self.config.costs.priority_escalate_pick
        if pick == "route":
            target = (await self.decide(ctx))[1].engine_id
        elif pick == "other":
            fleet = ctx.fleet
            try:
                target = (await self.decide(ctx, exclude=engine_id))[1].engine_id
            except RouterError as exc:  # no other engine is healthy: the one it was on
                ctx.fleet = fleet  # (decide left the empty one): the candidates it was priced among
                log.warning("request %s: escalated, no other engine: %s", ctx.request_id, exc.message)
        log.info(
            "request %s: no first token from engine %s %.1f s after it arrived; cancelled there and"
            " sent again with priority 0 to engine %s",
            ctx.request_id,
            engine_id,
            time.monotonic() - ctx.started_s,
            target,
        )
        return target

    def _stream_answer(self, ctx: RouteContext, response: UpstreamResponse) -> _StreamAnswer:
        """A stream whose first event is in (or that ended before one), to relay to the client."""
        return _StreamAnswer(StreamRelay(self, ctx, response), _answer_headers(ctx, response.content_type))

    def _answer_started(self, ctx: RouteContext, whole: bool) -> None:
        """A complete (non-stream or error) answer's headers are in; ``whole``: its body too."""
        reservation = ctx.reservation
        if reservation is not None and not whole:
            # A non-stream body arrives only when generation is over: no token to time. The
            # engine's prefill is assumed over at the predicted TTFT, so the queue does not
            # count it for the whole answer (the scraped waiting gauge corrects the guess).
            # With the body in too, the finish releases it, with the load, before anything else
            # runs (the due call would find the ticket done): nothing to schedule.
            delay_s = reservation.parts.total_s
            if 0 < delay_s < 3600:
                self._prefill_releases.add(delay_s, reservation)
            else:
                self.core.release_prefill(reservation)

    def _first_token(self, ctx: RouteContext) -> None:
        """Account a stream's first event (stamped ``first_token_s`` on its arrival) once its
        bytes are out (``StreamRelay.sent``); an error is logged (the bytes went out). With
        ``after_answer``, the queued prefill is released at once and the rest queued."""
        try:
            after = self.after_answer
            if after is None:
                reservation, arrived_s = ctx.reservation, ctx.first_token_s
                if reservation is not None and arrived_s is not None:
                    self.core.on_first_token(reservation, arrived_s)
                self._notify("on_first_byte", ctx)
                return
            if ctx.reservation is not None and ctx.first_token_s is not None:
                self.core.release_prefill(ctx.reservation)
            after.add(self._first_token_learned, ctx)
        except Exception:
            log.exception(_AFTER_ANSWER, ctx.request_id)

    def _first_token_learned(self, ctx: RouteContext) -> None:
        """The learning half of ``_first_token`` (queued on ``after_answer``); an error is logged
        with the request's id, as ``_first_token``'s."""
        try:
            reservation, arrived_s = ctx.reservation, ctx.first_token_s
            if reservation is not None and arrived_s is not None:
                self.core.tally_first_token(reservation, arrived_s)
            self._notify("on_first_byte", ctx)
        except Exception:
            log.exception(_AFTER_ANSWER, ctx.request_id)

    def _finish(self, ctx: RouteContext, status: int, error: str = "", *, log_error: bool = True) -> None:
        """Account the end of a request once (later calls are no-ops). ``log_error=False`` when the
        caller raises a RouterError, which the app logs."""
        if ctx.finished_s is not None:
            return
        ctx.http_status, ctx.finished_s = status, time.monotonic()
        ctx.error = error
        if error and log_error:
            log.warning(
                "request %s on engine %s: %s (status %d)", ctx.request_id, ctx.engine_id, error, status
            )
        if ctx.reservation is not None:
            usage = ctx.usage or {}
            prompt_tokens = usage.get("prompt_tokens")
            outcome = Outcome(
                ok=ctx.ok,
                cached_tokens=ctx.cached_tokens,
                prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
                client_gone=status == STATUS_CLIENT_GONE,
                client_ttft_s=ctx.ttft_s,
            )
            after = self.after_answer
            if after is not None:  # the load now, the rest queued
                learn = self.core.release_finished(ctx.reservation, outcome)
                after.add(self._finish_later, ctx, outcome if learn else None)
                return
            self.core.on_finished(ctx.reservation, outcome, ctx.finished_s)
        self._finish_learned(ctx, None)

    def _finish_later(self, ctx: RouteContext, outcome: Outcome | None) -> None:
        """``_finish_learned`` queued on ``after_answer``: an error is logged with the request's
        id, as the callers of ``_finish`` log it."""
        try:
            self._finish_learned(ctx, outcome)
        except Exception:
            log.exception(_AFTER_ANSWER, ctx.request_id)

    def _finish_learned(self, ctx: RouteContext, outcome: Outcome | None) -> None:
        """The rest of ``_finish`` after the load's release: the core's learning from ``outcome``
        (None: nothing to learn, or learnt already), the observers and the log line."""
        if outcome is not None:
            assert ctx.reservation is not None and ctx.finished_s is not None
            self.core.learn_finished(ctx.reservation, outcome, ctx.finished_s)
        self._notify("on_finished", ctx)
        if log.isEnabledFor(logging.INFO):
            ttft_s = ctx.ttft_s
            log.info(
                "request %s: engine %s arm %s status %d ttft %s cached %s/%s tokens%s",
                ctx.request_id,
                ctx.engine_id,
                ctx.arm,
                ctx.http_status,
                "-" if ttft_s is None else f"{ttft_s * 1000:.1f}ms",
                ctx.cached_tokens,
                (ctx.usage or {}).get("prompt_tokens"),
                "" if ctx.priority is None else f" priority {ctx.priority}",
            )

    def _answered(self, ctx: RouteContext, status: int, data: bytes) -> None:
        """Account a whole answer (the engine's ``status`` and body ``data``) once it is out, or
        its write failed; an error is logged (the answer went out as it was)."""
        try:
            if status >= 500:
                self.metrics.upstream_error(ctx.engine_id, f"http_{status}")
            if status == 200:
                ctx.usage = _usage_from_json(data)
            self._finish(ctx, status, "" if status < 400 else f"engine answered {status}")
        except Exception:
            log.exception(_AFTER_ANSWER, ctx.request_id)


def _answer_headers(ctx: RouteContext, content_type: bytes) -> list[tuple[bytes, bytes]]:
    """The headers of a proxied answer: the router's own, and the engine's ``content_type``."""
    return [
        (b"x-kvroute-engine", ctx.engine_id.encode()),
        (b"x-kvroute-policy", ctx.policy_name.encode()),
        (b"x-kvroute-arm", ctx.arm.encode()),
        (b"x-request-id", ctx.request_id.encode()),
        (b"content-type", content_type),
    ]


class CallbackClient(Protocol):
    """The client's side of a request on the callback path (router/app.py, on router/fastpath.py's
    exchange)."""

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send a complete answer (a content-length is added)."""
        ...

    def refuse(self, err: RouterError) -> None:
        """Answer ``err`` as the coroutine path's caller would (log line, metric, JSON error)."""
        ...

    def hand_over(
        self, deciding: Awaitable[tuple[Arm, Decision]] | None, sent: UpstreamResponse | None
    ) -> None:
        """Go on as a task through ``Router.serve`` from where the callback path stopped."""
        ...

    def watch_disconnect(self, on_disconnect: Callable[[], None] | None) -> bool:
        """Call ``on_disconnect`` when the client goes away (None: stop); True if it has gone."""
        ...

    def watch_writable(self, on_writable: Callable[[bool], None] | None) -> bool:
        """Call ``on_writable(False)`` when the client's write buffer goes over its high-water mark
        and ``on_writable(True)`` when it has drained (None: stop); whether it is writable now."""
        ...

    def cut_reason(self) -> str:
        """Why the router cut the client's connection, once it is lost ("": the client went away)."""
        ...

    def stream_start(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Start a streamed answer (status 200, ``headers``; sent with the first bytes)."""
        ...

    def stream_write(self, data: bytes) -> None:
        """Send ``data`` (not empty) of the streamed answer."""
        ...

    def stream_end(self, data: bytes) -> None:
        """Send ``data`` (may be empty) and end the streamed answer."""
        ...

    def stream_whole(self, headers: list[tuple[bytes, bytes]], data: bytes) -> None:
        """A whole streamed answer at once: ``stream_start`` and ``stream_end(data)`` in one
        write, with no relay to watch the client from (it ends with this call)."""
        ...

    def stream_abort(self, data: bytes) -> None:
        """Send ``data`` (may be empty), then close the connection without ending the answer (a
        client must not take it for complete)."""
        ...


class _Resumed:
    """The rest of a coroutine started outside a task that suspended on ``yielded`` (a future):
    awaited in a task, it hands that future to the task and goes on where the coroutine stopped."""

    __slots__ = ("_coro", "_yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._coro, self._yielded = coro, yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, yielded = self._coro, self._yielded
        while True:
            try:
                value = yield yielded
            except BaseException as exc:  # the task throws in what the future raised or a cancel
                try:
                    yielded = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    yielded = coro.send(value)
                except StopIteration as done:
                    return done.value


class _Relay:
    """A complete (non-stream or error) answer relayed from the upstream connection's callbacks
    (``UpstreamResponse.on_event``): the accounting and the client's answer as ``_forward`` does
    them; a failure before the answer's headers (or a stream's first event) goes on in ``serve``
    (stale connection retry, first-byte budget, fail-over), one after them is a 502/504 as there.
    A stream (status 200) goes on in ``_CallbackStream`` once its first event is in."""

    __slots__ = ("client", "ctx", "response", "router", "started")

    def __init__(
        self, router: Router, ctx: RouteContext, response: UpstreamResponse, client: CallbackClient
    ) -> None:
        self.router, self.ctx, self.response, self.client = router, ctx, response, client
        self.started = False

    def on_event(self) -> None:
        try:
            self._relay()
        except Exception:  # a bug: the client gets the task path's last-resort 500, not silence
            log.exception("request %s: the callback path failed", self.ctx.request_id)
            self._stop_watching()
            self.response.close()
            self.router._finish(self.ctx, 500, "internal router error", log_error=False)
            self.client.refuse(
                RouterError(
                    500,
                    "internal router error; see the router log",
                    type="server_error",
                    code="internal_error",
                )
            )

    def _relay(self) -> None:
        response = self.response
        if not response.status:
            if response.error is not None:
                self._stop_watching()
                self.client.hand_over(None, response)
            return
        router, ctx = self.router, self.ctx
        if ctx.stream and response.status == 200:
            if response.event_seen or response.done:
                self._stop_watching()
                stream = router._stream_answer(ctx, response)
                relayed = _CallbackStream(stream.relay, self.client)
                if response.done:  # (the client is there: this relay watched it until now)
                    relayed.send_whole(stream.headers)
                else:
                    relayed.start(stream.headers)
            elif response.error is not None:  # no event yet, so nothing sent: as from ``send``
                self._stop_watching()
                self.client.hand_over(None, response)
            return
        if not self.started:
            self.started = True
            router._answer_started(ctx, response.done)
        error = response.error
        if error is not None:
            self._stop_watching()
            response.close()
            self.client.refuse(router._upstream_failure(ctx, ctx.engine_id, error))
            return
        if not response.done:
            return
        self._stop_watching()
        data = response.take_body()
        response.close()
        status = response.status
        self.client.answer(status, _answer_headers(ctx, response.content_type), data)
        router._answered(ctx, status, data)  # (the client's bytes first)

    def on_disconnect(self) -> None:
        """The client went away before its answer: the engine's request is cancelled."""
        self._stop_watching()
        self.response.close()
        self.router._finish(self.ctx, STATUS_CLIENT_GONE, client_gone_error(self.client.cut_reason()))

    def _stop_watching(self) -> None:
        self.response.on_event = None
        self.client.watch_disconnect(None)


class StreamRelay:
    """The rules of a proxied stream's bytes, one definition for both ways a stream is relayed (a
    task's ``_StreamAnswer.send``, and the callback path's ``_CallbackStream``): per piece of the
    engine's answer, the first event's arrival stamped and the tail kept for the final usage
    chunk, or the router's own usage chunk taken out (``_UsageChunkStripper``) when the client did
    not ask for usage; once bytes went out, the first event accounted (``sent``); at the end, the
    usage read and the request finished once: 200 when the engine's answer is complete (once its
    last bytes went out: ``end``), 502 with an OpenAI-shaped SSE error event when it broke off
    (``broken``: the connection is then aborted, a client must never take it for a complete
    answer), 499 when the client went away before the final [DONE]. Every end closes the
    upstream response (closing the socket before the end is what cancels the request in the
    engine)."""

    __slots__ = ("_first_pending", "_strip", "_tail", "_tail_bytes", "ctx", "ended", "response", "router")

    def __init__(self, router: Router, ctx: RouteContext, response: UpstreamResponse) -> None:
        self.router, self.ctx, self.response = router, ctx, response
        self._strip = _UsageChunkStripper() if ctx.strip_usage else None
        self._tail: deque[bytes] = deque()  # the last pieces, about _USAGE_TAIL_BYTES of them
        self._tail_bytes = 0
        self.ended = False
        #: The first event arrived (``first_token_s``; stamped by ``_forward`` on the task path) and
        #: is not accounted yet: that waits until bytes went out (``sent``, ``end``).
        self._first_pending = ctx.first_token_s is not None

    def feed(self, chunk: bytes) -> bytes:
        """A piece of the engine's answer -> the bytes for the client (b"": none yet)."""
        ctx = self.ctx
        if ctx.first_token_s is None and b"data:" in chunk:  # not a keep-alive comment
            ctx.first_token_s = time.monotonic()  # its arrival; accounted once sent on (``sent``)
            self._first_pending = True
        strip = self._strip
        if strip is not None:
            return strip.feed(chunk)
        tail = self._tail
        tail.append(chunk)
        self._tail_bytes += len(chunk)
        while self._tail_bytes - len(tail[0]) >= _USAGE_TAIL_BYTES:
            self._tail_bytes -= len(tail.popleft())
        return chunk

    def sent(self) -> None:
        """Bytes of the answer went out to the client: the first event accounted, once it was
        among them (``Router._first_token``)."""
        if self._first_pending:
            self._first_pending = False
            self.router._first_token(self.ctx)

    def end(self) -> None:
        """The engine's answer was complete and its last bytes (``held_back`` taken) went out:
        accounted (200); an error is logged (the answer went out as it was)."""
        try:
            self._close(200, "")
        except Exception:
            log.exception(_AFTER_ANSWER, self.ctx.request_id)

    def broken(self, error: UpstreamError) -> bytes:
        """The engine's answer broke off: accounted (502), and the SSE error event, the last bytes
        before the connection is aborted."""
        # Headers are sent, so no retry and no status: tell the client in the stream (the way vLLM
        # reports a failure midway); the caller then aborts the connection, so that no client,
        # whatever it does with the event, can see a cleanly ended answer.
        router, ctx = self.router, self.ctx
        router.metrics.upstream_error(ctx.engine_id, error.kind)
        router.tracker.record_failure(ctx.engine_id, f"stream broke off: {error}")
        self._close(502, f"stream broke off: {error}")
        return sse_error_event(
            f"engine {ctx.engine_id} failed during the answer: {error}; the answer is incomplete",
            type="upstream_error",
            code="upstream_stream_error",
        )

    def held_back(self) -> bytes:
        """The bytes held back for the end of an event (the usage chunk's stripper), taken."""
        strip = self._strip
        return strip.flush() if strip is not None and strip.pending else b""

    def gone(self, error: str = CLIENT_GONE, cut_reason: str = "") -> None:
        """The client went away (a no-op once the stream ended): 499 with ``error``, unless it had
        the whole answer (a client that hangs up right after the final [DONE]); or the router cut
        it for ``cut_reason`` (bytes were still waiting for it): 499 with that reason."""
        if self.ended:
            return
        if cut_reason:
            self._close(STATUS_CLIENT_GONE, client_gone_error(cut_reason))
            return
        strip, tail = self._strip, self._tail
        done = strip.done if strip is not None else bool(tail and b"data: [DONE]" in tail[-1])
        self._close(200 if done else STATUS_CLIENT_GONE, "" if done else error)

    def _close(self, status: int, error: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.response.close()
        self.sent()  # (the first event before the finish, as the core expects them)
        strip = self._strip
        self.ctx.usage = strip.usage if strip is not None else usage_from_stream_tail(b"".join(self._tail))
        self.router._finish(self.ctx, status, error)


class _CallbackStream:
    """A stream relayed from the upstream connection's callbacks (the callback path, once the
    stream's first event is in): each read of the engine's answer goes through
    ``StreamRelay.feed`` straight to the client's transport, with no task, future or generator
    step per piece. The client's write buffer over its high-water mark pauses the upstream
    connection's reading, and its drain resumes it (a slow client holds the engine back instead
    of the router buffering the answer); the client going away closes the upstream connection,
    which cancels the engine's request."""

    __slots__ = ("client", "relay")

    def __init__(self, relay: StreamRelay, client: CallbackClient) -> None:
        self.relay, self.client = relay, client

    def start(self, headers: list[tuple[bytes, bytes]]) -> None:
        client, response = self.client, self.relay.response
        if client.watch_disconnect(self.on_disconnect):
            self.on_disconnect()
            return
        client.stream_start(headers)
        response.on_event = self.on_event
        if not client.watch_writable(self.on_writable):
            response.pause_reading(True)
        self.on_event()  # what is in already: the first event, or even the whole answer

    def send_whole(self, headers: list[tuple[bytes, bytes]]) -> None:
        """A stream whose whole answer is in already, to a client known to be there: sent in one
        write, with nothing to watch (``start`` without the watchers)."""
        relay = self.relay
        try:
            data = relay.response.take_body()
            self.client.stream_whole(headers, (relay.feed(data) if data else data) + relay.held_back())
        except Exception:
            self._failed()
            return
        relay.end()  # (the client's bytes first)

    def on_event(self) -> None:
        try:
            self._relay()
        except Exception:
            self._failed()

    def _failed(self) -> None:
        """A bug: the answer is cut off (the task path's guard does the same)."""
        relay = self.relay
        log.exception("request %s: the stream relay failed", relay.ctx.request_id)
        self._stop_watching()
        relay.response.close()
        relay.sent()
        relay.router._finish(relay.ctx, 500, "internal router error", log_error=False)
        self.client.stream_abort(b"")

    def _relay(self) -> None:
        relay = self.relay
        response = relay.response
        data = response.take_body()
        if data:
            data = relay.feed(data)
        if response.done:
            self._stop_watching()
            self.client.stream_end(data + relay.held_back())
            relay.end()  # (the client's bytes first)
        elif response.error is not None:
            self._stop_watching()
            self.client.stream_abort(data + relay.broken(response.error))
        elif data:
            self.client.stream_write(data)
            relay.sent()

    def on_writable(self, writable: bool) -> None:
        self.relay.response.pause_reading(not writable)

    def on_disconnect(self) -> None:
        """The client went away, or the router cut it (a client write timeout): the engine's
        request is cancelled (``StreamRelay.gone``)."""
        self._stop_watching()
        self.relay.gone(cut_reason=self.client.cut_reason())

    def _stop_watching(self) -> None:
        self.relay.response.on_event = None
        self.client.watch_disconnect(None)
        self.client.watch_writable(None)


class _DueCalls:
    """``call(item)`` for items due at times of the event loop's clock, all on one loop timer armed
    for the earliest (not a TimerHandle per request); items due within ``slack_s`` of each other
    run together."""

    def __init__(self, call: Callable[[Any], None], slack_s: float = 0.005) -> None:
        self._call = call
        self._slack_s = slack_s
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0
        # The loop the items were added on, kept: asyncio.get_running_loop() is a getpid() system
        # call on Python 3.11 (asked again only when this one is not running).
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, delay_s: float, item: Any) -> None:
        loop = self._loop
        if loop is None or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
        due = loop.time() + delay_s
        heapq.heappush(self._heap, (due, next(self._seq), item))
        if self._timer is None or due < self._timer_due - self._slack_s:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_due = loop.call_at(due, self._run), due

    def _run(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None  # (armed by add)
        heap, limit = self._heap, loop.time() + self._slack_s
        while heap and heap[0][0] <= limit:
            item = heapq.heappop(heap)[2]
            try:
                self._call(item)
            except Exception:
                log.exception("a due call failed")
        if heap:
            self._timer, self._timer_due = loop.call_at(heap[0][0], self._run), heap[0][0]


class _Answer(Protocol):
    async def send(self, send: Send, watcher: DisconnectWatcher) -> None: ...


class _BodyAnswer:
    """A complete answer: status, headers and the whole body in two ASGI messages (in one write,
    ``answer_now``, on kvroute's own exchange), accounted once it is out (``Router._answered``)."""

    __slots__ = ("body", "ctx", "headers", "router", "status")

    def __init__(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, router: Router, ctx: RouteContext
    ) -> None:
        self.status, self.headers, self.body = status, headers, body
        self.router, self.ctx = router, ctx

    async def send(self, send: Send, watcher: DisconnectWatcher) -> None:
        watcher.answered = True  # from here on a "disconnect" is the end of the answer
        answer_now = getattr(getattr(send, "__self__", None), "answer_now", None)
        if answer_now is not None:  # kvroute's own exchange (router/fastpath.py): one write, no await
            try:
                answer_now(self.status, self.headers, self.body)
            finally:  # (accounted also if the write failed: a bug must not leave the load held)
                self.router._answered(self.ctx, self.status, self.body)
            return
        # An ASGI server's ``send`` (uvicorn's request cycle) awaits only before its write (a
        # paused transport's drain): the accounting follows the last write in the same loop step.
        try:
            self.headers.append((b"content-length", b"%d" % len(self.body)))
            await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
            await send({"type": "http.response.body", "body": self.body, "more_body": False})
        finally:
            self.router._answered(self.ctx, self.status, self.body)


class _StreamAnswer:
    """A stream: status 200 and the headers, then the engine's bytes as they come, relayed by the
    request's task (``send``) or from callbacks (``_CallbackStream``, the callback path). A stream
    that broke off ends without the final empty chunk, so the server aborts the connection and
    HTTP clients report an incomplete answer; one whose client went away before it began is
    finished as such."""

    __slots__ = ("headers", "relay")

    def __init__(self, relay: StreamRelay, headers: list[tuple[bytes, bytes]]) -> None:
        self.relay, self.headers = relay, headers

    async def send(self, send: Send, watcher: DisconnectWatcher) -> None:
        """The task path's relay: each time the engine's bytes come (from the first: the wait for
        the first event read none), what ``StreamRelay.feed`` makes of them in one ``send``, and
        the last of them with the answer's end (one write); no generator per stream or piece."""
        relay = self.relay
        response = relay.response
        if response.done:  # the whole stream is in (usual at once): on kvroute's own exchange
            stream_now = getattr(getattr(send, "__self__", None), "stream_now", None)
            if stream_now is not None:  # (router/fastpath.py) in one write, with no await
                self._send_whole(stream_now, watcher)
                return
        response.count_buffered()
        started = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            started = True
            while True:
                data = response.take_body()
                if data:
                    data = relay.feed(data)
                if response.done:  # the end goes with the last bytes; accounted once they are out
                    data += relay.held_back()
                    await send({"type": "http.response.body", "body": data, "more_body": False})
                    watcher.answered = True
                    relay.end()
                    return
                error = response.error
                if error is not None:  # the SSE error event, then no final chunk: the connection
                    data += relay.broken(error)  # is aborted (run_asgi closes it)
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    return
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    relay.sent()  # (no await since the write: ``send`` awaits only before it)
                try:
                    await response.wait_body()
                except BaseException:  # cancelled while waiting for the engine: the client is gone
                    relay.gone()
                    raise
        except BaseException:
            if watcher.fired and (cut_reason := watcher.cut_reason()):
                relay.gone(cut_reason=cut_reason)  # the router cut the client: its reason
            elif started:
                relay.gone()
            else:
                relay.gone("client disconnected before the stream began")
            raise

    def _send_whole(
        self, stream_now: Callable[[list[tuple[bytes, bytes]], bytes], None], watcher: DisconnectWatcher
    ) -> None:
        """The whole stream as ``send`` would write it (the head and every byte in one write, then
        the final chunk), without its two messages and awaits; accounted once it is out."""
        relay = self.relay
        data = relay.response.take_body()
        try:
            stream_now(self.headers, (relay.feed(data) if data else data) + relay.held_back())
        except BaseException:
            relay.gone("client disconnected before the stream began")
            raise
        watcher.answered = True
        relay.end()


class DisconnectWatcher:
    """Cancels the task serving a request when its client disconnects after the body was read,
    until the answer's last byte is on its way (``answered``); ``uncancel_if_fired`` turns that
    cancellation back into a normal return. ``watch_disconnect`` picks the implementation."""

    __slots__ = ("_task", "answered", "fired")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.answered = False
        self.fired = False
        # With the loop given, no getpid() system call (Python 3.11's running-loop check).
        self._task = asyncio.current_task(loop)

    def _fire(self) -> None:
        if not self.answered and not self.fired and self._task is not None:
            self.fired = True
            self._task.cancel()

    def uncancel_if_fired(self) -> bool:
        """True when the cancellation came from the client's disconnect (and only from it)."""
        if not self.fired or self._task is None:
            return False
        return self._task.uncancel() == 0

    def stop(self) -> None:
        return None

    def cut_reason(self) -> str:
        """Why the router cut the client's connection ("": it did not, or cannot say)."""
        return ""


def watch_disconnect(receive: Receive) -> DisconnectWatcher:
    """A callback watcher when ``receive`` is kvroute's own exchange (router/fastpath.py) or
    uvicorn's request cycle (their connection_lost calls back: no task per request), else one that
    awaits ASGI ``http.disconnect``."""
    cycle = getattr(receive, "__self__", None)
    if hasattr(cycle, "disconnect_watcher"):
        return _HookDisconnectWatcher(cycle)
    if isinstance(getattr(cycle, "message_event", None), asyncio.Event) and hasattr(cycle, "disconnected"):
        return _CycleDisconnectWatcher(cycle)
    return _TaskDisconnectWatcher(receive)


class _CycleDisconnectWatcher(DisconnectWatcher):
    """uvicorn's ``RequestResponseCycle``: its protocol marks ``disconnected`` and sets
    ``message_event`` when the connection is lost; the event is swapped for one that calls back."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        super().__init__()
        self._cycle = cycle
        if cycle.disconnected:
            self._fire()
            return
        event = _CallbackEvent(self._on_event)
        if cycle.message_event.is_set():
            event.set()
        cycle.message_event = event

    def _on_event(self) -> None:
        if self._cycle.disconnected:
            self._fire()

    def stop(self) -> None:
        event = self._cycle.message_event
        if isinstance(event, _CallbackEvent):
            event.callback = None


class _HookDisconnectWatcher(DisconnectWatcher):
    """An exchange that calls back on a lost connection (``ProxyExchange.disconnect_watcher``)."""

    __slots__ = ("_exchange",)

    def __init__(self, exchange: Any) -> None:
        # The exchange's loop: no getpid() system call (Python 3.11's running-loop check).
        super().__init__(exchange.loop)
        self._exchange = exchange
        if exchange.disconnect_watcher(self._fire):
            self._fire()

    def stop(self) -> None:
        self._exchange.disconnect_watcher(None)

    def cut_reason(self) -> str:
        return str(self._exchange.cut_reason)


class _CallbackEvent(asyncio.Event):
    """An asyncio.Event that also calls ``callback`` when set."""

    def __init__(self, callback: Callable[[], None]) -> None:
        super().__init__()
        self.callback: Callable[[], None] | None = callback

    def set(self) -> None:
        super().set()
        if self.callback is not None:
            self.callback()


class _TaskDisconnectWatcher(DisconnectWatcher):
    """Any ASGI server: one small task per request reading ``receive`` until ``http.disconnect``."""

    __slots__ = ("_watch",)

    def __init__(self, receive: Receive) -> None:
        super().__init__()
        self._watch = asyncio.get_running_loop().create_task(self._run(receive))

    async def _run(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                break
        self._fire()

    def stop(self) -> None:
        self._watch.cancel()


class _UsageChunkStripper:
    """Removes the usage-only SSE event (``"choices": []`` with ``usage``) that the router asked
    the engine for, passing every other byte through unchanged. Bytes are held back only up to
    the end of the current event (a client cannot use half an event anyway)."""

    __slots__ = ("_buffer", "done", "usage")

    def __init__(self) -> None:
        self._buffer = b""
        self.usage: dict[str, Any] | None = None
        self.done = False

    @property
    def pending(self) -> bool:
        return bool(self._buffer)

    def feed(self, chunk: bytes) -> bytes:
        data = self._buffer + chunk if self._buffer else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._buffer = data
            return b""
        complete, self._buffer = data[: cut + 2], data[cut + 2 :]
        if b"data: [DONE]" in complete:
            self.done = True
        if b'"usage"' not in complete:
            return complete
        events = complete.split(b"\n\n")
        del events[-1]  # (b"": ``complete`` ends with the separator)
        kept: list[bytes] = []
        for event in events:
            if b'"usage"' in event:  # (only such an event is looked at: the usage event, last)
                usage = self._usage_only(event)
                if usage is not None:
                    self.usage = usage
                    continue
            kept.append(event)
        return b"\n\n".join(kept) + b"\n\n" if kept else b""

    def flush(self) -> bytes:
        out, self._buffer = self._buffer, b""
        return out

    @staticmethod
    def _usage_only(event: bytes) -> dict[str, Any] | None:
        line = event.strip()
        if b'"usage"' not in line or not line.startswith(b"data:"):
            return None
        try:
            doc = _decode_json(line[5:].strip())
        except msgspec.DecodeError:
            return None
        if isinstance(doc, dict) and doc.get("choices") == [] and isinstance(doc.get("usage"), dict):
            return doc["usage"]
        return None
