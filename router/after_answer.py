"""The accounting that follows an answer out, run later (``proxy.defer_accounting``).

At concurrency 1 a client sends its next request as soon as it has the answer, so whatever the
router does after the answer's last write delays that request: the learning (the TTFT model's
step, the index's delivered-blocks check, experiments), the observers (metrics, the first-byte
budget, liveness, traces) and the request's log line. ``AfterAnswer`` queues that work and runs it
(in order, an error logged) at the next of:

- ``drain()`` (the callback path) or ``drain_soon()`` (the task path, whose request goes out when
  its task awaits the send) once the next request went upstream: the router then waits for the
  engine, whose time, on its own core, covers the work;
- a loop timer ``delay_s`` after the queue's first item (nothing else came);
- the queue reaching ``cap`` items (memory stays bounded whatever the timing);
- ``drain()`` before anything reads what the work writes (``GET /metrics``, the explain endpoint)
  and at shutdown.

The load is never deferred (the ledger's release, the policy's in-flight counts): the routing
core's ``release_finished`` runs at once; only ``learn_finished`` waits, so a decision sees every
finished request's load and at most one batch's learning late.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvroute.after_answer")

#: Items queued before the queue drains at once (bounded memory).
DEFAULT_CAP = 256
#: Seconds after the first queued item at which a timer drains the queue.
DEFAULT_DELAY_S = 0.002


class AfterAnswer:
    """A bounded FIFO of calls ``call(*args)`` run by ``drain`` (see the module docstring)."""

    __slots__ = ("_cap", "_delay_s", "_loop", "_queue", "_soon", "_timer", "drained")

    def __init__(self, *, cap: int = DEFAULT_CAP, delay_s: float = DEFAULT_DELAY_S) -> None:
        if cap < 1 or delay_s <= 0:
            raise ValueError("AfterAnswer needs cap >= 1 and delay_s > 0")
        self._cap, self._delay_s = cap, delay_s
        self._queue: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._soon = False
        # The loop, kept: asyncio.get_running_loop() is a getpid() system call on Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Calls run so far (tests and the benchmark's notes read it).
        self.drained = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, call: Callable[..., None], *args: Any) -> None:
        """Queue ``call(*args)``; at the cap, everything queued runs now."""
        queue = self._queue
        queue.append((call, args))
        if len(queue) >= self._cap:
            self.drain()
        elif self._timer is None:
            loop = self._loop
            if loop is None or not loop.is_running():
                try:
                    loop = self._loop = asyncio.get_running_loop()
                except RuntimeError:  # no loop (a synchronous caller): nothing to wait for
                    self.drain()
                    return
            self._timer = loop.call_later(self._delay_s, self._on_timer)

    def drain_soon(self) -> None:
        """``drain`` on the event loop's next turn (after the caller's task suspends: a request it
        is about to send is written by then), if anything is queued."""
        if self._queue and not self._soon and self._loop is not None:
            self._soon = True
            self._loop.call_soon(self._on_soon)

    def _on_soon(self) -> None:
        self._soon = False
        self.drain()

    def _on_timer(self) -> None:
        self._timer = None
        self.drain()

    def drain(self) -> None:
        """Run every queued call, oldest first (calls queued meanwhile too); errors are logged."""
        queue = self._queue
        while queue:
            call, args = queue.popleft()
            self.drained += 1
            try:
                call(*args)
            except Exception:  # the answer went out as it was: the work's bug is only logged
                log.exception("accounting after an answer failed (%r)", call)

    def close(self) -> None:
        """Drain and stop the timer (shutdown)."""
        self.drain()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
