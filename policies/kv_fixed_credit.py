"""kv_fixed_credit: the peers' rule - fixed credits per tier instead of measured costs.

cost_blocks_e = prompt_blocks - sum_t credit_t x hit_blocks_e,t + decode_blocks_per_request x in_flight_e
(credits GPU 1.0, CPU 0.8, STORAGE 0.3 by default). Lowest cost wins; ties: fewer in-flight, then a
hash of (request_id, engine_id). The baseline that ``tier_cost`` must beat when the guess is wrong.
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
    register,
    require_engines,
)
from policies.tier_cost import tiebreak

DEFAULT_CREDITS: dict[str, float] = {"gpu": 1.0, "cpu": 0.8, "storage": 0.3}


@register("kv_fixed_credit")
class KvFixedCreditPolicy(BasePolicy):
    """Prefill blocks minus credited hit blocks, plus a load term, all in blocks."""

    name = "kv_fixed_credit"
    uses_index = True

    def __init__(
        self, *, credits: Mapping[str, float] | None = None, decode_blocks_per_request: float = 8.0
    ) -> None:
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

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        engines = require_engines(fleet, self.name)
        prompt_blocks = max(len(request.block_keys), -(-request.prompt_tokens // max(1, request.block_size)))
        scores: dict[str, dict[str, float]] = {}
        for engine in engines:
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
            }
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
        return Decision(
            chosen, self.name, reason=reason, scores=scores, fallbacks=tuple(e.engine_id for e in order[1:])
        )
