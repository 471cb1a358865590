"""loadtest/calib_compare.py without engines: saved live runs replayed against the DES with the
profile's server stages (the --live-json path), and its run summaries."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvcore.stats import percentiles
from loadtest.calib_compare import cpu_split, main, write_workload
from sim.des import FleetSimulator, SimConfig
from sim.engine import EngineProfile
from sim.fleets import EngineSpec, FleetSpec
from sim.frontend import ServerStage
from sim.workloads import LadderConfig, ladder_workload

LADDER = ["--conversations", "2", "--concurrency", "2", "--turns", "2", "--first-prompt-tokens", "300",
          "--system-tokens", "100", "--tokens-per-turn", "200", "--answer-tokens", "4,8"]  # fmt: skip
ENGINE = {"step_overhead_s": 0.002, "prefill_tokens_per_s": 50_000.0, "decode_s_per_seq": 0.0005}
API = ServerStage(request_s=0.02, output_s_per_token=0.001, stall_s=0.01)
ROUTER = ServerStage(request_s=0.005)


def _saved_run(ttfts: list[float], cached: int) -> dict[str, object]:
    records = [
        {"conv": i // 2, "turn": i % 2, "prompt_tokens": 100, "cached_tokens": cached, "ttft_s": t}
        for i, t in enumerate(ttfts)
    ]
    return {
        "records": records,
        "engine_phases": {
            "time_to_first_token_seconds": 0.1,
            "request_queue_time_seconds": 0.0,
            "request_prefill_time_seconds": 0.05,
        },
        "router_phases": {"kvroute_ttft_seconds": 0.2, "kvroute_router_seconds": 0.01},
        "cpu_s": {"http://e0 api": 1.0, "http://e0 child0:VLLM::EngineCore": 2.0, "router": 0.5},
        "wall_s": 10.0,
        "load": ["1.0 1.0 1.0", "2.0 2.0 2.0"],
        "utc": "00:00:00",
    }


@pytest.mark.parametrize("profile_has_seqs", [False, True])
def test_saved_runs_replay_against_the_des_with_the_profiles_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], profile_has_seqs: bool
) -> None:
    # profile_has_seqs: calibrate_vllm writes max_num_seqs into the profile since round q36; an
    # older profile has none and gets vLLM CPU's 128 (a clash of the two once raised TypeError).
    wl = ladder_workload(
        LadderConfig(first_prompt_tokens=300, system_prefix_tokens=100, tokens_per_turn=200, turns=2,
                     answer_min_tokens=4, answer_max_tokens=8, concurrency=2, total_conversations=2,
                     block_size=32, seed=0)
    )  # fmt: skip
    # What the engines' /tokenize would have given: here the ladder's own turns.
    write_workload(tmp_path / "wl.json", wl)
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps(
            {
                "engine_profile": {**ENGINE, "max_num_seqs": 128} if profile_has_seqs else ENGINE,
                "api_server": dataclasses.asdict(API),
                "router_stage": dataclasses.asdict(ROUTER),
            }
        )
    )
    fleet = [
        {"id": e, "url": f"http://{e}:1", "block_size": 32, "model": "m", "scheduling_policy": "fcfs"}
        for e in ("e0", "e1")
    ]
    runs = []
    for k, (ttfts, cached) in enumerate(
        (([0.1, 0.2, 0.3, 0.4], 0), ([0.5, 0.6, 0.7, 0.8], 50), ([0.9, 1.0, 1.1, 1.2], 100))
    ):
        path = tmp_path / f"run{k}.json"
        path.write_text(json.dumps({"runs": {"round_robin": _saved_run(ttfts, cached)}, "fleet": fleet}))
        runs.append(str(path))
    args = ["--model-dir", str(tmp_path), "--profile", str(profile), "--policies", "round_robin",
            "--workload-json", str(tmp_path / "wl.json"), "--live-json", *runs, *LADDER]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| round_robin | 3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # Live: the median run and the range over the three (hit 0, 0.5, 1.0; p50 0.25, 0.65, 1.05).
    assert cells[2] == "0.500 [0.000-1.000]"
    assert cells[5] == "0.650 [0.250-1.050]"
    # DES: the same run the simulator makes with the profile's engine and both stages.
    spec = EngineProfile(**ENGINE, block_size=32, num_gpu_blocks=399, max_num_seqs=128)  # type: ignore[arg-type]
    engines = [EngineSpec(e, dataclasses.replace(spec)) for e in ("e0", "e1")]
    # calib_compare replays the engine-tokenized turns with every conversation starting at once.
    replayed = dataclasses.replace(wl, ramp_s=0.0)
    fleet_spec = FleetSpec(engines, api_server=API, router_stage=ROUTER)
    des = FleetSimulator(replayed, "round_robin", fleet_spec, SimConfig(seed=0)).run()
    p50, p90 = percentiles(des.ttfts_s, (50, 90))
    assert cells[6] == f"{p50:.3f}" and cells[9] == f"{p90:.3f}"
    assert p50 > 0.02 + 0.01 + 0.005  # the stages' work and stall are in it
    # The phases table: one row per run, with the CPU split.
    assert out.count("| round_robin | ") == 1 + 3


def test_cpu_split_reads_named_and_older_child_names() -> None:
    named = {"u api": 1.0, "u child0:VLLM::EngineCore": 2.0, "u child1:VLLM::Worker": 8.0, "router": 0.5}
    older = {"u api": 1.0, "u child0": 2.0, "u child1": 8.0, "u child2": 0.0}
    assert cpu_split(named) == "8.0 / 2.0 / 1.0 / 0.5"
    assert cpu_split(older) == "8.0 / 2.0 / 1.0 / 0.0"
