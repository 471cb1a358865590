"""What a request costs on an engine: per-engine cost parameters (prefill rate, per-tier KV load
bandwidth and latency, slot wait), the one TTFT formula (``predict_parts``) and fixed priors.

Pricing only: the router's learned estimates (calibration from observed TTFTs and the engines'
offload counters, the index self-check) are ``kvcore.calibration.CostModel``, which policies see
through ``CostEstimates``. Pure code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from policies.base import (
    NO_MATCH,
    TIERS,
    Decision,
    EngineView,
    RouteRequest,
    Tier,
    max_hit_tokens,
    prompt_tokens_of,
    wait_tokens_of,
)

#: Reference numbers (Llama-3-8B bf16 on one H100, see docs/routing.md): 128 KiB of KV per token,
#: host->GPU over PCIe 5 at 64 GB/s, prefill ~22x slower than a host reload.
DEFAULT_KV_BYTES_PER_TOKEN = 131_072
DEFAULT_PREFILL_TOKENS_PER_S = 22_000.0
#: GPU hits need no load: infinite bandwidth, no latency.
DEFAULT_LOAD_BANDWIDTH_BYTES_PER_S: tuple[float, float, float] = (math.inf, 64e9, 5e9)
DEFAULT_LOAD_LATENCY_S: tuple[float, float, float] = (0.0, 0.0005, 0.002)

_TIER_NAMES = {t.name.lower(): t for t in TIERS}
#: The tiers as module constants (an enum member read through its class costs a lookup each time).
_GPU, _CPU, _STORAGE = TIERS
#: ``PredictedParts.as_scores`` keys per tier (enum names are slow to read per request).
_LOAD_KEYS = tuple(f"load_{t.name.lower()}_s" for t in TIERS)
_HIT_KEYS = tuple(f"hit_tokens_{t.name.lower()}" for t in TIERS)
#: Upper bound of the (learned or configured) seconds per in-flight request.
MAX_SLOT_S_PER_REQUEST = 5.0


@dataclass(frozen=True, slots=True)
class EngineCosts:
    """One engine's cost parameters (an estimate or a prior)."""

    #: Prompt tokens the engine computes per second during prefill.
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    #: Per Tier (GPU, CPU, STORAGE): bytes/s a tier -> GPU load moves; inf = no load needed.
    load_bandwidth_bytes_per_s: tuple[float, float, float] = DEFAULT_LOAD_BANDWIDTH_BYTES_PER_S
    #: Per Tier: fixed seconds added once when a request loads anything from that tier.
    load_latency_s: tuple[float, float, float] = DEFAULT_LOAD_LATENCY_S
    #: KV-cache bytes one token occupies (all layers, K and V).
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    #: Seconds a new request waits per request already in flight on the engine, beyond the
    #: prefill queue: the wait for a running slot when the engine is bound by KV memory (requests
    #: wait for running ones to finish and free blocks) or by max_num_seqs. Learned by
    #: ``kvcore.calibration.CostModel.observe``; the prior 0 says "the prefill queue is all the wait
    #: there is".
    slot_s_per_request: float = 0.0

    def load_time_s(self, tier: Tier, tokens: float) -> float:
        """Seconds to bring ``tokens`` tokens of KV from ``tier`` to the GPU (0 for no tokens)."""
        if tokens <= 0:
            return 0.0
        bandwidth = self.load_bandwidth_bytes_per_s[tier]
        transfer_s = 0.0 if math.isinf(bandwidth) else tokens * self.kv_bytes_per_token / bandwidth
        return transfer_s + self.load_latency_s[tier]

    def prefill_time_s(self, tokens: float) -> float:
        """Seconds to compute the prefill of ``tokens`` uncached tokens."""
        return max(0.0, tokens) / self.prefill_tokens_per_s

    def validate(self, where: str) -> EngineCosts:
        """Self, or ValueError naming the config key ``where`` and the bad value."""
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(f"{where}.prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"{where}.kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token}")
        for tier in TIERS:
            if not self.load_bandwidth_bytes_per_s[tier] > 0:
                raise ValueError(
                    f"{where}.tiers.{tier.name.lower()}.bandwidth_bytes_per_s must be > 0 "
                    f"(use a very large number or 'inf' for free loads)"
                )
            if self.load_latency_s[tier] < 0:
                raise ValueError(f"{where}.tiers.{tier.name.lower()}.latency_s must be >= 0")
        if not 0 <= self.slot_s_per_request <= MAX_SLOT_S_PER_REQUEST:
            raise ValueError(
                f"{where}.slot_s_per_request must be in [0, {MAX_SLOT_S_PER_REQUEST}], "
                f"got {self.slot_s_per_request}"
            )
        return self


def costs_from_config(raw: Mapping[str, Any], base: EngineCosts, where: str) -> EngineCosts:
    """Overlay a config mapping on ``base``.

    Keys: ``prefill_tokens_per_s``, ``kv_bytes_per_token``, ``slot_s_per_request`` and ``tiers`` =
    {"gpu"|"cpu"|"storage": {"bandwidth_bytes_per_s": float, "latency_s": float}}. Unknown keys are
    an error.
    """
    known = {"prefill_tokens_per_s", "kv_bytes_per_token", "slot_s_per_request", "tiers"}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{where}: unknown cost keys {sorted(unknown)}; accepted: {sorted(known)}")
    bandwidth = list(base.load_bandwidth_bytes_per_s)
    latency = list(base.load_latency_s)
    for tier_name, tier_raw in dict(raw.get("tiers", {})).items():
        tier = _TIER_NAMES.get(str(tier_name).lower())
        if tier is None:
            raise ValueError(f"{where}.tiers: unknown tier {tier_name!r}; accepted: gpu, cpu, storage")
        bad = set(tier_raw) - {"bandwidth_bytes_per_s", "latency_s"}
        if bad:
            raise ValueError(
                f"{where}.tiers.{tier_name}: unknown keys {sorted(bad)}; "
                "accepted: bandwidth_bytes_per_s, latency_s"
            )
        if "bandwidth_bytes_per_s" in tier_raw:
            bandwidth[tier] = float(tier_raw["bandwidth_bytes_per_s"])
        if "latency_s" in tier_raw:
            latency[tier] = float(tier_raw["latency_s"])
    out = EngineCosts(
        prefill_tokens_per_s=float(raw.get("prefill_tokens_per_s", base.prefill_tokens_per_s)),
        load_bandwidth_bytes_per_s=(bandwidth[0], bandwidth[1], bandwidth[2]),
        load_latency_s=(latency[0], latency[1], latency[2]),
        kv_bytes_per_token=int(raw.get("kv_bytes_per_token", base.kv_bytes_per_token)),
        slot_s_per_request=float(raw.get("slot_s_per_request", base.slot_s_per_request)),
    )
    return out.validate(where)


def priors_from_config(raw: Mapping[str, Any] | None) -> tuple[EngineCosts, dict[str, EngineCosts]]:
    """(fleet prior, per-engine priors) from a config mapping: fleet-wide cost keys (see
    ``costs_from_config``) plus ``engines`` = {engine_id: overrides of the fleet's}."""
    raw = dict(raw or {})
    engines_raw = dict(raw.pop("engines", {}) or {})
    fleet = costs_from_config(raw, EngineCosts(), "costs")
    engines = {
        str(e): costs_from_config(over, fleet, f"costs.engines.{e}") for e, over in engines_raw.items()
    }
    return fleet, engines


class CostEstimates(Protocol):
    """What a policy reads of a cost model (``FleetView.costs``): an engine's current costs."""

    def estimates(self, engine_id: str) -> EngineCosts:
        """The costs to price ``engine_id`` with."""
        ...


class PriorCosts:
    """Fixed costs, never calibrated: the configured priors (fleet-wide, overridden per engine).

    What a policy prices with when its caller keeps no learned model (the router and the DES pass
    ``kvcore.calibration.CostModel`` as ``FleetView.costs``)."""

    def __init__(
        self, fleet_prior: EngineCosts | None = None, engine_priors: Mapping[str, EngineCosts] | None = None
    ) -> None:
        self.fleet_prior = (fleet_prior or EngineCosts()).validate("costs")
        self._engine_priors = dict(engine_priors or {})

    @classmethod
    def from_config(cls, raw: Mapping[str, Any] | None) -> PriorCosts:
        """Build from ``priors_from_config`` keys."""
        return cls(*priors_from_config(raw))

    def estimates(self, engine_id: str) -> EngineCosts:
        return self._engine_priors.get(engine_id, self.fleet_prior)


class PredictedParts(NamedTuple):
    """What ``tier_cost`` predicted for one request on one engine, in seconds and tokens.

    ``total_s`` (the predicted TTFT) = wait_s + slot_s + read_wait_s + sum(load_s) + prefill_s. The token and
    request counts let the cost model re-price the same request with newer estimates when the
    observation comes back.

    Immutable; a named tuple rather than a frozen dataclass because one is built per engine per
    request and a frozen dataclass takes about three times as long to build (each field set
    through ``object.__setattr__``). ``_replace`` gives a changed copy.
    """

    wait_s: float = 0.0
    load_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    prefill_s: float = 0.0
    #: Prefill tokens queued ahead of the request (its wait, in tokens).
    wait_tokens: float = 0.0
    #: Expected hit tokens per tier (after any stale-index discount).
    hit_tokens: tuple[float, float, float] = (0.0, 0.0, 0.0)
    #: Tokens expected to be computed (prompt - expected hits).
    prefill_tokens: float = 0.0
    #: Requests already in flight on the engine when this one was placed.
    in_flight: float = 0.0
    #: in_flight x the engine's learned slot_s_per_request: the wait for a running slot.
    slot_s: float = 0.0
    #: The wait for the reads booked ahead on the engine's shared STORAGE pool before this request's
    #: own read starts (``storage_read_parts``; 0 without STORAGE hits or when the router books none).
    read_wait_s: float = 0.0

    @property
    def total_s(self) -> float:
        """The predicted TTFT: the waits (queued prefill, slot, shared STORAGE reads) plus the service."""
        return self.wait_s + self.slot_s + self.read_wait_s + self.service_s

    @property
    def service_s(self) -> float:
        """The engine's own work for this request: its loads and its prefill (the TTFT less the waits)."""
        return sum(self.load_s) + self.prefill_s

    def as_scores(self) -> dict[str, float]:
        """Flat numbers for ``Decision.scores`` (the inverse of ``from_scores``)."""
        load_s, hit_tokens = self.load_s, self.hit_tokens
        # One dict display (keys in ``Tier`` order, as ``_LOAD_KEYS``/``_HIT_KEYS`` name them):
        # this runs per engine per request.
        return {
            "wait_s": self.wait_s,
            "slot_s": self.slot_s,
            "prefill_s": self.prefill_s,
            "total_s": self.wait_s + self.slot_s + self.read_wait_s + (sum(load_s) + self.prefill_s),
            "in_flight": self.in_flight,
            "load_gpu_s": load_s[0],
            "hit_tokens_gpu": hit_tokens[0],
            "load_cpu_s": load_s[1],
            "hit_tokens_cpu": hit_tokens[1],
            "load_storage_s": load_s[2],
            "hit_tokens_storage": hit_tokens[2],
            "wait_tokens": self.wait_tokens,
            "prefill_tokens": self.prefill_tokens,
            "read_wait_s": self.read_wait_s,
        }

    @classmethod
    def from_scores(cls, scores: Mapping[str, float]) -> PredictedParts:
        """Parts back from one engine's ``Decision.scores`` entry written by ``as_scores``."""
        return cls(
            wait_s=float(scores.get("wait_s", 0.0)),
            load_s=tuple(float(scores.get(key, 0.0)) for key in _LOAD_KEYS),  # type: ignore[arg-type]
            prefill_s=float(scores.get("prefill_s", 0.0)),
            wait_tokens=float(scores.get("wait_tokens", 0.0)),
            hit_tokens=tuple(float(scores.get(key, 0.0)) for key in _HIT_KEYS),  # type: ignore[arg-type]
            prefill_tokens=float(scores.get("prefill_tokens", 0.0)),
            in_flight=float(scores.get("in_flight", 0.0)),
            slot_s=float(scores.get("slot_s", 0.0)),
            read_wait_s=float(scores.get("read_wait_s", 0.0)),
        )


#: ``PredictedParts`` from a tuple of its fields in order, without the named tuple's Python ``__new__``.
_new_parts: Callable[[type[PredictedParts], tuple[Any, ...]], PredictedParts] = tuple.__new__  # type: ignore[assignment]


def predict_parts(
    costs: EngineCosts,
    hit_tokens: tuple[float, float, float],
    prefill_tokens: float,
    wait_tokens: float,
    in_flight: float = 0.0,
) -> PredictedParts:
    """Price a request: the one place where the TTFT formula lives (docs/routing.md), in seconds:

        ttft = wait_tokens / prefill_rate + in_flight x slot_s_per_request
               + sum_t [hit_t > 0] (latency_t + hit_t x kv_bytes / bw_t) + prefill_tokens / prefill_rate

    split into its parts; ``PredictedParts.total_s`` is the sum. The waits that depend on the
    engine's extra numbers (admission, the shared STORAGE pool's read queue) are added by
    ``engine_wait_parts``."""
    gpu, cpu, storage = hit_tokens
    load_time_s = costs.load_time_s
    # In field order, built by ``tuple.__new__`` itself (the named tuple's own ``__new__`` is a
    # Python function around it): this runs per engine per request.
    return _new_parts(
        PredictedParts,
        (
            costs.prefill_time_s(wait_tokens),  # wait_s
            # Tiers without hits load nothing (load_time_s is 0 for no tokens): skip the call.
            (
                load_time_s(_GPU, gpu) if gpu > 0 else 0.0,
                load_time_s(_CPU, cpu) if cpu > 0 else 0.0,
                load_time_s(_STORAGE, storage) if storage > 0 else 0.0,
            ),  # load_s
            costs.prefill_time_s(prefill_tokens),  # prefill_s
            wait_tokens,
            hit_tokens,
            prefill_tokens,
            in_flight,
            in_flight * costs.slot_s_per_request,  # slot_s
            0.0,  # read_wait_s (``storage_read_parts``)
        ),
    )


def queue_wait_s(costs: EngineCosts, engine: EngineView) -> float:
    """The wait part of a new turn's predicted TTFT on ``engine`` (``predict_parts``' ``wait_s`` +
    ``slot_s``): the prefill the router has queued there (``wait_tokens_of``) at the engine's
    prefill rate, plus its requests in flight x its slot seconds. First come and the same for
    every turn: no priority re-pricing (``priority_wait_parts``) and no admission wait, which
    depend on the turn."""
    parts = predict_parts(costs, (0.0, 0.0, 0.0), 0.0, wait_tokens_of(engine, 0), float(engine.in_flight))
    return parts.wait_s + parts.slot_s


def has_room(costs: EngineCosts, engine: EngineView, wait_limit_s: float) -> bool:
    """The late-binding room rule: ``engine`` takes a new turn now when its predicted queue wait
    (``queue_wait_s``) is below ``wait_limit_s`` seconds; a fleet is busy when no engine has room.
    An engine with nothing in flight always has room (its wait is 0; ``wait_limit_s`` > 0)."""
    return queue_wait_s(costs, engine) < wait_limit_s


def priority_wait_parts(costs: EngineCosts, parts: PredictedParts, engine: EngineView) -> PredictedParts:
    """``parts`` (priced with every queued token ahead: first come) re-priced with the wait a
    priority engine gives: only the queued prefill it serves before this request
    (``engine.queued_ahead``; kvcore.core.InMemoryLoadLedger.queued_ahead), as the same share of
    the queue estimate (``wait_tokens_of``, which may add scraped waiting requests of unknown
    priority: those stay ahead). ``parts`` unchanged where ``queued_ahead`` is None."""
    ahead = engine.queued_ahead
    if ahead is None or not parts.wait_tokens > 0:
        return parts
    queued = float(engine.queued_prefill_tokens)
    wait_tokens = parts.wait_tokens
    if queued > 0:
        unknown = max(0.0, wait_tokens - queued)  # scraped waiting requests the ledger does not hold
        wait_tokens = max(0.0, ahead(parts)) + unknown
    return predict_parts(costs, parts.hit_tokens, parts.prefill_tokens, wait_tokens, parts.in_flight)


#: ``EngineView.extra`` key of an engine whose router prices the admission wait (vLLM admits a
#: waiting request only when its whole sequence fits the free KV blocks): a callable (the prompt
#: tokens of a request placed now, its parts priced so far) -> seconds until enough of the engine's
#: running sequences finish to fit it (``kvcore.core.SequenceLedger.admission_wait_s``; the parts
#: give the deadline a priority engine would serve it by). Absent = the learned
#: ``slot_s_per_request`` prices that wait.
ADMISSION_WAIT_KEY = "admission_wait_s"


#: ``EngineView.extra`` key beside ``ADMISSION_WAIT_KEY``: a fraction of the prompt in (0, 1]. The
#: admission wait then prices only a request that is a recompute on every engine anyway: one whose
#: ``best_cached_fraction`` is below it (placing it where it is admitted soonest moves no cached turn
#: off its history); every other request keeps the learned slot term. Absent = every request.
ADMISSION_RECOMPUTE_BELOW_KEY = "admission_recompute_below"


#: A turn is a recompute (on every engine, wherever it goes) when its ``best_cached_fraction`` is
#: below this: above the B1 ladder's shared system prefix (1,000 of a 12,000-token first prompt,
#: 0.08) and below what any engine holding the previous turn has (12,000 of 16,000 tokens at the
#: second turn, 0.75, more later). The default gate of the admission wait's and the priority
#: ordering's recompute rules (``kvcore.core.PRIORITY_RECOMPUTE_BELOW``).
RECOMPUTE_BELOW = 0.25


def best_cached_fraction(request: RouteRequest, prompt_tokens: int) -> float:
    """The largest share of the prompt any engine holds in any tier: the longest prefix match in
    ``request.prefix_matches`` (blocks x block size, capped at ``max_hit_tokens``) / the prompt
    tokens; 0 for an empty prompt or no match."""
    if prompt_tokens <= 0:
        return 0.0
    blocks = max((m.blocks for m in request.prefix_matches.values()), default=0)
    return min(blocks * request.block_size, max_hit_tokens(prompt_tokens)) / prompt_tokens


def admission_wait_parts(
    parts: PredictedParts, engine: EngineView, request: RouteRequest, prompt_tokens: int
) -> PredictedParts:
    """``parts`` with its slot wait (``slot_s``, in flight x the learned seconds per request) replaced
    by the engine's admission wait for this prompt (``ADMISSION_WAIT_KEY``); unchanged without it, and
    unchanged where ``ADMISSION_RECOMPUTE_BELOW_KEY`` gates the request out (some engine holds at
    least that fraction of its prompt)."""
    wait_s = engine.extra.get(ADMISSION_WAIT_KEY)
    if wait_s is None:
        return parts
    below = engine.extra.get(ADMISSION_RECOMPUTE_BELOW_KEY)
    if below is not None and not best_cached_fraction(request, prompt_tokens) < below:
        return parts
    return parts._replace(slot_s=max(0.0, float(wait_s(prompt_tokens, parts))))


#: ``EngineView.extra`` key of an engine that mounts a shared STORAGE pool whose traffic the router
#: books (``kvcore.core.StorageReadQueue``; router config ``costs.storage_pool_bandwidth``, DES
#: ``SimConfig.storage_read_queue``): seconds from now until the pool's bandwidth has moved every
#: read (and write-through) the router placed on any of its members so far. A request with STORAGE
#: hits there waits that long before its own read starts (``storage_read_parts``). Absent = no
#: wait priced.
STORAGE_QUEUE_KEY = "storage_queue_s"


def storage_read_parts(parts: PredictedParts, engine: EngineView) -> PredictedParts:
    """``parts`` with ``read_wait_s`` set to the engine's shared STORAGE pool queue
    (``STORAGE_QUEUE_KEY``) when it reads anything from STORAGE; unchanged otherwise. The wait is
    not the request's own work: it adds to the TTFT (``total_s``), not to ``service_s``."""
    if not parts.hit_tokens[2] > 0:
        return parts
    queue_s = engine.extra.get(STORAGE_QUEUE_KEY)
    if not queue_s:
        return parts
    return parts._replace(read_wait_s=float(queue_s))


def engine_wait_parts(
    parts: PredictedParts, engine: EngineView, request: RouteRequest, prompt_tokens: int
) -> PredictedParts:
    """``parts`` (priced first come, or by a priority engine's queue) with the waits an engine's
    extra numbers price: its admission wait (``admission_wait_parts``), then its shared STORAGE
    pool's read queue (``storage_read_parts``). The one order every pricer applies them in."""
    return storage_read_parts(admission_wait_parts(parts, engine, request, prompt_tokens), engine)


#: ``EngineView.extra`` key of a priority engine whose router prices placement by the deadline it
#: sends (round q12): a callable (a request's parts priced there) -> the deadline offset, seconds
#: after now, of the shortest-first priority the router would send it with
#: (``kvcore.core.shortest_first_priority``). Absent = off.
DEADLINE_OFFSET_KEY = "deadline_offset_s"


def deadline_floor_s(
    parts: PredictedParts, engine: EngineView, prompt_tokens: int, best_fraction: float
) -> float:
    """The predicted TTFT ``parts.total_s`` of a turn moved off its history, raised to its deadline
    offset on a priority engine with a queue (``DEADLINE_OFFSET_KEY``; ``parts.wait_tokens`` > 0).

    A move is a turn some engine holds at least ``RECOMPUTE_BELOW`` of (``best_fraction``, from
    ``best_cached_fraction``) priced on an engine that holds less than that: it is recomputed there,
    so it gets a late deadline (its long prefill, stretched), and an engine serving the earliest
    deadline first serves it about when that deadline comes: every turn placed meanwhile with an
    earlier deadline goes ahead. The first-come price (the queue ahead now) leaves that wait out
    (docs/results/q12.md). Every other turn, and a move to an engine with no queue, keeps
    ``parts.total_s``. For choosing only: the parts the router keeps (calibration, the priority
    sent) are not changed."""
    total_s = parts.total_s
    offset = engine.extra.get(DEADLINE_OFFSET_KEY) if engine.extra else None
    if offset is None or not parts.wait_tokens > 0 or best_fraction < RECOMPUTE_BELOW or prompt_tokens <= 0:
        return total_s
    if sum(parts.hit_tokens) / prompt_tokens >= RECOMPUTE_BELOW:
        return total_s
    floor_s = float(offset(parts))
    return floor_s if floor_s > total_s else total_s


#: ``EngineView.extra`` key of an engine whose router prices what a placement does to the turns
#: already queued there (round q13): a callable (a request's parts priced there) -> ``QueuedTurns``.
#: Absent = off.
QUEUED_TURNS_KEY = "queued_turns"


class QueuedTurns(NamedTuple):
    """What the router knows of the turns it has queued on one engine (placed there, first token not
    seen yet), for ``externality_s``; built per priced request (the deadlines are relative to now)."""

    #: Per queued turn: (its deadline offset from now, seconds, inf on a first-come engine; the
    #: prompt tokens the router predicted cached on the engine's GPU and CPU when it placed it).
    turns: Sequence[tuple[float, float]]
    #: The priced request's own deadline offset there (seconds from now; inf on a first-come engine:
    #: it waits behind every queued turn and overtakes none).
    own_offset_s: float
    #: The engine's local KV capacity in tokens (its largest local tier): the cache whose least
    #: recently used blocks a new sequence's blocks displace.
    capacity_tokens: float
    #: What one lost history token costs its turn, in multiples of its prefill time: a turn whose
    #: history is evicted while it waits is a recompute, sent (on a priority engine) with its
    #: prefill stretched into a later deadline (the router's stretch; 1 on a first-come engine).
    lost_token_factor: float
    #: The footprint a placement is priced with (``placement_externality_s``): False = the whole
    #: sequence (prompt and expected output) on every engine; True = only the blocks it writes
    #: there (prompt less its predicted GPU and CPU hits, and output), so that staying on the
    #: history is cheap and a move pays for the copy it makes (post hoc, round q13).
    new_blocks_only: bool = False


def placement_externality_s(
    parts: PredictedParts, engine: EngineView, request: RouteRequest, prompt_tokens: int, costs: EngineCosts
) -> float:
    """``externality_s`` of placing ``request`` (priced ``parts``) on ``engine``, 0 where the router
    gives no queued turns there (``QUEUED_TURNS_KEY``). The footprint is its prompt and expected
    output, less its predicted local (GPU and CPU) hits there when ``QueuedTurns.new_blocks_only``."""
    queued_turns = engine.extra.get(QUEUED_TURNS_KEY)
    if queued_turns is None:
        return 0.0
    queued: QueuedTurns = queued_turns(parts)
    footprint = float(prompt_tokens + request.expected_output_tokens)
    if queued.new_blocks_only:
        hits = parts.hit_tokens
        footprint = max(0.0, footprint - hits[0] - hits[1])
    return externality_s(parts, footprint, queued, costs)


def externality_s(
    parts: PredictedParts, footprint_tokens: float, queued: QueuedTurns, costs: EngineCosts
) -> float:
    """Seconds a placement costs the turns already queued on the engine (round q13; priced for
    choosing only), the sum of:

        delay_s = parts.service_s x #queued turns with a later deadline than the request's
                  (a priority engine serves it before them; a first-come engine before none)
        evict_s = lost_token_factor x prefill_time(footprint_tokens x min(1, cached_queued / capacity))

    ``footprint_tokens``: the KV the request's sequence takes there (its prompt and expected output:
    new blocks, or its history kept from eviction where it stays). In a full LRU cache each token
    it takes displaces one; the router does not know the LRU order, so each displaced token is a
    queued turn's history with the share of the cache those histories fill (``cached_queued``, the
    cached tokens predicted for the queued turns, over ``capacity_tokens``). A lost history token
    is recomputed with a later deadline (``lost_token_factor``). Staying on the engine holding the
    turn's history prices its sequence there; moving prices it on the other engine and leaves the
    history behind as an eviction candidate in the holder's queued turns' place (no term there):
    both sides of a move."""
    own = queued.own_offset_s
    delay_s = parts.service_s * sum(1 for offset, _ in queued.turns if offset > own)
    cached = sum(tokens for _, tokens in queued.turns)
    if not cached > 0 or not queued.capacity_tokens > 0 or not footprint_tokens > 0:
        return delay_s
    lost_tokens = footprint_tokens * min(1.0, cached / queued.capacity_tokens)
    return delay_s + queued.lost_token_factor * costs.prefill_time_s(lost_tokens)


def predicted_prefill_tokens(request: RouteRequest, decision: Decision, engine_id: str | None = None) -> int:
    """Prompt tokens the chosen engine is expected to compute: what the in-flight accounting should
    queue as pending prefill (``LoadTracker.begin``) until the first token.

    The decision's own prediction (its ``parts[chosen].prefill_tokens``, which its
    ``scores[chosen]["prefill_tokens"]`` repeat, tier_cost; or that score alone) when present;
    else the prompt minus the chosen engine's prefix match in any tier (capped at prompt - 1: the
    engine recomputes the last token); else the whole prompt. Counting a mostly cached prompt whole
    makes its engine look busy and pushes the conversation's next turn away from its history.
    ``engine_id``: price a fallback engine instead of the choice (a retry after a refused connection).
    """
    engine_id = decision.engine_id if engine_id is None else engine_id
    prompt_tokens = prompt_tokens_of(request)
    parts = decision.parts
    if parts is not None:  # the parts its scores are made of (read without building the scores)
        priced = parts.get(engine_id)
        if priced is not None:
            return max(0, min(prompt_tokens, round(priced.prefill_tokens)))
    else:
        score = decision.scores.get(engine_id)
        if score is not None and "prefill_tokens" in score:
            return max(0, min(prompt_tokens, round(score["prefill_tokens"])))
    match = request.prefix_matches.get(engine_id, NO_MATCH)
    hit_tokens = min(match.blocks * request.block_size, max_hit_tokens(prompt_tokens))
    return prompt_tokens - hit_tokens
