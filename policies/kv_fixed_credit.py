"""kv_fixed_credit: the peers' rule - fixed credits per tier instead of measured costs.

cost_blocks_e = prompt_blocks - sum_t credit_t x hit_blocks_e,t + decode_blocks_per_request x in_flight_e
(credits GPU 1.0, CPU 0.8, STORAGE 0.3 by default). Lowest cost wins among engines that are not
overloaded (the peers' balance guard, ``policies.base.overloaded_engines``); ties: fewer in-flight,
then a hash of (request_id, engine_id). The baseline ``tier_cost`` must beat when the guess is wrong.

``home_fill`` > 0 (off by default) routes each conversation by ``policies.homing`` instead: home while
its engine's homed conversations fit home_fill x the local cache, else to the overflow engine (the
last; ``home_dedicated`` = 0: by the credits, every engine homing).
"""

from __future__ import annotations

from collections.abc import Mapping

from policies.base import (
    NO_MATCH,
    TIERS,
    BasePolicy,
    Decision,
    FleetView,
    RouteRequest,
    overloaded_engines,
    register,
    require_engines,
    tiebreak,
    validate_guard,
)
from policies.homing import ConversationHoming

DEFAULT_CREDITS: dict[str, float] = {"gpu": 1.0, "cpu": 0.8, "storage": 0.3}


@register("kv_fixed_credit")
class KvFixedCreditPolicy(BasePolicy):
    """Prefill blocks minus credited hit blocks, plus a load term, all in blocks."""

    name = "kv_fixed_credit"
    uses_index = True

    def __init__(
        self,
        *,
        credits: Mapping[str, float] | None = None,
        decode_blocks_per_request: float = 8.0,
        overload_factor: float = 3.0,
        min_in_flight: int = 4,
        min_queued_tokens: int = 16_384,
        home_fill: float = 0.0,
        home_dedicated: int = 1,
    ) -> None:
        """The guard (3x: tighter guards cost this policy its locality on B1b, see docs/benchmarks.md):
        an engine above ``overload_factor`` x the fleet mean of in-flight requests or
        queued prefill tokens (and above the floors) is skipped unless all are; without it a long
        shared prefix (an agent's system + tool prompt) pulls every request onto one engine."""
        validate_guard("kv_fixed_credit", overload_factor, min_in_flight, min_queued_tokens)
        self.overload_factor = overload_factor
        self.min_in_flight = min_in_flight
        self.min_queued_tokens = min_queued_tokens
        merged = dict(DEFAULT_CREDITS)
        for tier_name, credit in dict(credits or {}).items():
            key = str(tier_name).lower()
            if key not in DEFAULT_CREDITS:
                raise ValueError(
                    f"kv_fixed_credit.credits: unknown tier {tier_name!r}; accepted: gpu, cpu, storage"
                )
            merged[key] = float(credit)
        if decode_blocks_per_request < 0:
            raise ValueError("kv_fixed_credit.decode_blocks_per_request must be >= 0")
        self.credits = tuple(merged[t.name.lower()] for t in TIERS)
        self.decode_blocks_per_request = decode_blocks_per_request
        self.homing = ConversationHoming(home_fill, dedicated=bool(home_dedicated)) if home_fill else None

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        all_engines = require_engines(fleet, self.name)
        overloaded = overloaded_engines(
            all_engines,
            factor=self.overload_factor,
            min_in_flight=self.min_in_flight,
            min_queued_tokens=self.min_queued_tokens,
        )
        engines = [e for e in all_engines if e.engine_id not in overloaded] or list(all_engines)
        prompt_blocks = max(len(request.block_keys), -(-request.prompt_tokens // max(1, request.block_size)))
        scores: dict[str, dict[str, float]] = {}
        for engine in all_engines:
            match = request.prefix_matches.get(engine.engine_id, NO_MATCH)
            credited = sum(self.credits[t] * match.blocks_by_tier[t] for t in TIERS)
            load_blocks = self.decode_blocks_per_request * engine.in_flight
            scores[engine.engine_id] = {
                "prompt_blocks": float(prompt_blocks),
                "gpu_blocks": float(match.blocks_by_tier[0]),
                "cpu_blocks": float(match.blocks_by_tier[1]),
                "storage_blocks": float(match.blocks_by_tier[2]),
                "credited_blocks": credited,
                "load_blocks": load_blocks,
                "cost_blocks": prompt_blocks - credited + load_blocks,
                "in_flight": float(engine.in_flight),
                "overloaded": float(engine.engine_id in overloaded),
            }
        skipped = [e for e in all_engines if e.engine_id in overloaded and len(engines) < len(all_engines)]
        order = sorted(
            engines,
            key=lambda e: (
                round(scores[e.engine_id]["cost_blocks"], 9),
                e.in_flight,
                tiebreak(request.request_id, e.engine_id),
            ),
        )
        chosen = order[0].engine_id
        s = scores[chosen]
        reason = (
            f"lowest fixed-credit cost: {chosen} {s['cost_blocks']:.1f} blocks = {prompt_blocks} prompt"
            f" - {s['credited_blocks']:.1f} credited (GPU {s['gpu_blocks']:.0f}, CPU {s['cpu_blocks']:.0f},"
            f" STORAGE {s['storage_blocks']:.0f}) + {s['load_blocks']:.1f} load"
        )
        if len(engines) < len(all_engines):
            reason += f"; skipped overloaded {sorted(overloaded)}"
        fallbacks = tuple(e.engine_id for e in [*order[1:], *skipped])
        homed = self.homing.plan(request, all_engines) if self.homing is not None else None
        if homed is not None:
            fallbacks = tuple(e for e in (chosen, *fallbacks) if e != homed[0])
            chosen, reason = homed[0], f"{homed[1]}; not {reason}"
        return Decision(chosen, self.name, reason=reason, scores=scores, fallbacks=fallbacks)

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        if self.homing is not None:
            self.homing.commit(request.request_id)
