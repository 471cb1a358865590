"""The routing core: one synchronous library, no I/O, called by the router and by the DES.

Every request goes through the same named steps (in the spirit of the Kubernetes scheduling
framework and the Gateway API inference extension):

    filter(request, engines)          -> candidates: healthy, not drained, serving the model,
                                         load figures from the ledger, index trust, and for large
                                         fleets a pre-filter (longest local hits + least loaded)
    score(policy, request, candidates)-> Decision (the policy: one file per policy in policies/)
    reserve(policy, request, decision)-> Reservation: load taken in the ledger (predicted uncached
                                         prefill tokens), speculation in the index, the predicted
                                         TTFT parts kept for calibration, policy.on_routed
    on_first_token(reservation, now)  -> the engine's prefill is over: queued prefill released;
                                         the TTFT is real (a streamed token was seen)
    release_prefill(reservation)      -> prefill assumed over without a measured token (non-stream
                                         answers): load released, nothing measured
    on_finished(reservation, outcome) -> load released; policy.on_finished; calibration (only
                                         with a measured TTFT); index self-check (every policy,
                                         from engine-reported cached tokens); experiment record
    (both in two halves for a caller that learns later: release_prefill + tally_first_token,
    release_finished + learn_finished - the load at once, the learning when it suits; the
    router's proxy.defer_accounting)

The async router (router/routing.py) and the discrete-event simulator (sim/des.py) both drive
this object, so a result of the simulator is a result of the router's own decision code.

Load accounting sits behind ``LoadLedger`` (reserve / first_token / finish, and reads for the
filter). ``InMemoryLoadLedger`` is the single-process implementation; a replicated router can
back the same protocol with a shared store (e.g. Redis hashes per engine: HINCRBY on reserve,
first token and finish; a sorted set for ``least_loaded``) without touching the core.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import msgspec
from sortedcontainers import SortedList

from kvcore.calibration import CostModel
from kvcore.index import PrefixIndex
from policies.base import (
    NO_MATCH,
    Decision,
    EngineView,
    FleetView,
    NoEngineAvailable,
    Policy,
    PrefixMatch,
    RouteRequest,
    hit_tokens_by_tier,
    prompt_tokens_of,
)
from policies.costs import (
    RECOMPUTE_BELOW,
    STORAGE_QUEUE_KEY,
    CostEstimates,
    EngineCosts,
    PredictedParts,
    best_cached_fraction,
    engine_wait_parts,
    predict_parts,
    predicted_prefill_tokens,
    priority_wait_parts,
)

log = logging.getLogger("kvroute.core")


# ----------------------------------------------------------------------------- load ledger


class LoadTicket(msgspec.Struct):
    """One request's share of an engine's load; ledger methods on it are idempotent."""

    engine_id: str
    prefill_tokens: int
    prefill_pending: bool = True
    done: bool = False
    #: vLLM priority sent with the request (``InMemoryLoadLedger.set_priority``); None = not known.
    priority: int | None = None
    #: Arrival order among the engine's prioritised tickets (ties of equal priority: first come).
    priority_seq: int = -1


class LoadLedger(Protocol):
    """In-flight requests and queued prefill tokens per engine (what ``filter`` reads)."""

    def reserve(self, engine_id: str, prefill_tokens: int) -> LoadTicket:
        """Count a request sent to ``engine_id`` with ``prefill_tokens`` still to compute."""
        ...

    def first_token(self, ticket: LoadTicket) -> None:
        """The engine finished this request's prefill (idempotent)."""
        ...

    def finish(self, ticket: LoadTicket) -> None:
        """The request is over, whatever the outcome (idempotent; also ends a pending prefill)."""
        ...

    def load(self, engine_id: str) -> tuple[int, int]:
        """(in-flight requests, queued prefill tokens) of ``engine_id``."""
        ...

    def least_loaded(self) -> Iterable[str]:
        """Engine ids from the fewest queued prefill tokens (then in-flight requests) upwards,
        lazily: the pre-filter stops after a few."""
        ...


class InMemoryLoadLedger:
    """The single-process ledger (its in-flight counts are the router's gauge, read at scrape time:
    ``in_flight_by_engine``). ``ordered=True`` keeps a sorted structure so
    ``least_loaded`` is O(n log engines) for 1,000-engine fleets (the DES's large-fleet runs)."""

    def __init__(
        self,
        engine_ids: Sequence[str] = (),
        *,
        ordered: bool = False,
    ) -> None:
        self._in_flight: dict[str, int] = {}
        self._queued: dict[str, int] = {}
        #: Per engine: (priority, sequence, prefill tokens) of the pending prefills whose priority is
        #: known (``set_priority``), for ``queued_ahead``.
        self._by_priority: dict[str, SortedList] = {}
        self._sequence = 0
        #: Per engine: (placed at, deadline offset, prefill tokens) of the prioritised requests in
        #: placement order, for ``overtaking`` (pruned to its window as it is read).
        self._placed: dict[str, deque[tuple[float, float, int]]] = {}
        self._order: SortedList | None = SortedList() if ordered else None
        for engine_id in engine_ids:
            self.add_engine(engine_id)

    def add_engine(self, engine_id: str) -> None:
        if engine_id in self._in_flight:
            return
        self._in_flight[engine_id] = 0
        self._queued[engine_id] = 0
        if self._order is not None:
            self._order.add((0, 0, engine_id))

    def _change(self, engine_id: str, in_flight: int, queued: int) -> None:
        old_in_flight = self._in_flight.get(engine_id)
        if old_in_flight is None:
            self.add_engine(engine_id)
            old_in_flight = 0
        old_queued = self._queued[engine_id]
        if self._order is not None:
            self._order.remove((old_queued, old_in_flight, engine_id))
        new_in_flight = old_in_flight + in_flight
        self._in_flight[engine_id] = new_in_flight
        self._queued[engine_id] = old_queued + queued
        if self._order is not None:
            self._order.add((old_queued + queued, new_in_flight, engine_id))

    def reserve(self, engine_id: str, prefill_tokens: int) -> LoadTicket:
        self._change(engine_id, 1, prefill_tokens)
        return LoadTicket(engine_id, prefill_tokens)

    def first_token(self, ticket: LoadTicket) -> None:
        if ticket.prefill_pending and not ticket.done:
            ticket.prefill_pending = False
            self._change(ticket.engine_id, 0, -ticket.prefill_tokens)
            if ticket.priority is not None:
                self._by_priority[ticket.engine_id].remove(
                    (ticket.priority, ticket.priority_seq, ticket.prefill_tokens)
                )

    def finish(self, ticket: LoadTicket) -> None:
        if ticket.done:
            return
        queued = 0
        if ticket.prefill_pending:  # ``first_token`` and the finish in one change of the figures
            ticket.prefill_pending = False
            queued = -ticket.prefill_tokens
            if ticket.priority is not None:
                self._by_priority[ticket.engine_id].remove(
                    (ticket.priority, ticket.priority_seq, ticket.prefill_tokens)
                )
        ticket.done = True
        self._change(ticket.engine_id, -1, queued)

    def load(self, engine_id: str) -> tuple[int, int]:
        return self._in_flight.get(engine_id, 0), self._queued.get(engine_id, 0)

    def in_flight_by_engine(self) -> dict[str, int]:
        """Engine id -> requests in flight, every engine this ledger has seen (a copy)."""
        return dict(self._in_flight)

    def set_priority(self, ticket: LoadTicket, priority: int, placed: float = 0.0) -> None:
        """The vLLM ``priority`` the request was sent with (once; a request whose prefill is over is
        not queued any more): ``queued_ahead`` then counts its prefill only for requests the engine
        serves after it. ``placed``: when it was sent, in the priority's own units (now / step), so
        ``priority - placed`` is how far its deadline lies ahead (for ``overtaking``)."""
        if ticket.priority is not None or not ticket.prefill_pending or ticket.done:
            return
        recent = self._placed.get(ticket.engine_id)
        if recent is None:
            recent = self._placed[ticket.engine_id] = deque()
        recent.append((placed, priority - placed, ticket.prefill_tokens))
        ticket.priority = priority
        ticket.priority_seq = self._sequence
        self._sequence += 1
        entries = self._by_priority.get(ticket.engine_id)
        if entries is None:
            entries = self._by_priority[ticket.engine_id] = SortedList()
        entries.add((priority, ticket.priority_seq, ticket.prefill_tokens))

    def queued_ahead(self, engine_id: str, priority: int, *, running_first: bool = False) -> int:
        """Queued prefill tokens of ``engine_id`` that a priority engine serves before a request of
        ``priority`` arriving now: every pending prefill except those sent with a larger priority
        (vLLM serves the lowest priority first, ties in arrival order; a prefill whose priority is
        not known counts as ahead). With no priorities set this is ``load(engine_id)[1]``.
        ``running_first``: the pending prefill with the lowest priority counts as ahead whatever its
        priority: it is the one the engine is serving (vLLM schedules running requests before any
        waiting one, so a new request waits for the rest of its chunks)."""
        queued = self._queued.get(engine_id, 0)
        entries = self._by_priority.get(engine_id)
        if not entries:
            return queued
        start = entries.bisect_left((priority + 1,))
        if running_first and start == 0:
            start = 1
        behind = 0
        for _, _, tokens in entries.islice(start):
            behind += tokens
        return queued - behind

    def overtaking(self, engine_id: str, offset: float, since: float) -> int:
        """Prefill tokens sent to ``engine_id`` at or after ``since`` with a deadline offset below
        ``offset`` (units of ``set_priority``'s): the recent arrival of work that a request whose
        deadline lies ``offset`` ahead is overtaken by while it waits. Entries before ``since`` are
        dropped (callers pass a ``since`` that never moves back)."""
        recent = self._placed.get(engine_id)
        if not recent:
            return 0
        while recent and recent[0][0] < since:
            recent.popleft()
        return sum(tokens for _, their_offset, tokens in recent if their_offset < offset)

    def least_loaded(self) -> Iterator[str]:
        if self._order is not None:
            return (engine_id for _, _, engine_id in self._order)
        return iter(sorted(self._in_flight, key=lambda e: (self._queued[e], self._in_flight[e])))


# ----------------------------------------------------------------------------- reservations


class Reservation(msgspec.Struct):
    """A routed request between ``reserve`` and ``on_finished`` (owned by the caller)."""

    request: RouteRequest
    decision: Decision
    policy: Policy
    engine_id: str
    ticket: LoadTicket
    #: Clock value when the request was handed to the engine (TTFT for calibration counts from here).
    sent_s: float
    #: Predicted TTFT parts on ``engine_id`` (the policy's own when it priced them, else the core's),
    #: or a function that prices them from the values of the reservation when first read (``parts``).
    priced: PredictedParts | Callable[[], PredictedParts]
    arm: str = ""
    first_token_s: float | None = None
    finished: bool = False

    @property
    def parts(self) -> PredictedParts:
        """Predicted TTFT parts on ``engine_id``: what ``priced`` is or gives (once)."""
        parts = self.priced
        if not isinstance(parts, PredictedParts):
            parts = self.priced = parts()
        return parts

    @property
    def engine_ttft_s(self) -> float | None:
        """Seconds from sending to the first streamed token; None when no token was seen."""
        return None if self.first_token_s is None else self.first_token_s - self.sent_s


#: vLLM's ``--scheduling-policy`` values: "priority" engines order their queue by the request's
#: ``priority`` (``shortest_first_priority``), "fcfs" ones (the default) by arrival.
SCHEDULING_POLICIES = ("fcfs", "priority")
#: Seconds of predicted own service per vLLM priority level (``shortest_first_priority``).
PRIORITY_STEP_S = 0.05
#: How far shortest work first goes (``shortest_first_priority``): a request's deadline is
#: ``stretch x`` its own predicted service after it was placed. Larger = more shortest-first;
#: 0 = arrival order (every deadline is ``now``).
PRIORITY_STRETCH = 20.0
#: The bound (seconds): no request is ever overtaken by one placed more than this after it,
#: whatever its own service (``shortest_first_priority``); inf = no bound.
PRIORITY_MAX_OVERTAKE_S = 10.0
#: The relative bound (factor K >= 1): a request's deadline is never more than K x its predicted
#: first-come TTFT on the chosen engine (``PredictedParts.total_s``: the queue ahead of it plus its
#: own service) after it was placed (``shortest_first_priority``); inf = off (the default).
PRIORITY_FCFS_FACTOR = math.inf
#: The recompute bound (factor K_r >= 1): the relative bound of a request that is a recompute on
#: every engine (``policies.costs.best_cached_fraction`` below ``PRIORITY_RECOMPUTE_BELOW``), in
#: place of ``PRIORITY_FCFS_FACTOR`` when tighter (``priority_fcfs_factor_for``); inf = off (the
#: default): a long recompute then gets a late deadline and is overtaken on every engine.
PRIORITY_RECOMPUTE_FCFS_FACTOR = math.inf
#: The recompute bound's gate: a fraction of the prompt in (0, 1], the recompute definition of
#: ``policies.costs.RECOMPUTE_BELOW`` unless set.
PRIORITY_RECOMPUTE_BELOW = RECOMPUTE_BELOW
#: Deadlines count seconds from 2026-01-01 UTC (wall clock), so that router replicas agree.
PRIORITY_EPOCH_S = 1_767_225_600.0
_MAX_PRIORITY = 1 << 62


def check_priority_stretch(stretch: float, what: str) -> None:
    """ValueError naming ``what`` unless ``stretch`` is a finite number >= 0."""
    if not 0 <= stretch < math.inf:
        raise ValueError(f"{what} must be >= 0 and finite (0 = arrival order), got {stretch}")


def check_priority_max_overtake(max_overtake_s: float, what: str) -> None:
    """ValueError naming ``what`` unless ``max_overtake_s`` is > 0 (inf allowed: no bound)."""
    if not max_overtake_s > 0:
        raise ValueError(f"{what} must be > 0 seconds (inf = no bound), got {max_overtake_s}")


def check_priority_fcfs_factor(fcfs_factor: float, what: str) -> None:
    """ValueError naming ``what`` unless ``fcfs_factor`` is >= 1 (inf allowed: off)."""
    if not fcfs_factor >= 1:
        raise ValueError(f"{what} must be >= 1 (1 = first-come deadlines, inf = off), got {fcfs_factor}")


def check_recompute_below(fraction: float, what: str) -> None:
    """ValueError naming ``what`` unless ``fraction`` is in (0, 1] (a fraction of the prompt: the
    recompute threshold of the recompute bound and of the admission wait's recompute gate)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{what} must be in (0, 1] (a fraction of the prompt), got {fraction}")


#: Late binding (``hold_wait_s`` in the simulator): the order in which the router's hold queue
#: releases turns. "fcfs" = arrival; "priority" = the shortest-first deadline the router would send
#: (``hold_parts`` at arrival through ``shortest_first_priority``), ties in arrival order.
HOLD_ORDERS = ("fcfs", "priority")
#: Which engines the policy chooses among when a held turn is released: "all" (every engine, as
#: without the hold) or "room" (only those with room, ``policies.costs.has_room``).
HOLD_PICKS = ("all", "room")

#: Escalation (issue 27, round q24; ``costs.priority_escalate_pick``, ``SimConfig.escalate_pick``):
#: where a request with no first token E s after it arrived is sent again at priority 0: "same" =
#: the engine it was on (its computed blocks are cached there), "route" = wherever the policy routes
#: it then, "other" = wherever the policy routes it among the other engines (round q29: an engine
#: that gave no first token in E s is short of something the router's wait does not see, KV memory
#: in q28's diagnosis; with no other candidate, the same engine).
ESCALATE_PICKS = ("same", "route", "other")


def other_engines(views: Sequence[EngineView], engine_id: str) -> list[EngineView]:
    """PICK other's candidates: ``views`` without ``engine_id``, or all of them when that leaves
    none (a one-engine fleet)."""
    return [view for view in views if view.engine_id != engine_id] or list(views)


def check_hold_wait(wait_s: float, what: str) -> None:
    """ValueError naming ``what`` unless ``wait_s`` is > 0 seconds (inf allowed: never holds): an
    engine with nothing queued (predicted wait 0) must have room, or a busy fleet could never drain
    its hold queue."""
    if not wait_s > 0:
        raise ValueError(f"{what} must be > 0 seconds (an engine has room below it), got {wait_s}")


def check_hold(
    wait_s: float | None,
    order: str,
    pick: str,
    recompute_below: float | None,
    max_s: float | None,
    aged: bool = False,
    names: tuple[str, str, str, str, str, str] = (
        "hold_wait_s",
        "hold_order",
        "hold_pick",
        "hold_recompute_below",
        "hold_max_s",
        "hold_aged",
    ),
) -> None:
    """ValueError naming the setting (``names``: W, ORDER, PICK, the recompute fraction, the bound,
    the aged deadline) unless the late binding's settings make sense together: without W nothing
    else is set; W and the bound > 0 seconds, ORDER in HOLD_ORDERS, PICK in HOLD_PICKS, the
    recompute fraction in (0, 1]. ``aged``: a held turn's shortest-first deadline counts from its
    arrival at the router, not from when it is routed (``shortest_first_priority``'s ``now_s``)."""
    n_wait, n_order, n_pick, n_below, n_max, n_aged = names
    if wait_s is None:
        if (order, pick, recompute_below, max_s, aged) != (HOLD_ORDERS[0], HOLD_PICKS[0], None, None, False):
            raise ValueError(
                f"{n_order}, {n_pick}, {n_below}, {n_max} and {n_aged} order, route, pick, bound and age"
                f" held turns: set {n_wait} too"
            )
        return
    check_hold_wait(wait_s, n_wait)
    if recompute_below is not None:
        check_recompute_below(recompute_below, n_below)
    if max_s is not None:
        check_hold_wait(max_s, n_max)
    if order not in HOLD_ORDERS:
        raise ValueError(f"{n_order} {order!r} is unknown; accepted: {', '.join(HOLD_ORDERS)}")
    if pick not in HOLD_PICKS:
        raise ValueError(f"{n_pick} {pick!r} is unknown; accepted: {', '.join(HOLD_PICKS)}")


def hold_parts(request: RouteRequest, costs: CostEstimates, engine_ids: Iterable[str]) -> PredictedParts:
    """A turn's parts with nothing queued ahead, on the engine where its own service (loads plus
    prefill of what the index says it does not hold there) is shortest: what a held turn's
    deadline is priced with before it is bound to an engine (its first-come TTFT is then its own
    service, so a relative bound K applies to that)."""
    prompt_tokens = prompt_tokens_of(request)
    best: PredictedParts | None = None
    for engine_id in engine_ids:
        hits = predicted_hit_tokens_by_tier(request, engine_id)
        parts = predict_parts(costs.estimates(engine_id), hits, prompt_tokens - sum(hits, 0.0), 0.0)
        if best is None or parts.service_s < best.service_s:
            best = parts
    return best if best is not None else PredictedParts()


def priority_fcfs_factor_for(
    request: RouteRequest,
    fcfs_factor: float = PRIORITY_FCFS_FACTOR,
    recompute_fcfs_factor: float = PRIORITY_RECOMPUTE_FCFS_FACTOR,
    recompute_below: float = PRIORITY_RECOMPUTE_BELOW,
) -> float:
    """The relative bound (``shortest_first_priority``'s ``fcfs_factor``) of ``request``:

        min(fcfs_factor, recompute_fcfs_factor)  if best_cached_fraction < recompute_below
        fcfs_factor                              otherwise

    where best_cached_fraction (``policies.costs.best_cached_fraction``) is the longest prefix any
    engine holds of the prompt in any tier, over its length, from ``request.prefix_matches`` (empty
    when the policy reads no index: every request is then a recompute). A cached turn keeps its
    ordering; a recompute's deadline is never beyond recompute_fcfs_factor x its first-come TTFT."""
    if recompute_fcfs_factor >= fcfs_factor:
        return fcfs_factor
    if best_cached_fraction(request, prompt_tokens_of(request)) < recompute_below:
        return recompute_fcfs_factor
    return fcfs_factor


def shortest_first_priority(
    parts: PredictedParts,
    step_s: float = PRIORITY_STEP_S,
    *,
    now_s: float = 0.0,
    stretch: float = PRIORITY_STRETCH,
    max_overtake_s: float = PRIORITY_MAX_OVERTAKE_S,
    fcfs_factor: float = PRIORITY_FCFS_FACTOR,
) -> int:
    """vLLM's ``priority`` for a routed request (lower is served first, ties in arrival order),
    in levels of ``step_s`` seconds: the request's deadline

        deadline = now_s + min(stretch x own, max_overtake_s, fcfs_factor x fcfs)

    where own = its predicted own service on the chosen engine (loads plus prefill, no queueing)
    and fcfs = ``parts.total_s``, its predicted first-come TTFT there (the queue ahead of it plus
    own: the cost model's one formula).
    An engine started with ``--scheduling-policy priority`` serves the earliest deadline first: a
    turn whose history is cached runs before a recompute queued ahead of it, while its blocks are
    still on the GPU. The bound: a request B served (or kept running) ahead of A has
    ``now_B <= deadline_B <= deadline_A <= now_A + max_overtake_s``, so no request is overtaken by
    one placed more than ``max_overtake_s`` after it, and its wait exceeds its first-come wait by
    at most the service of what was placed in that window. ``stretch`` only moves requests within
    it: 0 = arrival order, larger = closer to pure shortest work first. The relative bound
    ``fcfs_factor`` (K) caps each deadline at K times what first-come would give the request, so a
    long recompute behind a short queue is not pushed back by the stretch, while cached turns still
    go ahead of it; with exact predictions and K = 1 every deadline is the request's first-come
    completion. docs/routing.md, "Shortest work first"."""
    own_s = parts.prefill_s + sum(parts.load_s)
    if not own_s > 0.0:  # nothing to compute, or NaN
        own_s = 0.0
    offset_s = stretch * own_s if stretch > 0.0 else 0.0
    if offset_s > max_overtake_s:
        offset_s = max_overtake_s
    if fcfs_factor < math.inf:
        fcfs_s = parts.total_s
        if not fcfs_s >= own_s:  # negative or NaN waits count as none
            fcfs_s = own_s
        if offset_s > fcfs_factor * fcfs_s:
            offset_s = fcfs_factor * fcfs_s
    level = (now_s + offset_s) / step_s
    if not level > 0.0:
        return 0
    return _MAX_PRIORITY if level >= _MAX_PRIORITY else int(level)


#: How the cost model prices the wait on an engine that orders its queue by priority: "all" = every
#: queued prefill token is ahead (first come; the default), "ahead" = only the queued prefill that
#: engine serves before the request, "overtake" = that, over (1 - rho): rho = the engine's recent
#: rate of work with an earlier deadline, which overtakes the request while it waits
#: (``priority_queued_ahead``; docs/routing.md); "running" = overtake, with the pending prefill of
#: the lowest priority (the one the engine is serving) ahead whatever its priority.
PRIORITY_WAITS = ("all", "ahead", "overtake", "running")
#: "overtake": the window (seconds) over which the rate of overtaking work is measured, and the
#: largest share of the engine it may take (the wait grows at most 1 / (1 - max) = 10x).
PRIORITY_OVERTAKE_WINDOW_S = 30.0
PRIORITY_OVERTAKE_MAX_RHO = 0.9


def priority_queued_ahead(
    ledger: InMemoryLoadLedger,
    engine_id: str,
    clock: Callable[[], float],
    *,
    step_s: float = PRIORITY_STEP_S,
    stretch: float = PRIORITY_STRETCH,
    max_overtake_s: float = PRIORITY_MAX_OVERTAKE_S,
    fcfs_factor: float = PRIORITY_FCFS_FACTOR,
    fcfs_factor_now: Callable[[], float] | None = None,
    overtake: CostEstimates | None = None,
    running_first: bool = False,
    deadline_from: Callable[[], float] | None = None,
) -> Callable[[PredictedParts], float]:
    """``EngineView.queued_ahead`` of a priority engine: a request's first-come parts -> the
    priority it would be sent with there (``shortest_first_priority`` at ``clock()``, the clock its
    priorities are sent in) -> the ledger's prefill tokens queued with a priority no larger
    (``InMemoryLoadLedger.queued_ahead``: what the engine serves first). The caller records each
    sent priority with ``InMemoryLoadLedger.set_priority``. A cached turn (small own service, early
    deadline) no longer counts the long recomputes queued before it; a long recompute still counts
    every cached turn queued ahead of it. With ``overtake`` (the router's cost estimates) it also
    counts the ones that will arrive while it waits, as a priority queue's waiting time does:

        ahead_tokens / (1 - rho),  rho = min(PRIORITY_OVERTAKE_MAX_RHO, overtaking tokens sent in
                                             the last PRIORITY_OVERTAKE_WINDOW_S / window / prefill rate)

    where the overtaking tokens are those sent with a deadline offset below this request's.
    ``running_first``: the ledger counts the prefill the engine is serving as ahead
    (``InMemoryLoadLedger.queued_ahead``). ``fcfs_factor_now``: read at each call, the relative
    bound of the request being priced (``priority_fcfs_factor_for``), in place of ``fcfs_factor``.
    ``deadline_from``: read at each call, the time the request's deadline counts from (its arrival
    at the router when it was held and the hold is aged, ``check_hold``), in place of ``clock()``;
    the overtaking window and offset still count from ``clock()``."""
    window_levels = PRIORITY_OVERTAKE_WINDOW_S / step_s

    def ahead(parts: PredictedParts) -> float:
        now_s = clock()
        level = shortest_first_priority(
            parts,
            step_s,
            now_s=now_s if deadline_from is None else deadline_from(),
            stretch=stretch,
            max_overtake_s=max_overtake_s,
            fcfs_factor=fcfs_factor if fcfs_factor_now is None else fcfs_factor_now(),
        )
        tokens = float(ledger.queued_ahead(engine_id, level, running_first=running_first))
        if overtake is None:
            return tokens
        now_level = now_s / step_s
        recent = ledger.overtaking(engine_id, level - now_level, now_level - window_levels)
        rate = overtake.estimates(engine_id).prefill_tokens_per_s * PRIORITY_OVERTAKE_WINDOW_S
        rho = min(PRIORITY_OVERTAKE_MAX_RHO, recent / rate)
        return tokens / (1.0 - rho)

    return ahead


#: Seconds per output token a running sequence is assumed to take before the engine's first
#: finished request is seen (``SequenceLedger``): a decode step shared with chunked prefills.
ADMISSION_DECODE_S_PER_TOKEN = 0.05
#: Weight of each finished request's seconds per output token in an engine's running average.
ADMISSION_DECODE_SMOOTHING = 0.1
#: How ``SequenceLedger.admission_wait_s`` counts the KV of the sequences placed on an engine:
#: "reserved" = every placed sequence holds its prompt + expected output from now until it ends;
#: "held" = a running sequence (first token seen) holds its prompt + the tokens it decoded so far
#: and grows one token per decode step until it ends, a waiting one holds nothing; "ahead" =
#: "held", plus what the waiting sequences served before the request claim first; "overtake" =
#: "ahead", plus what the expected arrivals with earlier deadlines claim while it waits (a
#: priority queue's wait over KV space).
ADMISSION_FORMS = ("reserved", "held", "ahead", "overtake")
#: "overtake": the window (seconds) over which the rate of earlier-deadline arrivals is measured.
ADMISSION_OVERTAKE_WINDOW_S = PRIORITY_OVERTAKE_WINDOW_S


@dataclass(slots=True)
class _Sequence:
    engine_id: str
    prompt_tokens: int
    output_tokens: int
    first_token_s: float | None = None
    #: The deadline it was sent with (seconds; ``priority x step``), None on a first-come engine.
    deadline_s: float | None = None

    @property
    def reserved_tokens(self) -> int:
        """KV tokens the sequence holds at its end: prompt + expected output."""
        return self.prompt_tokens + self.output_tokens


class SequenceLedger:
    """The sequences the router placed on each engine and has not seen finish (prompt + expected
    output tokens each, the deadline each was sent with) and each engine's seconds per output token
    (first token -> finish of the requests it saw finish): what it needs to price the admission wait
    of an engine that admits a request only when its whole sequence fits the free KV blocks (vLLM's
    ``scheduler_reserve_full_isl``, on by default)."""

    def __init__(self, decode_s_per_token: float = ADMISSION_DECODE_S_PER_TOKEN) -> None:
        if not decode_s_per_token > 0:
            raise ValueError(f"decode_s_per_token must be > 0 seconds, got {decode_s_per_token}")
        self._prior_decode_s = decode_s_per_token
        self._sequences: dict[str, _Sequence] = {}
        self._by_engine: dict[str, dict[str, _Sequence]] = {}
        self._reserved: dict[str, int] = {}
        self._decode_s: dict[str, float] = {}
        #: Per engine: (placed at s, deadline offset s, prompt tokens) of the sequences sent with a
        #: deadline, in placement order (pruned to ADMISSION_OVERTAKE_WINDOW_S as they are read).
        self._placed: dict[str, deque[tuple[float, float, int]]] = {}

    def place(self, request_id: str, engine_id: str, prompt_tokens: int, output_tokens: int) -> None:
        """A request sent to ``engine_id`` (a request id already placed is moved)."""
        self.finish(request_id, None)
        seq = _Sequence(engine_id, max(0, prompt_tokens), max(0, output_tokens))
        self._sequences[request_id] = seq
        self._by_engine.setdefault(engine_id, {})[request_id] = seq
        self._reserved[engine_id] = self._reserved.get(engine_id, 0) + seq.reserved_tokens

    def set_deadline(self, request_id: str, deadline_s: float, placed_s: float) -> None:
        """The deadline a placed request was sent with to a priority engine (its ``priority`` x the
        priority step, in the clock of ``placed_s``, when it was sent); unknown ids are ignored."""
        seq = self._sequences.get(request_id)
        if seq is None or seq.deadline_s is not None:
            return
        seq.deadline_s = deadline_s
        recent = self._placed.get(seq.engine_id)
        if recent is None:
            recent = self._placed[seq.engine_id] = deque()
        recent.append((placed_s, deadline_s - placed_s, seq.prompt_tokens))

    def first_token(self, request_id: str, now: float) -> None:
        seq = self._sequences.get(request_id)
        if seq is not None and seq.first_token_s is None:
            seq.first_token_s = now

    def finish(self, request_id: str, now: float | None) -> None:
        """The request is over (unknown ids are ignored); with ``now`` and a first token seen, its
        seconds per output token update its engine's average."""
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return
        del self._by_engine[seq.engine_id][request_id]
        self._reserved[seq.engine_id] -= seq.reserved_tokens
        if now is not None and seq.first_token_s is not None and seq.output_tokens > 1:
            sample = (now - seq.first_token_s) / (seq.output_tokens - 1)
            old = self._decode_s.get(seq.engine_id)
            self._decode_s[seq.engine_id] = (
                sample if old is None else old + ADMISSION_DECODE_SMOOTHING * (sample - old)
            )

    def decode_s_per_token(self, engine_id: str) -> float:
        return self._decode_s.get(engine_id, self._prior_decode_s)

    def reserved_tokens(self, engine_id: str) -> int:
        return self._reserved.get(engine_id, 0)

    def overtaking_tokens_per_s(self, engine_id: str, offset_s: float, now: float) -> float:
        """Prompt tokens per second sent to ``engine_id`` over the last ADMISSION_OVERTAKE_WINDOW_S
        with a deadline offset below ``offset_s``: the rate at which arrivals that a request whose
        deadline lies ``offset_s`` ahead is overtaken by claim KV (callers pass a ``now`` that
        never moves back)."""
        recent = self._placed.get(engine_id)
        if not recent:
            return 0.0
        since = now - ADMISSION_OVERTAKE_WINDOW_S
        while recent and recent[0][0] < since:
            recent.popleft()
        tokens = sum(prompt for _, their_offset, prompt in recent if their_offset < offset_s)
        return tokens / ADMISSION_OVERTAKE_WINDOW_S

    def admission_wait_s(
        self,
        engine_id: str,
        need_tokens: float,
        capacity_tokens: float,
        now: float,
        *,
        form: str = "reserved",
        deadline_s: float | None = None,
    ) -> float:
        """Seconds until ``need_tokens`` (a new request's whole prompt) fit ``engine_id``'s KV of
        ``capacity_tokens`` beside the sequences placed there, counted as ``form``
        (ADMISSION_FORMS) says. Each running sequence ends at

            end = (its first token, or now if none yet) + its output tokens x seconds per token

        "reserved" (every placed sequence at its full reservation until it ends):

            excess = reserved tokens of the placed sequences + need_tokens - capacity_tokens
            wait   = 0 if excess <= 0, else the time until the sequences that end first free excess
                     tokens (past the last one when even all of them do not free enough)

        "held", "ahead" and "overtake": the earliest t in {now} and the running sequences' ends with

            capacity - held(t) >= need_tokens + claims(t)
            held(t)   = sum over the running sequences not ended by t of
                        prompt + (t - first token) / seconds per token   (decoded so far, growing)
            claims(t) = 0                                                 ("held")
                      = ahead                                             ("ahead")
                      = ahead + rate x (min(t, deadline_s) - now)         ("overtake")

        where ahead = the prompts of the waiting sequences (no first token) the engine serves
        before the request: those with a deadline no later than ``deadline_s`` (or none known),
        every waiting one when ``deadline_s`` is None (a first-come engine: nothing overtakes);
        rate = ``overtaking_tokens_per_s`` at the request's deadline offset (arrivals after
        ``deadline_s`` come later in the queue, so the claims stop growing there). Between two ends
        held(t) only grows and claims(t) only grow, so the condition first holds at one of them.
        When even an empty engine does not fit the request beside what is ahead, it waits past the
        last end by the longest expected decode of the waiting sequences ahead (they run first)."""
        if form == "reserved":
            return self._reserved_wait_s(engine_id, need_tokens, capacity_tokens, now)
        if form not in ADMISSION_FORMS:
            raise ValueError(f"admission form {form!r} is unknown; accepted: {', '.join(ADMISSION_FORMS)}")
        queue_ahead = form != "held"  # the waiting sequences served first claim first
        decode_s = self.decode_s_per_token(engine_id)
        running: list[tuple[float, int, float]] = []  # (end, prompt tokens, first token) per sequence
        ahead = 0.0
        longest_ahead_s = 0.0
        for seq in self._by_engine.get(engine_id, {}).values():
            first_s = seq.first_token_s
            if first_s is None:
                if queue_ahead and (
                    deadline_s is None or seq.deadline_s is None or seq.deadline_s <= deadline_s
                ):
                    ahead += seq.prompt_tokens
                    longest_ahead_s = max(longest_ahead_s, seq.output_tokens * decode_s)
                continue
            end_s = first_s + seq.output_tokens * decode_s
            if end_s > now:  # an overdue sequence counts as ending now
                running.append((end_s, seq.prompt_tokens, first_s))
        rate = 0.0
        if form == "overtake" and deadline_s is not None and deadline_s > now:
            rate = self.overtaking_tokens_per_s(engine_id, deadline_s - now, now)
        free_for = capacity_tokens - need_tokens - ahead
        # held(t) of the sequences still running at t = prompts + (count x t - sum of first tokens) / s
        prompts = float(sum(prompt for _, prompt, _ in running))
        firsts = sum(first for _, _, first in running)
        count = len(running)

        def fits(t: float) -> bool:
            held = prompts + (count * t - firsts) / decode_s
            claimed = rate * (min(t, deadline_s) - now) if rate > 0.0 and deadline_s is not None else 0.0
            return held + claimed <= free_for

        if fits(now):
            return 0.0
        running.sort()
        for end_s, prompt, first_s in running:
            prompts -= prompt
            firsts -= first_s
            count -= 1
            if fits(end_s):
                return end_s - now
        return (running[-1][0] - now if running else 0.0) + longest_ahead_s

    def _reserved_wait_s(
        self, engine_id: str, need_tokens: float, capacity_tokens: float, now: float
    ) -> float:
        """``admission_wait_s``'s "reserved" form."""
        excess = self._reserved.get(engine_id, 0) + need_tokens - capacity_tokens
        if excess <= 0:
            return 0.0
        decode_s = self.decode_s_per_token(engine_id)
        finishes = sorted(
            (
                (now if seq.first_token_s is None else seq.first_token_s) + seq.output_tokens * decode_s,
                seq.reserved_tokens,
            )
            for seq in self._by_engine.get(engine_id, {}).values()
        )
        freed = 0
        for end_s, tokens in finishes:
            freed += tokens
            if freed >= excess:
                return max(0.0, end_s - now)
        return max(0.0, finishes[-1][0] - now) if finishes else 0.0


class Outcome(msgspec.Struct):
    """How a request ended, as the engine reported it."""

    ok: bool
    #: usage.prompt_tokens_details.cached_tokens (None when the engine did not report usage).
    cached_tokens: int | None = None
    #: usage.prompt_tokens (None when not reported; the request's own count is used then).
    prompt_tokens: int | None = None
    #: The client left before the end: says nothing about the arm or the engine.
    client_gone: bool = False
    #: TTFT as the client saw it through the router (for experiments), when a token was streamed.
    client_ttft_s: float | None = None


class ExperimentRecorder(Protocol):
    """Where finished requests are accounted per arm (router.experiments.Experiments)."""

    def record_turn(
        self,
        arm: str,
        session_key: str,
        *,
        ok: bool,
        ttft_s: float | None,
        cached_tokens: int | None,
        prompt_tokens: int,
        predicted_hit_tokens_by_tier: Sequence[float],
    ) -> None: ...


def _unpriced_parts(
    est: EngineCosts,
    match: PrefixMatch,
    block_size: int,
    prompt_tokens: int,
    wait_tokens: float,
    in_flight: float,
) -> PredictedParts:
    """The core's parts for a policy that did not price them (``RoutingCore._parts``): the formula
    on the index's ``match`` and the engine's queue, before any priority or admission wait."""
    hits = hit_tokens_by_tier(match, block_size, prompt_tokens)
    return predict_parts(est, hits, prompt_tokens - sum(hits, 0.0), wait_tokens, in_flight)


def predicted_hit_tokens_by_tier(request: RouteRequest, engine_id: str) -> tuple[float, float, float]:
    """The index's prediction of the chosen engine's hits, in tokens per tier (cheapest tier
    first), capped at prompt - 1 (vLLM always computes the last prompt token)."""
    match = request.prefix_matches.get(engine_id, NO_MATCH)
    return hit_tokens_by_tier(match, request.block_size, prompt_tokens_of(request))


# ----------------------------------------------------------------------------- shared STORAGE reads


def check_pool_bandwidth(bandwidth: object, what: str) -> None:
    """ValueError naming ``what`` unless ``bandwidth`` is a positive finite number (bytes/s)."""
    if not (isinstance(bandwidth, int | float) and bandwidth > 0 and math.isfinite(bandwidth)):
        raise ValueError(f"{what} must be a positive number of bytes/s, got {bandwidth!r}")


class StorageReadQueue:
    """The traffic the router has placed on each shared STORAGE pool, booked first come at the
    pool's aggregate bandwidth (router config ``costs.storage_pool_bandwidth``; the DES passes its
    pool's): ``queue_s(pool, now)`` is how long a read placed now waits behind it. Several engines
    mounting one pool share its bandwidth, and what one of them queued there delays every member's
    reads; the engine's own STORAGE load cost (``EngineCosts.load_time_s``) prices the read alone.
    A request books its STORAGE read and, with ``write_through`` (vLLM's tiering manager with an fs
    tier writes every block its CPU tier stores through to the pool), the blocks it computes
    (round q54: half a shared pool's traffic is those writes). The booking is the router's: what it
    did not place (another router replica's requests) is not in it, and a booked read the engine
    did not make (its blocks were nearer by then) still drains at the pool's rate. Pure; times in
    the caller's clock."""

    __slots__ = ("_bandwidth", "_free_at", "write_through")

    def __init__(self, bandwidth_bytes_per_s: Mapping[str, float], *, write_through: bool = True) -> None:
        for pool, bandwidth in bandwidth_bytes_per_s.items():
            if not pool:
                raise ValueError("a shared STORAGE pool's read bandwidth needs the pool's name")
            check_pool_bandwidth(bandwidth, f"shared STORAGE pool {pool!r}: read bandwidth")
        self._bandwidth = dict(bandwidth_bytes_per_s)
        #: Book the blocks a request computes too (the engines write them through to the pool).
        self.write_through = write_through
        #: Per pool: when (the caller's clock) the traffic booked so far is done.
        self._free_at: dict[str, float] = {}

    def __contains__(self, pool: object) -> bool:
        return pool in self._bandwidth

    def queue_s(self, pool: str, now: float) -> float:
        """Seconds from ``now`` until ``pool`` has moved every read booked there (0 = idle; 0 for a
        pool without a bandwidth)."""
        free_at = self._free_at.get(pool)
        return free_at - now if free_at is not None and free_at > now else 0.0

    def snapshot(self, now: float) -> dict[str, dict[str, float]]:
        """Per pool its configured bandwidth and the booked queue now (``/debug/costs``)."""
        return {
            pool: {"bandwidth_bytes_per_s": bandwidth, "queue_s": self.queue_s(pool, now)}
            for pool, bandwidth in self._bandwidth.items()
        }

    def book(self, pool: str, nbytes: float, now: float) -> None:
        """``nbytes`` of traffic on ``pool`` placed at ``now``: queued after what was booked before
        it. Nothing for a pool without a bandwidth or no bytes."""
        bandwidth = self._bandwidth.get(pool)
        if bandwidth is None or not nbytes > 0:
            return
        free_at = self._free_at.get(pool, now)
        self._free_at[pool] = (free_at if free_at > now else now) + nbytes / bandwidth


# ----------------------------------------------------------------------------- the core


@dataclass(slots=True)
class CoreConfig:
    """Tunables of the core (router config: index.speculation_ttl_s; DES: SimConfig)."""

    #: Seconds a routed prompt's blocks count as GPU entries of the chosen engine before events
    #: confirm them (0 disables speculation).
    speculation_ttl_s: float = 2.0
    #: Fleets with more candidates than this are pre-filtered for index-reading policies: the
    #: ``prefilter_keep`` engines with the longest GPU/CPU hits plus as many least loaded ones.
    prefilter_above_engines: int = 64
    prefilter_keep: int = 8
    #: What-if (the old accounting): queue the whole prompt as pending prefill, not the predicted
    #: uncached tokens of the chosen engine.
    queue_whole_prompt: bool = False
    #: Feed measured TTFTs to the cost model.
    calibrate: bool = True


@dataclass(slots=True)
class TtftTally:
    """How true one engine's predicted TTFTs were: the measured TTFTs (sent -> first token) and
    the TTFTs predicted for the same requests, summed (the router exports both as counters; the
    DES reports their ratio)."""

    measured_s: float = 0.0
    predicted_s: float = 0.0


@dataclass(slots=True)
class CoreCounters:
    """What the core did (exposed by /debug/costs and the DES)."""

    routed: int = 0
    finished: int = 0
    calibrations: int = 0
    selfchecks: int = 0
    prefiltered: int = 0


class RoutingCore:
    """filter -> score -> reserve -> on_first_token -> on_finished; see the module docstring."""

    def __init__(
        self,
        *,
        ledger: LoadLedger,
        costs: CostModel,
        index: PrefixIndex | None = None,
        config: CoreConfig | None = None,
        recorder: ExperimentRecorder | None = None,
        index_trusted: Callable[[str], bool] | None = None,
        storage_reads: StorageReadQueue | None = None,
    ) -> None:
        """``index_trusted``: extra per-engine distrust from the shell (e.g. an event gap without
        replay); the cost model's self-check verdict is always applied. ``storage_reads``: the
        shared STORAGE pools whose traffic the core books (``reserve``) and whose queue it prices
        (``score``: each candidate's ``STORAGE_QUEUE_KEY``); None = none."""
        self.ledger = ledger
        self.costs = costs
        self.index = index
        self.config = config or CoreConfig()
        self.recorder = recorder
        self._index_trusted = index_trusted
        self.storage_reads = storage_reads
        self.counters = CoreCounters()
        #: Per engine: measured vs predicted TTFT of the requests that got a first token.
        self.ttft_tally: dict[str, TtftTally] = {}

    # -- filter -----------------------------------------------------------------------------

    def filter(
        self,
        request: RouteRequest,
        engines: Sequence[EngineView],
        *,
        uses_index: bool = False,
        refresh: bool = True,
        trust: bool | None = None,
    ) -> list[EngineView]:
        """The candidates for ``request``: healthy, not drained, serving its model; their load
        figures and index trust refreshed in place (callers run filter -> score -> reserve with no
        await in between, so the views are consistent). Large fleets are pre-filtered for
        index-reading policies (``CoreConfig.prefilter_above_engines``). ``refresh=False``: the
        candidates only (a caller that filters again before choosing). ``trust``: whether the
        index trust is asked (``refresh``)."""
        model = request.model
        out = [
            v
            for v in engines
            if v.healthy and not v.drained and (not model or not v.models or model in v.models)
        ]
        if not refresh:
            return self._prefiltered(request, out) if uses_index else out
        return self.refresh(request, out, uses_index=uses_index, trust=trust)

    def refresh(
        self,
        request: RouteRequest,
        candidates: list[EngineView],
        *,
        uses_index: bool = False,
        trust: bool | None = None,
    ) -> list[EngineView]:
        """``filter``'s second half, for candidates ``filter(refresh=False)`` returned from the
        same views (a caller that awaited between the two: the candidates are what filtering the
        views again would give): the large fleet's pre-filter, then the load figures and index
        trust refreshed in place. ``trust``: whether the index trust is asked (None: for a policy
        that reads the index, the only one whose choice it can change; a view's trust is left as
        it was otherwise)."""
        out = self._prefiltered(request, candidates) if uses_index else candidates
        ledger, costs, extra = self.ledger, self.costs, self._index_trusted
        trust = uses_index if trust is None else trust
        for view in out:
            engine_id = view.engine_id
            view.in_flight, view.queued_prefill_tokens = ledger.load(engine_id)
            if trust:
                trusted = costs.index_trusted(engine_id)
                view.index_trusted = trusted and (extra is None or extra(engine_id))
        return out

    def _prefiltered(self, request: RouteRequest, candidates: list[EngineView]) -> list[EngineView]:
        """``candidates``, pre-filtered when there are more than ``prefilter_above_engines``."""
        if 0 < self.config.prefilter_above_engines < len(candidates):
            self.counters.prefiltered += 1
            return self._prefilter(request, candidates)
        return candidates

    def _prefilter(self, request: RouteRequest, engines: list[EngineView]) -> list[EngineView]:
        """The engines with the longest local (GPU or CPU) hits - a shared storage pool's copy is
        everyone's - plus the ``prefilter_keep`` least loaded others."""
        keep = self.config.prefilter_keep
        by_id = {v.engine_id: v for v in engines}
        local = heapq.nlargest(
            keep,
            (
                (m.blocks_by_tier[0] + m.blocks_by_tier[1], e)
                for e, m in request.prefix_matches.items()
                if (m.blocks_by_tier[0] or m.blocks_by_tier[1]) and e in by_id
            ),
        )
        chosen = [by_id[e] for _, e in local]
        seen = {v.engine_id for v in chosen}
        for engine_id in self.ledger.least_loaded():
            if engine_id not in seen and engine_id in by_id:
                chosen.append(by_id[engine_id])
                seen.add(engine_id)
                if len(chosen) >= len(local) + keep:
                    break
        return chosen

    # -- score ------------------------------------------------------------------------------

    def score(
        self,
        policy: Policy,
        request: RouteRequest,
        candidates: Sequence[EngineView],
        now: float,
        *,
        fleet: FleetView | None = None,
    ) -> Decision:
        """The policy's choice among ``candidates``; NoEngineAvailable when there are none.
        ``fleet``: the caller's FleetView of exactly these candidates, ``now`` and this core's
        costs (else one is built)."""
        if not candidates:
            raise NoEngineAvailable(
                f"no healthy engine serves model {request.model!r}" if request.model else "no healthy engine"
            )
        if self.storage_reads is not None:
            self._price_storage_reads(candidates, now)
        if fleet is None:
            fleet = FleetView(candidates, now=now, costs=self.costs)
        return policy.choose(request, fleet)

    def _price_storage_reads(self, candidates: Sequence[EngineView], now: float) -> None:
        """Each candidate's ``STORAGE_QUEUE_KEY``: its shared pool's booked read queue now, where
        the core books that pool's reads and the queue is not empty (absent otherwise)."""
        reads, pool_of = self.storage_reads, self.costs.storage_pool_of
        assert reads is not None
        for view in candidates:
            pool = pool_of(view.engine_id)
            queue_s = reads.queue_s(pool, now) if pool is not None else 0.0
            if queue_s > 0.0:
                view.extra[STORAGE_QUEUE_KEY] = queue_s
            elif STORAGE_QUEUE_KEY in view.extra:
                del view.extra[STORAGE_QUEUE_KEY]

    def _book_storage_traffic(
        self, request: RouteRequest, decision: Decision, engine_id: str, now: float
    ) -> None:
        """What ``request`` will move on ``engine_id``'s shared pool, booked there: its STORAGE read
        (the index's predicted STORAGE hit) and, with ``write_through``, the blocks it computes
        (``predicted_prefill_tokens``)."""
        reads = self.storage_reads
        assert reads is not None
        pool = self.costs.storage_pool_of(engine_id)
        if pool is None or pool not in reads:
            return
        tokens = predicted_hit_tokens_by_tier(request, engine_id)[2]
        if reads.write_through:
            tokens += predicted_prefill_tokens(request, decision, engine_id)
        if tokens > 0:
            reads.book(pool, tokens * self.costs.estimates(engine_id).kv_bytes_per_token, now)

    # -- reserve ----------------------------------------------------------------------------

    def reserve(
        self,
        policy: Policy,
        request: RouteRequest,
        decision: Decision,
        now: float,
        *,
        engine_id: str | None = None,
        arm: str = "",
        candidates: Sequence[EngineView] = (),
    ) -> Reservation:
        """Take the chosen engine's load, speculate its prompt blocks and keep the predicted parts.

        ``engine_id``: a fallback engine of the same decision (a retry after a refused
        connection); speculation and ``policy.on_routed`` happen only for the first choice.
        ``candidates``: the views the policy saw (to price the wait when the policy did not)."""
        target = decision.engine_id if engine_id is None else engine_id
        prompt_tokens = prompt_tokens_of(request)
        queued = (
            prompt_tokens
            if self.config.queue_whole_prompt
            else predicted_prefill_tokens(request, decision, target)
        )
        ticket = self.ledger.reserve(target, queued)
        parts = self._parts(request, decision, target, candidates)
        if self.storage_reads is not None:
            self._book_storage_traffic(request, decision, target, now)
        if engine_id is None:
            index, keys = self.index, request.block_keys
            if index is not None and keys:
                ttl_s = self.config.speculation_ttl_s
                if ttl_s > 0:  # every arm speculates: the engine will hold these blocks whatever chose it
                    index.speculate(target, keys, ttl_s, now)
                # The engine will read its pool-only prefix blocks: the pool's LRU refreshes them.
                index.refresh_pool_reads(target, keys, now)
            policy.on_routed(request, decision)
        self.counters.routed += 1
        return Reservation(request, decision, policy, target, ticket, now, parts, arm)

    def _parts(
        self, request: RouteRequest, decision: Decision, engine_id: str, candidates: Sequence[EngineView]
    ) -> PredictedParts | Callable[[], PredictedParts]:
        """The policy's priced parts (tier_cost), else the same formula on the index's match and
        the engine's queue, so every policy's requests calibrate the same cost model: priced when
        first read (``Reservation.parts``; a non-stream answer of such a policy may never need
        them) from the inputs of now, unless the engine's view itself is read (a priority or
        admission wait): then now."""
        if decision.parts is not None:  # (an engine it did not price is in no score either)
            priced = decision.parts.get(engine_id)
            if priced is not None:
                return priced  # type: ignore[no-any-return]
        else:
            scores = decision.scores.get(engine_id)
            if scores is not None and "prefill_tokens" in scores and "wait_tokens" in scores:
                return PredictedParts.from_scores(scores)
        match = request.prefix_matches.get(engine_id, NO_MATCH)
        prompt_tokens = prompt_tokens_of(request)
        wait_tokens = in_flight = 0.0
        chosen: EngineView | None = None
        for view in candidates:
            if view.engine_id == engine_id:
                wait_tokens = float(view.queued_prefill_tokens)
                in_flight = float(view.in_flight)
                chosen = view
                break
        est, block_size = self.costs.estimates(engine_id), request.block_size
        if chosen is None or (chosen.queued_ahead is None and not chosen.extra):
            return partial(_unpriced_parts, est, match, block_size, prompt_tokens, wait_tokens, in_flight)
        parts = _unpriced_parts(est, match, block_size, prompt_tokens, wait_tokens, in_flight)
        if chosen.queued_ahead is not None:
            parts = priority_wait_parts(est, parts, chosen)
        if chosen.extra:  # (only an engine with extra numbers has one)
            parts = engine_wait_parts(parts, chosen, request, prompt_tokens)
        return parts

    # -- post-response ----------------------------------------------------------------------

    def on_first_token(self, reservation: Reservation, now: float) -> None:
        """A streamed token arrived: the TTFT is measured and the prefill is over."""
        self.tally_first_token(reservation, now)
        self.ledger.first_token(reservation.ticket)

    def tally_first_token(self, reservation: Reservation, now: float) -> None:
        """The measured and predicted TTFT of a first token (once per reservation): the learning
        half of ``on_first_token`` (``release_prefill`` is its load half)."""
        if reservation.first_token_s is None:
            reservation.first_token_s = now
            tally = self.ttft_tally.get(reservation.engine_id)
            if tally is None:
                tally = self.ttft_tally[reservation.engine_id] = TtftTally()
            tally.measured_s += now - reservation.sent_s
            tally.predicted_s += reservation.parts.total_s

    def release_prefill(self, reservation: Reservation) -> None:
        """The prefill is assumed over without a measured token (non-stream answers: vLLM sends
        the body only when generation ends); frees the queued prefill, measures nothing."""
        self.ledger.first_token(reservation.ticket)

    def abandon(self, reservation: Reservation) -> None:
        """Give the load back without any accounting (a connection the engine refused: the next
        attempt takes a new reservation)."""
        self.ledger.finish(reservation.ticket)
        reservation.finished = True

    def on_finished(self, reservation: Reservation, outcome: Outcome, now: float) -> None:
        """Release the load and learn from the request (once; later calls are no-ops)."""
        if self.release_finished(reservation, outcome):
            self.learn_finished(reservation, outcome, now)

    def release_finished(self, reservation: Reservation, outcome: Outcome) -> bool:
        """The load half of ``on_finished``: the ledger's release, the policy's ``on_finished``,
        the count (once). True when there is something to learn (``learn_finished``)."""
        if reservation.finished:
            return False
        reservation.finished = True
        self.ledger.finish(reservation.ticket)
        reservation.policy.on_finished(reservation.request, reservation.engine_id, outcome.ok)
        self.counters.finished += 1
        return not outcome.client_gone

    def learn_finished(self, reservation: Reservation, outcome: Outcome, now: float) -> None:
        """The learning half of ``on_finished`` (after ``release_finished`` returned True): the
        index's delivered blocks, the TTFT calibration, the self-check, the experiment's turn."""
        request, engine_id = reservation.request, reservation.engine_id
        cached = outcome.cached_tokens
        if outcome.ok and cached is not None and self.index is not None and request.block_keys:
            # A shortfall against the index's promise: the pool evicted what it never announced.
            bs = max(1, request.block_size)
            self.index.learn_delivered(
                engine_id,
                request.block_keys,
                int(cached) // bs,
                int(sum(reservation.parts.hit_tokens)) // bs,
                reservation.sent_s,
            )
        if outcome.ok:
            ttft_s = reservation.engine_ttft_s
            if self.config.calibrate and ttft_s is not None:
                # observe() also runs the index self-check when cached tokens are known.
                self.costs.observe(engine_id, reservation.parts, ttft_s, cached, now)
                self.counters.calibrations += 1
                if cached is not None:
                    self.counters.selfchecks += 1
            elif cached is not None and request.block_keys:
                self.costs.selfcheck.observe(engine_id, sum(reservation.parts.hit_tokens), cached)
                self.counters.selfchecks += 1
        if self.recorder is not None and reservation.arm:
            prompt_tokens = outcome.prompt_tokens
            if prompt_tokens is None:
                prompt_tokens = request.prompt_tokens
            self.recorder.record_turn(
                reservation.arm,
                request.session_key,
                ok=outcome.ok,
                ttft_s=outcome.client_ttft_s if outcome.client_ttft_s is not None else None,
                cached_tokens=cached,
                prompt_tokens=prompt_tokens,
                predicted_hit_tokens_by_tier=predicted_hit_tokens_by_tier(request, engine_id)
                if outcome.ok
                else (0.0, 0.0, 0.0),
            )

    def ttft_over_predicted(self) -> float:
        """Measured over predicted TTFT, summed over every engine (nan before any first token)."""
        predicted = sum(t.predicted_s for t in self.ttft_tally.values())
        return sum(t.measured_s for t in self.ttft_tally.values()) / predicted if predicted > 0 else math.nan

    # -- one-call convenience (DES, explain) -------------------------------------------------

    def route(
        self,
        policy: Policy,
        request: RouteRequest,
        engines: Sequence[EngineView],
        now: float,
        *,
        arm: str = "",
    ) -> Reservation:
        """filter -> score -> reserve in one synchronous call."""
        candidates = self.filter(request, engines, uses_index=bool(getattr(policy, "uses_index", False)))
        decision = self.score(policy, request, candidates, now)
        return self.reserve(policy, request, decision, now, arm=arm, candidates=candidates)
