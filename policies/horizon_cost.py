"""horizon_cost: tier_cost's predicted TTFT plus what the placement does to the requests after it.

tier_cost prices this request's first token and a flat work term. Under memory pressure two costs it
does not see decide the fleet's throughput: the copy a placement writes evicts other conversations'
blocks (some of which come back and must be reloaded or recomputed), and the GPU time it takes delays
every request that queues behind it while the engine is busy. For engine e (seconds s, tokens):

    cost_s = total_s                          tier_cost's predicted TTFT (wait + slot + loads + prefill)
           + omega_e x work_s                 queueing externality of the work placed on e
           + footprint_s                      future reload / recompute: live footprint past capacity
           + in_flight_s x in_flight_e        requests in flight on e (in_flight_s 0.2 s each)
           + slot_wait_s                      wait for a running slot (slot_wait_weight, default 0)
           + evict_s                          LRU-age eviction model (evict_weight, default 0)
           + future_s                         this conversation's next turn (future_weight, default 0)
           + decode_s + pressure_s            as tier_cost
    among engines not overloaded (kv_fixed_credit's guard, overload_factor 3), lowest cost_s wins.
    Defaults (round 2, tuned on seeds 100-102 of B1 128 with storage none and 1/4, docs/routing.md):
    max_work_weight 8, in_flight_s 0.2, footprint_weight 1, evict_weight 0.

    work_s  = load_s[CPU] + load_s[STORAGE] + prefill_s          (GPU seconds this request takes on e)
    omega_e = min(max_work_weight (8), work_weight (1) + L_e)    (requests delayed per second of work)
    L_e     = EWMA over decisions (time constant rate_window_s) of wait_tokens_e / prefill tokens per
              routed request: the mean number of requests queued for prefill on e. In an M/G/1
              queue a job of size x delays the jobs behind it by x x L in total; work_weight (1.0,
              tier_cost's default) is the floor, so an idle fleet routes exactly as tier_cost.

    evict_s = sum over k in {GPU_e, CPU_e, STORAGE} of  N_k x phi(T_k) x c_k
      N_GPU   = prompt - hit_GPU + expected output         tokens newly written into e's GPU pool
      N_CPU   = prompt - hit_GPU - hit_CPU                 write-through to e's CPU tier
      N_STOR  = prompt - hit_GPU - hit_CPU - hit_STORAGE   write-through to the shared pool
      T_k     = C_k / w_k   LRU residence time (s): capacity C_k (tokens) over the rate w_k (tokens/s,
              EWMA of this router's own placements) at which new tokens enter tier k; a tier not
              yet full (tokens written so far < C_k) evicts only the overflow
      phi(T)  = (1 - q) x (-dS/dln t)(T): expected reuses lost per token evicted from an LRU whose
              tail is T seconds old. Writing N tokens brings every resident block's eviction forward
              by N / w s; a block is lost if its conversation returns in that window, and summed over
              the resident blocks (w x S(a) tokens of age a) this is N x T x f(T) = N x phi(T).
              S = survival function of the gap between a session's turns, f its density, q = share of
              turns that are a session's last (sessions / turns), all learned from the routed
              requests (session key and time); log-spaced histogram, prior = no reuse known
      c_GPU   = kv_bytes_per_token / bw_CPU_e             a token evicted from GPU reloads from CPU
      c_CPU   = r x kv_bytes_per_token / bw_STORAGE_e + (1 - r) / prefill_tokens_per_s_e,
                r = 1 - S(T_STOR) / S(T_CPU): share of returns after T_CPU that the pool still holds
      c_STOR  = 1 / prefill_tokens_per_s_e                a token lost from the pool is recomputed

    future_s = future_weight x (1 - q) x (prompt + output) x [(S(T_GPU) - S(T_CPU)) kv / bw_CPU
               + (S(T_CPU) - S(T_STOR)) kv / bw_STOR + S(T_STOR) / prefill_tokens_per_s]

    footprint_s = footprint_weight x (1 - q) x dOver_tokens x c_token           (the default
                  eviction price: engines run LRU, and a working set past capacity thrashes)
      F_e       = sum of the history tokens (prompt + expected output) of the sessions homed on e
                  (their latest turn went there) that are alive: seen within H, where S(H) =
                  alive_survival (0.05) of the learned gap distribution (10 x rate_window_s before)
      C_e       = max(GPU, CPU capacity) of e: the CPU tier is written through, so it holds the GPU's
      over(F,C) = max(0, F - C): tokens LRU must drop
      dOver     = over(F_e + new - old_here, C_e) - over(F_e, C_e)          placing the session on e
                  + [over(F_h - old, C_h) - over(F_h, C_h)]   moving it off its home h (<= 0: relief)
      c_token   = p x kv_bytes_per_token / bw_STORAGE + (1 - p) / prefill_tokens_per_s,
                  p = min(1, pool capacity / sum_e F_e): a dropped token the pool still holds
    slot_wait_s = slot_wait_weight x max(0, waiting_e / mu_e - wait_s): requests waiting for a running
                  slot (KV memory) start as running ones finish, mu_e = the engine's finish rate

Capacities come from ``EngineView.extra`` (``gpu_capacity_tokens``, ``cpu_capacity_tokens``,
``storage_capacity_tokens``: vLLM's ``cache_config_info`` num_gpu_blocks x block_size and the
offload config; 0 = no such tier) or from the policy's params; an unknown capacity prices no
eviction for that tier (it then routes as tier_cost with the queueing externality).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.base import TIERS, Decision, EngineView, FleetView, RouteRequest, Tier, register
from policies.costs import CostEstimates
from policies.kv_gpu import overloaded_engines, validate_guard
from policies.tier_cost import TierCostPolicy, prompt_tokens_of

#: Log-spaced session-gap histogram: bin i holds gaps in [GAP_BIN0_S x 2^(i-1), GAP_BIN0_S x 2^i).
GAP_BIN0_S = 0.25
GAP_BINS = 24  # up to ~0.25 x 2^23 s = 24 days; the last bin also takes anything longer
#: ``EngineView.extra`` keys of the tier capacities in tokens (router.scrape fills them live).
CAPACITY_KEYS = ("gpu_capacity_tokens", "cpu_capacity_tokens", "storage_capacity_tokens")
_LN2 = math.log(2.0)


@dataclass(slots=True)
class _Rate:
    """An exponentially decayed accumulator: ``value(now)`` / window = the recent rate per second."""

    window_s: float
    acc: float = 0.0
    t: float = 0.0

    def add(self, amount: float, now: float) -> None:
        self.decay(now)
        self.acc += amount

    def decay(self, now: float) -> None:
        if now > self.t:
            self.acc *= math.exp(-(now - self.t) / self.window_s)
            self.t = now

    def per_s(self, now: float) -> float:
        self.decay(now)
        return self.acc / self.window_s


@dataclass(slots=True)
class _EngineLoad:
    """What the router's own placements say about one engine's tiers and queue."""

    gpu_in: _Rate
    cpu_in: _Rate
    gpu_written_tokens: float = 0.0
    cpu_written_tokens: float = 0.0
    #: EWMA of requests queued for prefill (wait_tokens / prefill tokens per request).
    queued_requests: float = 0.0
    last_seen_s: float = field(default=-math.inf)


@register("horizon_cost")
class HorizonCostPolicy(TierCostPolicy):
    """tier_cost plus the eviction and queueing externalities of a placement (module docstring)."""

    name = "horizon_cost"
    uses_index = True

    def __init__(
        self,
        *,
        work_weight: float = 1.0,
        max_work_weight: float = 8.0,
        evict_weight: float = 0.0,
        future_weight: float = 0.0,
        in_flight_s: float = 0.2,
        footprint_weight: float = 1.0,
        slot_wait_weight: float = 0.0,
        alive_survival: float = 0.05,
        rate_window_s: float = 60.0,
        gpu_capacity_tokens: float | None = None,
        cpu_capacity_tokens: float | None = None,
        storage_capacity_tokens: float | None = None,
        max_sessions: int = 1_000_000,
        overload_factor: float | None = 3.0,
        min_in_flight: int = 4,
        min_queued_tokens: int = 16_384,
        **tier_cost_params: Any,
    ) -> None:
        """Params of tier_cost plus: ``max_work_weight`` (8, cap of omega), ``footprint_weight`` (1),
        ``in_flight_s`` (0.2 s per in-flight request), ``slot_wait_weight`` (0),
        ``alive_survival`` (0.05), ``evict_weight`` (0: the LRU-age model, replaced by the
        footprint model in round 2), ``future_weight`` (0: did not help, docs/routing.md),
        the balance guard of kv_fixed_credit (``overload_factor`` 3, None = off),
        ``rate_window_s`` (60, EWMA time constant of rates and queue), capacities in tokens (None =
        from ``EngineView.extra``, else unknown), ``max_sessions`` (sessions remembered, LRU)."""
        super().__init__(work_weight=work_weight, **tier_cost_params)
        if max_work_weight < work_weight:
            raise ValueError("horizon_cost.max_work_weight must be >= work_weight")
        if future_weight < 0:
            raise ValueError(f"horizon_cost.future_weight must be >= 0, got {future_weight}")
        if in_flight_s < 0 or footprint_weight < 0 or slot_wait_weight < 0:
            raise ValueError(
                f"horizon_cost: in_flight_s and footprint_weight must be >= 0, got {in_flight_s},"
                f" {footprint_weight}"
            )
        if not 0.0 < alive_survival < 1.0:
            raise ValueError(f"horizon_cost.alive_survival must be in (0, 1), got {alive_survival}")
        if evict_weight < 0 or rate_window_s <= 0 or max_sessions < 1:
            raise ValueError("horizon_cost: evict_weight >= 0, rate_window_s > 0, max_sessions >= 1")
        for key, value in (
            ("gpu_capacity_tokens", gpu_capacity_tokens),
            ("cpu_capacity_tokens", cpu_capacity_tokens),
            ("storage_capacity_tokens", storage_capacity_tokens),
        ):
            if value is not None and value < 0:
                raise ValueError(f"horizon_cost.{key} must be >= 0 (0 = no such tier), got {value}")
        if overload_factor is not None:
            validate_guard("horizon_cost", overload_factor, min_in_flight, min_queued_tokens)
        self.overload_factor = overload_factor
        self.min_in_flight = min_in_flight
        self.min_queued_tokens = min_queued_tokens
        self.max_work_weight = max_work_weight
        self.evict_weight = evict_weight
        self.future_weight = future_weight
        self.in_flight_s = in_flight_s
        self.footprint_weight = footprint_weight
        self.slot_wait_weight = slot_wait_weight
        #: Per engine: requests finished per second (EWMA), the engine's admission rate.
        self._finished: dict[str, _Rate] = {}
        self.alive_survival = alive_survival
        #: Footprint model: session -> (home engine, history tokens, last seen s), oldest first,
        #: and per engine the history tokens of the sessions homed there that are still alive.
        self._homes: OrderedDict[str, tuple[str, float, float]] = OrderedDict()
        self._footprint: dict[str, float] = {}
        self._footprint_total = 0.0
        self.rate_window_s = rate_window_s
        self.capacity_params = (gpu_capacity_tokens, cpu_capacity_tokens, storage_capacity_tokens)
        self.max_sessions = max_sessions
        self._engines: dict[str, _EngineLoad] = {}
        self._storage_in = _Rate(rate_window_s)
        self._storage_written_tokens = 0.0
        self._prefill_per_request = _Rate(rate_window_s)
        self._requests = _Rate(rate_window_s)
        self._sessions: OrderedDict[str, float] = OrderedDict()
        self._gap_counts = [0] * GAP_BINS
        self._turns = 0
        self._session_count = 0
        self._now = 0.0
        self._storage_capacity: float | None = None

    # -- what the router learns from its own placements -----------------------------------------

    def _load(self, engine_id: str) -> _EngineLoad:
        load = self._engines.get(engine_id)
        if load is None:
            load = _EngineLoad(_Rate(self.rate_window_s), _Rate(self.rate_window_s))
            self._engines[engine_id] = load
        return load

    def capacity_tokens(self, engine: EngineView, tier: Tier) -> float | None:
        """Capacity of ``tier`` on ``engine`` in tokens (STORAGE: the shared pool), None = unknown."""
        param = self.capacity_params[tier]
        if param is not None:
            return float(param)
        value = engine.extra.get(CAPACITY_KEYS[tier])
        return None if value is None else float(value)

    def survival(self, gap_s: float) -> float:
        """S(t): share of observed inter-turn gaps longer than ``gap_s`` (1.0 before any gap)."""
        total = sum(self._gap_counts)
        if total == 0 or math.isinf(gap_s):
            return 0.0 if math.isinf(gap_s) else 1.0
        pos = _bin_position(gap_s)
        i = int(pos)
        longer = sum(self._gap_counts[i + 1 :]) + self._gap_counts[i] * (1.0 - (pos - i))
        return longer / total

    def reuse_density(self, age_s: float) -> float:
        """phi(T) = (1 - q) x (-dS/dln t) at T: expected lost reuses per evicted token (module doc)."""
        total = sum(self._gap_counts)
        if total == 0 or not math.isfinite(age_s) or age_s <= 0:
            return 0.0
        # Density per ln-second of the gap at T: the bin's share over its ln-width (ln 2), linearly
        # interpolated between neighbouring bin centres.
        pos = _bin_position(age_s) - 0.5
        lo = max(0, min(GAP_BINS - 1, math.floor(pos)))
        hi = min(GAP_BINS - 1, lo + 1)
        frac = min(1.0, max(0.0, pos - lo))
        share = (self._gap_counts[lo] * (1.0 - frac) + self._gap_counts[hi] * frac) / total
        return (1.0 - self.last_turn_share()) * share / _LN2

    def last_turn_share(self) -> float:
        """q: share of turns that were a session's last (sessions / turns; 1.0 before any turn)."""
        return self._session_count / self._turns if self._turns else 1.0

    def queue_weight(self, engine: EngineView) -> float:
        """omega_e: requests delayed per second of GPU work placed on ``engine``."""
        load = self._engines.get(engine.engine_id)
        queued = load.queued_requests if load is not None else 0.0
        return min(self.max_work_weight, self.work_weight + queued)

    # -- pricing ----------------------------------------------------------------------------------

    def evict_s(
        self, request: RouteRequest, engine: EngineView, scores: Mapping[str, float], costs: CostEstimates
    ) -> float:
        """Expected future reload / recompute seconds caused by the copy this placement writes."""
        if self.evict_weight == 0:
            return 0.0
        load = self._load(engine.engine_id)
        est = costs.estimates(engine.engine_id)
        prompt = float(prompt_tokens_of(request))
        hit_gpu, hit_cpu, hit_storage = (
            scores["hit_tokens_gpu"],
            scores["hit_tokens_cpu"],
            scores["hit_tokens_storage"],
        )
        per_token_prefill_s = 1.0 / est.prefill_tokens_per_s
        kv = est.kv_bytes_per_token
        cpu_bw = est.load_bandwidth_bytes_per_s[Tier.CPU]
        storage_bw = est.load_bandwidth_bytes_per_s[Tier.STORAGE]
        t_gpu, t_cpu, t_storage = self.residences_s(engine)
        c_storage = self.capacity_tokens(engine, Tier.STORAGE)
        total = 0.0
        # GPU: an evicted token is normally still in the CPU tier (write-through, twice the size).
        n_gpu = _overflow(
            prompt - hit_gpu + request.expected_output_tokens,
            load.gpu_written_tokens,
            self.capacity_tokens(engine, Tier.GPU),
        )
        if n_gpu > 0:
            c_gpu = (
                kv / cpu_bw
                if t_cpu > t_gpu and not math.isinf(cpu_bw)
                else self._after_cpu_s(t_cpu, t_storage, kv, storage_bw, per_token_prefill_s)
            )
            total += n_gpu * self.reuse_density(t_gpu) * c_gpu
        n_cpu = _overflow(
            prompt - hit_gpu - hit_cpu, load.cpu_written_tokens, self.capacity_tokens(engine, Tier.CPU)
        )
        if n_cpu > 0:
            total += (
                n_cpu
                * self.reuse_density(t_cpu)
                * self._after_cpu_s(t_cpu, t_storage, kv, storage_bw, per_token_prefill_s)
            )
        n_storage = _overflow(
            prompt - hit_gpu - hit_cpu - hit_storage, self._storage_written_tokens, c_storage
        )
        if n_storage > 0:
            total += n_storage * self.reuse_density(t_storage) * per_token_prefill_s
        return self.evict_weight * total

    def residences_s(self, engine: EngineView) -> tuple[float, float, float]:
        """(T_GPU, T_CPU, T_STORAGE): LRU residence times on ``engine`` (inf = unknown or idle)."""
        now = self._now
        load = self._load(engine.engine_id)
        return (
            _residence_s(
                self.capacity_tokens(engine, Tier.GPU), load.gpu_in.per_s(now), load.gpu_written_tokens
            ),
            _residence_s(
                self.capacity_tokens(engine, Tier.CPU), load.cpu_in.per_s(now), load.cpu_written_tokens
            ),
            _residence_s(
                self.capacity_tokens(engine, Tier.STORAGE),
                self._storage_in.per_s(now),
                self._storage_written_tokens,
            ),
        )

    def alive_horizon_s(self) -> float:
        """H: a session unseen for longer than H is taken as finished (S(H) = alive_survival);
        before any gap is known, 10 x rate_window_s."""
        total = sum(self._gap_counts)
        if total == 0:
            return 10.0 * self.rate_window_s
        longer = float(total)
        for i, count in enumerate(self._gap_counts):
            if (longer - count) / total <= self.alive_survival:
                # Inside bin i: interpolate on its log-scale position.
                frac = (longer / total - self.alive_survival) / (count / total) if count else 1.0
                lo = 0.0 if i == 0 else GAP_BIN0_S * 2.0 ** (i - 1)
                hi = GAP_BIN0_S * 2.0**i
                return lo + (hi - lo) * min(1.0, max(0.0, frac))
            longer -= count
        return GAP_BIN0_S * 2.0 ** (GAP_BINS - 1)

    def _expire_homes(self, now: float) -> None:
        horizon_s = self.alive_horizon_s()
        while self._homes:
            key, (engine_id, tokens, last_s) = next(iter(self._homes.items()))
            if now - last_s <= horizon_s:
                break
            del self._homes[key]
            self._footprint[engine_id] = self._footprint.get(engine_id, 0.0) - tokens
            self._footprint_total -= tokens

    def local_capacity_tokens(self, engine: EngineView) -> float | None:
        """What the engine keeps of histories: its larger local tier (the CPU tier is written
        through, so it holds what the GPU holds); None = unknown."""
        known = [
            c
            for c in (self.capacity_tokens(engine, Tier.GPU), self.capacity_tokens(engine, Tier.CPU))
            if c is not None
        ]
        return max(known) if known else None

    def footprint_s(
        self, request: RouteRequest, engine: EngineView, by_id: Mapping[str, EngineView], costs: CostEstimates
    ) -> float:
        """Expected future reload / recompute (s) caused by the history this placement homes on
        ``engine``, from the live footprints (sum of the alive sessions' histories per engine):
        the growth of an engine's overflow past its local capacity is lost to LRU (each overflowing
        token comes back with probability 1 - q); moving a session away relieves its old home."""
        if self.footprint_weight == 0 or not request.session_key:
            return 0.0
        capacity = self.local_capacity_tokens(engine)
        if capacity is None:
            return 0.0
        new_tokens = float(prompt_tokens_of(request) + request.expected_output_tokens)
        home = self._homes.get(request.session_key)
        old_engine, old_tokens = (home[0], home[1]) if home is not None else ("", 0.0)
        here = self._footprint.get(engine.engine_id, 0.0)
        after = here + new_tokens - (old_tokens if old_engine == engine.engine_id else 0.0)
        delta = _over(after, capacity) - _over(here, capacity)
        old_view = by_id.get(old_engine)
        if old_view is not None and old_engine != engine.engine_id:
            old_capacity = self.local_capacity_tokens(old_view)
            if old_capacity is not None:
                there = self._footprint.get(old_engine, 0.0)
                delta += _over(there - old_tokens, old_capacity) - _over(there, old_capacity)
        if delta == 0:
            return 0.0
        est = costs.estimates(engine.engine_id)
        per_token_s = 1.0 / est.prefill_tokens_per_s
        pool = self.capacity_tokens(engine, Tier.STORAGE)
        storage_bw = est.load_bandwidth_bytes_per_s[Tier.STORAGE]
        total_footprint = self._footprint_total
        if pool and not math.isinf(storage_bw) and total_footprint > 0:
            in_pool = min(1.0, pool / total_footprint)
            per_token_s = in_pool * est.kv_bytes_per_token / storage_bw + (1.0 - in_pool) * per_token_s
        return self.footprint_weight * (1.0 - self.last_turn_share()) * delta * per_token_s

    def slot_wait_s(self, engine: EngineView, wait_s: float) -> float:
        """Wait for a running slot beyond the prefill queue (s): a request queued on an engine
        whose KV memory is full of running requests starts only as they finish, so the N requests
        waiting ahead take N / mu seconds (Little's law; mu = the engine's finish rate, learned
        from the router's own finished requests). Only the excess over ``wait_s`` is added."""
        if self.slot_wait_weight == 0:
            return 0.0
        waiting = engine.num_requests_waiting
        rate = self._finished.get(engine.engine_id)
        mu = rate.per_s(self._now) if rate is not None else 0.0
        if not waiting or mu <= 0:
            return 0.0
        return self.slot_wait_weight * max(0.0, waiting / mu - wait_s)

    def on_finished(self, request: RouteRequest, engine_id: str, ok: bool) -> None:
        rate = self._finished.get(engine_id)
        if rate is None:
            rate = self._finished[engine_id] = _Rate(self.rate_window_s)
        rate.add(1.0, self._now)

    def future_s(self, request: RouteRequest, engine: EngineView, costs: CostEstimates) -> float:
        """Expected cost of this conversation's next turn if it finds its history where this one
        leaves it: the history (prompt + answer) is on ``engine`` and ages there until it returns."""
        if self.future_weight == 0:
            return 0.0
        est = costs.estimates(engine.engine_id)
        t_gpu, t_cpu, t_storage = self.residences_s(engine)
        kv = est.kv_bytes_per_token
        cpu_bw = est.load_bandwidth_bytes_per_s[Tier.CPU]
        storage_bw = est.load_bandwidth_bytes_per_s[Tier.STORAGE]
        c_cpu = 0.0 if math.isinf(cpu_bw) else kv / cpu_bw
        c_storage = 0.0 if math.isinf(storage_bw) else kv / storage_bw
        c_prefill = 1.0 / est.prefill_tokens_per_s
        s_gpu = self.survival(t_gpu)
        s_cpu = min(s_gpu, self.survival(t_cpu)) if t_cpu > 0 else s_gpu
        s_storage = min(s_cpu, self.survival(t_storage)) if t_storage > t_cpu else s_cpu
        per_token = (s_gpu - s_cpu) * c_cpu + (s_cpu - s_storage) * c_storage + s_storage * c_prefill
        history = float(prompt_tokens_of(request) + request.expected_output_tokens)
        return self.future_weight * (1.0 - self.last_turn_share()) * history * per_token

    def _after_cpu_s(
        self, t_cpu: float, t_storage: float, kv: float, storage_bw: float, prefill_s: float
    ) -> float:
        """Cost per token of a return after the CPU tier dropped it: the shared pool or recompute."""
        if t_storage <= t_cpu or math.isinf(storage_bw):
            return prefill_s
        s_cpu = self.survival(t_cpu)
        in_pool = 1.0 - (self.survival(t_storage) / s_cpu if s_cpu > 0 else 0.0)
        return in_pool * kv / storage_bw + (1.0 - in_pool) * prefill_s

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        self._now = fleet.now
        if self.footprint_weight:
            self._expire_homes(fleet.now)
        base = super().choose(request, fleet)
        costs: CostEstimates = fleet.costs if fleet.costs is not None else self._own_costs
        by_id = fleet.by_id()
        overloaded: set[str] = set()
        if self.overload_factor is not None:
            overloaded = overloaded_engines(
                fleet.engines,
                factor=self.overload_factor,
                min_in_flight=self.min_in_flight,
                min_queued_tokens=self.min_queued_tokens,
            )
            if all(e in overloaded for e in base.scores):
                overloaded = set()
        order: list[tuple[bool, float, float, str]] = []
        for engine_id, s in base.scores.items():
            engine = by_id[engine_id]
            omega = self.queue_weight(engine)
            work_s = omega * (s["load_cpu_s"] + s["load_storage_s"] + s["prefill_s"])
            evict_s = self.evict_s(request, engine, s, costs)
            future_s = self.future_s(request, engine, costs)
            s["future_s"] = future_s
            s["in_flight_s"] = in_flight_s = self.in_flight_s * engine.in_flight
            s["footprint_s"] = footprint_s = self.footprint_s(request, engine, by_id, costs)
            s["slot_wait_s"] = slot_wait_s = self.slot_wait_s(engine, s["wait_s"])
            s["work_weight"] = omega
            s["work_s"] = work_s
            s["evict_s"] = evict_s
            s["cost_s"] = (
                s["total_s"]
                + work_s
                + evict_s
                + footprint_s
                + future_s
                + in_flight_s
                + slot_wait_s
                + s["decode_s"]
                + s["pressure_s"]
            )
            s["overloaded"] = float(engine_id in overloaded)
            for tier, key in zip(TIERS, CAPACITY_KEYS, strict=True):
                capacity = self.capacity_tokens(engine, tier)
                if capacity is not None:  # what the eviction price used (explain shows it)
                    s[key] = capacity
            order.append((engine_id in overloaded, round(s["cost_s"], 6), s["in_flight"], engine_id))
        # Re-rank with the full cost; tier_cost's tiebreak order (its ranking) settles exact ties.
        rank = {e: i for i, e in enumerate((base.engine_id, *base.fallbacks))}
        order.sort(key=lambda x: (x[0], x[1], x[2], rank.get(x[3], len(rank))))
        chosen = order[0][3]
        s = base.scores[chosen]
        reason = (
            f"lowest horizon cost: {chosen} {s['cost_s']:.4f} s = TTFT {s['total_s']:.4f} + work"
            f" {s['work_s']:.4f} (x{s['work_weight']:.2f}) + evictions {s['evict_s']:.4f}"
            f" + next turn {s['future_s']:.4f}"
        )
        if len(order) > 1:
            reason += f"; next {order[1][3]} {order[1][1]:.4f} s"
        if overloaded:
            reason += f"; skipped overloaded {sorted(overloaded)}"
        scored = [e for *_, e in order]
        fallbacks = tuple(scored[1:]) + tuple(e for e in base.fallbacks if e not in base.scores)
        return Decision(chosen, self.name, reason=reason, scores=base.scores, fallbacks=fallbacks)

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        now = self._now
        s = decision.scores.get(decision.engine_id)
        if s is None:
            return
        prompt = float(prompt_tokens_of(request))
        load = self._load(decision.engine_id)
        gpu_new = max(0.0, prompt - s["hit_tokens_gpu"] + request.expected_output_tokens)
        cpu_new = max(0.0, prompt - s["hit_tokens_gpu"] - s["hit_tokens_cpu"])
        storage_new = max(0.0, s["prefill_tokens"])
        load.gpu_in.add(gpu_new, now)
        load.cpu_in.add(cpu_new, now)
        load.gpu_written_tokens += gpu_new
        load.cpu_written_tokens += cpu_new
        self._storage_in.add(storage_new, now)
        self._storage_written_tokens += storage_new
        self._prefill_per_request.add(s["prefill_tokens"], now)
        self._requests.add(1.0, now)
        # Queue EWMA: requests waiting ahead, sampled at every placement on this engine.
        per_request = self._prefill_per_request.acc / self._requests.acc if self._requests.acc > 0 else 0.0
        queued_now = s["wait_tokens"] / per_request if per_request > 0 else 0.0
        alpha = (
            1.0 - math.exp(-(now - load.last_seen_s) / self.rate_window_s)
            if math.isfinite(load.last_seen_s)
            else 1.0
        )
        load.queued_requests += max(alpha, 0.05) * (queued_now - load.queued_requests)
        load.last_seen_s = now
        self._observe_session(request.session_key, now)
        if self.footprint_weight and request.session_key:
            self._rehome(
                request.session_key, decision.engine_id, prompt + request.expected_output_tokens, now
            )

    def _rehome(self, session_key: str, engine_id: str, tokens: float, now: float) -> None:
        old = self._homes.pop(session_key, None)
        if old is not None:
            self._footprint[old[0]] = self._footprint.get(old[0], 0.0) - old[1]
            self._footprint_total -= old[1]
        self._homes[session_key] = (engine_id, tokens, now)
        self._footprint[engine_id] = self._footprint.get(engine_id, 0.0) + tokens
        self._footprint_total += tokens
        if len(self._homes) > self.max_sessions:
            _, (evicted_engine, evicted_tokens, _) = self._homes.popitem(last=False)
            self._footprint[evicted_engine] -= evicted_tokens
            self._footprint_total -= evicted_tokens

    def _observe_session(self, session_key: str, now: float) -> None:
        if not session_key:
            return
        self._turns += 1
        last = self._sessions.pop(session_key, None)
        if last is None:
            self._session_count += 1
        else:
            self._gap_counts[min(GAP_BINS - 1, int(_bin_position(max(0.0, now - last))))] += 1
        self._sessions[session_key] = now
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)


def _bin_position(gap_s: float) -> float:
    """Continuous histogram position of a gap: bin i covers [GAP_BIN0_S 2^(i-1), GAP_BIN0_S 2^i)."""
    if gap_s < GAP_BIN0_S:
        return gap_s / GAP_BIN0_S  # bin 0 covers [0, GAP_BIN0_S)
    return min(GAP_BINS - 1e-9, 1.0 + math.log2(gap_s / GAP_BIN0_S))


def _residence_s(capacity_tokens: float | None, in_tokens_per_s: float, written_tokens: float) -> float:
    """LRU residence time T = C / w (0 for an absent tier, inf when unknown or idle); a tier not
    yet full first fills its free space: T = (2C - written) / w."""
    if capacity_tokens is None or in_tokens_per_s <= 0:
        return math.inf
    if capacity_tokens == 0:
        return 0.0
    return (capacity_tokens + max(0.0, capacity_tokens - written_tokens)) / in_tokens_per_s


def _over(tokens: float, capacity_tokens: float) -> float:
    """Tokens past a tier's capacity (what LRU must drop)."""
    return max(0.0, tokens - capacity_tokens)


def _overflow(new_tokens: float, written_tokens: float, capacity_tokens: float | None) -> float:
    """Tokens of ``new_tokens`` that evict (a tier not yet full takes the rest into free space)."""
    if capacity_tokens is None or capacity_tokens <= 0 or new_tokens <= 0:
        return 0.0
    return min(new_tokens, max(0.0, written_tokens + new_tokens - capacity_tokens))
