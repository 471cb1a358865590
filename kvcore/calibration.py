"""The router's learned costs: per-engine estimates calibrated online, and the index self-check.

``CostModel`` starts from the configured priors (``policies.costs``, where pricing and the TTFT
formula live) and calibrates from (a) the engines' own offload counters and (b) the router's observed
TTFTs against the parts the request was priced with. ``IndexSelfCheck`` flags engines whose index
promises hits they do not deliver. Pure code: time comes in as arguments. Used by the router and the
DES (both through ``kvcore.core.RoutingCore``); policies read it as ``policies.costs.CostEstimates``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from policies.base import TIERS, Tier
from policies.costs import MAX_SLOT_S_PER_REQUEST, EngineCosts, PredictedParts, priors_from_config


@dataclass(slots=True)
class CalibrationConfig:
    """How fast and how far the online estimates may move."""

    #: Forgetting factor of the recursive least squares (0 < f <= 1): observations older than
    #: ~1 / (1 - f) requests fade, so a changed engine is followed; 1 = never forget.
    forgetting: float = 0.99
    #: Observed TTFTs are clipped to [predicted / max_ratio, predicted x max_ratio] (outlier guard).
    max_ratio: float = 4.0
    #: Estimates stay within [prior / max_drift, prior * max_drift].
    max_drift: float = 50.0
    #: EWMA weight of one scraped bandwidth sample (deltas of the offload counters).
    metrics_weight: float = 0.3
    #: Counter deltas below this many bytes are too small to time reliably; they are accumulated.
    min_metrics_bytes: float = 8 * 2**20
    #: A request placed while at most this many others were in flight on its engine calibrates the
    #: rates (prefill, loads); one placed behind more calibrates only the slot wait. A TTFT measured
    #: behind a queue mixes service and wait, and a regression fed with it lets the wait pass for a
    #: slow (or, with the intercept, an impossibly fast) prefill: under load the rates drifted to
    #: the 50x bound and requests herded onto the engine that looked fastest.
    clean_in_flight: int = 0
    #: Engines that share a prior (same model and hardware, as configured) also share evidence: an
    #: engine's rate multipliers are shrunk toward its twins' (their geometric mean, weighted by
    #: each one's own clean observations), the twins weighing as much as this many observations
    #: of the engine's own. 0 = off (each engine on its own, as before). Without it one slow
    #: early TTFT can mark an engine several times slower than its twin, tier_cost then stops
    #: sending it the requests that would correct that, and the estimate never recovers
    #: (docs/benchmarks.md, the lock-in on real vLLM).
    pool_observations: float = 0.0
    #: Engines that mount one shared STORAGE pool (``CostModel.set_storage_pool``; the router's
    #: ``engines[].storage_pool``) share one STORAGE load bandwidth, measured from every member's
    #: offload counters (round q31). A load from a shared pool waits for the pool as much as for
    #: the engine's link, so a per-engine figure reads the pool's contention at the moments that
    #: engine loaded: in B1b the engines that loaded under contention drifted 4-40x below the one
    #: that had not, tier_cost herded the storage hits onto that one, and its queue piled up
    #: (results/q28.md, q31.md). False = each engine's own counters (as before). True is
    #: ``storage_spread`` 1.
    shared_storage: bool = False
    #: Between the two (round q32): a pool member's STORAGE load bandwidth is its own counters'
    #: figure, kept within [pool / spread, pool x spread] of the pool's one figure (the EWMA of
    #: every member's samples). A member's own figure carries its link (engines with different
    #: links to one pool), the bound stops the pool's contention from driving one member 4-40x
    #: below the others. 1 = the pool's figure for every member (``shared_storage``); inf (the
    #: default) = each engine on its own. In q32's B1b (links of 1.5 and 6 GB/s to one pool) any
    #: spread above 1 brought the pile-ups back and did not help placement (results/q32.md).
    storage_spread: float = math.inf

    def __post_init__(self) -> None:
        if not 0 < self.forgetting <= 1:
            raise ValueError(f"calibration.forgetting must be in (0, 1], got {self.forgetting}")
        if not self.pool_observations >= 0 or not math.isfinite(self.pool_observations):
            raise ValueError(
                f"calibration.pool_observations must be a finite number >= 0, got {self.pool_observations}"
            )
        if not self.storage_spread >= 1:
            raise ValueError(
                "calibration.storage_spread must be >= 1 (inf = each engine on its own),"
                f" got {self.storage_spread}"
            )

    @property
    def pool_spread(self) -> float:
        """How far a shared pool member's STORAGE figure may stray from the pool's (inf = no pool
        figure): ``storage_spread``, or 1 with ``shared_storage``."""
        return 1.0 if self.shared_storage else self.storage_spread


@dataclass(slots=True)
class _CounterBaseline:
    bytes_total: float
    time_total_s: float


#: RLS parameters: per-request overhead seconds, then multipliers of the prior's prefill time,
#: CPU load time, STORAGE load time and queue wait (1.0 = the prior is right; 2.0 = twice as slow).
#: The wait has its own multiplier: the router's queue figure is a guess, and folding it into the
#: prefill rate would let a bad guess bias the rate.
_N_PARAMS = 5  # (``_rls_update`` is written out for five)
#: Initial covariance: weak priors (worth about one observation), so data dominate at once. The
#: intercept's is 0.1 s (std): per-request overheads are tens of milliseconds, and prompts all of
#: one size cannot tell an intercept from the rate, so the prior decides. At 1 s the intercept took
#: ~70% of every correction and the rate stayed 1.6-1.9x too fast (tests/test_costs.py).
_P0 = (0.01, 100.0, 100.0, 100.0, 100.0)
_MAX_OVERHEAD_S = 10.0


@dataclass(slots=True)
class _Rls:
    theta: list[float] = field(default_factory=lambda: [0.0, 1.0, 1.0, 1.0, 1.0])
    cov: list[list[float]] = field(
        default_factory=lambda: [
            [_P0[i] if i == j else 0.0 for j in range(_N_PARAMS)] for i in range(_N_PARAMS)
        ]
    )


@dataclass(slots=True)
class _EngineState:
    prior: EngineCosts
    current: EngineCosts
    rls: _Rls = field(default_factory=_Rls)
    #: Tiers whose bandwidth the engine's offload counters have measured.
    counter_tiers: set[Tier] = field(default_factory=set)
    #: The engine's own STORAGE counters' EWMA (bytes/s), kept apart from the figure it prices
    #: with when that figure is bounded by its shared pool's (``calibration.storage_spread``).
    own_storage_bps: float | None = None
    #: Forgetting-weighted counts of the clean observations that informed the prefill, CPU and
    #: STORAGE multipliers (index 1-3 as in the regression; 0 unused): each engine's weight in
    #: its pool and against it (``calibration.pool_observations``).
    evidence: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    observations: int = 0
    metric_samples: int = 0
    last_update_s: float = 0.0
    baselines: dict[Tier, _CounterBaseline] = field(default_factory=dict)
    #: Forgetting-weighted sums of in_flight x residual and in_flight^2 over queued observations
    #: (the slot wait's least squares through the origin); sxx starts at one unit observation.
    slot_sxy: float = 0.0
    slot_sxx: float = 1.0
    slot_observations: int = 0


class IndexSelfCheck:
    """Flags engines whose index predicts more hit tokens than the engine reports as cached.

    Per engine: EWMA of the shortfall ratio max(0, predicted - cached) / predicted over requests that
    predicted at least ``min_predicted_tokens``. Untrusted once ``min_samples`` were seen and the EWMA
    exceeds ``untrust_above``; trusted again when it falls below ``trust_below`` (hysteresis).
    """

    def __init__(
        self,
        *,
        weight: float = 0.2,
        untrust_above: float = 0.3,
        trust_below: float = 0.1,
        min_samples: int = 5,
        min_predicted_tokens: int = 16,
    ) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"selfcheck weight must be in (0, 1], got {weight}")
        if not 0 <= trust_below < untrust_above <= 1:
            raise ValueError("selfcheck needs 0 <= trust_below < untrust_above <= 1")
        self._weight = weight
        self._untrust_above = untrust_above
        self._trust_below = trust_below
        self._min_samples = min_samples
        self._min_predicted_tokens = min_predicted_tokens
        self._shortfall: dict[str, float] = {}
        self._samples: dict[str, int] = {}
        #: The engines whose index is not trusted now (read by ``CostModel.index_trusted`` per
        #: engine and request: a set lookup, no call; written here only).
        self.untrusted: set[str] = set()

    def observe(self, engine_id: str, predicted_hit_tokens: float, cached_tokens: float) -> bool:
        """Record one finished request; returns whether the engine's index is trusted now."""
        if predicted_hit_tokens >= self._min_predicted_tokens:
            ratio = max(0.0, predicted_hit_tokens - cached_tokens) / predicted_hit_tokens
            old = self._shortfall.get(engine_id)
            self._shortfall[engine_id] = ratio if old is None else old + self._weight * (ratio - old)
            self._samples[engine_id] = self._samples.get(engine_id, 0) + 1
            ewma = self._shortfall[engine_id]
            if self._samples[engine_id] >= self._min_samples and ewma > self._untrust_above:
                self.untrusted.add(engine_id)
            elif ewma < self._trust_below:
                self.untrusted.discard(engine_id)
        return self.trusted(engine_id)

    def trusted(self, engine_id: str) -> bool:
        return engine_id not in self.untrusted

    def forget(self, engine_id: str) -> None:
        """Start over for an engine (after it re-announced its cache or was removed)."""
        self._shortfall.pop(engine_id, None)
        self._samples.pop(engine_id, None)
        self.untrusted.discard(engine_id)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {
            e: {"shortfall_ewma": s, "samples": self._samples.get(e, 0), "trusted": self.trusted(e)}
            for e, s in sorted(self._shortfall.items())
        }


class CostModel:
    """Per-engine cost estimates, seeded from priors and calibrated online.

    Two kinds of evidence:
    - ``update_offload_counters``: cumulative ``vllm:kv_offload_load_bytes_total`` and
      ``..._load_time_total`` per tier; their deltas give a measured bandwidth per tier.
    - ``observe``: the router's observed TTFT (sent -> first streamed token) against the parts
      of the same request. Recursive least squares with forgetting fits

          ttft = overhead_s + a x prefill_s_prior + b_cpu x cpu_load_s_prior
                 + b_storage x storage_load_s_prior + c x wait_s_prior + tier latencies
                 + slot_s_per_request x requests in flight on the engine when it was placed

      where ``*_prior`` are the times the prior would predict (uncached tokens / prefill rate;
      hit tokens x kv_bytes_per_token / bandwidth; queued tokens / prefill rate) and a, b, c are
      multipliers (estimate = prior / multiplier), weighted by 1 / prediction (relative error).
      The intercept absorbs what every request pays whatever its size (HTTP, scheduling, a
      step), which would otherwise be mistaken for a slow prefill. Observations are clipped to
      ``max_ratio`` of the prediction and the estimates stay within ``max_drift`` of the prior.
    """

    def __init__(
        self,
        fleet_prior: EngineCosts | None = None,
        engine_priors: Mapping[str, EngineCosts] | None = None,
        *,
        calibration: CalibrationConfig | None = None,
        selfcheck: IndexSelfCheck | None = None,
    ) -> None:
        self.fleet_prior = (fleet_prior or EngineCosts()).validate("costs")
        self._engine_priors = dict(engine_priors or {})
        self.calibration = calibration or CalibrationConfig()
        self.selfcheck = selfcheck or IndexSelfCheck()
        self._engines: dict[str, _EngineState] = {}
        #: Engines that share each distinct prior, and their pool (``calibration.pool_observations``).
        self._pool_members: dict[EngineCosts, list[str]] = {}
        self._pools: dict[EngineCosts, _Pool] = {}
        #: Each engine's shared STORAGE pool (``set_storage_pool``), and each pool's measured load
        #: bandwidth in bytes/s (``calibration.shared_storage``).
        self._storage_pool_of: dict[str, str] = {}
        self._storage_bandwidth: dict[str, float] = {}

    @classmethod
    def from_config(cls, raw: Mapping[str, Any] | None) -> CostModel:
        """Build from a config mapping: the priors' keys (``policies.costs.priors_from_config``:
        fleet-wide cost keys plus ``engines``) and ``calibration`` = CalibrationConfig fields."""
        raw = dict(raw or {})
        calibration_raw = dict(raw.pop("calibration", {}) or {})
        fleet, engines = priors_from_config(raw)
        try:
            calibration = CalibrationConfig(**calibration_raw)
        except TypeError as exc:
            raise ValueError(f"costs.calibration: {exc}") from None
        return cls(fleet, engines, calibration=calibration)

    # -- reading ----------------------------------------------------------------------------

    def _state(self, engine_id: str) -> _EngineState:
        state = self._engines.get(engine_id)
        if state is None:
            prior = self._engine_priors.get(engine_id, self.fleet_prior)
            state = self._engines[engine_id] = _EngineState(prior=prior, current=prior)
            state.slot_sxy = prior.slot_s_per_request
            self._pool_members.setdefault(prior, []).append(engine_id)
            if self.calibration.pool_observations > 0 and prior in self._pools:
                self._refresh(state, set())  # a newcomer starts from what its twins have shown
            pool = self._storage_pool_of.get(engine_id)
            if pool is not None and pool in self._storage_bandwidth:  # what the pool has shown
                self._set_storage_bandwidth(state, self._pooled(state, self._storage_bandwidth[pool]))
        return state

    def _pool_of(self, state: _EngineState) -> _Pool | None:
        return self._pools.get(state.prior) if self.calibration.pool_observations > 0 else None

    def estimates(self, engine_id: str) -> EngineCosts:
        """The current estimate for ``engine_id`` (its prior when nothing was measured yet)."""
        state = self._engines.get(engine_id)  # (per engine per request: ``_state`` only for a new one)
        return (state if state is not None else self._state(engine_id)).current

    def set_prior(self, engine_id: str, prior: EngineCosts) -> None:
        """Replace an engine's prior (e.g. an engine added at runtime) and restart its estimate."""
        self._engine_priors[engine_id] = prior.validate(f"costs.engines.{engine_id}")
        old = self._engines.pop(engine_id, None)
        if old is not None:
            self._pool_members[old.prior].remove(engine_id)
            pool = self._pools.get(old.prior)
            if pool is not None:
                pool.remove(old)

    def set_storage_pool(self, engine_id: str, pool: str) -> None:
        """``engine_id`` mounts the shared STORAGE pool ``pool`` ("" = none): with
        ``calibration.shared_storage`` its STORAGE load bandwidth is the pool's."""
        if not pool:
            self._storage_pool_of.pop(engine_id, None)
            return
        self._storage_pool_of[engine_id] = pool
        state = self._engines.get(engine_id)
        if state is not None and pool in self._storage_bandwidth:
            self._set_storage_bandwidth(state, self._pooled(state, self._storage_bandwidth[pool]))

    def storage_pool_of(self, engine_id: str) -> str | None:
        """The shared STORAGE pool ``engine_id`` mounts (``set_storage_pool``), else None."""
        return self._storage_pool_of.get(engine_id)

    def _pooled(self, state: _EngineState, pool_bytes_per_s: float) -> float:
        """A pool member's STORAGE figure: its own, within ``pool_spread`` of the pool's (the pool's
        while it has measured nothing of its own)."""
        own = state.own_storage_bps
        spread = self.calibration.pool_spread
        if own is None or spread == 1:
            return pool_bytes_per_s
        return min(max(own, pool_bytes_per_s / spread), pool_bytes_per_s * spread)

    def _set_storage_bandwidth(self, state: _EngineState, bytes_per_s: float) -> None:
        """A pool member's STORAGE bandwidth set to the pool's measurement (within its drift
        bound): measured by counters, so the TTFT regression leaves it alone."""
        bandwidth = list(state.current.load_bandwidth_bytes_per_s)
        bandwidth[Tier.STORAGE] = self._bounded(
            bytes_per_s, state.prior.load_bandwidth_bytes_per_s[Tier.STORAGE]
        )
        state.current = replace(
            state.current, load_bandwidth_bytes_per_s=(bandwidth[0], bandwidth[1], bandwidth[2])
        )
        state.counter_tiers.add(Tier.STORAGE)

    # -- learning from engine metrics -------------------------------------------------------

    def update_offload_counters(
        self,
        engine_id: str,
        load_bytes_by_tier: Mapping[Tier, float],
        load_time_s_by_tier: Mapping[Tier, float],
        now: float,
    ) -> list[tuple[Tier, float, float]]:
        """Feed cumulative offload-load counters scraped from an engine's /metrics.

        A counter that went backwards means the engine restarted: the baseline restarts. Deltas
        smaller than ``min_metrics_bytes`` keep accumulating until they are large enough to time.
        Returns (tier, measured bytes/s, the bound it lies beyond) for every sample outside
        [prior / max_drift, prior x max_drift]: a figure the estimate can never reach, whose
        prior is set for other hardware (the router logs it).
        """
        beyond: list[tuple[Tier, float, float]] = []
        state = self._state(engine_id)
        cal = self.calibration
        bandwidth = list(state.current.load_bandwidth_bytes_per_s)
        changed = False
        for tier, bytes_total in load_bytes_by_tier.items():
            time_total_s = load_time_s_by_tier.get(tier)
            if time_total_s is None or tier == Tier.GPU:
                continue
            base = state.baselines.get(tier)
            if base is None or bytes_total < base.bytes_total or time_total_s < base.time_total_s:
                state.baselines[tier] = _CounterBaseline(bytes_total, time_total_s)
                continue
            delta_bytes = bytes_total - base.bytes_total
            delta_s = time_total_s - base.time_total_s
            if delta_bytes < cal.min_metrics_bytes or delta_s <= 0:
                continue
            measured = delta_bytes / delta_s
            prior_bw = state.prior.load_bandwidth_bytes_per_s[tier]
            if self._bounded(measured, prior_bw) != measured:
                beyond.append((tier, measured, self._bounded(measured, prior_bw)))
            pool = (
                self._storage_pool_of.get(engine_id)
                if tier == Tier.STORAGE and math.isfinite(cal.pool_spread)
                else None
            )
            if pool is not None:  # one figure for the pool, from every member's loads
                own = state.own_storage_bps
                own = measured if own is None else _ewma_log(own, measured, cal.metrics_weight)
                state.own_storage_bps = own
                shared = self._storage_bandwidth.get(pool, math.inf)
                shared = measured if math.isinf(shared) else _ewma_log(shared, measured, cal.metrics_weight)
                self._storage_bandwidth[pool] = shared
                for member, member_pool in self._storage_pool_of.items():
                    if member_pool == pool and member != engine_id and member in self._engines:
                        member_state = self._engines[member]
                        self._set_storage_bandwidth(member_state, self._pooled(member_state, shared))
                bandwidth[tier] = self._pooled(state, shared)
            elif math.isinf(bandwidth[tier]):
                bandwidth[tier] = measured
            else:
                bandwidth[tier] = _ewma_log(bandwidth[tier], measured, cal.metrics_weight)
            bandwidth[tier] = self._bounded(bandwidth[tier], state.prior.load_bandwidth_bytes_per_s[tier])
            state.baselines[tier] = _CounterBaseline(bytes_total, time_total_s)
            state.counter_tiers.add(tier)
            state.metric_samples += 1
            changed = True
        if changed:
            state.current = replace(
                state.current, load_bandwidth_bytes_per_s=(bandwidth[0], bandwidth[1], bandwidth[2])
            )
            state.last_update_s = now
        return beyond

    # -- learning from the router's own observations ----------------------------------------

    def observe(
        self,
        engine_id: str,
        parts: PredictedParts,
        observed_ttft_s: float,
        cached_tokens: float | None,
        now: float,
    ) -> EngineCosts:
        """Calibrate with one finished request; returns the new estimate.

        ``cached_tokens`` (usage.prompt_tokens_details.cached_tokens, all tiers) corrects the
        predicted split first: a shortfall is taken from the deepest tier first and added to the
        prefill; extra cached tokens beyond the prediction are assumed GPU hits. It also feeds the
        index self-check. The features are rebuilt from the priors and the corrected split, so
        a late observation is compared with today's fit, not with the model that routed it. A
        tier whose bandwidth the engine's own offload counters measure keeps that measurement.
        """
        state = self._state(engine_id)
        hits = list(parts.hit_tokens)
        prefill_tokens = parts.prefill_tokens
        if cached_tokens is not None:
            predicted_hits = sum(hits)
            self.selfcheck.observe(engine_id, predicted_hits, cached_tokens)
            shortfall = max(0.0, predicted_hits - cached_tokens)
            for tier in reversed(TIERS):
                taken = min(hits[tier], shortfall)
                hits[tier] -= taken
                shortfall -= taken
            extra = max(0.0, min(cached_tokens - predicted_hits, prefill_tokens))
            hits[Tier.GPU] += extra
            prefill_tokens = prefill_tokens + predicted_hits - sum(hits)
        if not observed_ttft_s > 0 or not math.isfinite(observed_ttft_s):
            return state.current
        cal = self.calibration
        prior = state.prior
        kvb = prior.kv_bytes_per_token
        latency_s = sum(prior.load_latency_s[t] for t in TIERS if hits[t] > 0)
        x = [
            1.0,
            prior.prefill_time_s(prefill_tokens),
            0.0
            if math.isinf(prior.load_bandwidth_bytes_per_s[Tier.CPU])
            else hits[Tier.CPU] * kvb / prior.load_bandwidth_bytes_per_s[Tier.CPU],
            0.0
            if math.isinf(prior.load_bandwidth_bytes_per_s[Tier.STORAGE])
            else hits[Tier.STORAGE] * kvb / prior.load_bandwidth_bytes_per_s[Tier.STORAGE],
            prior.prefill_time_s(parts.wait_tokens),
        ]
        rls = state.rls
        predicted_s = latency_s + sum(t * xi for t, xi in zip(rls.theta, x, strict=True))
        if parts.in_flight > cal.clean_in_flight:
            # Placed behind other requests: what the TTFT has beyond the service and prefill-queue
            # prediction is the wait for a slot. Least squares through the origin on the number in
            # flight, with the same forgetting; the rates are left alone (see clean_in_flight).
            f = cal.forgetting
            state.slot_sxy = f * state.slot_sxy + parts.in_flight * (observed_ttft_s - predicted_s)
            state.slot_sxx = f * state.slot_sxx + parts.in_flight * parts.in_flight
            slot_s = min(MAX_SLOT_S_PER_REQUEST, max(0.0, state.slot_sxy / state.slot_sxx))
            current = state.current
            state.current = _updated(
                current, current.prefill_tokens_per_s, current.load_bandwidth_bytes_per_s, slot_s
            )
            state.slot_observations += 1
            state.observations += 1
            state.last_update_s = now
            return state.current
        if predicted_s > 0:
            observed_ttft_s = min(
                predicted_s * cal.max_ratio, max(predicted_s / cal.max_ratio, observed_ttft_s)
            )
        # Weighted by 1 / prediction: relative errors count, as TTFT noise grows with the TTFT
        # (a 5% jitter on a 2 s prefill must not drown a 20 ms load term of another request).
        weight = 1.0 / max(predicted_s, 1e-3)
        wx, wy = [v * weight for v in x], (observed_ttft_s - latency_s) * weight
        loaded = {tier for k, tier in ((2, Tier.CPU), (3, Tier.STORAGE)) if x[k] > 0}
        pool = None
        if cal.pool_observations > 0:
            pool = self._pools.get(prior)
            if pool is None:
                pool = self._pools[prior] = _Pool()
            pool.remove(state)  # its contribution before this observation; added back below
        _rls_update(rls, wx, wy, cal.forgetting)
        _bound_theta(rls.theta, cal.max_drift)
        state.observations += 1
        state.last_update_s = now
        if pool is not None:
            for k in (1, 2, 3):
                state.evidence[k] *= cal.forgetting
                if x[k] > 0:
                    state.evidence[k] += 1.0
            pool.add(state)
            if pool.moved():  # the twins' mean moved noticeably: every twin's estimate follows
                for member in self._pool_members[prior]:
                    self._refresh(self._engines[member], loaded if member == engine_id else set())
                pool.settle()
                return state.current
        self._refresh(state, loaded)
        return state.current

    def _refresh(self, state: _EngineState, loaded: set[Tier]) -> None:
        """Derive ``state.current``'s prefill rate and uncounted tier bandwidths from the fit: the
        engine's own multipliers, or with pooling their weighted mean with its twins' in log
        space (the engine's own weight is its evidence, the twins' ``pool_observations``).
        ``loaded``: the tiers the observation just fitted had a load from."""
        prior = state.prior
        rls = state.rls
        theta = list(rls.theta)
        pool = self._pool_of(state)
        if pool is not None:
            w_pool = self.calibration.pool_observations
            for k in (1, 2, 3):
                twins = pool.mean_log(k)
                if twins is not None:
                    own = state.evidence[k]
                    theta[k] = math.exp((own * math.log(theta[k]) + w_pool * twins) / (own + w_pool))
        bandwidth = list(state.current.load_bandwidth_bytes_per_s)
        for k, tier in ((2, Tier.CPU), (3, Tier.STORAGE)):
            if tier in state.counter_tiers:
                continue  # measured by the engine itself: more direct than a TTFT regression
            observed = tier in loaded or rls.cov[k][k] < _P0[k]
            if pool is not None:
                observed = observed or pool.mean_log(k) is not None
            if observed:  # this tier was ever observed (here, or with pooling on a twin)
                bandwidth[tier] = prior.load_bandwidth_bytes_per_s[tier] / theta[k]
        state.current = _updated(
            state.current,
            prior.prefill_tokens_per_s / theta[1],
            (bandwidth[0], bandwidth[1], bandwidth[2]),
            state.current.slot_s_per_request,
        )

    def overhead_s(self, engine_id: str) -> float:
        """The calibration's estimate of the fixed seconds every request pays on ``engine_id``."""
        return self._state(engine_id).rls.theta[0]

    def _bounded(self, value: float, prior: float) -> float:
        if math.isinf(prior):
            return value
        drift = self.calibration.max_drift
        return min(prior * drift, max(prior / drift, value))

    def index_trusted(self, engine_id: str) -> bool:
        """The self-check's verdict: False -> set EngineView.index_trusted False (and re-announce)."""
        return engine_id not in self.selfcheck.untrusted  # (its ``trusted``, one call less per engine)

    # -- exposition -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for /debug/costs (infinite bandwidth shown as null = no load)."""

        def costs_json(c: EngineCosts) -> dict[str, Any]:
            return {
                "prefill_tokens_per_s": c.prefill_tokens_per_s,
                "kv_bytes_per_token": c.kv_bytes_per_token,
                "slot_s_per_request": c.slot_s_per_request,
                "tiers": {
                    t.name.lower(): {
                        "bandwidth_bytes_per_s": None
                        if math.isinf(c.load_bandwidth_bytes_per_s[t])
                        else c.load_bandwidth_bytes_per_s[t],
                        "latency_s": c.load_latency_s[t],
                    }
                    for t in TIERS
                },
            }

        return {
            "engines": {
                e: {
                    "estimate": costs_json(s.current),
                    "prior": costs_json(s.prior),
                    "observations": s.observations,
                    "slot_observations": s.slot_observations,
                    "overhead_s": s.rls.theta[0],
                    "metric_samples": s.metric_samples,
                    "last_update_s": s.last_update_s,
                    "index_trusted": self.selfcheck.trusted(e),
                }
                for e, s in sorted(self._engines.items())
            },
            "selfcheck": self.selfcheck.snapshot(),
            "calibration": {  # (an infinite storage_spread, off, as null: JSON has no infinity)
                k: None if isinstance(v, float) and math.isinf(v) else v
                for k, v in asdict(self.calibration).items()
            },
        }

    def gauge_values(self) -> list[tuple[str, dict[str, str], float]]:
        """(metric name, labels, value) rows for the router's /metrics; infinite values omitted."""
        rows: list[tuple[str, dict[str, str], float]] = []
        for engine_id, state in sorted(self._engines.items()):
            c = state.current
            rows.append(
                ("kvroute_cost_prefill_tokens_per_second", {"engine": engine_id}, c.prefill_tokens_per_s)
            )
            rows.append(
                ("kvroute_cost_slot_seconds_per_request", {"engine": engine_id}, c.slot_s_per_request)
            )
            for tier in TIERS:
                labels = {"engine": engine_id, "tier": tier.name}
                if not math.isinf(c.load_bandwidth_bytes_per_s[tier]):
                    rows.append(
                        (
                            "kvroute_cost_load_bandwidth_bytes_per_second",
                            labels,
                            c.load_bandwidth_bytes_per_s[tier],
                        )
                    )
                rows.append(("kvroute_cost_load_latency_seconds", labels, c.load_latency_s[tier]))
            rows.append(
                (
                    "kvroute_index_trusted",
                    {"engine": engine_id},
                    1.0 if self.selfcheck.trusted(engine_id) else 0.0,
                )
            )
        return rows


class _Pool:
    """The engines that share a prior, as sums over their own fits: per multiplier (prefill, CPU,
    STORAGE) the evidence-weighted sum of log multipliers and the sum of evidence. Kept
    incrementally (an engine's old contribution out, its new one in), so an observation costs the
    same whatever the fleet's size; the twins' estimates are re-derived only when the pool's mean
    moved by more than 1% since they last were."""

    __slots__ = ("_settled", "weight", "weighted_log")

    #: A change of the pool's mean (in log space) below which the twins are not re-derived.
    _MOVE = 0.01

    def __init__(self) -> None:
        self.weighted_log = [0.0, 0.0, 0.0, 0.0]
        self.weight = [0.0, 0.0, 0.0, 0.0]
        self._settled: list[float | None] = [None, None, None, None]

    def _apply(self, state: _EngineState, sign: float) -> None:
        for k in (1, 2, 3):
            w = state.evidence[k]
            if w > 0:
                self.weight[k] += sign * w
                self.weighted_log[k] += sign * w * math.log(state.rls.theta[k])

    def add(self, state: _EngineState) -> None:
        self._apply(state, 1.0)

    def remove(self, state: _EngineState) -> None:
        self._apply(state, -1.0)

    def mean_log(self, k: int) -> float | None:
        """The evidence-weighted mean log multiplier k of the pool; None before any evidence."""
        w = self.weight[k]
        return self.weighted_log[k] / w if w > 1e-9 else None

    def moved(self) -> bool:
        for k in (1, 2, 3):
            now, then = self.mean_log(k), self._settled[k]
            if (now is None) != (then is None) or (
                now is not None and then is not None and abs(now - then) > self._MOVE
            ):
                return True
        return False

    def settle(self) -> None:
        self._settled = [None, self.mean_log(1), self.mean_log(2), self.mean_log(3)]


def _bound_theta(theta: list[float], drift: float) -> None:
    """The overhead within [0, _MAX_OVERHEAD_S]; the multipliers within [1 / drift, drift]."""
    theta[0] = min(_MAX_OVERHEAD_S, max(0.0, theta[0]))
    for k in (1, 2, 3, 4):
        theta[k] = min(drift, max(1.0 / drift, theta[k]))


def _updated(
    costs: EngineCosts,
    prefill_tokens_per_s: float,
    load_bandwidth_bytes_per_s: tuple[float, float, float],
    slot_s_per_request: float,
) -> EngineCosts:
    """``costs`` with the three learned figures replaced: ``dataclasses.replace`` without its walk
    over the fields (~160 bytecodes at every streamed answer's TTFT observation; round dp20).
    Every field is named here (tests/test_calibration.py checks that none is left out)."""
    return EngineCosts(
        prefill_tokens_per_s=prefill_tokens_per_s,
        load_bandwidth_bytes_per_s=load_bandwidth_bytes_per_s,
        load_latency_s=costs.load_latency_s,
        kv_bytes_per_token=costs.kv_bytes_per_token,
        slot_s_per_request=slot_s_per_request,
    )


def _rls_update(rls: _Rls, x: list[float], y: float, forgetting: float) -> None:
    """One recursive-least-squares step with forgetting; the covariance of directions the data do
    not excite is capped at its initial value (no wind-up while, e.g., no STORAGE hit arrives).

    Written out for the five parameters (tuple unpacking, one list per row; no index arithmetic
    nor generator per element: ~1,200 bytecodes and ~8 µs instead of ~2,200 and ~13 at every
    streamed answer's finish at c1, round dp23), with every float operation of the element-wise
    form, in its order:
    each sum starts at 0 and adds its products left to right, as ``sum`` does
    (tests/test_calibration.py compares the two bit for bit)."""
    cov = rls.cov
    x0, x1, x2, x3, x4 = x
    px = [0.0 + r[0] * x0 + r[1] * x1 + r[2] * x2 + r[3] * x3 + r[4] * x4 for r in cov]
    p0, p1, p2, p3, p4 = px
    denom = forgetting + (0.0 + x0 * p0 + x1 * p1 + x2 * p2 + x3 * p3 + x4 * p4)
    if denom <= 0:
        return
    theta = rls.theta
    t0, t1, t2, t3, t4 = theta
    error = y - (0.0 + t0 * x0 + t1 * x1 + t2 * x2 + t3 * x3 + t4 * x4)
    gain = (p0 / denom, p1 / denom, p2 / denom, p3 / denom, p4 / denom)
    g0, g1, g2, g3, g4 = gain
    theta[:] = (t0 + g0 * error, t1 + g1 * error, t2 + g2 * error, t3 + g3 * error, t4 + g4 * error)
    f = forgetting
    for row, g in zip(cov, gain, strict=True):
        c0, c1, c2, c3, c4 = row
        row[:] = (
            (c0 - g * p0) / f,
            (c1 - g * p1) / f,
            (c2 - g * p2) / f,
            (c3 - g * p3) / f,
            (c4 - g * p4) / f,
        )
    for i, cap in enumerate(_P0):
        row = cov[i]
        if row[i] > cap:
            # Row i, then column i: the diagonal element is scaled twice, every other once (the
            # element-wise loop's products; each element's scalings in the same order).
            scale = math.sqrt(cap / row[i])
            row[:] = [v * scale for v in row]
            for other in cov:
                other[i] *= scale


def _ewma_log(old: float, measured: float, weight: float) -> float:
    """One EWMA step in log space (a 10x outlier moves it as much as a 10x drop the other way)."""
    return math.exp(math.log(old) + weight * math.log(measured / old))
