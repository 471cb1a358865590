"""session_affinity: consistent hashing of request.session_key with bounded load.

A conversation keeps landing on the same engine (so its KV cache is reused) while the ring keeps
moves to ~1/N of sessions when an engine joins or leaves. Bounded load (Mirrokni et al.): walking
the ring from the session's point, skip an engine if taking this request would put it above
ceil((1 + epsilon) * (total_in_flight + 1) / N); the first engine within the bound wins.
"""

from __future__ import annotations

import math

from uhashring import HashRing

from policies.base import BasePolicy, Decision, FleetView, RouteRequest, register, require_engines


@register("session_affinity")
class SessionAffinityPolicy(BasePolicy):
    name = "session_affinity"
    uses_index = False

    def __init__(self, epsilon: float = 0.25, vnodes: int = 160) -> None:
        if epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon}")
        if vnodes <= 0:
            raise ValueError(f"vnodes must be positive, got {vnodes}")
        self.epsilon = epsilon
        self.vnodes = vnodes
        self._ring: HashRing | None = None
        self._ring_members: frozenset[str] = frozenset()

    def _ring_for(self, engine_ids: list[str]) -> HashRing:
        members = frozenset(engine_ids)
        if self._ring is None or members != self._ring_members:
            # Rebuilt only when the healthy set changes; points depend on ids only, so an engine
            # that comes back gets its old sessions back.
            self._ring = HashRing(nodes=sorted(members), vnodes=self.vnodes)
            self._ring_members = members
        return self._ring

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        engines = require_engines(fleet, self.name)
        by_id = {e.engine_id: e for e in engines}
        ring = self._ring_for(list(by_id))
        key = request.session_key or request.request_id
        ring_order: list[str] = [node["nodename"] for node in ring.range(key, size=len(by_id), unique=True)]
        total = sum(e.in_flight for e in engines)
        bound = math.ceil((1.0 + self.epsilon) * (total + 1) / len(engines))
        within = [eid for eid in ring_order if by_id[eid].in_flight + 1 <= bound]
        chosen = within[0] if within else min(ring_order, key=lambda eid: by_id[eid].in_flight)
        skipped = ring_order.index(chosen)
        reason = (
            f"session's ring owner {chosen}"
            if skipped == 0
            else f"ring owner {ring_order[0]} over load bound {bound}; next within bound: {chosen}"
        )
        return Decision(
            engine_id=chosen,
            policy=self.name,
            reason=reason,
            scores={
                eid: {
                    "ring_rank": float(i),
                    "in_flight": float(by_id[eid].in_flight),
                    "load_bound": float(bound),
                }
                for i, eid in enumerate(ring_order)
            },
            # Retry order: engines within the bound first, then the rest, each in ring order.
            fallbacks=tuple(eid for eid in dict.fromkeys([*within, *ring_order]) if eid != chosen),
        )
