"""The DES's placement trace (issue 27, round q12; ``sim.placement``): every decision with the
router's predictions beside the engines' true state, a shadow policy's choice on the same state, a
forced choice for a single decision's counterfactual, and a run stopped once the turns compared
have their first token. Virtual time, the real DES, engines and policies."""

from __future__ import annotations

import math

import pytest

from loadtest.placement_diag import CLASSES, annotate
from sim.des import FleetSimulator, SimConfig
from sim.engine import EngineCore, EngineProfile, SimRequest
from sim.hashing import HashChain
from tests.test_admission_wait import _tight_fleet, _workload


def _hashes(core: EngineCore, block_ids: list[int]) -> list[int]:
    chain = HashChain(core.profile.hash_algo, core.hash_cache)
    for block_id in block_ids:
        chain.append((block_id,))
    return chain.hashes


def _run_to_first_token(core: EngineCore, rid: str) -> None:
    for _ in range(10_000):
        out = core.step()
        if out.new_token_ids.get(rid):
            return
    raise AssertionError(f"{rid} got no first token")


def test_the_true_cached_prefix_is_what_admission_serves_by_tier() -> None:
    """``cached_prefix_tokens`` counts the longest prefix per tier as admission will serve it (the
    GPU's one block short of a full hit, the offload tiers' from there to the end, as vLLM's
    connector looks them up), reading only: probing changes nothing the next admission sees."""
    core = EngineCore("e0", EngineProfile(block_size=16, num_gpu_blocks=64, num_cpu_blocks=256))
    ids = list(range(1, 21))  # 20 blocks, 320 tokens
    hashes = _hashes(core, ids)
    assert core.cached_prefix_tokens(hashes, 320) == (0, 0, 0)
    core.add_request(SimRequest("a", [], max_tokens=1, block_ids=ids, prompt_len=320))
    _run_to_first_token(core, "a")
    core.step()  # its finish frees the blocks: cached and evictable on the GPU
    # The GPU prefix stops one block short of a full hit; the CPU tier serves the last block.
    assert core.cached_prefix_tokens(hashes, 320) == (19 * 16, 16, 0)
    assert core.cached_prefix_tokens(hashes[:10], 320) == (10 * 16, 0, 0)
    # Another prompt of 50 blocks takes most of the GPU pool: part of the first goes, it stays on the CPU.
    other = list(range(1000, 1050))
    core.add_request(SimRequest("b", [], max_tokens=1, block_ids=other, prompt_len=800))
    _run_to_first_token(core, "b")
    core.step()
    gpu, cpu, storage = core.cached_prefix_tokens(hashes, 320)
    assert cpu > 0 and gpu + cpu == 20 * 16 and storage == 0
    # What the next admission serves is what the probe said, tier by tier.
    longer = [*ids, 99]
    probe = core.cached_prefix_tokens(_hashes(core, longer), 336)
    assert probe[0] + probe[1] >= 19 * 16
    core.add_request(SimRequest("c", [], max_tokens=1, block_ids=longer, prompt_len=336))
    assert core.pending_prefill_tokens() == 336 - sum(probe)  # its cached prefix left out
    finished = []
    for _ in range(1000):
        finished += core.step().finished
        if finished:
            break
    assert finished[0].cached_tokens_by_tier == probe


def test_the_trace_changes_nothing_and_records_every_decision_with_its_truth() -> None:
    """With the trace on (and a shadow policy asked at each decision) the run is the same turn by
    turn; each record has the predicted parts and the true state per engine and the outcome."""
    fleet = _tight_fleet("priority")
    plain = FleetSimulator(_workload(), "tier_cost", fleet, SimConfig(seed=3, split_ttft=True)).run()
    traced = FleetSimulator(
        _workload(),
        "tier_cost",
        _tight_fleet("priority"),
        SimConfig(seed=3, split_ttft=True, trace_placement=True, trace_shadow="kv_fixed_credit"),
    ).run()
    assert traced.ttft_by_request_s == plain.ttft_by_request_s and traced.ttft_p99_s == plain.ttft_p99_s
    assert plain.placement == []
    records = traced.placement
    assert sorted(r["rid"] for r in records) == sorted(plain.ttft_by_request_s)  # each turn once
    for r in records:
        assert r["engine"] == r["choice"] and not r["forced"]
        assert r["shadow"] in ("e0", "e1")
        assert len(r["pred_total_s"]) == len(r["true_gpu"]) == 2
        assert r["ttft_s"] == plain.ttft_by_request_s[r["rid"]] == r["split_ttft_s"]
        assert isinstance(r["priority"], int)
        # What the engine served was at most what it held when the turn was routed plus the storage.
        served = sum(r["cached"])
        assert 0 <= served <= r["prompt"]
    # Later turns find their history: some turn is served from cache, and its engine held it.
    cached = [r for r in records if sum(r["cached"]) > 0 and r["turn"] > 0]
    assert cached
    assert any(r["true_gpu"][int(r["engine"][1])] + r["true_cpu"][int(r["engine"][1])] > 0 for r in cached)
    # The shadow disagrees somewhere (two different policies on the same states).
    assert any(r["shadow"] != r["choice"] for r in records)
    classes = {r["class"] for r in annotate(records)}
    assert classes <= set(CLASSES) and CLASSES[0] in classes and CLASSES[1] in classes


def test_a_forced_turn_goes_where_forced_and_the_run_is_the_same_before_it() -> None:
    """``force_engines`` sends one turn elsewhere: every turn routed before it is placed and timed as
    in the unforced run, the forced one lands on the engine given, and ``stop_after`` ends the run
    once the turns asked for have their first token."""
    base = FleetSimulator(
        _workload(), "tier_cost", _tight_fleet(), SimConfig(seed=3, trace_placement=True)
    ).run()
    target = base.placement[len(base.placement) // 2]
    other = "e1" if target["engine"] == "e0" else "e0"
    forced = FleetSimulator(
        _workload(),
        "tier_cost",
        _tight_fleet(),
        SimConfig(
            seed=3,
            trace_placement=True,
            force_engines={target["rid"]: other},
            stop_after=(target["rid"],),
        ),
    ).run()
    position = next(i for i, r in enumerate(forced.placement) if r["rid"] == target["rid"])
    assert position == len(base.placement) // 2
    for before, again in zip(base.placement[:position], forced.placement[:position], strict=True):
        assert (before["rid"], before["engine"], before["t_s"]) == (
            again["rid"],
            again["engine"],
            again["t_s"],
        )
    record = forced.placement[position]
    assert record["engine"] == other and record["choice"] == target["engine"] and record["forced"]
    assert not math.isnan(record["ttft_s"])
    # Stopped early: fewer turns finished than the whole workload.
    assert forced.requests < base.requests
    assert len(forced.placement) < len(base.placement)


def test_force_needs_the_trace() -> None:
    with pytest.raises(ValueError, match="force_engines needs trace_placement"):
        FleetSimulator(_workload(), "tier_cost", _tight_fleet(), SimConfig(force_engines={"x#0": "e0"}))
