"""Offline fleet simulator: N sim/engine.py EngineCores in virtual time behind any routing policy.

A discrete-event simulation (heap of (time, seq, event)) that drives the router's own routing core
(``kvcore.core.RoutingCore``: candidate filter and large-fleet pre-filter, the policy, load ledger,
speculation, calibration, self-check) with the PrefixIndex fed by the engines' KV events after a
configurable delay, and reports TTFT, throughput, hit rate by tier against the ideal (infinite
shared cache). Deterministic for a given seed. CLI: ``main(argv)``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import heapq
import json
import math
import os
import random
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcore.calibration import CostModel
from kvcore.core import (
    PRIORITY_MAX_OVERTAKE_S,
    PRIORITY_STEP_S,
    PRIORITY_STRETCH,
    SCHEDULING_POLICIES,
    CoreConfig,
    InMemoryLoadLedger,
    Outcome,
    Reservation,
    RoutingCore,
    check_priority_max_overtake,
    check_priority_stretch,
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
from policies.costs import EngineCosts
from sim.cache import StoragePool
from sim.engine import EngineCore, EngineProfile, SimRequest, StepOutput
from sim.hashing import BlockHashCache, HashChain
from sim.oracle import ClairvoyantPolicy
from sim.workloads import (
    DATA_TRACES,
    NAMED_TRACES,
    Conversation,
    LadderConfig,
    Workload,
    agentic_workload,
    ladder_workload,
    mooncake_workload,
    read_agentic_sessions,
    read_mooncake_records,
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


# ------------------------------------------------------------------------------------ fleet


@dataclass(slots=True)
class EngineSpec:
    engine_id: str
    profile: EngineProfile


#: Capacity that never fills (an "unbounded" pool): far above any workload's distinct blocks.
UNBOUNDED_STORAGE_BLOCKS = 1 << 40

#: Aggregate bandwidth of the shared pool per mounting engine, as a fraction of one engine's own
#: storage read rate: the pool (a shared filesystem of a few servers) moves half of what all its
#: clients' links could. An assumption, not a published figure: ``--storage-bandwidth`` sets it.
SHARED_POOL_BANDWIDTH_PER_ENGINE = 0.5


@dataclass(slots=True)
class FleetSpec:
    """The simulated engines and their shared STORAGE pool."""

    engines: list[EngineSpec]
    storage_pool_blocks: int = 0  # 0 = no shared storage tier
    storage_load_bytes_per_s: float | None = None  # None = each engine's profile figure
    storage_latency_s: float | None = None
    #: The pool's aggregate bandwidth (reads and writes of all engines); None = no shared limit.
    storage_shared_bytes_per_s: float | None = None
    #: The pool's writers publish BlockRemoved(STORAGE) for what it evicts, as vLLM's offloading
    #: connectors do; False models a shared fs directory nobody announces removals for (llm-d's).
    storage_announces_removals: bool = True
    #: Heterogeneous fleet: at this fraction of the workload's requests, divide this engine's
    #: storage bandwidth by ``slowdown_factor`` (a noisy neighbour). None = never.
    slowdown_engine: str | None = None
    slowdown_at_fraction: float = 0.5
    slowdown_factor: float = 4.0

    @property
    def block_size(self) -> int:
        return self.engines[0].profile.block_size


def b1_fleet(
    num_engines: int = 4,
    *,
    block_size: int = 16,
    conversations_in_hbm: float = 64,
    mean_conversation_tokens: float = LadderConfig().mean_prompt_tokens(),
    cpu_ratio: float = 2.0,
    storage_blocks: int | None = None,
    storage_shared_bytes_per_s: float | str | None = "default",
    hetero: bool = False,
    base: EngineProfile | None = None,
    engine_model: str = "vllm",
    engine_variation: float = 0.0,
    variation_seed: int = 0,
) -> FleetSpec:
    """The B1 fleet: GPU pools sized so the fleet's HBM holds ``conversations_in_hbm`` average
    conversations, CPU tier ``cpu_ratio`` x GPU per engine, one shared STORAGE pool.

    ``storage_blocks``: None = unbounded (never fills), 0 = no storage tier, N = N blocks
    (``storage_blocks_for`` turns "1/4" of a workload's working set into blocks).
    ``storage_shared_bytes_per_s``: the pool's aggregate bandwidth; "default" =
    SHARED_POOL_BANDWIDTH_PER_ENGINE x engines x one engine's read rate, None = no shared limit.
    ``engine_model``: "vllm" (asynchronous loads, context-dependent costs) or "legacy" (the model
    before issue 16: loads stall the step, context-free costs, no shared pool bandwidth).
    ``engine_variation``: each engine's prefill rate and load bandwidths are scaled by a factor drawn
    uniformly in [1 - v, 1 + v] (seeded by ``variation_seed``); the router is not told.
    ``hetero`` (B1b): engines 2 and 3 load CPU at 1/4 PCIe 5 speed, engine 1 reads storage 4x
    slower, and halfway through engine 0's storage slows down 4x (noisy neighbour)."""
    if num_engines < 1:
        raise ValueError("--engines must be >= 1")
    if storage_blocks is not None and storage_blocks < 0:
        raise ValueError(f"storage_blocks must be >= 0 (0 = no storage tier), got {storage_blocks}")
    if engine_model not in ENGINE_MODELS:
        raise ValueError(f"engine_model {engine_model!r} is unknown; accepted: {', '.join(ENGINE_MODELS)}")
    if not 0 <= engine_variation < 1:
        raise ValueError(f"engine_variation must be in [0, 1), got {engine_variation}")
    base = base or EngineProfile()
    if engine_model == "legacy":
        base = base.legacy_model()
    gpu_blocks = max(8, math.ceil(conversations_in_hbm * mean_conversation_tokens / num_engines / block_size))
    cpu_blocks = int(gpu_blocks * cpu_ratio)
    profile = dataclasses.replace(
        base, block_size=block_size, num_gpu_blocks=gpu_blocks, num_cpu_blocks=cpu_blocks
    )
    specs = [EngineSpec(f"e{i}", dataclasses.replace(profile)) for i in range(num_engines)]
    if storage_shared_bytes_per_s == "default":
        shared: float | None = (
            None
            if engine_model == "legacy"
            else SHARED_POOL_BANDWIDTH_PER_ENGINE * num_engines * base.storage_load_bytes_per_s
        )
    elif storage_shared_bytes_per_s is None or isinstance(storage_shared_bytes_per_s, float | int):
        shared = storage_shared_bytes_per_s
        if shared is not None and not shared > 0:
            raise ValueError(f"storage_shared_bytes_per_s must be positive or None, got {shared}")
    else:
        raise ValueError(
            f"storage_shared_bytes_per_s {storage_shared_bytes_per_s!r}: a number, None or 'default'"
        )
    fleet = FleetSpec(
        specs,
        storage_pool_blocks=UNBOUNDED_STORAGE_BLOCKS if storage_blocks is None else storage_blocks,
        storage_shared_bytes_per_s=shared,
    )
    if engine_variation:
        rng = random.Random(f"variation:{variation_seed}")
        for spec in specs:
            p = spec.profile
            p.prefill_tokens_per_s *= rng.uniform(1 - engine_variation, 1 + engine_variation)
            p.cpu_load_bytes_per_s *= rng.uniform(1 - engine_variation, 1 + engine_variation)
            p.storage_load_bytes_per_s *= rng.uniform(1 - engine_variation, 1 + engine_variation)
    if hetero:
        for i, spec in enumerate(specs):
            if i % 4 in (2, 3):
                spec.profile.cpu_load_bytes_per_s = spec.profile.cpu_load_bytes_per_s / 4
            if i % 4 == 1:
                spec.profile.storage_load_bytes_per_s = spec.profile.storage_load_bytes_per_s / 4
        fleet.slowdown_engine = specs[0].engine_id
    return fleet


ENGINE_MODELS = ("vllm", "legacy")
ROUTER_PRIORS = ("defaults", "nominal")


def working_set_blocks(workload: Workload) -> int:
    """Distinct blocks the workload's prompts hold: what a pool must keep to miss nothing."""
    seen: set[int] = set()
    for conv in workload.conversations:
        for turn in conv.turns:
            seen.update(turn.block_ids)
    return len(seen)


def parse_storage(text: str) -> str:
    """Validate one ``--storage`` value: "none", "unbounded", a block count, or a fraction of the
    working set ("1/4", "0.25"). Returns it normalised; ValueError says what is accepted."""
    value = text.strip().lower()
    if value in ("none", "unbounded"):
        return value
    try:
        if "/" in value:
            num, _, den = value.partition("/")
            fraction = float(num) / float(den)
        elif "." in value or "e" in value:
            fraction = float(value)
        else:
            blocks = int(value)
            if blocks < 1:
                raise ValueError
            return str(blocks)
    except (ValueError, ZeroDivisionError):
        raise ValueError(
            f"--storage {text!r}: accepted values are none, unbounded, a block count (e.g. 500000) "
            "or a fraction of the working set (e.g. 1/4 or 0.25)"
        ) from None
    if not 0 < fraction <= 1:
        raise ValueError(f"--storage {text!r}: a fraction of the working set must be in (0, 1]")
    return value


def storage_blocks_for(spec: str, working_set: int) -> int | None:
    """Pool capacity for a ``parse_storage`` value: None = unbounded, 0 = no storage tier."""
    value = parse_storage(spec)
    if value == "none":
        return 0
    if value == "unbounded":
        return None
    if "/" in value or "." in value or "e" in value:
        num, _, den = value.partition("/")
        fraction = float(num) / float(den) if den else float(num)
        return max(1, round(fraction * working_set))
    return int(value)


def prior_costs(profile: EngineProfile) -> EngineCosts:
    """What a router operator would configure from the data sheet (the homogeneous nominal fleet)."""
    return EngineCosts(
        prefill_tokens_per_s=profile.prefill_tokens_per_s,
        load_bandwidth_bytes_per_s=(math.inf, profile.cpu_load_bytes_per_s, profile.storage_load_bytes_per_s),
        load_latency_s=(0.0, profile.cpu_latency_s, profile.storage_latency_s),
        kv_bytes_per_token=profile.kv_bytes_per_token,
    )


#: EngineProfile fields a profile file may not set: the fleet options set them.
_FLEET_SET_FIELDS = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "scheduling_policy", "counter_noise")


def load_engine_profile(path: str | Path) -> dict[str, Any]:
    """EngineProfile fields from a JSON file: an object of fields, or one under "engine_profile"
    (what loadtest/calibrate_vllm.py writes). Unknown fields and the fleet-set ones are refused."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--engine-profile {path}: {exc}") from exc
    fields = doc.get("engine_profile", doc) if isinstance(doc, dict) else None
    if not isinstance(fields, dict):
        raise ValueError(f"--engine-profile {path}: a JSON object of EngineProfile fields expected")
    known = {f.name for f in dataclasses.fields(EngineProfile)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"--engine-profile {path}: unknown EngineProfile fields {', '.join(unknown)}")
    fleet_set = sorted(set(fields) & set(_FLEET_SET_FIELDS))
    if fleet_set:
        raise ValueError(f"--engine-profile {path}: {', '.join(fleet_set)} are set by the fleet options")
    EngineProfile(**fields)  # the profile's own validation, with its messages
    return fields


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
    #: Engines whose profile has ``scheduling_policy="priority"`` get each request's
    #: ``shortest_first_priority`` (levels of ``priority_step_s`` seconds, deadlines stretched by
    #: ``priority_stretch`` and never more than ``priority_max_overtake_s`` after placement; virtual
    #: time is the clock), as the router sends them.
    priority_step_s: float = PRIORITY_STEP_S
    priority_stretch: float = PRIORITY_STRETCH
    priority_max_overtake_s: float = PRIORITY_MAX_OVERTAKE_S


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

    @property
    def hit(self) -> float:
        return self.hit_gpu + self.hit_cpu + self.hit_storage

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("ttfts_s")
        d.pop("ttft_by_request_s")
        d["hit"] = self.hit
        return d


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
        self.costs = (
            CostModel(prior_costs(fleet.engines[0].profile))
            if cfg.router_priors == "nominal"
            else CostModel()
        )
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
        )
        # Trace mode keys: one pseudo-token per block id (block_size 1), as the engine's events.
        self._key_block_size = fleet.block_size if cfg.token_mode else 1

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

        while heap:
            now, _, kind, payload = heapq.heappop(heap)
            if kind == _STEP_DONE:
                i, out = payload
                self._on_step(i, out, now, reqs, states, ttfts, push)
                for fin in out.finished:
                    r = reqs.pop(fin.request_id)
                    finished += 1
                    last_finish = now
                    for t in TIERS:
                        by_tier[t] += fin.cached_tokens_by_tier[t]
                    prompt_total += fin.prompt_tokens
                    output_total += len(fin.output_token_ids)
                    progress.update(finished)
                    after_turn(r.conv_slot, r.turn, now)
                if self.cores[i].has_unfinished():
                    start_step(i, now)
                else:
                    busy[i] = False
            elif kind == _ARRIVE:
                slot, k = payload
                cs = states[slot]
                turn = cs.conv.turns[k]
                routed = self._route(cs, slot, k, now, uses_index)
                if routed is None:  # the engine refused it (too long for its pool / model length)
                    rejected += 1
                    after_turn(slot, k, now)
                    continue
                r = routed
                reqs[r.request_id] = r
                arrived += 1
                routed_tokens[r.engine] += r.prompt_tokens
                if cfg.track_ideal:
                    n = 0
                    for b in turn.block_ids:
                        if b not in seen_ids:
                            break
                        n += 1
                    seen_ids.update(turn.block_ids)
                    ideal_tokens += min(n * wl.block_size, max_hit_tokens(turn.prompt_tokens))
                if not busy[r.engine]:
                    start_step(r.engine, now)
                if not slowed and self.fleet.slowdown_engine is not None and arrived >= slowdown_at:
                    slowed = True
                    self._slow_down(self.fleet.slowdown_engine, self.fleet.slowdown_factor)
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
            elif kind == _SCRAPE:
                self._scrape(now)
                if reqs or active or (wl.concurrency is None and open_order_pos < len(order)):
                    push(now + cfg.scrape_interval_s, _SCRAPE, None)
        progress.close()

        ttfts.sort()
        ttft_p50_s, ttft_p90_s, ttft_p99_s = percentiles(ttfts, (50, 90, 99), empty=0.0)
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
            ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
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
            rejected=rejected,
            ttft_over_predicted=self.core.ttft_over_predicted(),
            ttfts_s=ttfts,
            ttft_by_request_s=self._ttft_by_request,
        )

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

    def _route(self, cs: _Conv, slot: int, k: int, now: float, uses_index: bool) -> _Req | None:
        conv = cs.conv
        turn = conv.turns[k]
        keys, tokens = self._keys_for(cs, k)
        prompt_tokens = len(tokens) if tokens is not None else turn.prompt_tokens
        request_id = f"{conv.conversation_id}#{k}"
        route = RouteRequest(
            request_id=request_id,
            session_key=conv.conversation_id,
            prompt_tokens=prompt_tokens,
            block_keys=keys,
            block_size=self.fleet.block_size,
            expected_output_tokens=turn.output_tokens,
        )
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
        # filter -> score -> reserve: the same calls the router makes.
        reservation = self.core.route(self.policy, route, self.views, now)
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
        if engine_core.profile.scheduling_policy == "priority":
            sim_req.priority = shortest_first_priority(
                reservation.parts,
                self.config.priority_step_s,
                now_s=now,
                stretch=self.config.priority_stretch,
                max_overtake_s=self.config.priority_max_overtake_s,
            )
        try:
            engine_core.add_request(sim_req)
        except ValueError:
            # A real engine answers 400; the router counts the failure and the client moves on.
            self.core.on_finished(reservation, Outcome(ok=False), now)
            return None
        return _Req(request_id, slot, k, engine, now, prompt_tokens, reservation)

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
            r = reqs.get(rid)
            if r is not None and r.reservation.first_token_s is None:
                core.on_first_token(r.reservation, now)
                ttfts.append(now - r.arrival_s)
                self._ttft_by_request[rid] = now - r.arrival_s
        for fin in out.finished:
            r = reqs[fin.request_id]
            outcome = Outcome(
                ok=fin.finish_reason != "abort",
                cached_tokens=fin.cached_tokens,
                prompt_tokens=fin.prompt_tokens,
            )
            core.on_finished(r.reservation, outcome, now)
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


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------- CLI


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _storage_list(text: str) -> list[str]:
    try:
        values = [parse_storage(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values:
        raise argparse.ArgumentTypeError("--storage needs at least one value")
    return values


def _storage_bandwidth(text: str) -> float | str | None:
    value = text.strip().lower()
    if value in ("default", "none"):
        return None if value == "none" else "default"
    try:
        bandwidth = float(value)
    except ValueError:
        bandwidth = -1.0
    if not bandwidth > 0:
        raise ValueError(
            f"--storage-bandwidth {text!r}: accepted values are default, none or bytes per second > 0"
        )
    return bandwidth


def _fleet_options(args: argparse.Namespace) -> dict[str, Any]:
    """b1_fleet keyword arguments from the fleet CLI options (storage size aside)."""
    if not 0 <= args.engine_variation < 1:
        raise ValueError(f"--engine-variation must be in [0, 1), got {args.engine_variation}")
    if args.counter_noise < 0:
        raise ValueError(f"--counter-noise must be >= 0, got {args.counter_noise}")
    return {
        "storage_shared_bytes_per_s": _storage_bandwidth(args.storage_bandwidth),
        "engine_model": args.engine_model,
        "engine_variation": args.engine_variation,
        "variation_seed": args.seed,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute sim",
        description="Discrete-event simulation of a simulated-vLLM fleet behind routing policies "
        "(virtual time, deterministic for a seed).",
    )
    src = p.add_argument_group("workload")
    src.add_argument(
        "--workload", default="ladder", choices=["ladder"], help="synthetic workload (default ladder)"
    )
    src.add_argument(
        "--trace",
        help="replay a trace instead: a Mooncake JSONL file, an agentic-session directory / JSON file, or "
        "a trace the repository carries: "
        + ", ".join(
            f"{name} ({path.relative_to(DATA_TRACES.parent.parent)})" for name, path in NAMED_TRACES.items()
        ),
    )
    src.add_argument(
        "--trace-format",
        choices=["mooncake", "agentic"],
        help="default: agentic for a directory or .json, mooncake otherwise",
    )
    src.add_argument("--speed", type=float, default=1.0, help="trace time compression (2 = twice as fast)")
    src.add_argument("--limit", type=int, help="trace: first N requests (Mooncake) or sessions (agentic)")
    src.add_argument("--stagger-s", type=float, default=30.0, help="agentic: start offset between sessions")
    src.add_argument(
        "--concurrency",
        type=_int_list,
        default=[16, 32, 64],
        help="ladder: comma-separated concurrent conversations (default 16,32,64: with the 8 default "
        "policies about 2 CPU-minutes, 1-2 minutes on 2 cores; the B1 figures use 16,32,64,128,256)",
    )
    src.add_argument(
        "--conversations",
        type=float,
        default=2.0,
        help="ladder: conversations per run as a multiple of the concurrency (default 2)",
    )
    src.add_argument("--turns", type=int, default=8)
    src.add_argument("--first-prompt-tokens", type=int, default=12_000)
    src.add_argument("--system-tokens", type=int, default=1_000)
    src.add_argument("--tokens-per-turn", type=int, default=4_000)
    src.add_argument("--answer-tokens", default="200,500", help="ladder: min,max answer tokens")
    src.add_argument("--think-time-s", type=float, default=10.0, help="ladder: mean exponential think time")
    src.add_argument(
        "--block-size",
        type=int,
        default=64,
        help="ladder: tokens per KV block (engines and block ids; default 64: token counts and timings "
        "stay full size, the per-block work is 4x less than vLLM's 16); larger = faster, coarser",
    )
    fl = p.add_argument_group("fleet")
    fl.add_argument("--engines", type=_int_list, default=[4], help="engine counts (comma-separated)")
    fl.add_argument(
        "--fleet",
        choices=["b1", "hetero"],
        default="b1",
        help="b1 = homogeneous; hetero = B1b (slow CPU on 2 engines, slow storage on 1, "
        "noisy neighbour halfway)",
    )
    fl.add_argument(
        "--hbm-conversations",
        type=float,
        default=64.0,
        help="ladder: size GPU pools so the fleet's HBM holds this many average conversations",
    )
    fl.add_argument(
        "--storage",
        type=_storage_list,
        default=["unbounded"],
        help="shared STORAGE pool size, comma-separated for a sweep: none, unbounded, a block count, "
        "or a fraction of the workload's working set (1/4, 0.5). Default unbounded",
    )
    fl.add_argument(
        "--storage-bandwidth",
        default="default",
        help="the shared pool's aggregate bytes/s (reads + writes of all engines), 'none' for no shared "
        f"limit; default {SHARED_POOL_BANDWIDTH_PER_ENGINE:g} x engines x one engine's storage read rate",
    )
    fl.add_argument(
        "--engine-model",
        choices=ENGINE_MODELS,
        default="vllm",
        help="vllm = asynchronous KV loads + context-dependent costs (docs/simulator.md); legacy = the "
        "model before issue 16 (loads stall the step), for before/after comparisons",
    )
    fl.add_argument(
        "--engine-variation",
        type=float,
        default=0.1,
        help="each engine's prefill rate and bandwidths scaled by a seeded factor in [1-v, 1+v] the "
        "router is not told (default 0.1; 0 = identical engines)",
    )
    fl.add_argument(
        "--counter-noise",
        type=float,
        default=0.2,
        help="log-normal sigma of the noise on the engines' offload time counters (default 0.2)",
    )
    fl.add_argument(
        "--engine-profile",
        help="JSON file of EngineProfile time fields (step_overhead_s, prefill_tokens_per_s, ...), e.g. "
        "the fit python -m loadtest.calibrate_vllm writes; default: the H100 figures (docs/simulator.md)",
    )
    fl.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="the engines' vLLM --scheduling-policy; priority: the router sends each request's "
        "predicted own service as its priority (shortest work first; docs/routing.md)",
    )
    fl.add_argument(
        "--priority-stretch",
        type=float,
        default=PRIORITY_STRETCH,
        help="priority engines: a request's deadline is this many times its own predicted service "
        f"after placement (default {PRIORITY_STRETCH:g}; larger = more shortest-first, 0 = arrival order)",
    )
    fl.add_argument(
        "--priority-max-overtake-s",
        type=float,
        default=PRIORITY_MAX_OVERTAKE_S,
        help="priority engines: no request is overtaken by one placed more than this many seconds "
        f"after it (default {PRIORITY_MAX_OVERTAKE_S:g}; inf = no bound)",
    )
    fl.add_argument(
        "--gpu-tokens",
        type=int,
        default=27_852 * 16,
        help="traces: GPU KV pool per engine in tokens (default one H100, Llama-3-8B)",
    )
    pol = p.add_argument_group("router")
    pol.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated policy names (registered ones, plus 'clairvoyant')",
    )
    pol.add_argument("--event-delay-ms", type=float, default=5.0, help="KV event delivery delay")
    pol.add_argument(
        "--router-priors",
        choices=ROUTER_PRIORS,
        default="defaults",
        help="the cost model's starting point: the router's configured defaults, or the fleet's "
        "nominal engine profile (the old what-if)",
    )
    pol.add_argument("--speculate-ttl-s", type=float, default=2.0)
    pol.add_argument("--scrape-interval-s", type=float, default=1.0)
    pol.add_argument(
        "--no-calibrate", action="store_true", help="do not feed simulated TTFTs to the cost model"
    )
    pol.add_argument(
        "--queue-whole-prompt",
        action="store_true",
        help="what-if (old router accounting): queue whole prompts as pending prefill, not the "
        "predicted uncached tokens",
    )
    pol.add_argument(
        "--no-ideal", action="store_true", help="skip the ideal hit rate (it keeps a set of every block id)"
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--out",
        help="directory for results.jsonl / results.md / results.json (written as each run finishes) "
        "and PNG plots (hits by tier; TTFT and throughput against concurrency)",
    )
    out.add_argument("--seed", type=int, default=0)
    out.add_argument(
        "--jobs", type=int, default=None, help="runs in parallel processes (default: one per CPU core)"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


@dataclass(slots=True)
class _RunSpec:
    label: str
    workload: Workload
    fleet: FleetSpec
    policy: str
    config: SimConfig
    #: Policy parameters parsed from "name:key=value:..." (the run is labelled with the whole spec).
    params: dict[str, Any] = field(default_factory=dict)
    spec: str = ""


_CREDIT_KEYS = ("gpu", "cpu", "storage")


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"tier_cost:work_weight=0.5"`` -> ("tier_cost", {"work_weight": 0.5}). Values are numbers;
    for kv_fixed_credit the keys gpu/cpu/storage set its per-tier credits."""
    name, *pairs = spec.split(":")
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"policy spec {spec!r}: expected key=value after ':', got {pair!r}")
        try:
            number: float | int = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise ValueError(f"policy spec {spec!r}: {key} must be a number, got {value!r}") from None
        if name == "kv_fixed_credit" and key in _CREDIT_KEYS:
            params.setdefault("credits", {})[key] = number
        else:
            params[key] = number
    return name, params


def _plan(args: argparse.Namespace) -> tuple[list[_RunSpec], str]:
    specs = [x.strip() for x in args.policies.split(",") if x.strip()]
    import policies as _registry  # noqa: F401  (fills the registry)
    from policies.base import REGISTRY

    parsed = [(spec, *parse_policy_spec(spec)) for spec in specs]
    profile_fields = load_engine_profile(args.engine_profile) if args.engine_profile else {}
    unknown = [name for _, name, _ in parsed if name != "clairvoyant" and name not in REGISTRY]
    if unknown:
        raise ValueError(
            f"unknown policies {unknown}; accepted: {', '.join(sorted([*REGISTRY, 'clairvoyant']))}"
        )
    for spec, name, params in parsed:
        if name != "clairvoyant":
            try:  # a bad parameter fails now, with the valid ones listed, not in the middle of a sweep
                build_policy(name, params)
            except ValueError as exc:
                raise ValueError(f"--policies {spec}: {exc}") from None
    config = SimConfig(
        seed=args.seed,
        event_delay_s=args.event_delay_ms / 1000.0,
        speculate_ttl_s=args.speculate_ttl_s,
        scrape_interval_s=args.scrape_interval_s,
        calibrate=not args.no_calibrate,
        track_ideal=not args.no_ideal,
        queue_whole_prompt=args.queue_whole_prompt,
        progress=not args.no_progress,
        router_priors=args.router_priors,
        priority_stretch=args.priority_stretch,
        priority_max_overtake_s=args.priority_max_overtake_s,
    )
    check_priority_stretch(args.priority_stretch, "--priority-stretch")
    check_priority_max_overtake(args.priority_max_overtake_s, "--priority-max-overtake-s")
    fleet_options = _fleet_options(args)
    storage_values: list[str] = args.storage

    def storage_label(label: str, storage: str) -> str:
        return label if len(storage_values) == 1 else f"{label} s={storage}"

    runs: list[_RunSpec] = []
    hetero = args.fleet == "hetero"
    if args.trace:
        path = NAMED_TRACES.get(args.trace, Path(args.trace))
        if not path.exists():
            raise ValueError(
                f"--trace {args.trace}: no such file or directory; named traces: {', '.join(NAMED_TRACES)}"
            )
        fmt = args.trace_format or ("agentic" if path.is_dir() or path.suffix == ".json" else "mooncake")
        if fmt == "mooncake":
            wl = mooncake_workload(
                read_mooncake_records(path, limit=args.limit), speed=args.speed, name=path.stem
            )
        else:
            wl = agentic_workload(
                read_agentic_sessions(path, limit=args.limit), stagger_s=args.stagger_s, speed=args.speed
            )
        base = EngineProfile(
            **{**profile_fields, "max_model_len": 1 << 22},
            counter_noise=args.counter_noise,
            scheduling_policy=args.scheduling_policy,
        )
        working_set = working_set_blocks(wl)
        for n in args.engines:
            gpu_blocks = max(8, args.gpu_tokens // wl.block_size)
            for storage in storage_values:
                fleet = b1_fleet(
                    n,
                    block_size=wl.block_size,
                    hetero=hetero,
                    base=base,
                    conversations_in_hbm=gpu_blocks * n * wl.block_size,
                    mean_conversation_tokens=1.0,
                    storage_blocks=storage_blocks_for(storage, working_set),
                    **fleet_options,
                )
                for spec, pol, params in parsed:
                    label = storage_label(f"{n}e x{args.speed:g}", storage)
                    runs.append(_RunSpec(label, wl, fleet, pol, config, params, spec))
        return runs, "engines x speed"
    lo, hi = (int(x) for x in args.answer_tokens.split(","))
    for c in args.concurrency:
        lcfg = LadderConfig(
            first_prompt_tokens=args.first_prompt_tokens,
            system_prefix_tokens=args.system_tokens,
            tokens_per_turn=args.tokens_per_turn,
            turns=args.turns,
            answer_min_tokens=lo,
            answer_max_tokens=hi,
            think_time_mean_s=args.think_time_s,
            concurrency=c,
            total_conversations=max(c, round(c * args.conversations)),
            block_size=args.block_size,
            seed=args.seed,
        )
        wl = ladder_workload(lcfg)
        working_set = working_set_blocks(wl)
        for n in args.engines:
            for storage in storage_values:
                fleet = b1_fleet(
                    n,
                    block_size=args.block_size,
                    hetero=hetero,
                    conversations_in_hbm=args.hbm_conversations,
                    mean_conversation_tokens=lcfg.mean_prompt_tokens(),
                    storage_blocks=storage_blocks_for(storage, working_set),
                    base=EngineProfile(
                        **profile_fields,
                        counter_noise=args.counter_noise,
                        scheduling_policy=args.scheduling_policy,
                    ),
                    **fleet_options,
                )
                for spec, pol, params in parsed:
                    label = storage_label(str(c) if len(args.engines) == 1 else f"{c}@{n}e", storage)
                    runs.append(_RunSpec(label, wl, fleet, pol, config, params, spec))
    return runs, "concurrency"


def _execute(spec: _RunSpec) -> SimResult:
    result = simulate(spec.workload, spec.policy, spec.fleet, spec.config, policy_params=spec.params)
    result.label = spec.label
    if spec.spec:
        result.policy = spec.spec
    result.ttfts_s = []
    result.ttft_by_request_s = {}
    return result


def _execute_indexed(item: tuple[int, _RunSpec]) -> tuple[int, SimResult]:
    index, spec = item
    return index, _execute(spec)


def _count_into(counter: Any) -> None:
    """Worker initializer: this process's runs report finished requests into ``counter``."""

    def add(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    _Progress.sink = add


def _run_line(result: SimResult) -> str:
    d = result.as_dict()
    return (
        f"{result.label} {result.policy}: TTFT p50 {d['ttft_p50_s']:.3f} s p99 {d['ttft_p99_s']:.3f} s, "
        f"hits GPU {d['hit_gpu']:.1%} CPU {d['hit_cpu']:.1%} STORAGE {d['hit_storage']:.1%} "
        f"miss {d['miss']:.1%}, {d['turns_per_s']:.3g} turns/s, wall {result.wall_s:.1f} s"
    )


class _ResultFiles:
    """``--out DIR``: results.jsonl gets a line as each run finishes; results.md and results.json
    are rewritten then too (plan order), so a stopped sweep leaves what it finished."""

    def __init__(self, out: Path | None, command: str, label_header: str, total_runs: int) -> None:
        self.out = out
        self.command = command
        self.label_header = label_header
        self.total_runs = total_runs
        self.done: dict[int, SimResult] = {}
        if out is not None:
            (out / "results.jsonl").write_text("")

    def add(self, index: int, result: SimResult) -> None:
        self.done[index] = result
        if self.out is None:
            return
        with open(self.out / "results.jsonl", "a") as fh:
            fh.write(json.dumps(result.as_dict()) + "\n")
        self._write_tables()

    def sync(self) -> None:
        """Rewrite every file from the finished runs: a Ctrl-C can land between the writes of
        ``add``, and the three files must then still agree."""
        if self.out is None:
            return
        ordered = [self.done[i] for i in sorted(self.done)]
        (self.out / "results.jsonl").write_text("".join(json.dumps(r.as_dict()) + "\n" for r in ordered))
        self._write_tables()

    def _write_tables(self) -> None:
        assert self.out is not None
        from sim.report import markdown_table

        ordered = [self.done[i] for i in sorted(self.done)]
        partial = (
            "" if len(ordered) == self.total_runs else f" ({len(ordered)} of {self.total_runs} runs so far)"
        )
        table = markdown_table(ordered, label_header=self.label_header)
        (self.out / "results.md").write_text(f"`{self.command}`{partial}\n\n{table}\n")
        (self.out / "results.json").write_text(json.dumps([r.as_dict() for r in ordered], indent=1))


def main(argv: Sequence[str] | None = None) -> int:
    """``kvroute sim ...``: run every (workload, engines, policy) combination with one progress bar
    over the sweep, print each run's figures as it finishes and a markdown table at the end; with
    --out, write results.jsonl / results.md / results.json as runs finish and PNG plots at the end."""
    from tqdm import tqdm

    argv_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv_list)
    # Ctrl-C must stop a sweep even when the parent passed SIGINT down as ignored (a test runner,
    # `cmd &` in a script): Python then never raises KeyboardInterrupt on its own.
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGINT, signal.default_int_handler)
    out = Path(args.out) if args.out else None
    if out is not None:
        # Checked before any run: a sweep must not end in an error about where to write.
        if out.exists() and not out.is_dir():
            print(
                f"kvroute sim: --out {out} is an existing file; --out names a directory for "
                "results.md, results.jsonl, results.json and the plots",
                file=sys.stderr,
            )
            return 2
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"kvroute sim: cannot create --out directory {out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    try:
        runs, label_header = _plan(args)
    except (ValueError, OSError) as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(runs)))
    files = _ResultFiles(out, "kvroute sim " + " ".join(argv_list), label_header, len(runs))
    total_requests = sum(r.workload.num_requests for r in runs)
    print(
        f"{len(runs)} runs ({total_requests:,} simulated requests) in {jobs} process(es)"
        + (f"; results in {out}/ as each run finishes" if out else ""),
        file=sys.stderr,
        flush=True,
    )
    bar = tqdm(
        total=total_requests,
        unit="req",
        desc="sweep",
        disable=args.no_progress,
        file=sys.stderr,
        dynamic_ncols=True,
        smoothing=0.05,
        mininterval=0.2 if sys.stderr.isatty() else 10.0,  # a log file gets a line every 10 s
        bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} requests "
        "[{elapsed} elapsed, ETA {remaining}]{postfix}",
    )
    wall0 = time.perf_counter()

    def finished(index: int, result: SimResult) -> None:
        files.add(index, result)
        bar.set_postfix_str(f"{len(files.done)}/{len(runs)} runs", refresh=False)
        bar.write(f"[{len(files.done)}/{len(runs)}] {_run_line(result)}", file=sys.stdout)

    try:
        if jobs == 1:
            _Progress.sink = bar.update
            try:
                for i, spec in enumerate(runs):
                    finished(i, _execute(spec))
            finally:
                _Progress.sink = None
        else:
            import multiprocessing

            ctx = multiprocessing.get_context("fork")
            counter = ctx.Value("q", 0)
            with ctx.Pool(jobs, initializer=_count_into, initargs=(counter,)) as pool:
                results_iter = pool.imap_unordered(_execute_indexed, list(enumerate(runs)), chunksize=1)
                while len(files.done) < len(runs):
                    try:
                        i, result = results_iter.next(timeout=0.5)
                    except multiprocessing.TimeoutError:
                        pass
                    else:
                        finished(i, result)
                    bar.update(counter.value - bar.n)
    except KeyboardInterrupt:
        bar.close()
        files.sync()
        where = f"; they are in {out}/" if out is not None and files.done else ""
        print(f"kvroute sim: interrupted after {len(files.done)} of {len(runs)} runs{where}", file=sys.stderr)
        return 130
    bar.close()
    from sim.report import markdown_table, plot_hits_by_tier, plot_vs_concurrency

    results = [files.done[i] for i in range(len(runs))]
    table = markdown_table(results, label_header=label_header)
    print()
    print(table)
    children_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(
        f"\n{len(runs)} runs, wall {time.perf_counter() - wall0:.1f} s, peak RSS "
        f"{max(peak_rss_bytes(), children_rss) / 2**20:.0f} MiB (largest process)"
    )
    if out is not None:
        title = f"{results[0].workload.split('-')[0]} {args.fleet}, {args.engines[0]} engines"
        try:
            paths = plot_hits_by_tier(results, out, title=title, label_name=label_header)
            if label_header == "concurrency" and len(args.concurrency) > 1 and len(args.storage) == 1:
                paths += plot_vs_concurrency(results, out, title=title)
        except ImportError:
            print(
                "plots skipped: matplotlib is not installed (pip install 'kvroute[plots]')", file=sys.stderr
            )
        else:
            for path in paths:
                print(f"wrote {path}")
        print(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'results.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
