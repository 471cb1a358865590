"""How long a stream may wait for its engine's first token before failing over: ``FirstByteBudget``.

A fixed ``limits.first_byte_timeout_s`` (> 0) is used as it is. With 0 (the default) the budget
follows the fleet's measured time to first event (request sent -> first SSE event, successful
streams only):

    budget_s = clamp(MULTIPLE * p99(last WINDOW first-event times), FLOOR_S, CEILING_S)

and ``FALLBACK_S`` until ``MIN_SAMPLES`` streams were measured. A stopped or hung engine is then
left after a few times the slowest normal prefill instead of two minutes; the floor keeps a fast
fleet from failing over on a hiccup, the ceiling bounds the wait however slow the history was.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from kvcore.stats import percentiles

if TYPE_CHECKING:
    from router.routing import RouteContext

MULTIPLE = 4.0
FLOOR_S = 5.0
CEILING_S = 60.0
FALLBACK_S = 30.0
WINDOW = 1024
MIN_SAMPLES = 20
#: The p99 is recomputed after this many new samples (not on every request), and at most once per
#: ``RECOMPUTE_INTERVAL_S`` of the streams' clock: a p99 over the window is a sort of 1,024 numbers,
#: which every 32 streams was ~3% of the router's CPU per stream at a few thousand streams a second.
RECOMPUTE_EVERY = 32
RECOMPUTE_INTERVAL_S = 1.0


class FirstByteBudget:
    """The first-byte budget of the next stream; a route observer that feeds itself on first tokens."""

    def __init__(self, fixed_s: float = 0.0) -> None:
        self.fixed_s = fixed_s
        self._samples_s: deque[float] = deque(maxlen=WINDOW)
        self._since_recompute = 0
        self._recomputed_s = -math.inf
        self._budget_s = fixed_s if fixed_s > 0 else FALLBACK_S

    def budget_s(self) -> float:
        return self._budget_s

    def record(self, first_event_s: float, now_s: float | None = None) -> None:
        """One successful stream's time from sending the request to its first event; ``now_s``
        (monotonic, when it arrived) spaces the recomputations (None: by sample count only)."""
        if self.fixed_s > 0 or not math.isfinite(first_event_s) or first_event_s < 0:
            return
        self._samples_s.append(first_event_s)
        self._since_recompute += 1
        if len(self._samples_s) >= MIN_SAMPLES and (
            len(self._samples_s) == MIN_SAMPLES
            or (
                self._since_recompute >= RECOMPUTE_EVERY
                and (now_s is None or now_s - self._recomputed_s >= RECOMPUTE_INTERVAL_S)
            )
        ):
            self._since_recompute = 0
            if now_s is not None:
                self._recomputed_s = now_s
            (p99_s,) = percentiles(self._samples_s, (99,))
            self._budget_s = min(CEILING_S, max(FLOOR_S, MULTIPLE * p99_s))

    # -- route observer (router.routing.RouteObserver) ----------------------------------------
    def on_routed(self, ctx: RouteContext) -> None:
        return None

    def on_first_byte(self, ctx: RouteContext) -> None:
        if ctx.sent_s is not None and ctx.first_token_s is not None:
            self.record(ctx.first_token_s - ctx.sent_s, now_s=ctx.first_token_s)

    def on_finished(self, ctx: RouteContext) -> None:
        return None
