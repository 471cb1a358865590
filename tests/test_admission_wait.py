"""The admission wait under vLLM's whole-sequence rule (issue 27, round q6): where a turn's TTFT
goes in the DES (``sim.des.ttft_split``) and its pricing from the router's ledger."""

from __future__ import annotations

import pytest

from sim.des import TTFT_SPLIT_KEYS, FleetSimulator, SimConfig
from sim.engine import EngineProfile
from sim.fleets import EngineSpec, FleetSpec
from sim.frontend import ServerStage
from sim.workloads import LadderConfig, Workload, ladder_workload


def _tight_fleet(scheduling_policy: str = "fcfs", engines: int = 2) -> FleetSpec:
    """Engines whose KV holds about four of the workload's sequences: turns wait for blocks."""
    engine = EngineProfile(
        block_size=16, num_gpu_blocks=640, num_cpu_blocks=1024, scheduling_policy=scheduling_policy
    )
    return FleetSpec([EngineSpec(f"e{i}", engine) for i in range(engines)])


def _workload(seed: int = 3) -> Workload:
    return ladder_workload(
        LadderConfig(
            first_prompt_tokens=2_000,
            system_prefix_tokens=400,
            tokens_per_turn=400,
            turns=3,
            answer_min_tokens=40,
            answer_max_tokens=120,
            think_time_mean_s=1.0,
            concurrency=16,
            total_conversations=24,
            block_size=16,
            seed=seed,
        )
    )


def test_the_ttft_split_adds_up_to_the_measured_ttft_and_finds_the_kv_wait() -> None:
    """Every turn's parts sum to its TTFT (no time lost or counted twice), none is negative, the
    split leaves the run unchanged, and on engines whose KV is full turns do wait for blocks."""
    plain = FleetSimulator(_workload(), "tier_cost", _tight_fleet(), SimConfig(seed=3)).run()
    result = FleetSimulator(
        _workload(), "tier_cost", _tight_fleet(), SimConfig(seed=3, split_ttft=True)
    ).run()
    assert result.ttfts_s == plain.ttfts_s
    splits = result.ttft_split_by_request
    assert set(splits) == set(result.ttft_by_request_s)
    for rid, s in splits.items():
        assert set(s) == set(TTFT_SPLIT_KEYS)
        measured = (
            s["queue_s"] + s["admission_kv_s"] + s["admission_seqs_s"] + s["service_s"] + s["preemption_s"]
        )
        assert measured == pytest.approx(s["ttft_s"], abs=1e-9)
        assert s["ttft_s"] == pytest.approx(result.ttft_by_request_s[rid], abs=1e-9)
        assert min(s[k] for k in ("queue_s", "admission_kv_s", "admission_seqs_s", "service_s")) >= -1e-9
    assert sum(s["admission_kv_s"] for s in splits.values()) > 0


def test_split_ttft_refuses_fleets_with_server_stages() -> None:
    fleet = _tight_fleet()
    fleet.api_server = ServerStage()
    with pytest.raises(ValueError, match="split_ttft needs a fleet without server stages"):
        FleetSimulator(_workload(), "tier_cost", fleet, SimConfig(split_ttft=True))
