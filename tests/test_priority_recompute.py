"""The priority ordering bounded for recomputes only (issue 27, round q9):
``kvcore.core.priority_fcfs_factor_for`` / ``SimConfig.priority_recompute_fcfs_factor`` /
``costs.priority_recompute_fcfs_factor`` / ``+recompute-k:KR[:X]``. A turn no engine holds much of
gets a deadline of at most KR x its predicted first-come TTFT; every other turn keeps K."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest

from kvcore.core import (
    PRIORITY_RECOMPUTE_BELOW,
    PRIORITY_RECOMPUTE_FCFS_FACTOR,
    PRIORITY_STEP_S,
    InMemoryLoadLedger,
    priority_fcfs_factor_for,
    priority_queued_ahead,
    shortest_first_priority,
)
from loadtest.bench_quality import Cell, parse_scheduling, recompute_bound_of, run_cell
from policies.base import PrefixMatch, RouteRequest
from policies.costs import RECOMPUTE_BELOW, PredictedParts
from router.config import ConfigError, load_config
from sim.des import FleetSimulator, SimConfig
from tests.conftest import OpenAIUpstream, ThreadedServer
from tests.test_admission_wait import _tight_fleet, _workload
from tests.test_priority import _priority_sent
from tests.test_sim_cli import assert_sim_refuses

INF = math.inf


def _request(held_blocks: int, *, tier: int = 0) -> RouteRequest:
    """A 20,000-token prompt (1,250 blocks of 16) of which e1 holds ``held_blocks`` in ``tier``
    and e0 a quarter as much in GPU."""
    by_tier = [0, 0, 0]
    by_tier[tier] = held_blocks
    matches = {
        "e0": PrefixMatch(blocks=held_blocks // 4, blocks_by_tier=(held_blocks // 4, 0, 0)),
        "e1": PrefixMatch(blocks=held_blocks, blocks_by_tier=(by_tier[0], by_tier[1], by_tier[2])),
    }
    return RouteRequest(request_id="r", prompt_tokens=20_000, block_size=16, prefix_matches=matches)


def _level(parts: PredictedParts, now_s: float, factor: float) -> int:
    return shortest_first_priority(
        parts, PRIORITY_STEP_S, now_s=now_s, stretch=40, max_overtake_s=INF, fcfs_factor=factor
    )


def test_the_defaults_are_off_and_the_gate_is_the_one_recompute_definition() -> None:
    assert PRIORITY_RECOMPUTE_FCFS_FACTOR == INF
    assert PRIORITY_RECOMPUTE_BELOW == RECOMPUTE_BELOW == 0.25
    assert priority_fcfs_factor_for(_request(0)) == INF


def test_a_recompute_never_past_kr_times_its_first_come_ttft_a_cached_turn_unchanged() -> None:
    """Over many parts and held prefixes: a turn held below 0.25 everywhere gets a deadline no later
    than now + KR x fcfs (and no later than with K alone); a turn held at 0.25 or more gets exactly
    the level K gives it, whatever KR. Catches: KR applied to every turn, KR ignored, or the cap
    taken as max(K, KR)."""
    recomputes = cached = 0
    for k in range(1500):
        held = (k * 37) % 1250  # 0 .. 0.99 of the prompt
        request = _request(held, tier=k % 3)
        wait, own = (k % 41) * 0.37, (k % 13) * 0.09 + 0.01
        parts = PredictedParts(wait_s=wait, slot_s=(k % 3) * 0.2, prefill_s=own)
        now_s = k * 0.017
        for fcfs_factor in (INF, 3.0):
            for recompute_factor in (1.0, 1.5, 2.0):
                factor = priority_fcfs_factor_for(request, fcfs_factor, recompute_factor)
                level = _level(parts, now_s, factor)
                if held * 16 / 20_000 < 0.25:
                    recomputes += 1
                    assert level * PRIORITY_STEP_S <= now_s + recompute_factor * parts.total_s + 1e-9
                    assert level <= _level(parts, now_s, fcfs_factor)
                else:
                    cached += 1
                    assert level == _level(parts, now_s, fcfs_factor)
    assert recomputes > 1000 and cached > 1000  # both classes exercised


@pytest.mark.parametrize("tier", [0, 1, 2])
def test_the_threshold_edge_a_turn_held_at_exactly_the_fraction_is_cached(tier: int) -> None:
    """313 blocks of 16 = 5,008 tokens: 0.2504 of the prompt; 312 = 0.2496. The longest match over
    the engines counts (e1's, not e0's quarter), in any tier. Catches: <= for <, a gate read from
    one engine's or the GPU's hits only."""
    assert priority_fcfs_factor_for(_request(313, tier=tier), INF, 1.5) == INF
    assert priority_fcfs_factor_for(_request(312, tier=tier), INF, 1.5) == 1.5
    exact = _request(250, tier=tier)  # 4,000 tokens: 0.2 exactly
    assert priority_fcfs_factor_for(exact, INF, 1.5, 0.2) == INF
    assert priority_fcfs_factor_for(exact, INF, 1.5, math.nextafter(0.2, 1.0)) == 1.5
    # KR never loosens K: a recompute keeps the tighter K.
    assert priority_fcfs_factor_for(_request(0), 1.2, 1.5) == 1.2
    # No prefix matches (a policy that reads no index): every turn is a recompute.
    assert priority_fcfs_factor_for(RouteRequest(request_id="r", prompt_tokens=100), INF, 2.0) == 2.0


def test_the_priced_wait_reads_the_bound_of_the_request_being_priced() -> None:
    """A cached turn queued with a deadline 4 s out; a long recompute priced now (own 2 s, nothing
    else ahead: fcfs 2 s) has a deadline 40 s out unbounded (the cached turn's 3,000 tokens are
    ahead of it) and 2 s out at KR = 1 (served first: nothing ahead). ``fcfs_factor_now`` is read at
    each call, so the same engine's priced wait follows the request. Catches: the priced wait
    reading the engine's K while the sent priority uses KR."""
    ledger = InMemoryLoadLedger(["e"])
    ticket = ledger.reserve("e", 3_000)
    ledger.set_priority(ticket, int(4.0 / PRIORITY_STEP_S))
    factor = [INF]
    ahead = priority_queued_ahead(
        ledger, "e", lambda: 0.0, stretch=20.0, max_overtake_s=INF, fcfs_factor_now=lambda: factor[0]
    )
    recompute = PredictedParts(prefill_s=2.0)
    assert ahead(recompute) == 3_000
    factor[0] = 1.0
    assert ahead(recompute) == 0
    fixed = priority_queued_ahead(ledger, "e", lambda: 0.0, stretch=20.0, max_overtake_s=INF, fcfs_factor=1.0)
    assert fixed(recompute) == 0


# ------------------------------------------------------------------ the simulator and the specs


def _ttfts(**config: float) -> list[float]:
    sim_config = SimConfig(
        seed=3, priority_stretch=1000.0, priority_max_overtake_s=INF, priority_wait="ahead", **config
    )
    return FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), sim_config).run().ttfts_s


def test_the_des_sends_and_prices_the_recompute_bound() -> None:
    """Gated at 1 every turn is a recompute (no hit covers the last token): KR = 1 is then the same
    run as K = 1 to the digit, in the priority sent and in the priced wait ("ahead" reads the
    deadline). KR = inf is the run without it; at 0.25 it is neither. Catches: KR reaching the sent
    priority but not the priced wait (or the reverse), or the gate never opening."""
    unbounded = _ttfts()
    assert _ttfts(priority_recompute_fcfs_factor=INF) == unbounded
    everyone = _ttfts(priority_fcfs_factor=1.0)
    assert everyone != unbounded
    assert _ttfts(priority_recompute_fcfs_factor=1.0, priority_recompute_below=1.0) == everyone
    gated = _ttfts(priority_recompute_fcfs_factor=1.0)
    assert gated not in (unbounded, everyone)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"priority_recompute_fcfs_factor": 0.5}, "priority_recompute_fcfs_factor must be >= 1"),
        ({"priority_recompute_fcfs_factor": math.nan}, "priority_recompute_fcfs_factor must be >= 1"),
        ({"priority_recompute_below": 0.0}, r"priority_recompute_below must be in \(0, 1\]"),
        ({"priority_recompute_below": 1.5}, r"priority_recompute_below must be in \(0, 1\]"),
        ({"priority_recompute_below": math.nan}, r"priority_recompute_below must be in \(0, 1\]"),
    ],
)
def test_the_simulator_refuses_a_bad_recompute_bound(config: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), SimConfig(**config))


def test_bench_quality_reads_the_recompute_bound() -> None:
    assert recompute_bound_of("priority:20:inf:inf:overtake") == ("priority:20:inf:inf:overtake", INF, 0.25)
    assert recompute_bound_of("priority:20:inf:inf:overtake+recompute-k:1.5") == (
        "priority:20:inf:inf:overtake",
        1.5,
        0.25,
    )
    assert recompute_bound_of("priority:20+recompute-k:2:0.5+admission:ahead:recompute") == (
        "priority:20",
        2.0,
        0.5,
    )
    assert parse_scheduling("priority:20:40:inf:overtake+recompute-k:1") == (
        "priority",
        20.0,
        40.0,
        INF,
        "overtake",
    )
    for bad, message in (
        ("fcfs+recompute-k:1.5", "priority engines only"),
        ("priority:20+recompute-k", "priority engines only"),
        ("priority:20+recompute-k:", "must be numbers"),
        ("priority:20+recompute-k:x", "must be numbers"),
        ("priority:20+recompute-k:1:0.2:3", "too many fields"),
        ("priority:20+recompute-k:0.9", "the recompute bound KR must be >= 1"),
        ("priority:20+recompute-k:nan", "the recompute bound KR must be >= 1"),
        ("priority:20+recompute-k:1.5:0", r"the recompute fraction X must be in \(0, 1\]"),
        ("priority:20+recompute-k:1.5:1.1", r"the recompute fraction X must be in \(0, 1\]"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_scheduling(bad)


def test_the_spec_reaches_the_bench_run() -> None:
    """``+recompute-k:1:1`` (every turn a recompute) is ``priority:S:H:1``'s run; ``+recompute-k:inf``
    is the run without it."""
    base = Cell("t", "none", "tier_cost", seed=3, concurrency=32, conversations=1.0, block_size=256)

    def ttfts(spec: str) -> object:
        return run_cell(dataclasses.replace(base, scheduling=spec))["ttft_by_request_s"]

    unbounded = ttfts("priority:1000:inf")
    assert ttfts("priority:1000:inf+recompute-k:inf") == unbounded
    everyone = ttfts("priority:1000:inf:1")
    assert everyone != unbounded
    assert ttfts("priority:1000:inf+recompute-k:1:1") == everyone


def test_kvroute_sim_refuses_a_bad_recompute_bound() -> None:
    for args, message in (
        (["--priority-recompute-fcfs-factor", "0.5"], "--priority-recompute-fcfs-factor must be >= 1"),
        (["--priority-recompute-below", "0"], "--priority-recompute-below must be in (0, 1]"),
    ):
        assert_sim_refuses(args, message)


# ---------------------------------------------------------------------------------- the router


def test_router_config_checks_the_recompute_bound() -> None:
    engine = {"id": "e0", "url": "http://127.0.0.1:9"}
    for bad in (0, 0.5, "nan"):
        with pytest.raises(ConfigError, match=r"costs.priority_recompute_fcfs_factor must be >= 1"):
            load_config(
                environ={}, overrides={"engines": [engine], "costs": {"priority_recompute_fcfs_factor": bad}}
            )
    for bad in (0, 1.5, "nan"):
        with pytest.raises(ConfigError, match=r"costs.priority_recompute_below must be in \(0, 1\]"):
            load_config(
                environ={}, overrides={"engines": [engine], "costs": {"priority_recompute_below": bad}}
            )
    default = load_config(environ={}, overrides={"engines": [engine]}).costs
    assert default.priority_recompute_fcfs_factor == INF and default.priority_recompute_below == 0.25
    from_env = load_config(
        environ={
            "KVROUTE_COSTS_PRIORITY_RECOMPUTE_FCFS_FACTOR": "1.5",
            "KVROUTE_COSTS_PRIORITY_RECOMPUTE_BELOW": "0.5",
        },
        overrides={"engines": [engine]},
    ).costs
    assert from_env.priority_recompute_fcfs_factor == 1.5 and from_env.priority_recompute_below == 0.5


def test_the_router_sends_a_recompute_the_recompute_bound(
    serve_asgi: Callable[..., ThreadedServer],
    upstreams: Callable[[int], list[tuple[OpenAIUpstream, str]]],
) -> None:
    """One idle engine behind round_robin (no index read: every request is a recompute): the
    predicted first-come TTFT is the own service, so with costs.priority_recompute_fcfs_factor 2 the
    deadline is now + 2 x own, a tenth of the unbounded now + 20 x own (as K = 2 gives). Catches:
    the key parsed but not reaching the priority the router sends."""
    ((engine, engine_url),) = upstreams(1)
    offsets: list[float] = []
    for factor in (INF, 2.0):
        costs = {
            "scrape_interval_s": 0,
            "priors": {"prefill_tokens_per_s": 1.0},
            "priority_max_overtake_s": INF,
            "priority_recompute_fcfs_factor": factor,
        }
        before_s, _, sent = _priority_sent(serve_asgi, engine, engine_url, costs)
        offsets.append(sent * PRIORITY_STEP_S - before_s)
    unbounded, recompute = offsets
    assert unbounded > 20.0, offsets
    assert recompute == pytest.approx(unbounded / 10, abs=0.5), offsets
