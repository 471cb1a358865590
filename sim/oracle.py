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
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore.stats import percentile
from policies.base import (
    BasePolicy,
    Decision,
    FleetView,
    Policy,
    RouteRequest,
    Tier,
    max_hit_tokens,
    require_engines,
)
from sim.engine import EngineCore


@dataclass(slots=True)
class Arrival:
    """One routed request: its block keys (one per full block) and prompt length in tokens."""

    keys: Sequence[int]
    prompt_tokens: int
    block_size: int
    request_id: str = ""
    session: str = ""


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
    """Wraps a policy and records every request it routes, in arrival order (nothing else changes).

    ``arrivals`` leaves out requests that finished with ok=False (the engine refused them: they
    cached nothing and the simulator's hit rates do not count them either)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.uses_index = inner.uses_index
        self._arrivals: list[Arrival] = []
        self._failed: set[str] = set()

    @property
    def arrivals(self) -> list[Arrival]:
        return [a for a in self._arrivals if a.request_id not in self._failed]

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        return self.inner.choose(request, fleet)

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        self._arrivals.append(
            Arrival(
                list(request.block_keys),
                request.prompt_tokens,
                request.block_size,
                request.request_id,
                request.session_key,
            )
        )
        self.inner.on_routed(request, decision)

    def on_finished(self, request: RouteRequest, engine_id: str, ok: bool) -> None:
        if not ok:
            self._failed.add(request.request_id)
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


def ideal_hit(seen: set[int], keys: Sequence[int]) -> int:
    """The contiguous prefix of ``keys`` (in blocks) that an infinite shared cache holding ``seen``
    holds; then caches ``keys`` in it. The one definition of the ideal hit, for the bound here
    and the simulator's running figure (sim/des.py)."""
    n = 0
    for key in keys:
        if key not in seen:
            break
        n += 1
    seen.update(keys)
    return n


def ideal_hit_blocks(arrivals: Sequence[Arrival]) -> list[int]:
    """Per request, the contiguous prefix an infinite shared cache holds at its arrival."""
    seen: set[int] = set()
    return [ideal_hit(seen, a.keys) for a in arrivals]


def _lru_serve(
    cache: OrderedDict[int, None],
    pool: OrderedDict[int, None],
    keys: Sequence[int],
    local_blocks: int,
    pool_blocks: int,
) -> int:
    """One request on an LRU engine ``cache`` over the shared LRU ``pool`` (both written through with
    every block computed): its prefix hit in blocks (up to the first block held by neither); then
    both caches hold its blocks, trimmed to their capacities. The engine ranks the request's blocks
    as vLLM's LRU policy does when a request finishes, head last (its deepest blocks go first)."""
    hits = 0
    for key in keys:
        if key in cache:
            pass
        elif key in pool:
            pool.move_to_end(key)
            cache[key] = None
        else:
            break
        hits += 1
    for key in keys[hits:]:
        cache[key] = None
        if pool_blocks > 0:
            pool[key] = None
            pool.move_to_end(key)
    for key in reversed(keys):
        cache.move_to_end(key)
    while len(cache) > local_blocks:
        cache.popitem(last=False)
    while len(pool) > pool_blocks:
        pool.popitem(last=False)
    return hits


def sticky_lru_hit(
    arrivals: Sequence[Arrival], engines: int, local_blocks: int, pool_blocks: int = 0
) -> float:
    """Reference (not a bound) for LRU engines: the hit rate of perfectly sticky, count-balanced
    routing (each new session goes to the next engine in turn and never moves), each engine an
    LRU of ``local_blocks`` (its larger local tier: the CPU tier is written through) over one
    shared LRU pool of ``pool_blocks`` written through with every block computed. Prefix hits:
    a request hits its blocks up to the first held by neither its engine nor the pool."""
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    local: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(engines)]
    pool: OrderedDict[int, None] = OrderedDict()
    home: dict[str, int] = {}
    total = hit_tokens = 0
    for n, a in enumerate(arrivals):
        e = home.setdefault(a.session or f"#{n}", len(home) % engines)
        hits = _lru_serve(local[e], pool, a.keys, local_blocks, pool_blocks)
        total += a.prompt_tokens
        hit_tokens += min(hits * a.block_size, max_hit_tokens(a.prompt_tokens))
    return hit_tokens / total if total else 0.0


#: ``homed_lru_replay``'s rules for where a conversation that is not homed sends its turns:
#: "fixed" all to the last engine; "dedicated" all to the last engine, which homes none; "slack"
#: each turn to the engine whose homed conversations leave the most room then; "sticky" to the
#: engine with the most room when it was turned away, for good.
OVERFLOW_RULES = ("fixed", "dedicated", "slack", "sticky")


@dataclass(slots=True)
class HomedReplay:
    """``homed_lru_replay``'s figures: the hit rate (fraction of prompt tokens), per engine the
    prompt tokens it had to compute and the turns it served, and the turns sent as overflow."""

    hit: float
    computed_tokens: list[int]
    turns: list[int]
    overflow_turns: int
    overflow_sessions: int


def homed_lru_replay(
    arrivals: Sequence[Arrival],
    engines: int,
    local_blocks: int,
    pool_blocks: int = 0,
    fill: float = 1.0,
    overflow: str = "slack",
) -> HomedReplay:
    """What-if beside ``sticky_lru_hit`` (same LRU engines and pool, same arrivals): the router keeps
    a conversation home only while its engine's homed conversations fit. A new session is homed on
    the engine with the fewest homed blocks (the sum of its homed conversations' current lengths)
    if that sum plus its length stays <= ``fill`` x ``local_blocks``; a homed conversation whose
    turn would take its engine's sum beyond that leaves home for good (its stale blocks, least
    recently used, go first) and, like every session never homed, sends its turns by the
    ``overflow`` rule (OVERFLOW_RULES). fill = inf is ``sticky_lru_hit`` with length-balanced
    homing."""
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    if overflow not in OVERFLOW_RULES:
        raise ValueError(f"overflow must be one of {OVERFLOW_RULES}, got {overflow!r}")
    room = fill * local_blocks
    local: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(engines)]
    pool: OrderedDict[int, None] = OrderedDict()
    homed: list[dict[str, int]] = [{} for _ in range(engines)]
    home: dict[str, int] = {}
    away: dict[str, int] = {}  # overflow session -> its engine (the "sticky" rule)
    sums = [0] * engines
    computed = [0] * engines
    turns = [0] * engines
    total = hit_tokens = overflow_turns = 0
    for n, a in enumerate(arrivals):
        s = a.session or f"#{n}"
        size = len(a.keys)
        e = home.get(s)
        if e is not None and sums[e] - homed[e][s] + size > room:
            sums[e] -= homed[e].pop(s)
            del home[s]
            e = None
        elif e is None and s not in away:
            homing = engines - 1 if overflow == "dedicated" and engines > 1 else engines
            best = min(range(homing), key=lambda i: (sums[i], i))
            if sums[best] + size <= room:
                e = home[s] = best
                homed[e][s] = 0
        if e is not None:
            sums[e] += size - homed[e][s]
            homed[e][s] = size
        else:
            overflow_turns += 1
            if overflow in ("fixed", "dedicated"):
                e = engines - 1
            elif overflow == "slack" or s not in away:
                e = min(range(engines), key=lambda i: (sums[i], i))
            else:
                e = away[s]
            away.setdefault(s, e)
        hits = _lru_serve(local[e], pool, a.keys, local_blocks, pool_blocks)
        hit = min(hits * a.block_size, max_hit_tokens(a.prompt_tokens))
        total += a.prompt_tokens
        hit_tokens += hit
        computed[e] += a.prompt_tokens - hit
        turns[e] += 1
    return HomedReplay(hit_tokens / total if total else 0.0, computed, turns, overflow_turns, len(away))


def capacity_bound(arrivals: Sequence[Arrival], capacity_blocks: int, prefill_tokens_per_s: float) -> Bound:
    """Both bounds for one run (module docstring). Hit tokens are capped at prompt - 1 per request,
    as the engine always computes the last prompt token."""
    total = sum(a.prompt_tokens for a in arrivals) or 1
    mins = belady_hit_blocks(arrivals, capacity_blocks)
    ideal = ideal_hit_blocks(arrivals)
    bound_tokens = sum(
        min(n * a.block_size, max_hit_tokens(a.prompt_tokens)) for n, a in zip(mins, arrivals, strict=True)
    )
    floors: list[float] = []
    ideal_tokens = 0
    for n, a in zip(ideal, arrivals, strict=True):
        hit = min(n * a.block_size, max_hit_tokens(a.prompt_tokens))
        ideal_tokens += hit
        floors.append((a.prompt_tokens - hit) / prefill_tokens_per_s)
    return Bound(
        capacity_blocks=capacity_blocks,
        bound_hit=bound_tokens / total,
        ideal_hit=ideal_tokens / total,
        # The DES's percentile (kvcore.stats): per request floor <= TTFT holds for the same
        # percentile definition only.
        ttft_floor_p50_s=percentile(floors, 50, empty=0.0),
        ttft_floor_p99_s=percentile(floors, 99, empty=0.0),
        requests=len(arrivals),
    )


class ClairvoyantPolicy(BasePolicy):
    """Greedy full-information what-if (NOT a bound: per request it is greedy and does worse than
    the router's policies under memory pressure, issue 15). Reads every EngineCore's caches and
    queues directly and picks the minimum predicted TTFT with the engines' true parameters:

        ttft_e = queued_prefill_tokens_e / prefill_rate_e + sum_t (latency_t + blocks_t x bytes/bw_t)
                 + (prompt_tokens - hit_tokens_e) / prefill_rate_e

    Not registered: the router cannot see engine internals. Ties: fewer running, then fleet order.
    """

    name = "clairvoyant"
    uses_index = False

    def __init__(self, cores: Sequence[EngineCore]) -> None:
        self._cores = {c.engine_id: c for c in cores}
        #: request_id -> engine block hashes of the prompt (set by the simulator before choose).
        self.hashes: list[int] = []

    def _hits(self, core: EngineCore, hashes: Sequence[int], limit: int) -> list[int]:
        by_tier = [0, 0, 0]
        gpu, cpu, storage = core.gpu, core.cpu, core.storage
        for h in hashes[:limit]:
            if gpu.contains(h):
                by_tier[Tier.GPU] += 1
            elif cpu is not None and h in cpu:
                by_tier[Tier.CPU] += 1
            elif storage is not None and h in storage:
                by_tier[Tier.STORAGE] += 1
            else:
                break
        return by_tier

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        engines = require_engines(fleet, self.name)
        scores: dict[str, dict[str, float]] = {}
        best: tuple[float, int, int] | None = None
        chosen = engines[0].engine_id
        for pos, view in enumerate(engines):
            core = self._cores[view.engine_id]
            p = core.profile
            bs = p.block_size
            limit = max_hit_tokens(request.prompt_tokens) // bs
            hits = self._hits(core, self.hashes, limit)
            bytes_per_block = bs * p.kv_bytes_per_token
            load_s = 0.0
            if hits[Tier.CPU]:
                load_s += p.cpu_latency_s + hits[Tier.CPU] * bytes_per_block / p.cpu_load_bytes_per_s
            if hits[Tier.STORAGE]:
                bw = core._storage_bw  # the true figure (a shared pool may override the profile)
                load_s += core._storage_latency_s + hits[Tier.STORAGE] * bytes_per_block / bw
            prefill_tokens = request.prompt_tokens - sum(hits) * bs
            wait_s = core.queued_prefill_tokens() / p.prefill_tokens_per_s
            ttft_s = wait_s + load_s + prefill_tokens / p.prefill_tokens_per_s
            scores[view.engine_id] = {
                "total_s": ttft_s,
                "hit_blocks_gpu": hits[0],
                "hit_blocks_cpu": hits[1],
                "hit_blocks_storage": hits[2],
            }
            key = (round(ttft_s, 6), core.num_running(), pos)
            if best is None or key < best:
                best, chosen = key, view.engine_id
        return Decision(chosen, self.name, reason="min true TTFT", scores=scores)
