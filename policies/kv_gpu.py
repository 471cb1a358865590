"""kv_gpu: the engine holding the longest prefix of the prompt in GPU memory (event-driven).

Balance guard (as the peers' cache-aware routers do): an engine whose in-flight requests or queued
prefill tokens exceed ``overload_factor`` x the fleet mean is skipped unless all are; a request with
no *useful* GPU hit (under ``min_hit_fraction`` of its prompt) goes to the least loaded engine.
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
    overloaded_engines,
    prompt_tokens_of,
    register,
    require_engines,
    validate_guard,
)


@register("kv_gpu")
class KvGpuPolicy(BasePolicy):
    """Longest useful GPU prefix hit among engines that are not overloaded; else least loaded."""

    name = "kv_gpu"
    uses_index = True

    def __init__(
        self,
        overload_factor: float = 1.5,
        min_in_flight: int = 4,
        seed: int | None = None,
        *,
        min_queued_tokens: int = 16_384,
        min_hit_fraction: float = 0.25,
    ) -> None:
        validate_guard("kv_gpu", overload_factor, min_in_flight, min_queued_tokens)
        if not 0.0 <= min_hit_fraction <= 1.0:
            raise ValueError(f"kv_gpu: min_hit_fraction must be in [0, 1], got {min_hit_fraction}")
        self.overload_factor = overload_factor
        #: Below these an engine is never called overloaded (tiny fleets, cold start).
        self.min_in_flight = min_in_flight
        self.min_queued_tokens = min_queued_tokens
        #: A GPU hit shorter than this share of the prompt (e.g. only the shared system prompt,
        #: which every engine holds) does not pull the request: it goes to the least loaded engine.
        self.min_hit_fraction = min_hit_fraction
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        engines = list(require_engines(fleet, self.name))
        overloaded = overloaded_engines(
            engines,
            factor=self.overload_factor,
            min_in_flight=self.min_in_flight,
            min_queued_tokens=self.min_queued_tokens,
        )
        eligible = [e for e in engines if e.engine_id not in overloaded] or engines
        matches = request.prefix_matches
        prompt_tokens = prompt_tokens_of(request)
        useful_tokens = self.min_hit_fraction * prompt_tokens

        def gpu_blocks(engine: EngineView) -> int:
            return matches.get(engine.engine_id, NO_MATCH).gpu_blocks

        def useful(engine: EngineView) -> bool:
            blocks = gpu_blocks(engine)
            return blocks > 0 and blocks * request.block_size >= useful_tokens

        # Random tie-break among equal scores (shuffle, then stable sort).
        self._rng.shuffle(eligible)
        any_useful = any(useful(e) for e in eligible)
        if any_useful:
            order = sorted(eligible, key=lambda e: (-gpu_blocks(e), e.in_flight, e.queued_prefill_tokens))
        else:
            order = sorted(eligible, key=lambda e: (e.queued_prefill_tokens, e.in_flight, -gpu_blocks(e)))
        best = order[0]
        scores = {
            e.engine_id: {
                "gpu_blocks": float(gpu_blocks(e)),
                "prefix_blocks": float(matches.get(e.engine_id, NO_MATCH).blocks),
                "in_flight": float(e.in_flight),
                "queued_prefill_tokens": float(e.queued_prefill_tokens),
                "overloaded": float(e.engine_id in overloaded),
                "useful_hit": float(useful(e)),
            }
            for e in engines
        }
        skipped = (
            f"; skipped overloaded {sorted(overloaded)}"
            if overloaded and len(eligible) < len(engines)
            else ""
        )
        how = "" if any_useful else f"no GPU hit >= {self.min_hit_fraction:g} of the prompt, least loaded: "
        return Decision(
            engine_id=best.engine_id,
            policy=self.name,
            reason=(
                f"{how}{gpu_blocks(best)} of {len(request.block_keys)} blocks in GPU, "
                f"{best.in_flight} in flight{skipped}"
            ),
            scores=scores,
            fallbacks=tuple(e.engine_id for e in order[1:]),
        )
