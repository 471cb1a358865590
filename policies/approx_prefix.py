"""approx_prefix: cache-aware routing without KV events, learned from the router's own decisions.

After each routing, every block key of the request is remembered as held by the chosen engine (an
LRU map (engine, key) -> last use, with a TTL and a capacity). A request goes to the engine with the
longest remembered prefix; an imbalance guard sends it to the least-loaded engine instead.
"""

from __future__ import annotations

from collections import OrderedDict

from policies.base import BasePolicy, Decision, FleetView, RouteRequest, register, require_engines, tiebreak


@register("approx_prefix")
class ApproxPrefixPolicy(BasePolicy):
    """Longest learned prefix, with a TTL, a capacity and an in-flight imbalance guard.

    Imbalance guard (as in SGLang's cache-aware gateway): when max in_flight - min in_flight >
    ``balance_abs_threshold`` and max in_flight > ``balance_rel_threshold`` x min in_flight, route to
    the least-loaded engine regardless of prefixes. A remembered prefix shorter than
    ``min_match_ratio`` of the request's blocks is ignored (least loaded again).
    """

    name = "approx_prefix"
    uses_index = False
    #: Learns from the prompt's block keys (its own memory, not the index): needs a tokenizer.
    needs_block_keys = True

    def __init__(
        self,
        *,
        ttl_s: float = 300.0,
        capacity_blocks: int = 1_000_000,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        min_match_ratio: float = 0.0,
    ) -> None:
        if ttl_s <= 0 or capacity_blocks <= 0:
            raise ValueError("approx_prefix: ttl_s and capacity_blocks must be > 0")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("approx_prefix: balance_abs_threshold >= 0 and balance_rel_threshold >= 1")
        self.ttl_s = ttl_s
        self.capacity_blocks = capacity_blocks
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.min_match_ratio = min_match_ratio
        # LRU order, oldest first: (engine_id, block key) -> last time routed there.
        self._last_used: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._holders: dict[int, set[str]] = {}
        # on_routed carries no clock: it follows choose, so the time of the last choose is used.
        self._now = 0.0

    def __len__(self) -> int:
        """Remembered (engine, block) entries."""
        return len(self._last_used)

    def matched_blocks(
        self, block_keys: list[int] | tuple[int, ...], engine_ids: set[str], now: float
    ) -> dict[str, int]:
        """Per engine, the contiguous prefix of ``block_keys`` it is remembered to hold (live entries)."""
        matched: dict[str, int] = {}
        alive = set(engine_ids)
        for i, key in enumerate(block_keys):
            holders = self._holders.get(key)
            if not holders:
                break
            alive = {
                e for e in alive & holders if now - self._last_used.get((e, key), -float("inf")) <= self.ttl_s
            }
            if not alive:
                break
            for e in alive:
                matched[e] = i + 1
        return matched

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        engines = require_engines(fleet, self.name)
        self._now = fleet.now
        by_load = sorted(engines, key=lambda e: (e.in_flight, tiebreak(request.request_id, e.engine_id)))
        least, most = by_load[0], by_load[-1]
        matched = self.matched_blocks(tuple(request.block_keys), {e.engine_id for e in engines}, fleet.now)
        scores = {
            e.engine_id: {
                "matched_blocks": float(matched.get(e.engine_id, 0)),
                "in_flight": float(e.in_flight),
            }
            for e in engines
        }
        imbalanced = (
            most.in_flight - least.in_flight > self.balance_abs_threshold
            and most.in_flight > self.balance_rel_threshold * least.in_flight
        )
        total_blocks = len(request.block_keys)
        best = max(matched.values(), default=0)
        if imbalanced or best == 0 or best < self.min_match_ratio * total_blocks:
            if imbalanced:
                reason = (
                    f"imbalance guard: in-flight {most.engine_id}={most.in_flight} vs "
                    f"{least.engine_id}={least.in_flight}; least loaded {least.engine_id}"
                )
            else:
                reason = f"no learned prefix ({best}/{total_blocks} blocks); least loaded {least.engine_id}"
            fallbacks = tuple(e.engine_id for e in by_load[1:])
            return Decision(least.engine_id, self.name, reason, scores, fallbacks)
        ranked_by_match = sorted(
            engines,
            key=lambda e: (
                -matched.get(e.engine_id, 0),
                e.in_flight,
                tiebreak(request.request_id, e.engine_id),
            ),
        )
        chosen = ranked_by_match[0]
        reason = f"longest learned prefix: {chosen.engine_id} {best}/{total_blocks} blocks"
        return Decision(
            chosen.engine_id,
            self.name,
            reason,
            scores,
            tuple(e.engine_id for e in ranked_by_match[1:]),
        )

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        engine_id = decision.engine_id
        now = self._now
        for key in request.block_keys:
            entry = (engine_id, key)
            self._last_used[entry] = now
            self._last_used.move_to_end(entry)
            self._holders.setdefault(key, set()).add(engine_id)
        self._evict(now)

    def learn_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        """``on_routed`` for a decision made elsewhere (another router replica) at ``now``, on the
        same monotonic clock as ``choose``: the entries age from then, not from an unset clock."""
        self._now = max(self._now, now)
        self.on_routed(request, decision)

    def forget_engine(self, engine_id: str) -> None:
        """Drop everything learned about an engine (removed, restarted or cache reset)."""
        for entry in [k for k in self._last_used if k[0] == engine_id]:
            self._drop(entry)

    def _evict(self, now: float) -> None:
        while self._last_used:
            entry, used_s = next(iter(self._last_used.items()))
            if len(self._last_used) <= self.capacity_blocks and now - used_s <= self.ttl_s:
                break
            self._drop(entry)

    def _drop(self, entry: tuple[str, int]) -> None:
        del self._last_used[entry]
        holders = self._holders.get(entry[1])
        if holders is not None:
            holders.discard(entry[0])
            if not holders:
                del self._holders[entry[1]]
