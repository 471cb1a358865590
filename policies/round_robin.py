"""round_robin: engines in turn, ignoring load and cache (the baseline every other policy beats)."""

from __future__ import annotations

from functools import partial

from policies.base import (
    NOTHING_PRICED,
    BasePolicy,
    Decision,
    FleetView,
    RouteRequest,
    engine_id_of,
    register,
    require_engines,
)

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
        # Engine (start + i) mod n at position i.
        order = tuple(map(engine_id_of, [*engines[start:], *engines[:start]]))
        return Decision(
            engine_id=order[0],
            policy=self.name,
            # The explanation is written when read (explain, a debug log).
            reason=partial(_REASON.format, start, n),
            scores=partial(_positions, order),
            fallbacks=order[1:],
            parts=NOTHING_PRICED,
        )


def _positions(order: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """round_robin's scores: each engine id's position in the turn."""
    return {engine_id: {"position": float(i)} for i, engine_id in enumerate(order)}
