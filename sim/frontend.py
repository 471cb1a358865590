"""The processes between a client and an engine core, as single-server FIFO stages.

A real request does not reach vLLM's engine core when the client sends it: vLLM's API server (one
Python process per engine) parses it, applies the chat template and tokenizes the prompt first, and
every token the engine core produces goes back through the same process (detokenized, framed as a
server-sent event) before the client sees it. A router in the path (one process for the fleet) adds
its own parse/tokenize/route work per request and a relay cost per streamed chunk. Each of these
processes serves one thing at a time: a request that arrives while it is busy streaming other
requests' tokens waits. On a host whose cores are shared, a process is also descheduled now and
then: a request's stall (``stall_s``, log-normal) delays it without holding the process.

``ServerStage`` holds one stage's service times; ``FifoServer`` is its queue. The DES
(sim/des.py) puts one API-server stage in front of every engine core and, optionally, one router
stage in front of the fleet (``FleetSpec.api_server`` / ``FleetSpec.router_stage``);
loadtest/calibrate_vllm.py fits the service times to real vLLM.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

#: ServerStage's fields (all seconds or a sigma, all >= 0).
FIELDS = ("request_s", "request_s_per_token", "output_s_per_token", "stall_s", "stall_sigma")


@dataclass(frozen=True, slots=True)
class ServerStage:
    """Service times of one single-server stage, in seconds of that process's time."""

    #: Per request on the way in (HTTP parse, chat template, routing): work that holds the process.
    request_s: float = 0.0
    #: Per prompt token on the way in (tokenization).
    request_s_per_token: float = 0.0
    #: Per output token on the way out (detokenization, one server-sent event, the relay).
    output_s_per_token: float = 0.0
    #: Median delay each request waits on top of its work without holding the process: a host whose
    #: cores other processes share deschedules it for a while now and then, and every request in it
    #: then waits the same stall together (they do not queue behind each other's stalls).
    stall_s: float = 0.0
    #: Log-normal sigma of the stall: each request's is ``stall_s`` x exp(sigma x z), z standard
    #: normal (``stall_s`` stays the median). 0 = every stall is ``stall_s``.
    stall_sigma: float = 0.0

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"ServerStage.{name} must be a finite number >= 0, got {value!r}")

    def request_cost_s(self, prompt_tokens: int) -> float:
        """The process's work on a request (it serves the next one after this)."""
        return self.request_s + self.request_s_per_token * prompt_tokens

    def output_cost_s(self, tokens: int) -> float:
        return self.output_s_per_token * tokens

    def stall_draw_s(self, rng: random.Random) -> float:
        """One request's stall."""
        if self.stall_sigma > 0 and self.stall_s > 0:
            return self.stall_s * math.exp(self.stall_sigma * rng.gauss(0.0, 1.0))
        return self.stall_s

    @classmethod
    def from_dict(cls, doc: object, what: str) -> ServerStage:
        """From a JSON object of the fields above (what calibrate_vllm writes); ``what`` names it
        in the error."""
        if not isinstance(doc, dict):
            raise ValueError(f"{what}: a JSON object of ServerStage fields expected, got {doc!r}")
        unknown = sorted(set(doc) - set(FIELDS))
        if unknown:
            raise ValueError(f"{what}: unknown ServerStage fields {', '.join(unknown)}")
        try:
            return cls(**doc)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from exc


class FifoServer:
    """One process serving jobs one at a time in arrival order. Jobs must be offered in
    non-decreasing arrival time (a DES offers them at their event's time): then the completion
    time is known when the job arrives."""

    __slots__ = ("busy_s", "free_at_s")

    def __init__(self) -> None:
        #: When the last accepted job completes.
        self.free_at_s = 0.0
        #: Total service time accepted (utilisation = busy_s / elapsed time).
        self.busy_s = 0.0

    def serve(self, arrival_s: float, work_s: float) -> float:
        """Accept a job of ``work_s`` arriving at ``arrival_s``; return when it completes."""
        self.free_at_s = max(arrival_s, self.free_at_s) + work_s
        self.busy_s += work_s
        return self.free_at_s
