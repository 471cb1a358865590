"""tier_cost: route each request to the engine with the lowest predicted time to first token.

For engine e (all times in seconds, token counts in tokens, bandwidths in bytes/s):

    wait_s    = wait_tokens_e / prefill_tokens_per_s_e
    load_s[t] = hit_tokens_e,t x kv_bytes_per_token / load_bandwidth_e,t + load_latency_e,t  (if hits)
    prefill_s = (prompt_tokens - sum_t hit_tokens_e,t) / prefill_tokens_per_s_e
    slot_s    = in_flight_e x slot_s_per_request_e   (wait for KV memory / a running slot, learned;
                or the admission wait for this prompt's whole sequence where the router prices it,
                optionally only for a prompt no engine holds much of: policies.costs
                .admission_wait_parts)
    read_wait_s = the traffic the router has booked ahead on e's shared STORAGE pool, if this
                request reads STORAGE there and the router books it (policies.costs
                .storage_read_parts; costs.storage_pool_bandwidth); else 0
    total_s   = wait_s + slot_s + read_wait_s + sum_t load_s[t] + prefill_s   (the predicted TTFT)
    work_s    = work_weight x (sum_t load_s[t] + prefill_s)
    cost_s    = total_s + work_s + decode_s + pressure_s                  (what is minimised)
                (on a priority engine whose router gives each request's deadline offset, a turn
                moved off the engine holding its history is priced at least at that offset while
                the engine has a queue: policies.costs.deadline_floor_s, off unless the router
                sets it; and, where the router gives the turns it queued on the engine, plus what
                the placement costs them, its service delaying those with later deadlines and
                its KV displacing their cached histories: policies.costs.externality_s, round q13)

    wait_tokens_e = max(queued_prefill_tokens_e, num_requests_waiting_e x tokens per queued request)
                    (on an engine with ``EngineView.queued_ahead``, a priority engine priced as it
                    serves: only the queued prefill ahead of this request; policies.costs
                    .priority_wait_parts)
    decode_s      = decode_s_per_running x running requests (decode steps share the GPU with prefill)
    pressure_s    = pressure_s_at_full x max(0, kv_cache_usage - pressure_threshold)
                    / (1 - pressure_threshold)           (a near-full pool evicts and preempts)
                    + pressure_s_per_waiting x num_requests_waiting, past the threshold only
                    (a request waiting on a full pool waits for running ones to free memory, which
                    wait_s, the queued prefill at the engine's rate, does not see: round q30; 0 =
                    off)

``work_s`` prices what greedy TTFT minimisation ignores: the GPU time this request takes delays every
request queued behind it on that engine, and re-computing a history on an idle engine leaves a copy
behind (the fleet's HBM holds fewer conversations, so later turns miss). Both grow with the work the
request brings, so a conversation stays where its history is unless the queue there is really long.

Hit tokens come from ``request.prefix_matches`` (blocks x block_size, at best tier); on an engine whose
index is not trusted they are multiplied by ``stale_hit_factor`` and the rest counted as prefill.
Costs come from ``fleet.costs`` (the caller's ``policies.costs.CostEstimates``: the router's and the
DES's calibrated ``kvcore.calibration.CostModel``) or from this policy's own fixed priors.
Engines with no GPU or CPU hit (at most the shared storage pool's copy) differ only by queue and
rates: they get the same cost formula in a cheap loop, and only the ``keep_unmatched`` best of them
get full scores and explanation dicts (O(engines with local hits + a few) dicts per request).
The explanation (the reason line and the score dicts) is built only when something reads it
(``Decision`` takes functions for both), from the parts and terms fixed at the choice.
Ties go to fewer in-flight requests, then to a hash of (request_id, engine_id). With
``temperature_s > 0`` the choice is a softmax over -cost_s / temperature_s, seeded per request.
"""

from __future__ import annotations

import heapq
import math
import operator
import random
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import xxhash

from policies.base import (
    NO_MATCH,
    TIERS,
    BasePolicy,
    Decision,
    EngineView,
    FleetView,
    RouteRequest,
    engine_id_of,
    hit_tokens_by_tier,
    max_hit_tokens,
    prompt_tokens_of,
    register,
    require_engines,
    tiebreak,
    wait_tokens_of,
)
from policies.costs import (
    DEADLINE_OFFSET_KEY,
    QUEUED_TURNS_KEY,
    CostEstimates,
    PredictedParts,
    PriorCosts,
    best_cached_fraction,
    deadline_floor_s,
    engine_wait_parts,
    placement_externality_s,
    predict_parts,
    priority_wait_parts,
)

#: Per tier: its index and its name (for the reason text).
_TIER_NAMES = tuple((int(t), t.name) for t in TIERS)


#: Two costs further apart than this keep their strict order when rounded to the microsecond
#: (each moves at most half a microsecond, and float error is far below that).
_CLEAR_GAP_S = 2e-6


#: The cost and the engine of a (cost, engine) pair.
_cost_of = operator.itemgetter(0)
_engine_of = operator.itemgetter(1)


def _reason(
    how: str,
    engine_id: str,
    parts: PredictedParts,
    work_s: float,
    runner_up: str | None,
    runner_up_cost_s: float,
) -> str:
    """The decision's reason line: the chosen engine's predicted parts and work, and the runner-up's
    cost (written when first read: ``Decision.reason``)."""
    load_s, hit_tokens = parts.load_s, parts.hit_tokens
    loads = [f"load {name} {load_s[tier]:.4f}" for tier, name in _TIER_NAMES if hit_tokens[tier] > 0]
    slot_s, read_wait_s = parts.slot_s, parts.read_wait_s
    reason = (
        f"{how}: {engine_id} TTFT {parts.total_s:.4f} s = wait {parts.wait_s:.4f}"
        f"{' + slot ' + format(slot_s, '.4f') if slot_s else ''}"
        f"{' + storage read queue ' + format(read_wait_s, '.4f') if read_wait_s else ''}"
        f"{' + ' + ' + '.join(loads) if loads else ''} + prefill {parts.prefill_s:.4f}"
        f" ({parts.prefill_tokens:.0f} tokens) + work {work_s:.4f}"
    )
    if runner_up is not None:
        reason += f"; next {runner_up} cost {runner_up_cost_s:.4f} s"
    return reason


def _scores(
    parts_by_engine: Mapping[str, PredictedParts],
    terms: Mapping[str, tuple[float, float, float, float, float]],
) -> dict[str, dict[str, float]]:
    """The decision's scores: per engine its parts' scores and the terms tier_cost added."""
    scores = {}
    for engine_id, parts in parts_by_engine.items():
        score = scores[engine_id] = parts.as_scores()
        (
            score["work_s"],
            score["decode_s"],
            score["pressure_s"],
            score["cost_s"],
            score["index_trusted"],
        ) = terms[engine_id]
    return scores


def _priced_total_s(
    parts: PredictedParts, engine: EngineView, request: RouteRequest, prompt_tokens: int, costs: CostEstimates
) -> float:
    """``parts.total_s``, raised to the engine's deadline floor where the router gives one
    (``DEADLINE_OFFSET_KEY``: policies.costs.deadline_floor_s), plus what the placement costs the
    turns queued there where the router gives them (``QUEUED_TURNS_KEY``: policies.costs
    .externality_s); each off unless it is set."""
    extra = engine.extra
    total_s = parts.total_s
    if DEADLINE_OFFSET_KEY in extra:
        total_s = deadline_floor_s(parts, engine, prompt_tokens, best_cached_fraction(request, prompt_tokens))
    if QUEUED_TURNS_KEY in extra:
        total_s += placement_externality_s(
            parts, engine, request, prompt_tokens, costs.estimates(engine.engine_id)
        )
    return total_s


@register("tier_cost")
class TierCostPolicy(BasePolicy):
    """Minimum predicted TTFT across engines, pricing each tier's hits by measured load cost."""

    name = "tier_cost"
    uses_index = True

    def __init__(
        self,
        *,
        stale_hit_factor: float = 0.5,
        decode_s_per_running: float = 0.0005,
        work_weight: float = 1.0,
        keep_unmatched: int = 3,
        pressure_threshold: float = 0.9,
        pressure_s_at_full: float = 0.05,
        pressure_s_per_waiting: float = 0.0,
        temperature_s: float = 0.0,
        seed: int = 0,
        costs: Mapping[str, Any] | None = None,
    ) -> None:
        """``costs``: priors used when the caller passes no ``fleet.costs`` (PriorCosts.from_config keys)."""
        if not 0.0 <= stale_hit_factor <= 1.0:
            raise ValueError(f"tier_cost.stale_hit_factor must be in [0, 1], got {stale_hit_factor}")
        if not 0.0 <= pressure_threshold < 1.0:
            raise ValueError(f"tier_cost.pressure_threshold must be in [0, 1), got {pressure_threshold}")
        if (
            min(temperature_s, decode_s_per_running, pressure_s_at_full, pressure_s_per_waiting, work_weight)
            < 0
        ):
            raise ValueError(
                "tier_cost: temperature_s, decode_s_per_running, pressure_s_at_full, pressure_s_per_waiting,"
                " work_weight must be >= 0"
            )
        if keep_unmatched < 1:
            raise ValueError(f"tier_cost.keep_unmatched must be >= 1, got {keep_unmatched}")
        self.work_weight = work_weight
        self.keep_unmatched = keep_unmatched
        self.stale_hit_factor = stale_hit_factor
        self.decode_s_per_running = decode_s_per_running
        self.pressure_threshold = pressure_threshold
        self.pressure_s_at_full = pressure_s_at_full
        self.pressure_s_per_waiting = pressure_s_per_waiting
        self.temperature_s = temperature_s
        self.seed = seed
        self._own_costs = PriorCosts.from_config(costs)

    def predict(self, request: RouteRequest, engine: EngineView, costs: CostEstimates) -> PredictedParts:
        """The predicted TTFT parts of ``request`` on ``engine``."""
        return self._predict(request, engine, costs, prompt_tokens_of(request))

    def _predict(
        self, request: RouteRequest, engine: EngineView, costs: CostEstimates, prompt_tokens: int
    ) -> PredictedParts:
        engine_id = engine.engine_id
        hits = hit_tokens_by_tier(
            request.prefix_matches.get(engine_id, NO_MATCH), request.block_size, prompt_tokens
        )
        if not engine.index_trusted:
            factor = self.stale_hit_factor
            hits = (hits[0] * factor, hits[1] * factor, hits[2] * factor)
        est = costs.estimates(engine_id)
        parts = predict_parts(
            est,
            hits,
            prompt_tokens - sum(hits),
            wait_tokens_of(engine, prompt_tokens),
            float(engine.in_flight),
        )
        if engine.queued_ahead is not None:
            parts = priority_wait_parts(est, parts, engine)
        # Only an engine with extra numbers can price an admission or read wait (skip the call otherwise).
        return engine_wait_parts(parts, engine, request, prompt_tokens) if engine.extra else parts

    def secondary_s(self, engine: EngineView) -> tuple[float, float]:
        """(decode_s, pressure_s): the documented secondary terms."""
        running = engine.num_requests_running if engine.num_requests_running is not None else engine.in_flight
        decode_s = self.decode_s_per_running * running
        pressure_s = 0.0
        if engine.kv_cache_usage is not None and engine.kv_cache_usage > self.pressure_threshold:
            excess = (engine.kv_cache_usage - self.pressure_threshold) / (1.0 - self.pressure_threshold)
            pressure_s = self.pressure_s_at_full * min(1.0, excess)
            if self.pressure_s_per_waiting and engine.num_requests_waiting:
                pressure_s += self.pressure_s_per_waiting * engine.num_requests_waiting
        return decode_s, pressure_s

    def _remote_cost_s(self, request: RouteRequest, engine: EngineView, costs: CostEstimates) -> float:
        """cost_s of an engine holding nothing of the prompt locally (no GPU or CPU blocks; at most
        the shared STORAGE pool's): the full formula, without building the explanation."""
        prompt_tokens = prompt_tokens_of(request)
        est = costs.estimates(engine.engine_id)
        match = request.prefix_matches.get(engine.engine_id, NO_MATCH)
        hit = float(min(match.blocks_by_tier[2] * request.block_size, max_hit_tokens(prompt_tokens)))
        if not engine.index_trusted:
            hit *= self.stale_hit_factor
        wait_tokens = wait_tokens_of(engine, prompt_tokens)
        parts = predict_parts(est, (0.0, 0.0, hit), prompt_tokens - hit, wait_tokens, float(engine.in_flight))
        if engine.queued_ahead is not None:
            parts = priority_wait_parts(est, parts, engine)
        parts = engine_wait_parts(parts, engine, request, prompt_tokens)
        decode_s, pressure_s = self.secondary_s(engine)
        total_s = parts.total_s
        if engine.extra:
            total_s = _priced_total_s(parts, engine, request, prompt_tokens, costs)
        return total_s + self.work_weight * parts.service_s + decode_s + pressure_s

    def _priced_engines(
        self, request: RouteRequest, all_engines: Sequence[EngineView], costs: CostEstimates
    ) -> Sequence[EngineView]:
        """The engines to price in full (of a fleet larger than ``keep_unmatched``): every engine
        when at most ``keep_unmatched`` hold nothing locally, else those with local (GPU or CPU)
        hits and the ``keep_unmatched`` best of the rest."""
        matches = request.prefix_matches

        def local(engine: EngineView) -> bool:
            by_tier = matches.get(engine.engine_id, NO_MATCH).blocks_by_tier
            return by_tier[0] + by_tier[1] > 0

        # Engines holding nothing locally (at most the shared storage pool's copy) differ only by
        # queue and rates: a cheap exact cost ranks them and the few best join the engines with GPU
        # or CPU hits for full pricing (a 1,000-engine fleet builds a handful of dicts).
        engines: list[EngineView] = [e for e in all_engines if local(e)]
        if len(all_engines) - len(engines) <= self.keep_unmatched:
            return all_engines
        return engines + heapq.nsmallest(
            self.keep_unmatched,
            (e for e in all_engines if not local(e)),
            key=lambda e: (
                round(self._remote_cost_s(request, e, costs), 6),
                e.in_flight,
                tiebreak(request.request_id, e.engine_id),
            ),
        )

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        all_engines = require_engines(fleet, self.name)
        costs: CostEstimates = fleet.costs if fleet.costs is not None else self._own_costs
        engines = (
            all_engines
            if len(all_engines) <= self.keep_unmatched  # nothing can be left out
            else self._priced_engines(request, all_engines, costs)
        )
        parts_by_engine: dict[str, PredictedParts] = {}
        #: Per engine: (work_s, decode_s, pressure_s, cost_s, index_trusted), the terms the scores
        #: add to its parts (the scores are built from them only if someone reads them).
        terms: dict[str, tuple[float, float, float, float, float]] = {}
        cost_by_engine: dict[str, float] = {}
        prompt_tokens = prompt_tokens_of(request)
        work_weight = self.work_weight
        priced: list[tuple[float, EngineView]] = []
        for engine in engines:
            engine_id = engine.engine_id
            parts = parts_by_engine[engine_id] = self._predict(request, engine, costs, prompt_tokens)
            decode_s, pressure_s = self.secondary_s(engine)
            service_s = parts.service_s  # once: total_s is the waits plus it (PredictedParts.total_s)
            work_s = work_weight * service_s
            total_s = parts.wait_s + parts.slot_s + parts.read_wait_s + service_s
            if engine.extra:
                total_s = _priced_total_s(parts, engine, request, prompt_tokens, costs)
            cost_s = cost_by_engine[engine_id] = total_s + work_s + decode_s + pressure_s
            terms[engine_id] = (work_s, decode_s, pressure_s, cost_s, 1.0 if engine.index_trusted else 0.0)
            priced.append((cost_s, engine))
        # The order is by (cost to the microsecond, in flight, a hash of request and engine): the
        # rounding makes equal predictions tie exactly despite float noise. Costs more than
        # _CLEAR_GAP_S apart keep their strict order when rounded, so when every cost is that far
        # from the next the order by cost alone is that order, with no rounding or hash computed.
        priced.sort(key=_cost_of)
        previous = -math.inf
        for cost_s, _ in priced:
            if not cost_s - previous > _CLEAR_GAP_S:  # (also false for a nan)
                order = self._rounded_order(request, engines, cost_by_engine)
                break
            previous = cost_s
        else:
            order = list(map(_engine_of, priced))
        chosen = order[0]
        how = "lowest predicted cost"
        if self.temperature_s > 0 and len(order) > 1:
            chosen = self._softmax_pick(request, order, cost_by_engine)
            how = f"softmax pick (temperature {self.temperature_s:g} s)"
        chosen_id = chosen.engine_id
        rest = order[1:] if chosen is order[0] else [e for e in order if e is not chosen]
        fallbacks = tuple(map(engine_id_of, rest))
        runner_up = fallbacks[0] if fallbacks else None
        # The explanation (reason line and scores) is built only if someone reads it (explain, a
        # debug log, horizon_cost), from the values priced here.
        reason = partial(
            _reason,
            how,
            chosen_id,
            parts_by_engine[chosen_id],
            terms[chosen_id][0],
            runner_up,
            cost_by_engine[runner_up] if runner_up is not None else 0.0,
        )
        scores = partial(_scores, parts_by_engine, terms)
        return Decision(chosen_id, self.name, reason, scores, fallbacks, parts_by_engine)

    @staticmethod
    def _rounded_order(
        request: RouteRequest, engines: Sequence[EngineView], cost_by_engine: Mapping[str, float]
    ) -> list[EngineView]:
        """``engines`` by (cost rounded to the microsecond, in flight), stable; the hash tiebreak
        is computed only when two engines tie on both."""
        ranks = {e.engine_id: (round(cost_by_engine[e.engine_id], 6), e.in_flight) for e in engines}
        if len(set(ranks.values())) == len(ranks):
            return sorted(engines, key=lambda e: ranks[e.engine_id])
        return sorted(engines, key=lambda e: (*ranks[e.engine_id], tiebreak(request.request_id, e.engine_id)))

    def _softmax_pick(
        self, request: RouteRequest, order: list[EngineView], cost_by_engine: Mapping[str, float]
    ) -> EngineView:
        best_s = cost_by_engine[order[0].engine_id]
        weights = [math.exp(-(cost_by_engine[e.engine_id] - best_s) / self.temperature_s) for e in order]
        rng = random.Random(xxhash.xxh3_64_intdigest(f"{self.seed}\x00{request.request_id}".encode()))
        return rng.choices(order, weights=weights, k=1)[0]
