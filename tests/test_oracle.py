"""The hindsight bound (sim/oracle.py) against brute force, and against real DES runs (it must bound
them), plus a smoke run of the quality sweep driver (loadtest/bench_quality.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random

import pytest

from loadtest.bench_quality import Cell, main, run_cell
from sim.oracle import (
    Arrival,
    belady_hit_blocks,
    capacity_bound,
    homed_lru_replay,
    ideal_hit_blocks,
    sticky_lru_hit,
)


def brute_force_max_hits(keys: tuple[int, ...], capacity: int) -> int:
    """Most hits any cache of ``capacity`` blocks can get on ``keys`` (a miss may be cached, evicting
    any one block, or not): exhaustive search, independent of Belady's rule."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(keys):
            return 0
        k = keys[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]  # do not keep it
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {k}))
        else:
            options.extend(best(i + 1, (cache - {v}) | {k}) for v in cache)
        return max(options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(25))
def test_belady_matches_exhaustive_optimum(seed: int) -> None:
    rng = random.Random(seed)
    keys = tuple(rng.randrange(5) for _ in range(rng.randrange(4, 13)))
    capacity = rng.randrange(1, 4)
    # One block per request here, so per-request hits sum to the total.
    arrivals = [Arrival([k], 16, 16) for k in keys]
    assert sum(belady_hit_blocks(arrivals, capacity)) == brute_force_max_hits(keys, capacity)


def test_bound_counts_tokens_and_caps_at_prompt_minus_one() -> None:
    # Two requests of 2 blocks; the second repeats the first exactly.
    arrivals = [Arrival([1, 2], 32, 16), Arrival([1, 2], 32, 16)]
    bound = capacity_bound(arrivals, capacity_blocks=10, prefill_tokens_per_s=16.0)
    assert bound.bound_hit == pytest.approx(31 / 64)  # 31 of the second's 32 tokens (last recomputed)
    assert bound.ideal_hit == pytest.approx(31 / 64)
    # Floors: 32 tokens / 16 per s for the first, 1 token for the second; their percentiles by the
    # DES's definition (linear interpolation), so a policy's p50 compares with the floor's p50.
    assert bound.ttft_floor_p50_s == pytest.approx((1 / 16 + 2.0) / 2)
    assert bound.ttft_floor_p99_s == pytest.approx(1 / 16 + 0.99 * (2.0 - 1 / 16))
    assert ideal_hit_blocks([Arrival([1, 2, 3], 48, 16), Arrival([1, 9, 3], 48, 16)]) == [0, 1]
    # No memory at all: nothing can be reused.
    assert capacity_bound(arrivals, 0, 16.0).bound_hit == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["round_robin", "kv_fixed_credit", "horizon_cost"])
def test_bound_bounds_real_runs(policy: str) -> None:
    """On a DES run with a storage pool much smaller than the working set, the policy's measured hit
    rate is at most the bound, and the bound's ideal equals the simulator's own ideal (computed by
    independent code in sim/des.py)."""
    row = run_cell(Cell("t", "1/8", policy, seed=3, concurrency=6, conversations=1.0, block_size=256))
    assert row["requests"] > 0
    assert row["hit"] <= row["bound_hit"] + 1e-9
    assert row["bound_hit"] <= row["bound_ideal_hit"] + 1e-9
    assert row["bound_ideal_hit"] == pytest.approx(row["ideal_hit"], abs=1e-9)
    assert row["ttft_floor_p50_s"] <= row["ttft_p50_s"]


@pytest.mark.slow
def test_sweep_driver_writes_a_table(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "q.md"
    code = main(
        [
            "--concurrency", "4",
            "--conversations", "1",
            "--block-size", "256",
            "--storage", "none,unbounded",
            "--seeds", "1,2",
            "--policies", "kv_fixed_credit:cpu=0.5,horizon_cost",
            "--scheduling", "fcfs,priority:0",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| b1 4 |")]
    # 2 storage sizes x 2 policies x 2 engine schedulings, seeds folded into median [min-max]
    assert len(rows) == 8
    assert all("| 2 |" in line for line in rows)
    assert sum("| priority:0 |" in line for line in rows) == 4
    raw = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert len(raw) == 16 and {r["seed"] for r in raw} == {1, 2}
    # No storage tier: the bound has only GPU + CPU; unbounded: the ideal.
    assert all(
        r["bound_hit"] == pytest.approx(r["bound_ideal_hit"]) for r in raw if r["storage"] == "unbounded"
    )
    assert main(["--storage", "lots"]) == 2
    assert "--storage" in capsys.readouterr().err
    assert main(["--scheduling", "priority:-1"]) == 2
    assert "--scheduling 'priority:-1'" in capsys.readouterr().err


def test_recorder_keeps_arrival_order_and_drops_refused_requests() -> None:
    from policies.base import EngineView, FleetView, RouteRequest, build_policy
    from sim.oracle import ArrivalRecorder

    recorder = ArrivalRecorder(build_policy("round_robin"))
    fleet = FleetView([EngineView("a"), EngineView("b")])
    for i in range(3):
        req = RouteRequest(f"r{i}", prompt_tokens=32, block_keys=(i, i + 10), block_size=16)
        recorder.on_routed(req, recorder.choose(req, fleet))
    refused = RouteRequest("r1", prompt_tokens=32, block_keys=(1, 11), block_size=16)
    recorder.on_finished(refused, "b", False)  # the engine refused it: it cached nothing
    recorder.on_finished(RouteRequest("r2"), "a", True)
    assert [a.request_id for a in recorder.arrivals] == ["r0", "r2"]
    assert [list(a.keys) for a in recorder.arrivals] == [[0, 10], [2, 12]]


def test_sticky_lru_reference_by_hand() -> None:
    """Two conversations alternating, 3 blocks of LRU: kept apart (one engine each) both hit their
    history; in one shared LRU, ranked as vLLM ranks a finished request's blocks (head last), each
    evicts the other's deepest blocks and a's second turn still hits its first block (a tier
    that ranked blocks at their store would evict a's first block: nothing would hit); a shared
    pool behind a 1-block local cache serves both histories."""

    def arr(session: str, keys: list[int]) -> Arrival:
        return Arrival(keys, 16 * len(keys), 16, f"{session}{len(keys)}", session)

    trace = [arr("a", [1, 2]), arr("b", [3, 4]), arr("a", [1, 2, 5]), arr("b", [3, 4, 6])]
    total = 16 * (2 + 2 + 3 + 3)
    assert sticky_lru_hit(trace, engines=2, local_blocks=3) == pytest.approx(64 / total)
    assert sticky_lru_hit(trace, engines=1, local_blocks=3) == pytest.approx(16 / total)
    assert sticky_lru_hit(trace, engines=1, local_blocks=1, pool_blocks=10) == pytest.approx(64 / total)
    with pytest.raises(ValueError, match="engines"):
        sticky_lru_hit(trace, engines=0, local_blocks=3)


def _turn(session: str, keys: list[int]) -> Arrival:
    """A turn of ``session`` whose prompt is its blocks plus the one token always computed."""
    return Arrival(keys, 16 * len(keys) + 1, 16, f"{session}{len(keys)}", session)


def test_homing_only_what_fits_beats_sticky_lru_on_a_cyclic_working_set() -> None:
    """Four 4-block conversations in turn, three rounds, two engines of 4 blocks: sticky routing puts
    two on each engine (8 > 4 blocks) and each turn evicts the other conversation's whole history;
    homing only what fits keeps a and b home (one each), c and d overflow to the last engine: a
    hits its history in rounds 2 and 3, b is thrashed by the overflow. Catches a room check that
    lets every conversation home (then the figure is sticky's 0) and the per-engine accounting of
    computed tokens."""
    rounds = [_turn(s, [10 * i + k for k in range(4)]) for _ in range(3) for i, s in enumerate("abcd")]
    total = 12 * 65
    assert sticky_lru_hit(rounds, engines=2, local_blocks=4) == 0.0
    r = homed_lru_replay(rounds, engines=2, local_blocks=4, fill=1.0, overflow="fixed")
    assert r.hit == pytest.approx(2 * 64 / total)
    assert r.computed_tokens == [65 + 1 + 1, 9 * 65]
    assert r.turns == [3, 9]
    assert (r.overflow_sessions, r.overflow_turns) == (2, 6)
    # every conversation home (no room limit): the sticky figure
    assert homed_lru_replay(rounds, engines=2, local_blocks=4, fill=math.inf).hit == 0.0


def test_a_conversation_that_outgrows_its_home_leaves_it() -> None:
    """One conversation grows 3 -> 5 -> 7 blocks on engines of 6: home while it fits (its second
    turn hits 3 blocks), its third turn would overflow the engine so it goes to the dedicated
    overflow engine and computes everything there. Catches a room check made only for new
    sessions (then the third turn hits 5 blocks on engine 0)."""
    trace = [_turn("a", [1, 2, 3]), _turn("a", [1, 2, 3, 4, 5]), _turn("a", list(range(1, 8)))]
    r = homed_lru_replay(trace, engines=2, local_blocks=6, fill=1.0, overflow="dedicated")
    assert r.hit == pytest.approx(48 / (49 + 81 + 113))
    assert r.computed_tokens == [49 + 33, 113]
    assert (r.overflow_sessions, r.overflow_turns) == (1, 1)
    with pytest.raises(ValueError, match="overflow"):
        homed_lru_replay(trace, engines=2, local_blocks=6, overflow="elsewhere")


def test_sweep_runs_a_policy_at_its_own_scheduling_and_prints_the_tail_table(capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["--concurrency", "4", "--conversations", "1", "--block-size", "256", "--storage", "none"]
    args += ["--seeds", "1", "--policies", "kv_fixed_credit@fcfs,tier_cost@priority:20:5"]
    assert main([*args, "--tail-reference", "kv_fixed_credit@fcfs"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| b1 4 |")]
    # 2 runs (not 2 policies x the --scheduling list), each in the main table and the tail table
    assert len(rows) == 4
    assert sum("| tier_cost | priority:20:5 |" in line for line in rows) == 2
    tail = [line for line in rows if "| kv_fixed_credit | fcfs |" in line][-1].split("|")
    assert tail[7].strip() == "0"  # the reference against itself: no turn over 10x
    assert main([*args, "--tail-reference", "tier_cost@fcfs"]) == 2
    assert "is not one of the runs" in capsys.readouterr().err
    assert main([*args, "--scheduling", "priority:20:0"]) == 2
    assert "the bound must be > 0" in capsys.readouterr().err
    assert main([*args, "--scheduling", "priority:20:inf:0.5"]) == 2
    assert "the fcfs factor must be >= 1" in capsys.readouterr().err
    assert main([*args, "--scheduling", "priority:20:inf:2:3"]) == 2
    assert "priority:STRETCH:MAX_OVERTAKE_S:FCFS_FACTOR" in capsys.readouterr().err


def test_the_fcfs_factor_reaches_the_simulated_engines_priorities() -> None:
    """``priority:S:H:K``'s K is the DES's priority_fcfs_factor: at a stretch far past every
    first-come TTFT, K = 1 serves (nearly) first come and unbounded is pure shortest work first,
    so the same seed's TTFTs differ; K = inf is the same run as no K at all."""
    base = Cell("t", "none", "tier_cost", seed=3, concurrency=32, conversations=1.0, block_size=256)
    runs = {
        spec: run_cell(dataclasses.replace(base, scheduling=spec))["ttft_by_request_s"]
        for spec in ("priority:1000:inf", "priority:1000:inf:inf", "priority:1000:inf:1")
    }
    assert runs["priority:1000:inf"] == runs["priority:1000:inf:inf"]
    assert runs["priority:1000:inf"] != runs["priority:1000:inf:1"]


def test_the_pool_option_reaches_the_simulated_routers_calibration() -> None:
    """``--pool-observations`` (Cell.pool_observations) is the DES router's
    calibration.pool_observations: on a fleet with one slower engine, a pool so heavy the twins
    cannot be told apart places differently from no pool (same seed: only the option differs)."""
    base = Cell(
        "t", "none", "tier_cost", seed=3, concurrency=8, conversations=1.0, block_size=256, hetero=True
    )
    alone = run_cell(base)
    pooled = run_cell(dataclasses.replace(base, pool_observations=1000.0))
    assert alone["load_imbalance"] != pooled["load_imbalance"]
    assert alone["ttft_over_predicted"] != pooled["ttft_over_predicted"]


def test_a_steady_reading_keeps_the_middle_conversations_turns_of_the_same_run() -> None:
    """``read="steady"`` reads the same run (same seed, deterministic) over the conversations
    numbered concurrency .. total - concurrency - 1 only: its figures are those of the whole run's
    per-turn map cut to that window, computed here independently of bench_quality's own code."""
    import numpy as np

    base = Cell("t", "none", "kv_fixed_credit", seed=5, concurrency=6, conversations=3.0, block_size=256)
    whole = run_cell(base)
    steady = run_cell(dataclasses.replace(base, read="steady"))
    ids = whole["ttft_by_request_s"]
    numbers = {k: int(k.split("#")[0].split("-")[-1]) for k in ids}
    assert sorted(set(numbers.values())) == list(range(18))
    kept = {k: t for k, t in ids.items() if 6 <= numbers[k] < 12}
    assert steady["ttft_by_request_s"] == kept and steady["read_turns"] == len(kept) < len(ids)
    assert steady["ttft_p50_s"] == pytest.approx(float(np.median(list(kept.values()))))
    assert steady["ttft_max_s"] == max(kept.values())
    assert steady["turns_per_s"] == whole["turns_per_s"]  # the run's other figures stay the whole run's
    assert (whole["read"], steady["read"]) == ("all", "steady")


def test_a_steady_reading_refuses_a_run_without_a_middle(capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["--concurrency", "4", "--block-size", "256", "--storage", "none", "--seeds", "1"]
    args += ["--read", "steady"]
    assert main([*args, "--conversations", "2"]) == 2
    assert "at least 3x the concurrency" in capsys.readouterr().err
    assert main([*args, "--conversations", "3", "--policies", "kv_fixed_credit"]) == 0
    assert "| b1 4 steady | none | kv_fixed_credit |" in capsys.readouterr().out
