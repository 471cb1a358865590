"""round_robin: engines in turn, ignoring load and cache (the baseline every other policy beats)."""

from __future__ import annotations

from functools import partial

from policies.base import BasePolicy, Decision, FleetView, RouteRequest, register, require_engines

_REASON = "turn {} of {} engines"


@register("round_robin")
class RoundRobinPolicy(BasePolicy):
    """The n-th request goes to engine n mod len(fleet); fallbacks are the following engines."""

    name = "round_robin"
    uses_index = False

    def __init__(self) -> None:
        self._counter = 0

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        engines = require_engines(fleet, self.name)
        n = len(engines)
        start = self._counter % n
        self._counter += 1
        order = [*engines[start:], *engines[:start]]  # engine (start + i) mod n at position i
        return Decision(
            engine_id=order[0].engine_id,
            policy=self.name,
            reason=partial(_REASON.format, start, n),  # written when read (explain, a debug log)
            scores={e.engine_id: {"position": float(i)} for i, e in enumerate(order)},
            fallbacks=tuple([e.engine_id for e in order[1:]]),
        )
