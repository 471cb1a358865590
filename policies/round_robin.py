"""round_robin: engines in turn, ignoring load and cache (the baseline every other policy beats)."""

from __future__ import annotations

from policies.base import BasePolicy, Decision, FleetView, RouteRequest, register, require_engines


@register("round_robin")
class RoundRobinPolicy(BasePolicy):
    """The n-th request goes to engine n mod len(fleet); fallbacks are the following engines."""

    name = "round_robin"
    uses_index = False

    def __init__(self) -> None:
        self._counter = 0

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        engines = require_engines(fleet, self.name)
        start = self._counter % len(engines)
        self._counter += 1
        order = [engines[(start + i) % len(engines)] for i in range(len(engines))]
        return Decision(
            engine_id=order[0].engine_id,
            policy=self.name,
            reason=f"turn {start} of {len(engines)} engines",
            scores={e.engine_id: {"position": float(i)} for i, e in enumerate(order)},
            fallbacks=tuple(e.engine_id for e in order[1:]),
        )
