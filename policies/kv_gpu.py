"""kv_gpu: the engine holding the longest prefix of the prompt in GPU memory (event-driven).

Score = (gpu_blocks desc, in_flight asc, queued_prefill_tokens asc). Overload guard: an engine whose
in_flight exceeds ``overload_factor`` x the fleet mean (and ``min_in_flight``) is skipped unless all are.
"""

from __future__ import annotations

import random

from policies.base import (
    NO_MATCH,
    BasePolicy,
    Decision,
    EngineView,
    FleetView,
    RouteRequest,
    register,
    require_engines,
)


@register("kv_gpu")
class KvGpuPolicy(BasePolicy):
    """Longest GPU prefix hit; load breaks ties and excludes overloaded engines."""

    name = "kv_gpu"
    uses_index = True

    def __init__(self, overload_factor: float = 2.0, min_in_flight: int = 4, seed: int | None = None) -> None:
        if overload_factor < 1.0:
            raise ValueError(
                f"kv_gpu: overload_factor must be >= 1.0 (a multiple of the mean), got {overload_factor}"
            )
        self.overload_factor = overload_factor
        #: Below this many in flight an engine is never called overloaded (tiny fleets, cold start).
        self.min_in_flight = min_in_flight
        self._rng = random.Random(seed)

    def _overloaded(self, engines: list[EngineView]) -> set[str]:
        mean = sum(e.in_flight for e in engines) / len(engines)
        limit = max(self.overload_factor * mean, float(self.min_in_flight))
        return {e.engine_id for e in engines if e.in_flight > limit}

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        engines = list(require_engines(fleet, self.name))
        overloaded = self._overloaded(engines)
        eligible = [e for e in engines if e.engine_id not in overloaded] or engines
        matches = request.prefix_matches

        def gpu_blocks(engine: EngineView) -> int:
            return matches.get(engine.engine_id, NO_MATCH).gpu_blocks

        # Random tie-break among equal scores (shuffle, then stable sort).
        self._rng.shuffle(eligible)
        order = sorted(eligible, key=lambda e: (-gpu_blocks(e), e.in_flight, e.queued_prefill_tokens))
        best = order[0]
        scores = {
            e.engine_id: {
                "gpu_blocks": float(gpu_blocks(e)),
                "prefix_blocks": float(matches.get(e.engine_id, NO_MATCH).blocks),
                "in_flight": float(e.in_flight),
                "overloaded": float(e.engine_id in overloaded),
            }
            for e in engines
        }
        skipped = (
            f"; skipped overloaded {sorted(overloaded)}"
            if overloaded and len(eligible) < len(engines)
            else ""
        )
        return Decision(
            engine_id=best.engine_id,
            policy=self.name,
            reason=(
                f"{gpu_blocks(best)} of {len(request.block_keys)} blocks in GPU, "
                f"{best.in_flight} in flight{skipped}"
            ),
            scores=scores,
            fallbacks=tuple(e.engine_id for e in order[1:]),
        )
