"""The routing library's data types and the Policy protocol.

Policies are pure: the router (or the offline simulator) hands them a RouteRequest and a FleetView
of plain data and gets a Decision back, with the numbers it compared. No I/O happens here.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import msgspec
import xxhash


class Tier(enum.IntEnum):
    """Where a KV block sits, cheapest to load first."""

    GPU = 0
    CPU = 1
    STORAGE = 2

    @classmethod
    def parse(cls, medium: str | None) -> Tier:
        """Tier of an event's ``medium`` field: None means GPU; case-insensitive.

        Raises ValueError for an unknown medium (callers count it as a malformed event)."""
        if medium is None:
            return cls.GPU
        try:
            return cls[str(medium).upper()]
        except KeyError:
            raise ValueError(f"unknown KV medium {medium!r}; expected GPU, CPU or STORAGE") from None


TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.STORAGE)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What one engine holds of a request's key chain.

    ``blocks``: length of the contiguous prefix (from block 0) present in any tier.
    ``blocks_by_tier[t]``: how many of those blocks are at best in tier t (sums to ``blocks``).
    """

    blocks: int = 0
    blocks_by_tier: tuple[int, int, int] = (0, 0, 0)

    @property
    def gpu_blocks(self) -> int:
        return self.blocks_by_tier[Tier.GPU]


NO_MATCH = PrefixMatch()


@dataclass(slots=True)
class EngineView:
    """One routable engine as the router sees it at decision time."""

    engine_id: str
    url: str = ""
    healthy: bool = True
    #: Requests the router has sent to this engine and not yet seen finish.
    in_flight: int = 0
    #: Prompt tokens of in-flight requests still expected to need prefill (router's accounting).
    queued_prefill_tokens: int = 0
    #: Scraped from the engine's /metrics (None when unknown).
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    kv_cache_usage: float | None = None
    block_size: int = 16
    #: False when the engine's index picture is known to be incomplete (gap without replay,
    #: publisher missing, self-check shortfall); policies may penalise such engines.
    index_trusted: bool = True
    #: Taken out of routing by an operator (in-flight requests finish; no new ones).
    drained: bool = False
    #: Model ids the engine serves; empty = not known yet (assumed to serve anything: the engine
    #: answers 404 itself for a wrong model).
    models: frozenset[str] = frozenset()
    #: Free-form extra numbers a policy may use (e.g. measured costs); keys documented by the producer.
    extra: dict[str, Any] = field(default_factory=dict)
    #: On an engine that orders its queue by ``priority`` and a router that prices the wait it
    #: really gives: (a request's first-come ``PredictedParts``) -> the queued prefill tokens that
    #: engine serves before it (``policies.costs.priority_wait_parts``). None = every queued token
    #: is ahead (first come, first served).
    queued_ahead: Callable[[Any], float] | None = None


# RouteRequest and FleetView, and the router's other objects built once per request (RouteContext;
# kvcore.core's LoadTicket, Reservation and Outcome), are msgspec Structs rather than dataclasses:
# their __init__ runs in C (a slotted dataclass's runs ~30 bytecodes each; 2.4% of a request's).
class RouteRequest(msgspec.Struct):
    """One request to place."""

    request_id: str
    model: str = ""
    #: Stable key of the conversation: x-session-id header, else the ``user`` field, else a hash
    #: of the first messages.
    session_key: str = ""
    #: Prompt length in tokens (exact when tokenised, estimated otherwise; 0 when unknown).
    prompt_tokens: int = 0
    #: Router block keys of the prompt's full blocks (empty when the prompt was not tokenised).
    block_keys: Sequence[int] = ()
    block_size: int = 16
    #: Expected output tokens (max_tokens or a default), for decode-load terms.
    expected_output_tokens: int = 0
    #: Per engine id: what the index says that engine holds of ``block_keys``. Filled by the router
    #: before ``choose`` when the policy has ``uses_index``; missing engines hold nothing.
    prefix_matches: Mapping[str, PrefixMatch] = msgspec.field(default_factory=dict)


class FleetView(msgspec.Struct):
    """The candidate engines for a request (already filtered to healthy ones serving the model)."""

    engines: Sequence[EngineView]
    #: Monotonic seconds (router clock or simulator virtual clock).
    now: float = 0.0
    #: The caller's cost estimates (``policies.costs.CostEstimates``; the router and the DES pass
    #: their calibrated ``kvcore.calibration.CostModel``), else None: policies use their own priors.
    costs: Any = None

    def by_id(self) -> dict[str, EngineView]:
        return {e.engine_id: e for e in self.engines}


class Decision:
    """A policy's choice and why.

    ``reason`` and ``scores`` (the explanation) may each be given as a function that builds them:
    it runs once, when they are first read (the explain endpoint, a debug log, a wrapping policy),
    not on every request. Such a function must only read what the policy has finished with (its
    own values, immutable ``parts``), never objects that change later (an engine's view, or
    ``scores`` themselves, which a wrapping policy may change in place)."""

    __slots__ = ("_reason", "_scores", "engine_id", "fallbacks", "parts", "policy")

    def __init__(
        self,
        engine_id: str,
        policy: str,
        reason: str | Callable[[], str] = "",
        scores: dict[str, dict[str, float]] | Callable[[], dict[str, dict[str, float]]] | None = None,
        fallbacks: tuple[str, ...] = (),
        parts: Mapping[str, Any] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.policy = policy
        self._reason = reason
        self._scores = {} if scores is None else scores
        #: Next-best engines in order, for a retry when the chosen engine refuses the connection.
        self.fallbacks = fallbacks
        #: Per engine id, the ``policies.costs.PredictedParts`` a pricing policy computed (the same
        #: numbers as its ``scores``, kept as the object so the core need not rebuild it). An engine
        #: missing here is not priced in ``scores`` either (``NOTHING_PRICED``: the policy prices
        #: no engine); None: the policy says nothing, its ``scores`` may hold a prediction.
        self.parts = parts

    @property
    def reason(self) -> str:
        """One human-readable line: why this engine."""
        reason = self._reason
        if not isinstance(reason, str):
            reason = self._reason = reason()
        return reason

    @reason.setter
    def reason(self, value: str) -> None:
        self._reason = value

    @property
    def scores(self) -> dict[str, dict[str, float]]:
        """Per engine id, the numbers the policy compared (e.g. {"gpu_blocks": 12, "ttft_s": 0.03})."""
        scores = self._scores
        if not isinstance(scores, dict):
            scores = self._scores = scores()
        return scores

    @scores.setter
    def scores(self, value: dict[str, dict[str, float]]) -> None:
        self._scores = value

    def _fields(self) -> tuple[Any, ...]:
        return (self.engine_id, self.policy, self.reason, self.scores, self.fallbacks, self.parts)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value (as the dataclass was)

    def __repr__(self) -> str:
        return (
            f"Decision(engine_id={self.engine_id!r}, policy={self.policy!r}, reason={self.reason!r}, "
            f"scores={self.scores!r}, fallbacks={self.fallbacks!r}, parts={self.parts!r})"
        )


#: A view's engine id (``map(engine_id_of, views)``: the ids in C).
engine_id_of: Callable[[EngineView], str] = operator.attrgetter("engine_id")

#: ``Decision.parts`` of a policy that prices no engine (its scores hold no prediction either).
NOTHING_PRICED: Mapping[str, Any] = MappingProxyType({})


class NoEngineAvailable(Exception):
    """Raised by a policy when the fleet view has no engine it can choose."""


@runtime_checkable
class Policy(Protocol):
    """A routing policy. Implementations live one per file in ``policies/``."""

    #: Registered name, used in config and metric labels.
    name: str
    #: True when ``choose`` reads ``request.prefix_matches`` (the router then queries the index).
    uses_index: bool

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        """Pick an engine from ``fleet.engines``. Raise NoEngineAvailable when there is none."""
        ...

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        """Feedback after the request was sent to ``decision.engine_id`` (default: nothing)."""
        ...

    def on_finished(self, request: RouteRequest, engine_id: str, ok: bool) -> None:
        """Feedback when the request finished on ``engine_id`` (default: nothing)."""
        ...


class BasePolicy:
    """Convenience base with no-op feedback hooks."""

    name: str = "base"
    uses_index: bool = False

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:  # pragma: no cover
        raise NotImplementedError

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        return None

    def on_finished(self, request: RouteRequest, engine_id: str, ok: bool) -> None:
        return None


def ranked(engines: Sequence[EngineView], score: Callable[[EngineView], Any]) -> list[EngineView]:
    """Engines sorted by ``score`` ascending (stable: ties keep fleet order)."""
    return sorted(engines, key=score)


def require_engines(fleet: FleetView, policy: str) -> Sequence[EngineView]:
    """The fleet's engines, or NoEngineAvailable naming the policy."""
    if not fleet.engines:
        raise NoEngineAvailable(f"policy {policy!r}: no healthy engine serves this request")
    return fleet.engines


# -- shared helpers of the policies (one module, so a new policy file imports from here) -------


def tiebreak(request_id: str, engine_id: str) -> int:
    """Deterministic per-request tiebreak: same inputs, same order, on every router replica."""
    return xxhash.xxh3_64_intdigest(f"{request_id}\x00{engine_id}".encode())


def prompt_tokens_of(request: RouteRequest) -> int:
    """Prompt length, falling back to the full blocks the router keyed when the length is unknown."""
    return request.prompt_tokens or len(request.block_keys) * request.block_size


def needs_block_keys(policy: Any) -> bool:
    """Whether a policy (an instance or its registered class) reads ``request.block_keys``: every
    policy that reads the index (keyed by them) and any that says ``needs_block_keys`` (approx_prefix
    learns from keys without the index). The router refuses a config that gives such a policy no
    tokenizer (router/config.py ``refuse_blind_policies``)."""
    return bool(getattr(policy, "uses_index", False) or getattr(policy, "needs_block_keys", False))


def max_hit_tokens(prompt_tokens: int) -> int:
    """The most prompt tokens a cache hit can spare the engine: all but the last, which vLLM always
    computes (a full hit still prefills one token). The one place this cap is written."""
    return max(0, prompt_tokens - 1)


def hit_tokens_by_tier(match: PrefixMatch, block_size: int, prompt_tokens: int) -> tuple[float, float, float]:
    """``match``'s hits in tokens per tier, cheapest tier first, capped at ``max_hit_tokens``
    (the cap trims the most expensive tier's hits)."""
    if match is NO_MATCH:  # nothing held (every engine for a policy without the index)
        return 0.0, 0.0, 0.0
    left = float(max_hit_tokens(prompt_tokens))
    # Unrolled over the three tiers (GPU, CPU, storage), with conditional expressions rather than
    # min/max calls: this runs per engine per request. Each tier takes its hits up to what is
    # left (never below 0).
    gpu, cpu, storage = match.blocks_by_tier
    gpu_tokens = float(gpu * block_size)
    gpu_tokens = left if gpu_tokens > left else (gpu_tokens if gpu_tokens > 0.0 else 0.0)
    if not cpu and not storage:  # GPU hits only (the usual match): the other tiers take nothing
        return gpu_tokens, 0.0, 0.0
    left -= gpu_tokens
    cpu_tokens = float(cpu * block_size)
    cpu_tokens = left if cpu_tokens > left else (cpu_tokens if cpu_tokens > 0.0 else 0.0)
    left -= cpu_tokens
    storage_tokens = float(storage * block_size)
    return (
        gpu_tokens,
        cpu_tokens,
        left if storage_tokens > left else (storage_tokens if storage_tokens > 0.0 else 0.0),
    )


def wait_tokens_of(engine: EngineView, request_prompt_tokens: int) -> float:
    """Prefill tokens queued ahead on ``engine``.

    The router's own accounting misses traffic from other routers or clients; the scraped
    ``num_requests_waiting`` catches it, priced at the router's mean queued request size (or this
    request's size when the router has nothing in flight there).
    """
    queued = float(engine.queued_prefill_tokens)
    waiting = engine.num_requests_waiting
    if waiting:
        per_request = queued / engine.in_flight if engine.in_flight > 0 else float(request_prompt_tokens)
        queued = max(queued, waiting * per_request)
    return queued


def load_key(engine: EngineView) -> tuple[int, int]:
    """Lower is less loaded: requests in flight, then prompt tokens still waiting for prefill."""
    return (engine.in_flight, engine.queued_prefill_tokens)


def load_scores(engines: list[EngineView] | tuple[EngineView, ...]) -> dict[str, dict[str, float]]:
    return {
        e.engine_id: {
            "in_flight": float(e.in_flight),
            "queued_prefill_tokens": float(e.queued_prefill_tokens),
        }
        for e in engines
    }


def overloaded_engines(
    engines: Sequence[EngineView], *, factor: float, min_in_flight: int, min_queued_tokens: int
) -> set[str]:
    """Ids of engines above ``factor`` x the fleet mean of in-flight requests or of queued prefill
    tokens. The floors keep a nearly idle fleet (mean ~0) from calling every busy engine overloaded."""
    if not engines:
        return set()
    n = len(engines)
    mean_in_flight = sum(e.in_flight for e in engines) / n
    mean_queued_tokens = sum(e.queued_prefill_tokens for e in engines) / n
    in_flight_limit = max(factor * mean_in_flight, float(min_in_flight))
    queued_limit = max(factor * mean_queued_tokens, float(min_queued_tokens))
    return {
        e.engine_id
        for e in engines
        if e.in_flight > in_flight_limit or e.queued_prefill_tokens > queued_limit
    }


def validate_guard(policy: str, overload_factor: float, min_in_flight: int, min_queued_tokens: int) -> None:
    """ValueError naming the bad guard parameter of ``policy``."""
    if overload_factor < 1.0:
        raise ValueError(
            f"{policy}: overload_factor must be >= 1.0 (a multiple of the mean), got {overload_factor}"
        )
    if min_in_flight < 0 or min_queued_tokens < 0:
        raise ValueError(f"{policy}: min_in_flight and min_queued_tokens must be >= 0")


# Registry: policy name -> factory(**params) -> Policy. Filled by policies/__init__.py.
PolicyFactory = Callable[..., Policy]
REGISTRY: dict[str, PolicyFactory] = {}


def register(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Class decorator registering a policy under ``name`` for config lookup."""

    def wrap(factory: PolicyFactory) -> PolicyFactory:
        if name in REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        REGISTRY[name] = factory
        return factory

    return wrap


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Instantiate a registered policy; a clear error names the accepted names and bad params."""
    import policies  # noqa: F401  (registers the built-in policies)

    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; accepted: {', '.join(sorted(REGISTRY))}")
    given = dict(params or {})
    accepted = policy_parameters(name)
    takes_any = accepted is None  # a factory with **kwargs checks its own keys
    accepted = accepted or {}
    unknown = [] if takes_any else sorted(set(given) - set(accepted))
    valid = ", ".join(f"{k} (default {v!r})" for k, v in accepted.items()) or "none"
    if unknown:
        raise ValueError(f"policy {name!r} has no parameter {', '.join(unknown)}; valid parameters: {valid}")
    try:
        return REGISTRY[name](**given)
    except TypeError as exc:
        # A value of the wrong type; say which parameters exist rather than showing a signature.
        raise ValueError(
            f"bad parameter value for policy {name!r} ({exc}); valid parameters: {valid}"
        ) from None


def policy_parameters(name: str) -> dict[str, Any] | None:
    """The keyword parameters of a registered policy and their defaults (for error messages);
    None when its factory also takes ``**kwargs``."""
    import inspect

    try:
        sig = inspect.signature(REGISTRY[name])
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name: p.default for p in sig.parameters.values() if p.kind in kinds}
