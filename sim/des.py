"""Offline fleet simulator: N sim/engine.py EngineCores in virtual time behind any routing policy.

A discrete-event simulation (heap of (time, seq, event)) that drives the router's own routing core
(``kvcore.core.RoutingCore``: candidate filter and large-fleet pre-filter, the policy, load ledger,
speculation, calibration, self-check) with the PrefixIndex fed by the engines' KV events after a
configurable delay, and reports TTFT, throughput, hit rate by tier against the ideal (infinite
shared cache). Deterministic for a given seed. The fleets it runs: sim/fleets.py; its sweep CLI
(``kvroute sim``): sim/des_cli.py.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore.calibration import CalibrationConfig, CostModel
from kvcore.core import (
    ADMISSION_FORMS,
    ESCALATE_PICKS,
    PRIORITY_FCFS_FACTOR,
    PRIORITY_MAX_OVERTAKE_S,
    PRIORITY_RECOMPUTE_BELOW,
    PRIORITY_RECOMPUTE_FCFS_FACTOR,
    PRIORITY_STEP_S,
    PRIORITY_STRETCH,
    PRIORITY_WAITS,
    CoreConfig,
    InMemoryLoadLedger,
    LoadTicket,
    Outcome,
    Reservation,
    RoutingCore,
    SequenceLedger,
    StorageReadQueue,
    check_hold,
    check_priority_fcfs_factor,
    check_recompute_below,
    hold_parts,
    other_engines,
    priority_fcfs_factor_for,
    priority_queued_ahead,
    shortest_first_priority,
)
from kvcore.index import PrefixIndex
from kvcore.keys import block_keys
from kvcore.stats import percentiles
from kvcore.wire import decode_events
from policies.base import (
    TIERS,
    EngineView,
    Policy,
    RouteRequest,
    Tier,
    build_policy,
    max_hit_tokens,
)
from policies.costs import (
    ADMISSION_RECOMPUTE_BELOW_KEY,
    ADMISSION_WAIT_KEY,
    DEADLINE_OFFSET_KEY,
    QUEUED_TURNS_KEY,
    EngineCosts,
    PredictedParts,
    QueuedTurns,
    best_cached_fraction,
    has_room,
)
from sim.cache import StoragePool
from sim.engine import (
    WAIT_REASONS,
    EngineCore,
    EngineProfile,
    FinishedRequest,
    SimRequest,
    StepOutput,
    WaitRecord,
)
from sim.fleets import (
    ROUTER_PRIORS,
    EngineSpec,
    FleetSpec,
)
from sim.frontend import FifoServer
from sim.hashing import BlockHashCache, HashChain
from sim.oracle import ClairvoyantPolicy, ideal_hit
from sim.placement import PlacementTracer
from sim.workloads import (
    Conversation,
    Workload,
)

#: The B1 comparison set. "clairvoyant" (sim/oracle.py, a greedy full-information what-if, not a
#: bound) is still accepted by name; the bound is sim.oracle.capacity_bound (loadtest/bench_quality.py).
DEFAULT_POLICIES = (
    "round_robin",
    "least_loaded",
    "session_affinity",
    "approx_prefix",
    "kv_gpu",
    "kv_fixed_credit",
    "tier_cost",
)

SHARED_POOL_ID = "shared"

# Event kinds; ties in time are broken by the sequence number (FIFO), never by the payload.
_START_CONV = 0
_ARRIVE = 1
_STEP_DONE = 2
_DELIVER = 3
_SCRAPE = 4
# With server stages (FleetSpec.api_server / router_stage, sim/frontend.py):
_ROUTE = 5  # the router process has read the request: route it
_AT_CORE = 6  # the engine's API server hands the request to its engine core
_OUT_API = 7  # the engine's API server has sent one step's tokens of a request (to the router)
_OUT = 8  # the client has them
_HOLD_DUE = 9  # a held turn's hold bound (SimConfig.hold_max_s) is reached
_ESCALATE = 10  # a turn's escalation time (SimConfig.escalate_after_s) is reached


def prior_costs(profile: EngineProfile) -> EngineCosts:
    """What a router operator would configure from the data sheet (the homogeneous nominal fleet)."""
    return EngineCosts(
        prefill_tokens_per_s=profile.prefill_tokens_per_s,
        load_bandwidth_bytes_per_s=(math.inf, profile.cpu_load_bytes_per_s, profile.storage_load_bytes_per_s),
        load_latency_s=(0.0, profile.cpu_latency_s, profile.storage_latency_s),
        kv_bytes_per_token=profile.kv_bytes_per_token,
    )


# ------------------------------------------------------------------------------- simulation


@dataclass(slots=True)
class SimConfig:
    seed: int = 0
    #: Delay between an engine step producing KV events and the index applying them.
    event_delay_s: float = 0.005
    #: Speculative GPU entries after routing (0 disables), as the router does.
    speculate_ttl_s: float = 2.0
    #: How often the simulated router scrapes each engine's metrics (queue gauges, offload counters).
    scrape_interval_s: float = 1.0
    #: Feed the cost model from simulated TTFTs (tier_cost's online calibration).
    calibrate: bool = True
    #: Track the ideal (infinite shared cache) hit rate; needs a set of every block id seen.
    track_ideal: bool = True
    #: Token mode: send the workload's token ids (synthetic conversations only) instead of block ids.
    token_mode: bool = False
    #: Progress bar on stderr.
    progress: bool = False
    #: What-if (the old router.load accounting): queue a request's whole prompt as pending prefill
    #: until its first token. Default: only its predicted uncached tokens on the chosen engine
    #: (``policies.costs.predicted_prefill_tokens``).
    queue_whole_prompt: bool = False
    #: Fleets larger than this: index-reading policies see only the ``prefilter_least_loaded``
    #: engines with the longest GPU/CPU prefix hits plus as many least loaded ones (by queued
    #: prefill tokens, then in flight; a sorted structure), as a router would pre-filter 1,000
    #: engines. 0 disables.
    prefilter_above_engines: int = 64
    prefilter_least_loaded: int = 8
    #: Where the router's cost model starts: "defaults" (policies.costs' configured defaults, as a
    #: deployed router would) or "nominal" (the fleet's nominal engine profile: the old what-if).
    router_priors: str = "defaults"
    #: The cost model's ``calibration.pool_observations`` (kvcore/calibration.py; 0 = off).
    calibration_pool_observations: float = 0.0
    #: The cost model's ``calibration.shared_storage``: the engines' STORAGE bandwidth is the shared
    #: pool's, measured from all of them (kvcore/calibration.py; round q31). False = per engine.
    calibration_shared_storage: bool = False
    #: The cost model's ``calibration.storage_spread``: each engine's STORAGE bandwidth its own,
    #: within this factor of the shared pool's (kvcore/calibration.py; round q32). inf = off.
    calibration_storage_spread: float = math.inf
    #: Engines whose profile has ``scheduling_policy="priority"`` get each request's
    #: ``shortest_first_priority`` (levels of ``priority_step_s`` seconds, deadlines stretched by
    #: ``priority_stretch`` and never more than ``priority_max_overtake_s`` nor
    #: ``priority_fcfs_factor`` x the predicted first-come TTFT after placement; virtual time is
    #: the clock), as the router sends them.
    priority_step_s: float = PRIORITY_STEP_S
    priority_stretch: float = PRIORITY_STRETCH
    priority_max_overtake_s: float = PRIORITY_MAX_OVERTAKE_S
    priority_fcfs_factor: float = PRIORITY_FCFS_FACTOR
    #: The recompute bound (``kvcore.core.priority_fcfs_factor_for``): a turn whose best cached
    #: fraction over the router's index is below ``priority_recompute_below`` when routed has its
    #: deadline capped at min(``priority_fcfs_factor``, this) x its predicted first-come TTFT, in
    #: the priority it is sent with and in the priced waits that read it; >= 1, inf = off.
    priority_recompute_fcfs_factor: float = PRIORITY_RECOMPUTE_FCFS_FACTOR
    priority_recompute_below: float = PRIORITY_RECOMPUTE_BELOW
    #: How the router's cost model prices the wait on priority engines (``kvcore.core
    #: .PRIORITY_WAITS``): "all" = every queued prefill token (first come), "ahead" = only the
    #: queued prefill sent with a priority no larger than the request's there
    #: (``priority_queued_ahead``), "overtake" / "running" (kvcore.core.PRIORITY_WAITS). fcfs
    #: engines always count every queued token.
    priority_wait: str = "all"
    #: Price the admission wait (``policies.costs.admission_wait_parts``): on engines that admit a
    #: request only when its whole sequence fits (``EngineProfile.reserve_full_isl``), the router's
    #: slot wait becomes the time until the sequences it placed there free room for the prompt
    #: (``kvcore.core.SequenceLedger``), instead of in flight x the learned slot seconds.
    admission_wait: bool = False
    #: How that admission wait counts the placed sequences' KV (``kvcore.core.ADMISSION_FORMS``):
    #: "reserved" (each at prompt + expected output from now), "held" (running ones at prompt +
    #: decoded so far, waiting ones at nothing), "ahead" ("held" plus the waiting sequences a
    #: priority engine serves first) or "overtake" ("ahead" plus the expected earlier-deadline
    #: arrivals).
    admission_form: str = "reserved"
    #: With ``admission_wait``: price it only for a turn that is a recompute on every engine anyway,
    #: its best cached fraction (``policies.costs.best_cached_fraction``: the largest share of the
    #: prompt any engine holds in any tier) below this fraction of the prompt, in (0, 1]; every
    #: other turn keeps the learned slot term (``policies.costs.ADMISSION_RECOMPUTE_BELOW_KEY``).
    #: None = every turn.
    admission_recompute_below: float | None = None
    #: Late binding (round q10): None = off (each turn is routed when it arrives). Else W seconds: an
    #: engine has room when the router's predicted queue wait there is below W
    #: (``policies.costs.has_room``); a turn arriving while no engine has room, or while turns are
    #: held, waits in the router's one hold queue, and held turns are routed (index, load, priority
    #: at that moment; TTFT still from arrival) whenever an engine's router-known load falls (a
    #: first token, a finish, a refusal, a scrape) while some engine has room. > 0; fleets without
    #: server stages only.
    hold_wait_s: float | None = None
    #: The hold queue's order (``kvcore.core.HOLD_ORDERS``): "fcfs" (arrival) or "priority" (the
    #: shortest-first deadline the router would send, priced at arrival by ``kvcore.core
    #: .hold_parts`` with the priority_* settings above; ties by arrival).
    hold_order: str = "fcfs"
    #: The engines a released turn is routed among (``kvcore.core.HOLD_PICKS``): "all" or "room".
    hold_pick: str = "all"
    #: With ``hold_wait_s``: hold only a turn that is a recompute on every engine, its best cached
    #: fraction when it arrives (``policies.costs.best_cached_fraction``) below this fraction of the
    #: prompt, in (0, 1]; every other turn is routed on arrival, past the held ones (it has a
    #: history to keep, a recompute has none to lose while held). None = every turn may be held.
    hold_recompute_below: float | None = None
    #: With ``hold_wait_s``: the hold's bound, seconds; a turn held this long after it arrived is
    #: routed then (among every engine), room or not, so that no held turn waits in the router for
    #: ever while the turns routed past it keep the fleet busy. None = no bound.
    hold_max_s: float | None = None
    #: With ``hold_wait_s``: a held turn's shortest-first deadline counts from its arrival at the
    #: router, not from when it is routed (``_route``: the priority sent to a priority engine and the
    #: priced waits that read it), as a router computing the priority when it forwards the request
    #: from the request's arrival time would send it: a turn held M seconds is M seconds more urgent
    #: on its engine. A turn routed on arrival gets the same deadline either way. Off = round q10's
    #: hold. Needs some engine with ``scheduling_policy="priority"``.
    hold_aged: bool = False
    #: Escalation (round q24): None = off. Else E seconds: a turn on a priority engine with no
    #: first token E seconds after it arrived is aborted there and sent again with priority 0, the
    #: most urgent (ahead of every deadline; escalated turns first come among themselves), as a
    #: router would on a first-byte deadline: vLLM aborts a request whose client connection closes
    #: and keeps its computed full blocks in the prefix cache, so the re-sent request finds them.
    #: The turn's TTFT still counts from its arrival. > 0; fleets without server stages only.
    escalate_after_s: float | None = None
    #: Where an escalated turn is sent (``ESCALATE_PICKS``).
    escalate_pick: str = "same"
    #: When the engine drops the escalated turn's first request (``ESCALATE_ABORTS``): "now" (at the
    #: escalation, as vLLM 0.32 drops a queued stream whose client leaves: docs/results/q25.md;
    #: rounds q24-q25 ran this; so does kvroute's sim server) or "first_token" (a sensitivity
    #: check: a server that finds the closed connection only when it writes, as the sim server did
    #: until 2026-12-05, so the request stays queued, is admitted and prefilled, and is aborted at
    #: its first token).
    escalate_abort: str = "now"
    #: The router books the traffic it places on the fleet's shared pool and prices a STORAGE
    #: read's wait behind it (``kvcore.core.StorageReadQueue``, ``policies.costs
    #: .storage_read_parts``), at the pool's aggregate bandwidth (``FleetSpec
    #: .storage_shared_bytes_per_s``: what an operator configures as ``costs
    #: .storage_pool_bandwidth``). Needs a shared pool with that bandwidth.
    storage_read_queue: bool = False
    #: With ``storage_read_queue``: book the blocks each request computes too (the simulated
    #: engines write them through to the pool, as vLLM's tiering manager does; ``costs
    #: .storage_pool_write_through``). False = the reads only (round q54's first build).
    storage_read_queue_writes: bool = True
    #: Split each turn's measured TTFT into where it went on the engine and keep it beside the
    #: predicted parts (``SimResult.ttft_split_by_request``, ``ttft_split``); fleets without
    #: server stages only.
    split_ttft: bool = False
    #: Price placement on priority engines by the deadline the router sends (round q12;
    #: ``policies.costs.deadline_floor_s``): each priority engine's view carries
    #: ``DEADLINE_OFFSET_KEY``, the offset of the shortest-first deadline a request priced there
    #: would get, and tier_cost ranks an engine with a queue by at least that offset. Needs some
    #: engine with ``scheduling_policy="priority"``.
    deadline_floor: bool = False
    #: Price what a placement does to the turns the router has queued on each engine (round q13;
    #: ``policies.costs.externality_s``): each view carries ``QUEUED_TURNS_KEY``, the turns placed
    #: there whose first token the router has not seen (their deadlines and the cached tokens
    #: predicted when placed), the engine's local KV capacity and the price of a lost history token
    #: (the priority stretch on a priority engine, 1 on a first-come one).
    externality: bool = False
    #: With ``externality``: price a placement's footprint as only the blocks it writes on the
    #: engine (``QueuedTurns.new_blocks_only``; post hoc, round q13) instead of its whole sequence.
    externality_new_blocks: bool = False
    #: Record every routing decision (``sim.placement.PlacementTracer``: each engine's predicted
    #: TTFT parts beside its true cached prefix, queue and free KV, and the turn's outcome) in
    #: ``SimResult.placement``; reads only, the run routes as without it. Trace-mode block ids only.
    trace_placement: bool = False
    #: With ``trace_placement``: a policy (registered name, and its params) asked on the same state
    #: at each decision; its choice is recorded as ``shadow``, never used.
    trace_shadow: str | None = None
    trace_shadow_params: dict[str, Any] | None = None
    #: Request id -> engine id: that turn goes to that engine whatever the policy chooses (a single
    #: decision's counterfactual: the same seeded run with one turn placed elsewhere). Needs
    #: ``trace_placement``.
    force_engines: dict[str, str] | None = None
    #: End the run once each of these requests has its first token (a counterfactual needs only
    #: the turns it compares); the figures then cover the turns finished so far.
    stop_after: tuple[str, ...] = ()


#: ``SimConfig.escalate_abort``'s values.
ESCALATE_ABORTS = ("now", "first_token")


#: ``ttft_split`` keys: the measured TTFT's parts, then the predicted ones (seconds).
TTFT_SPLIT_KEYS = (
    "ttft_s",
    "queue_s",
    "admission_kv_s",
    "admission_seqs_s",
    "service_s",
    "preemption_s",
    "predicted_s",
    "predicted_wait_s",
    "predicted_slot_s",
    "predicted_read_wait_s",
    "predicted_service_s",
)


#: ``SimResult.ttft_split_by_request`` key beside ``TTFT_SPLIT_KEYS``: the turn's best cached fraction
#: when it was first routed (``policies.costs.best_cached_fraction`` over the router's index: the
#: largest share of its prompt any engine held in any tier; below a small fraction it is a recompute
#: wherever it goes).
SPLIT_CACHED_FRACTION_KEY = "best_cached_fraction"


def ttft_split(record: WaitRecord, arrival_s: float, parts: PredictedParts) -> dict[str, float]:
    """One turn's measured TTFT (``arrival_s`` -> first token) split by where it went:

        queue_s          waiting while the engine's steps were full of other prefill (their token
                         budget spent), and the step in progress when it arrived
        admission_kv_s   waiting at an engine whose next request's whole sequence did not fit the
                         free KV blocks (vLLM's scheduler_reserve_full_isl), or that preempted
        admission_seqs_s waiting while max_num_seqs requests ran
        service_s        first admission -> first token (its loads, its prefill chunks), or ->
                         its first preemption
        preemption_s     first preemption -> first token (the work lost and the wait again)

    summing to ``ttft_s``; beside the predicted parts: ``predicted_wait_s`` (queued prefill ahead),
    ``predicted_slot_s`` (in flight x slot seconds), ``predicted_read_wait_s`` (the shared STORAGE
    pool's booked traffic ahead: ``SimConfig.storage_read_queue``) and ``predicted_service_s`` (loads
    + prefill)."""
    waits = record.waits_s
    kv_s = waits[WAIT_REASONS.index("kv")] + waits[WAIT_REASONS.index("preempt")]
    seqs_s = waits[WAIT_REASONS.index("seqs")]
    preempted = record.preempted_s >= 0
    return {
        "ttft_s": record.first_token_s - arrival_s,
        "queue_s": record.admitted_s - arrival_s - kv_s - seqs_s,
        "admission_kv_s": kv_s,
        "admission_seqs_s": seqs_s,
        "service_s": (record.preempted_s if preempted else record.first_token_s) - record.admitted_s,
        "preemption_s": record.first_token_s - record.preempted_s if preempted else 0.0,
        "predicted_s": parts.total_s,
        "predicted_wait_s": parts.wait_s,
        "predicted_slot_s": parts.slot_s,
        "predicted_read_wait_s": parts.read_wait_s,
        "predicted_service_s": parts.service_s,
    }


@dataclass(slots=True)
class _Req:
    request_id: str
    conv_slot: int
    turn: int
    engine: int
    arrival_s: float
    prompt_tokens: int
    #: The routing core's reservation (load, predicted parts, first token).
    reservation: Reservation
    #: Server stages: the engine core has emitted a token of it (its first output job is queued).
    emitted: bool = False


@dataclass(slots=True)
class _Conv:
    conv: Conversation
    #: Router keys of the last turn (extended incrementally turn by turn).
    ids: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    finished_turns: int = 0


@dataclass(slots=True)
class SimResult:
    """Figures of one (workload, policy) run. Rates are fractions of prompt tokens."""

    policy: str
    workload: str
    engines: int
    requests: int
    virtual_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    turns_per_s: float
    tokens_per_s: float
    output_tokens_per_s: float
    hit_gpu: float
    hit_cpu: float
    hit_storage: float
    miss: float
    ideal_hit: float
    fraction_of_ideal: float
    load_imbalance: float
    preemptions: int
    wall_s: float
    #: Turns aborted and sent again at the most urgent priority (``SimConfig.escalate_after_s``).
    escalations: int = 0
    #: Requests the engine refused (prompt larger than its GPU pool or max_model_len).
    rejected: int = 0
    #: How true the router's TTFT predictions were: sum of the engines' TTFTs (sent -> first token)
    #: over the sum of the TTFTs the cost model predicted for the same requests (1.0 = unbiased;
    #: 2.0 = waits twice as long as predicted). Every policy's requests are priced, so it is
    #: reported for all of them; nan when no request got a first token.
    ttft_over_predicted: float = math.nan
    label: str = ""
    ttfts_s: list[float] = field(default_factory=list, repr=False)
    #: Each request's TTFT by request id ("conversation#turn": the same turn in every run of a
    #: seed), for per-turn comparisons between runs (loadtest/bench_quality.py's tail table).
    ttft_by_request_s: dict[str, float] = field(default_factory=dict, repr=False)
    #: With ``SimConfig.split_ttft``: each request's ``ttft_split`` by request id (and its
    #: ``SPLIT_CACHED_FRACTION_KEY``).
    ttft_split_by_request: dict[str, dict[str, float]] = field(default_factory=dict, repr=False)
    #: With ``SimConfig.trace_placement``: one record per routed turn (``sim.placement``), with its
    #: outcome: ``ttft_s`` (nan if it had none), ``cached`` (tokens served from GPU, CPU, STORAGE at
    #: admission), ``priority`` (sent to a priority engine), and the ``ttft_split`` parts when split.
    placement: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def hit(self) -> float:
        return self.hit_gpu + self.hit_cpu + self.hit_storage

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("ttfts_s")
        d.pop("ttft_by_request_s")
        d.pop("ttft_split_by_request")
        d.pop("placement")
        d["hit"] = self.hit
        return d


def ttft_figures(ttfts: Sequence[float]) -> tuple[float, float, float, float]:
    """A run's TTFT figures, ``SimResult``'s ttft_p50_s, ttft_p90_s, ttft_p99_s and ttft_mean_s
    (each 0 without turns)."""
    p50, p90, p99 = percentiles(ttfts, (50, 90, 99), empty=0.0)
    return p50, p90, p99, sum(ttfts) / len(ttfts) if ttfts else 0.0


class FleetSimulator:
    """One run: a workload through one policy on one fleet, in virtual time.

    ``policy`` is a registered name (built with policies.base.build_policy), "clairvoyant", or a
    Policy object. Use ``run()`` once.
    """

    def __init__(
        self,
        workload: Workload,
        policy: str | Policy,
        fleet: FleetSpec,
        config: SimConfig | None = None,
        *,
        policy_params: dict[str, Any] | None = None,
    ) -> None:
        self.workload = workload
        self.fleet = fleet
        self.config = config or SimConfig()
        cfg = self.config
        if cfg.token_mode and any(c.messages_fn is None for c in workload.conversations):
            raise ValueError("token_mode needs a synthetic workload (trace conversations have no text)")
        if not cfg.token_mode and workload.block_size != fleet.block_size:
            raise ValueError(
                f"workload block ids are {workload.block_size}-token blocks but the engines use "
                f"block_size {fleet.block_size}; build the fleet with block_size={workload.block_size}"
            )
        self.storage = (
            StoragePool(
                SHARED_POOL_ID,
                fleet.storage_pool_blocks,
                fleet.storage_load_bytes_per_s,
                fleet.storage_latency_s,
                fleet.storage_shared_bytes_per_s,
                announce_removals=fleet.storage_announces_removals,
            )
            if fleet.storage_pool_blocks > 0
            else None
        )
        # One memo of block hashes for the whole fleet: a history resent to any engine is hashed once.
        self.hash_cache = BlockHashCache()
        self.cores = [
            EngineCore(
                s.engine_id, s.profile, self.storage, seed=cfg.seed * 1009 + i, hash_cache=self.hash_cache
            )
            for i, s in enumerate(fleet.engines)
        ]
        self.engine_ids = [c.engine_id for c in self.cores]
        self._pos = {e: i for i, e in enumerate(self.engine_ids)}
        self.views = [
            EngineView(
                engine_id=s.engine_id,
                block_size=s.profile.block_size,
                num_requests_running=0,
                num_requests_waiting=0,
                kv_cache_usage=0.0,
            )
            for s in fleet.engines
        ]
        for spec, view in zip(fleet.engines, self.views, strict=True):
            # What the live router reads from each engine's vllm:cache_config_info (router.scrape
            # .tier_capacities_tokens): tier capacities in tokens, for policies pricing evictions.
            bs = spec.profile.block_size
            view.extra["gpu_capacity_tokens"] = float(spec.profile.num_gpu_blocks * bs)
            view.extra["cpu_capacity_tokens"] = float(spec.profile.num_cpu_blocks * bs)
            view.extra["storage_capacity_tokens"] = float(fleet.storage_pool_blocks * bs)
        self.index = PrefixIndex(
            # ``is not None``: an empty StoragePool is falsy (it has __len__).
            storage_pools={SHARED_POOL_ID: fleet.storage_pool_blocks} if self.storage is not None else {},
            engine_storage_pool=(
                {e: SHARED_POOL_ID for e in self.engine_ids} if self.storage is not None else {}
            ),
        )
        for e in self.engine_ids:
            self.index.add_engine(e)
        # The router starts from its own configured defaults (policies.costs), not from the engines'
        # true parameters: calibration has to earn what it knows. "nominal" = the old what-if.
        if cfg.router_priors not in ROUTER_PRIORS:
            raise ValueError(
                f"router_priors {cfg.router_priors!r} is unknown; accepted: {', '.join(ROUTER_PRIORS)}"
            )
        calibration = CalibrationConfig(
            pool_observations=cfg.calibration_pool_observations,
            shared_storage=cfg.calibration_shared_storage,
            storage_spread=cfg.calibration_storage_spread,
        )
        self.costs = (
            CostModel(prior_costs(fleet.engines[0].profile), calibration=calibration)
            if cfg.router_priors == "nominal"
            else CostModel(calibration=calibration)
        )
        if self.storage is not None:  # every engine mounts the fleet's one shared pool
            for e in self.engine_ids:
                self.costs.set_storage_pool(e, SHARED_POOL_ID)
        self.clairvoyant: ClairvoyantPolicy | None = None
        if isinstance(policy, str):
            if policy == "clairvoyant":
                self.clairvoyant = ClairvoyantPolicy(self.cores)
                self.policy: Policy = self.clairvoyant
            else:
                self.policy = build_policy(policy, _with_seed(policy, policy_params, cfg.seed))
        else:
            self.policy = policy
        self.policy_name = getattr(self.policy, "name", str(policy))
        #: The placement trace (``SimConfig.trace_placement``) and the block ids of the turn being
        #: routed, which it reads.
        self.tracer: PlacementTracer | None = None
        self._trace_block_ids: list[int] | None = None
        #: Per request finished while tracing: the tokens it was served from each tier.
        self._cached_by_request: dict[str, tuple[int, int, int]] = {}
        if cfg.force_engines and not cfg.trace_placement:
            raise ValueError("force_engines needs trace_placement")
        if cfg.trace_placement:
            shadow = (
                build_policy(
                    cfg.trace_shadow, _with_seed(cfg.trace_shadow, cfg.trace_shadow_params, cfg.seed)
                )
                if cfg.trace_shadow
                else None
            )
            self.tracer = PlacementTracer(self.policy, self, shadow=shadow, force=cfg.force_engines)
            self.policy = self.tracer
        #: Engines that stepped since the last scrape (the others' metrics did not change).
        self._stepped: set[int] = set()
        # The router's own core: a sorted ledger only when the pre-filter will ask for least loaded.
        self.ledger = InMemoryLoadLedger(
            self.engine_ids, ordered=0 < cfg.prefilter_above_engines < len(self.views)
        )
        self.core = RoutingCore(
            ledger=self.ledger,
            costs=self.costs,
            index=self.index,
            config=CoreConfig(
                speculation_ttl_s=cfg.speculate_ttl_s,
                prefilter_above_engines=cfg.prefilter_above_engines,
                prefilter_keep=cfg.prefilter_least_loaded,
                queue_whole_prompt=cfg.queue_whole_prompt,
                calibrate=cfg.calibrate,
            ),
            storage_reads=self._storage_reads(fleet),
        )
        # Trace mode keys: one pseudo-token per block id (block_size 1), as the engine's events.
        self._key_block_size = fleet.block_size if cfg.token_mode else 1
        #: The router's placed sequences (``SimConfig.admission_wait``).
        self.sequences: SequenceLedger | None = None
        if cfg.admission_form not in ADMISSION_FORMS:
            raise ValueError(
                f"admission_form {cfg.admission_form!r} is unknown; accepted: {', '.join(ADMISSION_FORMS)}"
            )
        below = cfg.admission_recompute_below
        if below is not None:
            if not cfg.admission_wait:
                raise ValueError("admission_recompute_below gates the admission wait: set admission_wait too")
            check_recompute_below(below, "admission_recompute_below")
        if cfg.admission_wait:
            self.sequences = SequenceLedger()
            for spec, view in zip(fleet.engines, self.views, strict=True):
                if spec.profile.reserve_full_isl:
                    capacity = float(spec.profile.num_gpu_blocks * spec.profile.block_size)
                    view.extra[ADMISSION_WAIT_KEY] = self._admission_wait(
                        spec.engine_id, capacity, spec.profile.scheduling_policy == "priority"
                    )
                    if below is not None:
                        view.extra[ADMISSION_RECOMPUTE_BELOW_KEY] = below
        self._ttft_split: dict[str, dict[str, float]] = {}
        #: Per request routed and not yet split: its best cached fraction when first routed.
        self._cached_fraction: dict[str, float] = {}
        if cfg.split_ttft:
            if fleet.api_server is not None or fleet.router_stage is not None:
                raise ValueError("split_ttft needs a fleet without server stages (api_server, router_stage)")
            for core in self.cores:
                core.wait_records = {}
        if cfg.priority_wait not in PRIORITY_WAITS:
            raise ValueError(
                f"priority_wait {cfg.priority_wait!r} is unknown; accepted: {', '.join(PRIORITY_WAITS)}"
            )
        check_priority_fcfs_factor(cfg.priority_recompute_fcfs_factor, "priority_recompute_fcfs_factor")
        check_recompute_below(cfg.priority_recompute_below, "priority_recompute_below")
        #: The routing clock the priorities are sent in (the virtual time of the request being routed).
        self._route_now = 0.0
        #: The relative bound of the request being routed (``priority_fcfs_factor_for``).
        self._route_fcfs_factor = cfg.priority_fcfs_factor
        self._priority_ahead = cfg.priority_wait != "all"
        check_hold(
            cfg.hold_wait_s,
            cfg.hold_order,
            cfg.hold_pick,
            cfg.hold_recompute_below,
            cfg.hold_max_s,
            cfg.hold_aged,
        )
        if cfg.hold_wait_s is not None and (fleet.api_server is not None or fleet.router_stage is not None):
            raise ValueError("hold_wait_s needs a fleet without server stages (api_server, router_stage)")
        if cfg.hold_aged and all(s.profile.scheduling_policy != "priority" for s in fleet.engines):
            raise ValueError("hold_aged ages the priority sent to priority engines: the fleet has none")
        if cfg.escalate_pick not in ESCALATE_PICKS:
            raise ValueError(
                f"escalate_pick {cfg.escalate_pick!r} is unknown; accepted: {', '.join(ESCALATE_PICKS)}"
            )
        if cfg.escalate_abort not in ESCALATE_ABORTS:
            raise ValueError(
                f"escalate_abort {cfg.escalate_abort!r} is unknown; accepted: {', '.join(ESCALATE_ABORTS)}"
            )
        if cfg.escalate_after_s is not None:
            if not cfg.escalate_after_s > 0:
                raise ValueError(f"escalate_after_s must be > 0 seconds, got {cfg.escalate_after_s}")
            if fleet.api_server is not None or fleet.router_stage is not None:
                raise ValueError(
                    "escalate_after_s needs a fleet without server stages (api_server, router_stage)"
                )
            if all(s.profile.scheduling_policy != "priority" for s in fleet.engines):
                raise ValueError(
                    "escalate_after_s re-sends turns at a higher priority: the fleet has no priority engine"
                )
        #: Turns escalated so far (``SimResult.escalations``), and each re-sent request's turn id
        #: (the first request id: what ``SimResult.ttft_by_request_s`` is keyed by).
        self._escalations = 0
        self._turn_of: dict[str, str] = {}
        #: Escalated turns' first requests still queued on their engine (``escalate_abort``
        #: "first_token"): aborted when they produce a token.
        self._ghosts: set[str] = set()
        #: The time the deadline of the request being routed counts from: ``_route_now``, or its
        #: arrival at the router with ``hold_aged``.
        self._route_from = 0.0
        #: A request for ``RoutingCore.refresh`` when the hold reads the engines' load between routes.
        self._no_request = RouteRequest(request_id="")
        if cfg.deadline_floor:
            if all(s.profile.scheduling_policy != "priority" for s in fleet.engines):
                raise ValueError(
                    "deadline_floor prices the deadline sent to priority engines: the fleet has none"
                )
            for spec, view in zip(fleet.engines, self.views, strict=True):
                if spec.profile.scheduling_policy == "priority":
                    view.extra[DEADLINE_OFFSET_KEY] = self._deadline_offset_s
        #: Per engine id (``SimConfig.externality``): the router's queued turns, request id ->
        #: (deadline s in the routing clock, inf on a first-come engine; predicted local cached
        #: tokens; the load ticket, whose pending prefill says whether it is still queued).
        self._queued_turns: dict[str, dict[str, tuple[float, float, LoadTicket]]] = {}
        if cfg.externality_new_blocks and not cfg.externality:
            raise ValueError(
                "externality_new_blocks chooses the externality's footprint: set externality too"
            )
        if cfg.externality:
            for spec, view in zip(fleet.engines, self.views, strict=True):
                self._queued_turns[spec.engine_id] = {}
                view.extra[QUEUED_TURNS_KEY] = self._queued_turns_of(spec)
        if self._priority_ahead:
            for spec, view in zip(fleet.engines, self.views, strict=True):
                if spec.profile.scheduling_policy == "priority":
                    view.queued_ahead = priority_queued_ahead(
                        self.ledger,
                        spec.engine_id,
                        lambda: self._route_now,
                        step_s=cfg.priority_step_s,
                        stretch=cfg.priority_stretch,
                        max_overtake_s=cfg.priority_max_overtake_s,
                        fcfs_factor=cfg.priority_fcfs_factor,
                        fcfs_factor_now=lambda: self._route_fcfs_factor,
                        overtake=self.costs if cfg.priority_wait in ("overtake", "running") else None,
                        running_first=cfg.priority_wait == "running",
                        deadline_from=(lambda: self._route_from) if cfg.hold_aged else None,
                    )

    def _admission_wait(
        self, engine_id: str, capacity_tokens: float, by_priority: bool
    ) -> Callable[[float, PredictedParts], float]:
        """``ADMISSION_WAIT_KEY`` of one engine: a prompt placed now (and its parts) -> its admission
        wait there; on a priority engine the "ahead" and "overtake" forms read the deadline it would be
        sent with."""
        sequences = self.sequences
        assert sequences is not None
        form = self.config.admission_form
        step_s = self.config.priority_step_s

        def wait_s(prompt_tokens: float, parts: PredictedParts) -> float:
            now = self._route_now
            deadline_s = None
            if by_priority and form in ("ahead", "overtake"):
                deadline_s = self._priority(parts, self._route_from) * step_s
            return sequences.admission_wait_s(
                engine_id, prompt_tokens, capacity_tokens, now, form=form, deadline_s=deadline_s
            )

        return wait_s

    def _queued_turns_of(self, spec: EngineSpec) -> Callable[[PredictedParts], QueuedTurns]:
        """``QUEUED_TURNS_KEY`` of one engine: a request's parts there -> the turns the router has
        queued on it (``_queued_turns``, pruned of those with a first token or a finish) as
        ``QueuedTurns``, deadlines relative to the routing clock."""
        queued = self._queued_turns[spec.engine_id]
        profile = spec.profile
        capacity = float(max(profile.num_gpu_blocks, profile.num_cpu_blocks) * profile.block_size)
        by_priority = profile.scheduling_policy == "priority"
        factor = self.config.priority_stretch if by_priority else 1.0
        new_blocks = self.config.externality_new_blocks

        def turns(parts: PredictedParts) -> QueuedTurns:
            for request_id in [r for r, (_, _, t) in queued.items() if not t.prefill_pending or t.done]:
                del queued[request_id]
            now = self._route_now
            own = self._deadline_offset_s(parts) if by_priority else math.inf
            return QueuedTurns(
                [(deadline - now, cached) for deadline, cached, _ in queued.values()],
                own,
                capacity,
                factor,
                new_blocks,
            )

        return turns

    def _storage_reads(self, fleet: FleetSpec) -> StorageReadQueue | None:
        """The core's booked STORAGE reads (``SimConfig.storage_read_queue``), else None."""
        if not self.config.storage_read_queue:
            return None
        bandwidth = fleet.storage_shared_bytes_per_s
        if self.storage is None or bandwidth is None:
            raise ValueError(
                "storage_read_queue books reads on the fleet's shared STORAGE pool at its aggregate"
                " bandwidth: the fleet has no shared pool with one (storage blocks > 0, engine model vllm)"
            )
        return StorageReadQueue(
            {SHARED_POOL_ID: bandwidth}, write_through=self.config.storage_read_queue_writes
        )

    def _deadline_offset_s(self, parts: PredictedParts) -> float:
        """``DEADLINE_OFFSET_KEY`` of a priority engine: seconds from now to the deadline of the
        priority the request being routed would be sent with, priced ``parts`` (``_priority``)."""
        return self._priority(parts, 0.0) * self.config.priority_step_s

    def _priority(self, parts: PredictedParts, from_s: float) -> int:
        """The vLLM ``priority`` the router sends the request being routed (``_route_fcfs_factor``)
        with ``parts``, its deadline counted from ``from_s`` (when it is placed, or ``_route_from``)."""
        cfg = self.config
        return shortest_first_priority(
            parts,
            cfg.priority_step_s,
            now_s=from_s,
            stretch=cfg.priority_stretch,
            max_overtake_s=cfg.priority_max_overtake_s,
            fcfs_factor=self._route_fcfs_factor,
        )

    # -- the event loop ----------------------------------------------------------------------

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        cfg = self.config
        wl = self.workload
        rng = random.Random(f"des:{cfg.seed}")
        heap: list[tuple[float, int, int, Any]] = []
        seq = 0

        def push(t: float, kind: int, payload: Any) -> None:
            nonlocal seq
            heapq.heappush(heap, (t, seq, kind, payload))
            seq += 1

        convs = wl.conversations
        total_requests = wl.num_requests
        next_conv = 0
        # Open loop: conversations start in start_s order, each scheduling the next (small heap).
        order = (
            sorted(range(len(convs)), key=lambda i: (convs[i].start_s, i)) if wl.concurrency is None else []
        )
        if wl.concurrency is not None:
            for _ in range(min(wl.concurrency, len(convs))):
                push(rng.uniform(0.0, wl.ramp_s) if wl.ramp_s > 0 else 0.0, _START_CONV, next_conv)
                next_conv += 1
        elif convs:
            push(convs[order[0]].start_s, _START_CONV, order[0])
        open_order_pos = 1
        slowdown_at = int(total_requests * self.fleet.slowdown_at_fraction)
        slowed = False
        if cfg.scrape_interval_s > 0:
            push(cfg.scrape_interval_s, _SCRAPE, None)

        states: dict[int, _Conv] = {}
        reqs: dict[str, _Req] = {}
        busy = [False] * len(self.cores)
        routed_tokens = [0] * len(self.cores)
        seen_ids: set[int] = set()
        ideal_tokens = 0
        ttfts: list[float] = []
        self._ttft_by_request: dict[str, float] = {}
        rejected = 0
        stop_after = cfg.stop_after
        by_tier = [0, 0, 0]
        prompt_total = output_total = finished = arrived = 0
        now = 0.0
        last_finish = 0.0
        active = 0
        stop_starting_at = (
            wl.duration_s if wl.concurrency is not None and wl.duration_s is not None else math.inf
        )
        progress = _Progress(total_requests, enabled=cfg.progress, label=f"{wl.name} {self.policy_name}")
        uses_index = bool(getattr(self.policy, "uses_index", False))
        # Server stages (sim/frontend.py): one API-server queue per engine core, one router queue.
        staged = self.fleet.api_server is not None or self.fleet.router_stage is not None
        api = [FifoServer() for _ in self.cores]
        router = FifoServer() if self.fleet.router_stage is not None else None
        # Their stalls: their own generator, so the rest of the run draws what it drew before.
        stage_rng = random.Random(f"stages:{cfg.seed}")

        def after_turn(slot: int, turn: int, t: float) -> None:
            """A turn is over (finished or rejected): send the next one or replace the conversation."""
            nonlocal active, next_conv
            cs = states[slot]
            cs.finished_turns += 1
            conv = cs.conv
            nxt = turn + 1
            if nxt < len(conv.turns) and conv.turns[nxt].at_s is None:
                push(t + conv.turns[nxt].think_time_s, _ARRIVE, (slot, nxt))
            elif cs.finished_turns == len(conv.turns):
                del states[slot]
                active -= 1
                if wl.concurrency is not None and next_conv < len(convs) and t < stop_starting_at:
                    push(t, _START_CONV, next_conv)
                    next_conv += 1

        def start_step(i: int, t: float) -> None:
            self._stepped.add(i)
            out = self.cores[i].step(t)
            busy[i] = True
            push(t + out.duration_s, _STEP_DONE, (i, out))

        def place(
            slot: int, k: int, t: float, sent_s: float, engines: list[EngineView] | None = None
        ) -> None:
            """Route turn ``k`` of the conversation in ``slot`` at ``t`` (sent at ``sent_s``) among
            ``engines`` (default every one), and hand it on; a refused turn counts as rejected."""
            nonlocal rejected, arrived, ideal_tokens, slowed
            cs = states[slot]
            turn = cs.conv.turns[k]
            routed = self._route(cs, slot, k, t, uses_index, sent_s, admit=not staged, engines=engines)
            if routed is None:  # the engine refused it (too long for its pool / model length)
                rejected += 1
                after_turn(slot, k, t)
                return
            r, sim_req = routed
            reqs[r.request_id] = r
            if escalate_s is not None and self.cores[r.engine].profile.scheduling_policy == "priority":
                push(max(t, sent_s + escalate_s), _ESCALATE, r.request_id)
            arrived += 1
            routed_tokens[r.engine] += r.prompt_tokens
            if cfg.track_ideal:
                n = ideal_hit(seen_ids, turn.block_ids)
                ideal_tokens += min(n * wl.block_size, max_hit_tokens(turn.prompt_tokens))
            if staged:
                # The engine's API server reads and tokenizes it before the engine core sees it.
                a = self.fleet.api_server
                done_s = api[r.engine].serve(t, a.request_cost_s(r.prompt_tokens)) if a else t
                push(done_s + (a.stall_draw_s(stage_rng) if a else 0.0), _AT_CORE, (r, sim_req))
            elif not busy[r.engine]:
                start_step(r.engine, t)
            if not slowed and self.fleet.slowdown_engine is not None and arrived >= slowdown_at:
                slowed = True
                self._slow_down(self.fleet.slowdown_engine, self.fleet.slowdown_factor)

        escalate_s = cfg.escalate_after_s
        #: Request ids aborted by an escalation: their "abort" finishes are not their turn's end.
        escalated: set[str] = set()

        # Late binding (SimConfig.hold_wait_s): the router's hold queue of (key, arrival seq, slot,
        # turn, arrival time); the key is the arrival seq (fcfs) or the turn's priority level.
        hold = cfg.hold_wait_s is not None
        held: list[tuple[int, int, int, int, float]] = []
        held_seq = 0
        #: The turns held now, by their seq (a heap entry whose seq is gone was routed at its bound).
        holding: dict[int, tuple[int, int, float]] = {}
        pick_room = cfg.hold_pick == "room"

        def release(t: float) -> None:
            """Route held turns from the head while some engine has room."""
            while holding:
                rooms = self._rooms()
                if not any(rooms):
                    return
                _, seq, slot, k, sent_s = heapq.heappop(held)
                if holding.pop(seq, None) is None:
                    continue  # routed at its bound already
                engines = (
                    [v for v, room in zip(self.views, rooms, strict=True) if room] if pick_room else None
                )
                place(slot, k, t, sent_s, engines)

        while heap:
            now, _, kind, payload = heapq.heappop(heap)
            if kind == _STEP_DONE:
                i, out = payload
                if staged:
                    self._queue_outputs(i, out, now, reqs, api, push)
                else:
                    self._on_step(i, out, now, reqs, states, ttfts, push)
                for fin in out.finished:
                    if fin.request_id in escalated:  # the turn goes on under its re-sent id
                        escalated.discard(fin.request_id)
                        continue
                    finished += 1
                    if self.tracer is not None:
                        self._cached_by_request[fin.request_id] = fin.cached_tokens_by_tier
                    for t in TIERS:
                        by_tier[t] += fin.cached_tokens_by_tier[t]
                    prompt_total += fin.prompt_tokens
                    output_total += len(fin.output_token_ids)
                    progress.update(finished)
                    if not staged:
                        r = reqs.pop(fin.request_id)
                        last_finish = now
                        after_turn(r.conv_slot, r.turn, now)
                if holding:  # its first tokens and finishes lowered the router's load there
                    release(now)
                if self.cores[i].has_unfinished():
                    start_step(i, now)
                else:
                    busy[i] = False
                if stop_after and all(rid in self._ttft_by_request for rid in stop_after):
                    break
            elif kind == _ARRIVE and router is not None and self.fleet.router_stage is not None:
                # Through the router process first: routed when it has read the request.
                slot, k = payload
                rs = self.fleet.router_stage
                done_s = router.serve(now, rs.request_cost_s(states[slot].conv.turns[k].prompt_tokens))
                push(done_s + rs.stall_draw_s(stage_rng), _ROUTE, (slot, k, now))
            elif kind in (_ARRIVE, _ROUTE):
                slot, k, *sent = payload
                if hold and (holding or not any(self._rooms())):  # no overtaking the hold queue
                    key = self._hold_key(states[slot], k, now, held_seq)
                    if key is not None:
                        heapq.heappush(held, (key, held_seq, slot, k, now))
                        holding[held_seq] = (slot, k, now)
                        if cfg.hold_max_s is not None:
                            push(now + cfg.hold_max_s, _HOLD_DUE, held_seq)
                        held_seq += 1
                        continue
                place(slot, k, now, sent[0] if sent else now)
            elif kind == _AT_CORE:
                r, sim_req = payload
                if not self._admit(r, sim_req, now):
                    del reqs[r.request_id]
                    rejected += 1
                    after_turn(r.conv_slot, r.turn, now)
                elif not busy[r.engine]:
                    start_step(r.engine, now)
            elif kind == _OUT_API:
                # The router reads the engine's output (its first-byte and finish bookkeeping), then
                # relays it through its own process.
                r, ntok, first, fin = payload
                if first:
                    self.core.on_first_token(r.reservation, now)
                    if self.sequences is not None:
                        self.sequences.first_token(r.request_id, now)
                if fin is not None:
                    self._on_finished(r, fin, now)
                done_s = (
                    router.serve(now, self.fleet.router_stage.output_cost_s(ntok))
                    if router is not None and self.fleet.router_stage is not None
                    else now
                )
                push(done_s, _OUT, (r, first, fin is not None))
            elif kind == _OUT:
                r, first, last = payload
                if first:
                    ttfts.append(now - r.arrival_s)
                    self._ttft_by_request[r.request_id] = now - r.arrival_s
                if last:
                    del reqs[r.request_id]
                    last_finish = now
                    after_turn(r.conv_slot, r.turn, now)
            elif kind == _DELIVER:
                i, events = payload
                self.index.apply_batch(self.engine_ids[i], decode_events(events), now)
            elif kind == _START_CONV:
                ci = payload
                conv = convs[ci]
                states[ci] = _Conv(conv)
                active += 1
                for k, turn in enumerate(conv.turns):
                    if turn.at_s is not None:
                        push(now + turn.at_s, _ARRIVE, (ci, k))
                    elif k == 0:
                        push(now, _ARRIVE, (ci, 0))
                if wl.concurrency is None and open_order_pos < len(order):
                    nci = order[open_order_pos]
                    open_order_pos += 1
                    push(max(now, convs[nci].start_s), _START_CONV, nci)
            elif kind == _ESCALATE:
                waiting = reqs.get(payload)
                if waiting is not None and waiting.reservation.first_token_s is None:
                    del reqs[waiting.request_id]
                    escalated.add(waiting.request_id)
                    again = self._escalate(waiting, states[waiting.conv_slot], uses_index, now)
                    if not busy[waiting.engine]:  # it reports the abort in its next step
                        start_step(waiting.engine, now)
                    if again is None:
                        rejected += 1
                        after_turn(waiting.conv_slot, waiting.turn, now)
                    else:
                        reqs[again.request_id] = again
                        if not busy[again.engine]:
                            start_step(again.engine, now)
            elif kind == _HOLD_DUE:
                bound = holding.pop(payload, None)
                if bound is not None:  # still held: routed now, room or not
                    slot, k, sent_s = bound
                    place(slot, k, now, sent_s)
            elif kind == _SCRAPE:
                self._scrape(now)
                if holding:  # the scraped waiting counts are part of the predicted wait
                    release(now)
                if reqs or active or (wl.concurrency is None and open_order_pos < len(order)):
                    push(now + cfg.scrape_interval_s, _SCRAPE, None)
        progress.close()
        if holding and not stop_after:
            raise RuntimeError(f"{len(holding)} turns were still held when the fleet drained")

        ttfts.sort()
        ttft_p50_s, ttft_p90_s, ttft_p99_s, ttft_mean_s = ttft_figures(ttfts)
        total = max(prompt_total, 1)
        hit_tokens = sum(by_tier)
        ideal = ideal_tokens / total if cfg.track_ideal else float("nan")
        mean_routed = sum(routed_tokens) / len(routed_tokens) if routed_tokens else 0.0
        virtual_s = last_finish if last_finish > 0 else 0.0
        preemptions = sum(c.stats().num_preemptions for c in self.cores)
        return SimResult(
            policy=self.policy_name,
            workload=wl.name,
            engines=len(self.cores),
            requests=finished,
            virtual_s=virtual_s,
            ttft_p50_s=ttft_p50_s,
            ttft_p90_s=ttft_p90_s,
            ttft_p99_s=ttft_p99_s,
            ttft_mean_s=ttft_mean_s,
            turns_per_s=finished / virtual_s if virtual_s else 0.0,
            tokens_per_s=(prompt_total + output_total) / virtual_s if virtual_s else 0.0,
            output_tokens_per_s=output_total / virtual_s if virtual_s else 0.0,
            hit_gpu=by_tier[0] / total,
            hit_cpu=by_tier[1] / total,
            hit_storage=by_tier[2] / total,
            miss=1.0 - hit_tokens / total,
            ideal_hit=ideal,
            fraction_of_ideal=(hit_tokens / total) / ideal if cfg.track_ideal and ideal > 0 else float("nan"),
            load_imbalance=max(routed_tokens) / mean_routed if mean_routed else 1.0,
            preemptions=preemptions,
            wall_s=time.perf_counter() - wall0,
            escalations=self._escalations,
            rejected=rejected,
            ttft_over_predicted=self.core.ttft_over_predicted(),
            ttfts_s=ttfts,
            ttft_by_request_s=self._ttft_by_request,
            ttft_split_by_request=self._ttft_split,
            placement=self._placement_outcomes(),
        )

    def _placement_outcomes(self) -> list[dict[str, Any]]:
        """The placement trace's records with each turn's outcome (``SimResult.placement``)."""
        if self.tracer is None:
            return []
        out = []
        for record in self.tracer.records:
            rid = record["rid"]
            row = dict(record)
            row["ttft_s"] = self._ttft_by_request.get(rid, math.nan)
            row["cached"] = list(self._cached_by_request.get(rid, (0, 0, 0)))
            row.setdefault("priority", None)
            split = self._ttft_split.get(rid)
            if split is not None:
                row.update({f"split_{k}": v for k, v in split.items()})
            out.append(row)
        return out

    # -- pieces of the loop ------------------------------------------------------------------

    def _keys_for(self, cs: _Conv, k: int) -> tuple[list[int], list[int] | None]:
        """Router keys of turn k (and its token ids in token mode), extended from the last turn's
        keys when the ids extend them (multi-turn prompts do)."""
        conv = cs.conv
        if self.config.token_mode:
            tokens = conv.prompt_token_ids(k)
            return block_keys(tokens, self._key_block_size), tokens
        ids = conv.turns[k].block_ids
        n = len(cs.ids)
        if n and len(ids) >= n and ids[n - 1] == cs.ids[-1] and ids[:n] == cs.ids:
            keys = cs.keys + block_keys(ids[n:], 1, parent=cs.keys[-1])
        else:
            keys = block_keys(ids, 1)
        cs.ids, cs.keys = list(ids), keys
        return keys, None

    def _route_request(self, cs: _Conv, k: int) -> tuple[RouteRequest, list[int] | None]:
        """Turn ``k``'s RouteRequest (no prefix matches yet) and its token ids in token mode."""
        conv = cs.conv
        turn = conv.turns[k]
        keys, tokens = self._keys_for(cs, k)
        route = RouteRequest(
            request_id=f"{conv.conversation_id}#{k}",
            session_key=conv.conversation_id,
            prompt_tokens=len(tokens) if tokens is not None else turn.prompt_tokens,
            block_keys=keys,
            block_size=self.fleet.block_size,
            expected_output_tokens=turn.output_tokens,
        )
        return route, tokens

    def _route(
        self,
        cs: _Conv,
        slot: int,
        k: int,
        now: float,
        uses_index: bool,
        sent_s: float,
        *,
        admit: bool = True,
        engines: list[EngineView] | None = None,
        escalation: int = 0,
    ) -> tuple[_Req, SimRequest] | None:
        """Route turn ``k`` (sent by the client at ``sent_s``) at ``now`` among ``engines`` (default
        every one); ``admit``: hand it to the engine core now (None if the core refuses it), else the
        caller does (``_admit``). ``escalation`` > 0: an escalated re-send (``_escalate``), numbered
        among the run's escalations: its own request id, priority 0 on a priority engine."""
        turn = cs.conv.turns[k]
        route, tokens = self._route_request(cs, k)
        if escalation:
            route.request_id = f"{route.request_id}!{escalation}"
        keys = route.block_keys
        prompt_tokens = route.prompt_tokens
        request_id = route.request_id
        if uses_index:
            route.prefix_matches = self.index.match(keys)
        if self.clairvoyant is not None:
            chain = HashChain(self.fleet.engines[0].profile.hash_algo, self.hash_cache)
            if tokens is not None:
                bs = self.fleet.block_size
                for b in range(len(tokens) // bs):
                    chain.append(tokens[b * bs : (b + 1) * bs])
            else:
                for block_id in turn.block_ids:
                    chain.append((block_id,))
            self.clairvoyant.hashes = chain.hashes
        if self.config.split_ttft:  # what the fleet held of the turn when it was routed
            matches = route.prefix_matches if uses_index else self.index.match(keys)
            held = RouteRequest(
                request_id=request_id,
                prompt_tokens=prompt_tokens,
                block_size=route.block_size,
                prefix_matches=matches,
            )
            self._cached_fraction.setdefault(request_id, best_cached_fraction(held, prompt_tokens))
        # filter -> score -> reserve: the same calls the router makes.
        self._route_now = now
        cfg = self.config
        self._route_from = sent_s if cfg.hold_aged else now
        self._route_fcfs_factor = priority_fcfs_factor_for(
            route, cfg.priority_fcfs_factor, cfg.priority_recompute_fcfs_factor, cfg.priority_recompute_below
        )
        self._trace_block_ids = turn.block_ids
        reservation = self.core.route(self.policy, route, self.views if engines is None else engines, now)
        engine = self._pos[reservation.engine_id]
        if tokens is not None:
            sim_req = SimRequest(request_id, tokens, max_tokens=turn.output_tokens)
        else:
            sim_req = SimRequest(
                request_id,
                [],
                max_tokens=turn.output_tokens,
                block_ids=turn.block_ids,
                prompt_len=prompt_tokens,
            )
        engine_core = self.cores[engine]
        r = _Req(request_id, slot, k, engine, sent_s, prompt_tokens, reservation)
        if self.sequences is not None:
            self.sequences.place(request_id, reservation.engine_id, prompt_tokens, turn.output_tokens)
        if engine_core.profile.scheduling_policy == "priority":
            sim_req.priority = 0 if escalation else self._priority(reservation.parts, self._route_from)
            if self.tracer is not None:
                self.tracer.records[-1]["priority"] = sim_req.priority
            if self.sequences is not None:
                self.sequences.set_deadline(request_id, sim_req.priority * self.config.priority_step_s, now)
            if self._priority_ahead:
                self.ledger.set_priority(
                    reservation.ticket, sim_req.priority, now / self.config.priority_step_s
                )
        queued_turns = self._queued_turns.get(reservation.engine_id)
        if queued_turns is not None:
            hits = reservation.parts.hit_tokens
            by_priority = engine_core.profile.scheduling_policy == "priority"
            deadline = sim_req.priority * cfg.priority_step_s if by_priority else math.inf
            queued_turns[request_id] = (deadline, hits[0] + hits[1], reservation.ticket)
        if admit and not self._admit(r, sim_req, now):
            return None
        return r, sim_req

    def _escalate(self, r: _Req, cs: _Conv, uses_index: bool, now: float) -> _Req | None:
        """Escalation (``SimConfig.escalate_after_s``): abort ``r`` on its engine, now or at its first
        token (``SimConfig.escalate_abort``; its computed full blocks stay cached there), release it
        in the router as a request whose client left, and send the turn again at priority 0 to
        ``SimConfig.escalate_pick``; its TTFT still counts from ``r.arrival_s``. None if the engine
        refuses the re-sent request."""
        if self.config.escalate_abort == "now":
            self.cores[r.engine].abort_request(r.request_id)
        else:  # the engine finds the connection closed when it writes the first token
            self._ghosts.add(r.request_id)
        self.core.on_finished(r.reservation, Outcome(ok=False, client_gone=True), now)
        if self.sequences is not None:
            self.sequences.finish(r.request_id, now)
        self._escalations += 1
        pick = self.config.escalate_pick
        engines: list[EngineView] | None = None  # "route": every engine
        if pick == "same":
            engines = [self.views[r.engine]]
        elif pick == "other":
            engines = other_engines(self.views, self.engine_ids[r.engine])
        routed = self._route(
            cs,
            r.conv_slot,
            r.turn,
            now,
            uses_index,
            r.arrival_s,
            engines=engines,
            escalation=self._escalations,
        )
        if routed is None:
            return None
        self._turn_of[routed[0].request_id] = self._turn_of.pop(r.request_id, r.request_id)
        return routed[0]

    def _rooms(self) -> list[bool]:
        """Per engine: whether it has room now (``policies.costs.has_room`` on the router's load)."""
        limit = self.config.hold_wait_s
        assert limit is not None
        views = self.core.refresh(self._no_request, self.views)
        return [has_room(self.costs.estimates(v.engine_id), v, limit) for v in views]

    def _hold_key(self, cs: _Conv, k: int, now: float, seq: int) -> int | None:
        """The hold queue's key of turn ``k`` arriving at ``now`` as the ``seq``-th held turn: ``seq``
        (fcfs) or the shortest-first priority (``_priority``) of its parts before it is bound to an
        engine (``hold_parts``); None when it is not held (``hold_recompute_below``: a cached turn)."""
        cfg = self.config
        below = cfg.hold_recompute_below
        if below is None and cfg.hold_order == "fcfs":
            return seq
        route, _ = self._route_request(cs, k)
        route.prefix_matches = self.index.match(route.block_keys)
        if below is not None and best_cached_fraction(route, route.prompt_tokens) >= below:
            return None
        if cfg.hold_order == "fcfs":
            return seq
        self._route_fcfs_factor = priority_fcfs_factor_for(
            route, cfg.priority_fcfs_factor, cfg.priority_recompute_fcfs_factor, cfg.priority_recompute_below
        )
        return self._priority(hold_parts(route, self.costs, self.engine_ids), now)

    def _admit(self, r: _Req, sim_req: SimRequest, now: float) -> bool:
        """Hand the request to its engine core; False if the core refuses it."""
        try:
            self.cores[r.engine].add_request(sim_req)
        except ValueError:
            # A real engine answers 400; the router counts the failure and the client moves on.
            self.core.on_finished(r.reservation, Outcome(ok=False), now)
            if self.sequences is not None:
                self.sequences.finish(r.request_id, None)
            return False
        return True

    def _queue_outputs(
        self,
        i: int,
        out: StepOutput,
        now: float,
        reqs: dict[str, _Req],
        api: list[FifoServer],
        push: Callable[[float, int, Any], None],
    ) -> None:
        """Server stages: each request's tokens of this step go through engine ``i``'s API server
        (one job per request and step) before the router reads them."""
        finished = {f.request_id: f for f in out.finished}
        stage = self.fleet.api_server
        for rid in dict.fromkeys([*out.new_token_ids, *finished]):
            r = reqs.get(rid)
            if r is None:
                continue
            ntok = len(out.new_token_ids.get(rid, ()))
            first = ntok > 0 and not r.emitted
            r.emitted = r.emitted or ntok > 0
            done_s = api[i].serve(now, stage.output_cost_s(ntok)) if stage is not None else now
            push(done_s, _OUT_API, (r, ntok, first, finished.get(rid)))
        if out.events:
            push(now + self.config.event_delay_s, _DELIVER, (i, out.events))

    def _on_finished(self, r: _Req, fin: FinishedRequest, now: float) -> None:
        outcome = Outcome(
            ok=fin.finish_reason != "abort",
            cached_tokens=fin.cached_tokens,
            prompt_tokens=fin.prompt_tokens,
        )
        self.core.on_finished(r.reservation, outcome, now)
        if self.sequences is not None:
            self.sequences.finish(r.request_id, now)

    def _on_step(
        self,
        i: int,
        out: StepOutput,
        now: float,
        reqs: dict[str, _Req],
        states: dict[int, _Conv],
        ttfts: list[float],
        push: Callable[[float, int, Any], None],
    ) -> None:
        core = self.core
        for rid, toks in out.new_token_ids.items():
            if not toks:
                continue
            if rid in self._ghosts:  # an escalated turn's first request: its write fails
                self._ghosts.discard(rid)
                self.cores[i].abort_request(rid)
                continue
            r = reqs.get(rid)
            if r is not None and r.reservation.first_token_s is None:
                core.on_first_token(r.reservation, now)
                if self.sequences is not None:
                    self.sequences.first_token(rid, now)
                ttfts.append(now - r.arrival_s)
                turn_id = self._turn_of.pop(rid, rid)  # an escalated turn: its first id
                self._ttft_by_request[turn_id] = now - r.arrival_s
                records = self.cores[i].wait_records
                if records is not None:
                    split = ttft_split(records.pop(rid), r.arrival_s, r.reservation.parts)
                    split[SPLIT_CACHED_FRACTION_KEY] = self._cached_fraction.pop(turn_id, 0.0)
                    self._ttft_split[turn_id] = split
        for fin in out.finished:
            r = reqs.get(fin.request_id)
            if r is not None:  # None: aborted by an escalation (``_escalate`` released it)
                self._on_finished(r, fin, now)
        if out.events:
            push(now + self.config.event_delay_s, _DELIVER, (i, out.events))

    def _scrape(self, now: float) -> None:
        """What the router's /metrics scraper would see: queue gauges and offload counters."""
        # An engine that has not stepped since the last scrape shows the same gauges and counters.
        stepped, self._stepped = self._stepped, set()
        for i in sorted(stepped):
            core = self.cores[i]
            view = self.views[i]
            view.num_requests_running = core.num_running()
            view.num_requests_waiting = core.num_waiting()
            view.kv_cache_usage = core.gpu.num_used() / core.gpu.num_blocks
            if self.config.calibrate:
                stats = core.stats()
                self.costs.update_offload_counters(
                    core.engine_id,
                    {
                        Tier.CPU: stats.load_bytes_by_tier.get("CPU", 0),
                        Tier.STORAGE: stats.load_bytes_by_tier.get("STORAGE", 0),
                    },
                    {
                        Tier.CPU: stats.load_time_s_by_tier.get("CPU", 0.0),
                        Tier.STORAGE: stats.load_time_s_by_tier.get("STORAGE", 0.0),
                    },
                    now,
                )

    def _slow_down(self, engine_id: str, factor: float) -> None:
        core = self.cores[self._pos[engine_id]]
        # The engine computes its storage bandwidth once at construction; a noisy neighbour changes
        # the real figure underneath it, which is exactly what the router cannot see.
        core._storage_bw /= factor
        core.profile.storage_load_bytes_per_s /= factor


def _with_seed(name: str, params: dict[str, Any] | None, seed: int) -> dict[str, Any]:
    """The policy's params plus ``seed`` when its factory takes one: policies that break ties at
    random default to an OS-seeded generator, which would make runs irreproducible."""
    import inspect

    from policies.base import REGISTRY

    out = dict(params or {})
    factory = REGISTRY.get(name)
    if factory is not None and "seed" not in out:
        try:
            if "seed" in inspect.signature(factory).parameters:
                out["seed"] = seed
        except (TypeError, ValueError):
            pass
    return out


class _Progress:
    """Reports one run's finished requests to the sweep's single progress bar: ``_Progress.sink``
    (set by ``main`` in this process or, with --jobs, in each worker) gets the newly finished count
    at most every 0.2 s, and the rest up to ``total`` at ``close``. Without a sink (tests, the
    Python API) nothing is drawn."""

    #: Called with a count of newly finished requests; None = no progress reporting.
    sink: Callable[[int], None] | None = None

    def __init__(self, total: int, *, enabled: bool, label: str) -> None:
        self.total = max(total, 0)
        self.enabled = enabled and _Progress.sink is not None
        self.label = label
        self._reported = 0
        self._last_s = 0.0

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_s < 0.2:
            return
        self._last_s = now
        self._report(min(done, self.total))

    def _report(self, done: int) -> None:
        if done > self._reported and _Progress.sink is not None:
            _Progress.sink(done - self._reported)
            self._reported = done

    def close(self) -> None:
        # Rejected or unfinished requests still count: the sweep's bar advances by exactly ``total``.
        if self.enabled:
            self._report(self.total)


def simulate(
    workload: Workload,
    policy: str | Policy,
    fleet: FleetSpec,
    config: SimConfig | None = None,
    *,
    policy_params: dict[str, Any] | None = None,
) -> SimResult:
    """Run one workload through one policy on a fresh fleet (engines, index, cost model)."""
    return FleetSimulator(workload, policy, fleet, config, policy_params=policy_params).run()
