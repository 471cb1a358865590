"""Capacity-aware homing (issue 27, round q14): the router chooses which conversations stay home.

On LRU engines whose conversations, accessed in turn, add up to slightly more than the local cache,
LRU keeps almost nothing (the cliff, docs/routing.md). Instead a conversation is homed on an engine
only while the current prompt lengths of that engine's homed conversations fit ``fill`` x its local
cache (the larger of its GPU and CPU tiers, ``EngineView.extra``'s capacities); a new conversation
goes to the homing engine with the fewest homed tokens; a conversation whose turn would take its
engine beyond that leaves home for good (its stale blocks, least recently used, go first) and,
like every conversation never homed, sends its turns to one overflow engine (the last of the fleet,
which homes none; ``sim.oracle.homed_lru_replay``'s rule "dedicated" is the offline replay) or, with
``dedicated`` False, wherever the policy itself would send them (every engine homes).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import EngineView, RouteRequest, prompt_tokens_of

#: The ``EngineView.extra`` keys of an engine's local tiers (the simulator fills them).
LOCAL_CAPACITY_KEYS = ("gpu_capacity_tokens", "cpu_capacity_tokens")


class ConversationHoming:
    """Where each conversation's turn goes; ``plan`` before routing, ``commit`` once it is routed."""

    def __init__(self, fill: float, *, dedicated: bool = True) -> None:
        if not fill > 0:
            raise ValueError(f"home_fill must be > 0, got {fill}")
        self.fill = fill
        self.dedicated = dedicated
        self._home: dict[str, str] = {}  # homed session -> its engine
        self._tokens: dict[str, int] = {}  # homed session -> its latest prompt tokens
        self._sums: dict[str, int] = {}  # engine -> its homed sessions' tokens
        self._away: set[str] = set()
        self._pending: dict[
            str, tuple[str, str, str, int]
        ] = {}  # request -> (action, session, engine, tokens)

    def _room(self, engine: EngineView) -> float | None:
        local = [float(engine.extra[k]) for k in LOCAL_CAPACITY_KEYS if k in engine.extra]
        return self.fill * max(local) if local else None

    def plan(self, request: RouteRequest, engines: Sequence[EngineView]) -> tuple[str, str] | None:
        """(engine id, reason) for this turn, or None (no session, one engine, a capacity unknown,
        the planned engine not routable, or an overflow turn without a dedicated engine: the
        policy's own choice stands)."""
        session = request.session_key
        if not session or len(engines) < 2:
            return None
        rooms = [self._room(e) for e in engines]
        if any(r is None for r in rooms):
            return None
        tokens = prompt_tokens_of(request)
        overflow = engines[-1].engine_id if self.dedicated else ""
        home = self._home.get(session)
        by_id = {e.engine_id: r for e, r in zip(engines, rooms, strict=True)}
        if home is not None:
            if home not in by_id:
                return None
            room = by_id[home]
            assert room is not None
            if self._sums[home] - self._tokens[session] + tokens <= room:
                action, engine = "home", home
            else:
                action, engine = "leave", overflow
        elif session in self._away:
            action, engine = "away", overflow
        else:
            homers = engines[:-1] if self.dedicated else engines
            homing = [(self._sums.get(e.engine_id, 0), i, e.engine_id) for i, e in enumerate(homers)]
            held, _, best = min(homing)
            room = by_id[best]
            assert room is not None
            action, engine = ("new", best) if held + tokens <= room else ("away", overflow)
        self._pending[request.request_id] = (action, session, engine, tokens)
        return (engine, f"homing: {action} ({engine})") if engine else None

    def commit(self, request_id: str) -> None:
        """Apply the plan of a routed request (nothing when it had none)."""
        planned = self._pending.pop(request_id, None)
        if planned is None:
            return
        action, session, engine, tokens = planned
        if action in ("home", "new"):
            self._sums[engine] = self._sums.get(engine, 0) - self._tokens.get(session, 0) + tokens
            self._tokens[session] = tokens
            self._home[session] = engine
            return
        if action == "leave":
            home = self._home.pop(session)
            self._sums[home] -= self._tokens.pop(session)
        self._away.add(session)
