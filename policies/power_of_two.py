"""power_of_two: sample two engines at random, send to the less loaded (power of two choices).

Near least_loaded's balance with only two looks, and less herding when many router replicas
act on stale load numbers. Load = (in_flight, queued_prefill_tokens), ties at random.
"""

from __future__ import annotations

import random

from policies.base import (
    BasePolicy,
    Decision,
    FleetView,
    RouteRequest,
    load_key,
    load_scores,
    register,
    require_engines,
)


@register("power_of_two")
class PowerOfTwoPolicy(BasePolicy):
    name = "power_of_two"
    uses_index = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        engines = list(require_engines(fleet, self.name))
        sampled = self._rng.sample(engines, k=min(2, len(engines)))
        pair = sorted(sampled, key=load_key)
        if len(pair) == 2 and load_key(pair[0]) == load_key(pair[1]):
            pair = sampled  # random order among equals (sample order is random)
        best = pair[0]
        rest = sorted((e for e in engines if e not in sampled), key=load_key)
        return Decision(
            engine_id=best.engine_id,
            policy=self.name,
            reason=f"less loaded of {', '.join(e.engine_id for e in sampled)}",
            scores=load_scores(pair),
            fallbacks=tuple(e.engine_id for e in [*pair[1:], *rest]),
        )
