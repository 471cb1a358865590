"""least_loaded: the engine with the fewest requests in flight from this router.

Score = (in_flight, queued_prefill_tokens); ties are broken at random (seeded) so an idle fleet
still spreads requests instead of piling them on the first engine.
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


@register("least_loaded")
class LeastLoadedPolicy(BasePolicy):
    name = "least_loaded"
    uses_index = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        engines = list(require_engines(fleet, self.name))
        # Random tie-break: shuffle, then a stable sort keeps the shuffled order among equals.
        self._rng.shuffle(engines)
        order = sorted(engines, key=load_key)
        best = order[0]
        return Decision(
            engine_id=best.engine_id,
            policy=self.name,
            reason=f"fewest in flight ({best.in_flight}, {best.queued_prefill_tokens} prefill tokens queued)",
            scores=load_scores(order),
            fallbacks=tuple(e.engine_id for e in order[1:]),
        )
