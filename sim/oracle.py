"""Bounds on what any routing policy can achieve on a run, computed offline with hindsight.

``capacity_bound``: Belady's MIN (evict the block used farthest in the future) on ONE cache as large
as the whole fleet's memory (every engine's GPU + CPU blocks + the shared STORAGE pool), over the
run's requests in arrival order. Any routing holds at most that many distinct blocks at a time and
must compute what it does not hold, and MIN maximises hits for a given capacity, so no policy's hit
rate on that arrival order can exceed it. ``ttft_floor_s``: per request, the prefill of the tokens an
infinite cache could not have served, at the fastest engine's rate, with no queue and free loads: no
policy's TTFT percentile can be below the same percentile of these floors.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.base import Decision, FleetView, Policy, RouteRequest


@dataclass(slots=True)
class Arrival:
    """One routed request: its block keys (one per full block) and prompt length in tokens."""

    keys: Sequence[int]
    prompt_tokens: int
    block_size: int


@dataclass(slots=True)
class Bound:
    """Hindsight bounds of one run (hit rates are fractions of prompt tokens)."""

    capacity_blocks: int
    bound_hit: float
    ideal_hit: float
    ttft_floor_p50_s: float
    ttft_floor_p99_s: float
    requests: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class ArrivalRecorder:
    """Wraps a policy and records every request it routes, in arrival order (nothing else changes)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.uses_index = inner.uses_index
        self.arrivals: list[Arrival] = []

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        return self.inner.choose(request, fleet)

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        self.arrivals.append(Arrival(list(request.block_keys), request.prompt_tokens, request.block_size))
        self.inner.on_routed(request, decision)

    def on_finished(self, request: RouteRequest, engine_id: str, ok: bool) -> None:
        self.inner.on_finished(request, engine_id, ok)


def belady_hit_blocks(arrivals: Sequence[Arrival], capacity_blocks: int) -> list[int]:
    """Per request, blocks MIN finds cached at its arrival (any block, not only a prefix: a bound)."""
    flat: list[int] = [k for a in arrivals for k in a.keys]
    never = len(flat)
    next_use = [never] * len(flat)
    last: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = last.get(flat[i], never)
        last[flat[i]] = i
    cached: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries skipped
    hits: list[int] = []
    i = 0
    for a in arrivals:
        n = 0
        for key in a.keys:
            nu = next_use[i]
            i += 1
            if key in cached:
                n += 1
            if nu == never:
                cached.pop(key, None)  # never used again: keeping it cannot help
                continue
            cached[key] = nu
            heapq.heappush(heap, (-nu, key))
            while len(cached) > capacity_blocks:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
        hits.append(n)
    return hits


def ideal_hit_blocks(arrivals: Sequence[Arrival]) -> list[int]:
    """Per request, the contiguous prefix an infinite shared cache holds at its arrival."""
    seen: set[int] = set()
    out: list[int] = []
    for a in arrivals:
        n = 0
        for key in a.keys:
            if key not in seen:
                break
            n += 1
        seen.update(a.keys)
        out.append(n)
    return out


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100.0 * len(ordered)))) - 1]


def capacity_bound(arrivals: Sequence[Arrival], capacity_blocks: int, prefill_tokens_per_s: float) -> Bound:
    """Both bounds for one run (module docstring). Hit tokens are capped at prompt - 1 per request,
    as the engine always computes the last prompt token."""
    total = sum(a.prompt_tokens for a in arrivals) or 1
    mins = belady_hit_blocks(arrivals, capacity_blocks)
    ideal = ideal_hit_blocks(arrivals)
    bound_tokens = sum(
        min(n * a.block_size, max(0, a.prompt_tokens - 1)) for n, a in zip(mins, arrivals, strict=True)
    )
    floors: list[float] = []
    ideal_tokens = 0
    for n, a in zip(ideal, arrivals, strict=True):
        hit = min(n * a.block_size, max(0, a.prompt_tokens - 1))
        ideal_tokens += hit
        floors.append((a.prompt_tokens - hit) / prefill_tokens_per_s)
    return Bound(
        capacity_blocks=capacity_blocks,
        bound_hit=bound_tokens / total,
        ideal_hit=ideal_tokens / total,
        ttft_floor_p50_s=_percentile(floors, 50),
        ttft_floor_p99_s=_percentile(floors, 99),
        requests=len(arrivals),
    )
