"""The wait a priority engine really gives, as the cost model prices it (issue 27, round q5):
``InMemoryLoadLedger.set_priority / queued_ahead / overtaking``, ``kvcore.core.priority_queued_ahead``,
``policies.costs.priority_wait_parts`` through tier_cost's prediction, and the DES / bench_quality
plumbing of ``priority_wait``."""

from __future__ import annotations

import math

import pytest

from kvcore.core import (
    PRIORITY_OVERTAKE_MAX_RHO,
    PRIORITY_OVERTAKE_WINDOW_S,
    PRIORITY_STEP_S,
    InMemoryLoadLedger,
    priority_queued_ahead,
    shortest_first_priority,
)
from loadtest.bench_quality import parse_scheduling
from policies.base import EngineView, PrefixMatch, RouteRequest
from policies.costs import EngineCosts, PredictedParts, PriorCosts
from policies.tier_cost import TierCostPolicy
from sim.des import FleetSimulator, SimConfig
from sim.engine import EngineProfile
from sim.fleets import EngineSpec, FleetSpec
from sim.workloads import LadderConfig, ladder_workload

RATE = 10_000.0  # prefill tokens per second of the priors below
COSTS = PriorCosts(EngineCosts(prefill_tokens_per_s=RATE))
STRETCH, BOUND = 20.0, math.inf


def _level(own_s: float, now_s: float) -> int:
    """The priority the router sends for a request of ``own_s`` predicted service placed at ``now_s``."""
    return shortest_first_priority(
        PredictedParts(prefill_s=own_s), now_s=now_s, stretch=STRETCH, max_overtake_s=BOUND
    )


def test_queued_ahead_counts_only_prefill_the_engine_serves_first() -> None:
    ledger = InMemoryLoadLedger(["e"])
    long_ticket = ledger.reserve("e", 20_000)  # a recompute: deadline 20 x 2 s = 40 s out
    ledger.set_priority(long_ticket, _level(2.0, 0.0))
    short_ticket = ledger.reserve("e", 300)  # a cached turn: deadline 20 x 0.03 s = 0.6 s out
    ledger.set_priority(short_ticket, _level(0.03, 0.0))
    ledger.reserve("e", 1_000)  # no priority recorded: assumed ahead of everyone
    assert ledger.load("e") == (3, 21_300)
    # A cached turn placed now is served after the earlier cached turn and the unknown one only.
    assert ledger.queued_ahead("e", _level(0.03, 0.0)) == 1_300  # ties: the earlier arrival first
    assert ledger.queued_ahead("e", _level(0.01, 0.0)) == 1_000
    # A recompute placed now counts everything queued (the other recompute's deadline is earlier).
    assert ledger.queued_ahead("e", _level(2.0, 0.5)) == 21_300
    # A prefill that is over is not queued any more, whatever its priority.
    ledger.first_token(long_ticket)
    assert ledger.queued_ahead("e", _level(2.0, 0.5)) == 1_300
    ledger.finish(short_ticket)
    assert ledger.queued_ahead("e", _level(2.0, 0.5)) == 1_000 == ledger.load("e")[1]
    # set_priority on a ticket whose prefill is over changes nothing.
    ledger.set_priority(short_ticket, 0)
    assert ledger.queued_ahead("e", 0) == 1_000


def test_running_first_counts_the_prefill_the_engine_is_serving_whatever_its_priority() -> None:
    """vLLM schedules running requests before waiting ones: a cached turn placed while a long
    recompute (the lowest priority pending, so the one being served) is chunk-prefilled waits for
    it. Without running_first it is left out; with it, only that one is added."""
    ledger = InMemoryLoadLedger(["e"])
    running = ledger.reserve("e", 20_000)
    ledger.set_priority(running, _level(2.0, 0.0))
    later = ledger.reserve("e", 24_000)
    ledger.set_priority(later, _level(2.4, 0.0))
    cached = _level(0.03, 0.2)
    assert ledger.queued_ahead("e", cached) == 0
    assert ledger.queued_ahead("e", cached, running_first=True) == 20_000
    # A request that outranks nothing pending but has the lowest one ahead anyway: counted once.
    assert ledger.queued_ahead("e", _level(2.0, 0.0), running_first=True) == 20_000
    ledger.first_token(running)  # the next one is now the engine's
    assert ledger.queued_ahead("e", cached, running_first=True) == 24_000


def test_without_priorities_queued_ahead_is_the_whole_queue() -> None:
    ledger = InMemoryLoadLedger(["e"])
    ledger.reserve("e", 5_000)
    ledger.reserve("e", 7)
    for priority in (0, 10, 1 << 40):
        assert ledger.queued_ahead("e", priority) == 5_007 == ledger.load("e")[1]


def _engine(ledger: InMemoryLoadLedger, now: list[float], *, overtake: bool = False) -> EngineView:
    view = EngineView("e")
    view.in_flight, view.queued_prefill_tokens = ledger.load("e")
    view.queued_ahead = priority_queued_ahead(
        ledger,
        "e",
        lambda: now[0],
        stretch=STRETCH,
        max_overtake_s=BOUND,
        overtake=COSTS if overtake else None,
    )
    return view


def _request(prompt_tokens: int, cached_tokens: int, block_size: int = 16) -> RouteRequest:
    blocks = cached_tokens // block_size
    return RouteRequest(
        "r",
        prompt_tokens=prompt_tokens,
        block_size=block_size,
        prefix_matches={"e": PrefixMatch(blocks, (blocks, 0, 0))},
    )


def _queue_recompute_and_cached_turns(ledger: InMemoryLoadLedger) -> None:
    """A long recompute (20,000 tokens, 2 s) queued first, then two cached turns (300 tokens each)."""
    first = ledger.reserve("e", 20_000)
    ledger.set_priority(first, _level(2.0, 0.0), 0.0)
    for _ in range(2):
        ticket = ledger.reserve("e", 300)
        ledger.set_priority(ticket, _level(0.03, 0.0), 0.0)


def test_a_cached_turn_does_not_wait_for_a_recompute_queued_before_it_with_a_later_deadline() -> None:
    """The bug it catches: pricing a priority engine first come makes a cached turn's engine look
    20,600 tokens (2 s) busy when the engine will serve it after 600 tokens."""
    ledger = InMemoryLoadLedger(["e"])
    _queue_recompute_and_cached_turns(ledger)
    now = [0.2]
    policy = TierCostPolicy()
    cached = _request(16_000, 15_680)  # 320 tokens to compute
    fcfs_view = _engine(ledger, now)
    fcfs_view.queued_ahead = None  # an fcfs engine: every queued token is ahead (unchanged)
    fcfs = policy.predict(cached, fcfs_view, COSTS)
    assert fcfs.wait_tokens == 20_600
    priced = policy.predict(cached, _engine(ledger, now), COSTS)
    assert priced.wait_tokens == 600  # the two cached turns queued before it, not the recompute
    assert priced.wait_s == pytest.approx(600 / RATE)
    assert priced.prefill_tokens == fcfs.prefill_tokens and priced.hit_tokens == fcfs.hit_tokens


def test_a_long_recompute_counts_every_cached_turn_queued_ahead_of_it() -> None:
    ledger = InMemoryLoadLedger(["e"])
    _queue_recompute_and_cached_turns(ledger)
    now = [0.2]
    recompute = _request(24_000, 0)  # 2.4 s: its deadline (48.2 s) is after the first one's (40 s)
    priced = TierCostPolicy().predict(recompute, _engine(ledger, now), COSTS)
    assert priced.wait_tokens == 20_600  # the earlier recompute and both cached turns
    shorter = _request(16_000, 0)  # 1.6 s: deadline 32.2 s, served before the 2 s recompute
    assert TierCostPolicy().predict(shorter, _engine(ledger, now), COSTS).wait_tokens == 600


def test_overtake_adds_the_earlier_deadline_work_that_arrives_while_a_recompute_waits() -> None:
    """rho = the earlier-deadline prefill sent in the last window / (window x rate); the recompute's
    wait is ahead / (1 - rho). A cached turn has nothing with an earlier deadline: no change."""
    ledger = InMemoryLoadLedger(["e"])
    _queue_recompute_and_cached_turns(ledger)
    step = PRIORITY_STEP_S
    # Cached turns sent over the last window, 60,000 tokens in all (sent and already served).
    for i in range(20):
        t = 1.0 + i
        ticket = ledger.reserve("e", 3_000)
        ledger.set_priority(ticket, _level(0.3, t), t / step)
        ledger.finish(ticket)
    now = [21.0]
    recompute = _request(24_000, 0)  # deadline offset 48 s: everything sent outranks it
    plain = TierCostPolicy().predict(recompute, _engine(ledger, now), COSTS)
    over = TierCostPolicy().predict(recompute, _engine(ledger, now, overtake=True), COSTS)
    # Sent in the last 30 s with a smaller offset: the 20 turns, the 2 cached turns and the 2 s
    # recompute (offset 40 s) queued at 0.
    rho = (60_000 + 600 + 20_000) / (PRIORITY_OVERTAKE_WINDOW_S * RATE)
    assert rho < PRIORITY_OVERTAKE_MAX_RHO
    assert plain.wait_tokens == 20_600  # still queued: the recompute and the 2 cached turns
    assert over.wait_tokens == pytest.approx(20_600 / (1 - rho))
    # 16 tokens (offset 0.032 s): the queued cached turns (deadline 0.6 s) are ahead, the recompute
    # is not, and nothing sent had a smaller offset: no overtaking factor.
    cached = _request(16_000, 15_984)
    assert TierCostPolicy().predict(cached, _engine(ledger, now, overtake=True), COSTS).wait_tokens == 600
    # Work sent before the window is forgotten (the last of the 20 went at 20 s).
    now[0] = 20.0 + PRIORITY_OVERTAKE_WINDOW_S + 1.0
    late = TierCostPolicy().predict(recompute, _engine(ledger, now, overtake=True), COSTS)
    assert late.wait_tokens == 20_600


def _small_run(scheduling_policy: str, priority_wait: str) -> list[float]:
    engine = EngineProfile(
        block_size=16, num_gpu_blocks=512, num_cpu_blocks=1024, scheduling_policy=scheduling_policy
    )
    fleet = FleetSpec([EngineSpec(f"e{i}", engine) for i in range(2)])
    wl = ladder_workload(
        LadderConfig(
            first_prompt_tokens=2_000,
            system_prefix_tokens=400,
            tokens_per_turn=400,
            turns=3,
            answer_min_tokens=16,
            answer_max_tokens=16,
            think_time_mean_s=1.0,
            concurrency=16,
            total_conversations=24,
            block_size=16,
            seed=3,
        )
    )
    config = SimConfig(
        seed=3, priority_stretch=STRETCH, priority_max_overtake_s=BOUND, priority_wait=priority_wait
    )
    return FleetSimulator(wl, "tier_cost", fleet, config).run().ttfts_s


def test_fcfs_engines_are_priced_first_come_whatever_priority_wait_says() -> None:
    """priority_wait only changes the pricing on priority engines: on fcfs ones every mode gives the
    same run to the last TTFT (the DES is deterministic), while on priority engines the modes
    differ (else the switch would do nothing at all)."""
    base = _small_run("fcfs", "all")
    assert _small_run("fcfs", "ahead") == base
    assert _small_run("fcfs", "overtake") == base
    assert _small_run("fcfs", "running") == base
    assert _small_run("priority", "ahead") != _small_run("priority", "all")


def test_an_unknown_priority_wait_is_refused() -> None:
    fleet = FleetSpec([EngineSpec("e0", EngineProfile())])
    wl = ladder_workload(LadderConfig(concurrency=1, total_conversations=1, turns=1))
    with pytest.raises(
        ValueError, match="priority_wait 'fifo' is unknown; accepted: all, ahead, overtake, running"
    ):
        FleetSimulator(wl, "tier_cost", fleet, SimConfig(priority_wait="fifo"))


def test_bench_quality_reads_the_priced_wait_from_the_scheduling_spec() -> None:
    assert parse_scheduling("priority:20:40:inf:overtake") == ("priority", 20.0, 40.0, math.inf, "overtake")
    assert parse_scheduling("priority:20:40:3")[4] == "all"
    with pytest.raises(ValueError, match="the priced wait must be one of all, ahead, overtake, running"):
        parse_scheduling("priority:20:40:inf:fifo")
    with pytest.raises(ValueError, match="use fcfs, priority"):
        parse_scheduling("priority:20:40:inf:ahead:1")
