"""The simulated engine against real vLLM's recorded in-flight waves, without vLLM: the waves
tests/vllm/test_sim_parity.py runs on a real engine (``make test-vllm``; requests with shared
prefixes queued behind a paused scheduler, then released; with and without a CPU tier, fcfs and
priority), as vLLM 0.32.0's CPU build announced them (data/fixtures/vllm-waves/README.md), replayed
in the simulator here; and a request arriving while another decodes (the preemption victim when the
running requests are out of arrival order). Every step's events must be the same, so ``make test``
catches a change to the engine model's admission, caching, offloading, ranking or preemption rules
that vLLM does not make, where the live check needs a vLLM install and fifteen minutes."""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest

from tests.vllm.test_sim_parity import (
    LATE_CASES,
    RECORDED_LATE_ARRIVALS,
    RECORDED_STORAGE_WAVES,
    RECORDED_WAVES,
    STORAGE_WAVE_CASES,
    WAVE_CASES,
    _labelled,
    _simulated_wave,
    _wave,
    arrivals_reproducing,
    late_arrival_key,
    recorded_storage_compared,
    simulated_storage_compared,
    storage_wave_key,
    wave_key,
)

WAVES: dict[str, Any] = json.loads(gzip.decompress(RECORDED_WAVES.read_bytes()))["waves"]


def test_the_recording_covers_every_live_case() -> None:
    """Every wave of the live check's cases (WAVE_CASES), none else."""
    cases = [wave_key(policy, cpu, n, seed) for policy, cpu, n, seeds in WAVE_CASES for seed in seeds]
    assert sorted(WAVES) == sorted(cases)


@pytest.mark.parametrize("key", sorted(WAVES))
def test_the_simulated_engine_reproduces_a_wave_real_vllm_ran(key: str) -> None:
    case, seed = key.split("/")
    policy, size = case.split("-")
    cpu, n = size.split("x")
    wave = _wave(int(seed), int(n))
    simulated = _simulated_wave(wave, policy, int(cpu))
    # Through JSON, as recorded: tuples become lists.
    steps = json.loads(json.dumps(_labelled(simulated[0], [prompt for _p, _m, prompt in wave])))
    recorded = WAVES[key]
    n = min(len(steps), len(recorded))
    diff = next((i for i in range(n) if steps[i] != recorded[i]), n)
    assert steps == recorded, (
        f"{key}: {len(recorded)} event batches from vLLM, {len(steps)} simulated; first difference at "
        f"{diff}:\nvllm {recorded[diff : diff + 2]}\nsim  {steps[diff : diff + 2]}"
    )


# ------------------------------------------------------------------------------- with STORAGE

STORAGE_WAVES: dict[str, Any] = json.loads(gzip.decompress(RECORDED_STORAGE_WAVES.read_bytes()))["waves"]


def test_the_storage_recording_covers_every_live_case() -> None:
    """Every wave of the live STORAGE check's cases (STORAGE_WAVE_CASES), none else."""
    cases = [
        storage_wave_key(policy, cpu, n, seed)
        for policy, cpu, n, seeds in STORAGE_WAVE_CASES
        for seed in seeds
    ]
    assert sorted(STORAGE_WAVES) == sorted(cases)


@pytest.mark.parametrize("key", sorted(STORAGE_WAVES))
def test_the_simulated_engine_serves_the_storage_waves_real_vllm_served(key: str) -> None:
    """The live STORAGE check's comparison (``storage_wave_compared``: the cold pass's events,
    STORAGE stores and figures, the second pass's cached tokens) against the recording."""
    case, seed = key.split("/")
    _fs, policy, size = case.split("-")
    cpu, n = size.split("x")
    wave = _wave(int(seed), int(n))
    recorded = recorded_storage_compared(wave, STORAGE_WAVES[key])
    simulated = simulated_storage_compared(wave, policy, int(cpu))
    assert [name for name in recorded if recorded[name] != simulated[name]] == [], key


# ------------------------------------------------------------------ a request arriving while another decodes

LATE_ARRIVALS: dict[str, Any] = json.loads(gzip.decompress(RECORDED_LATE_ARRIVALS.read_bytes()))["waves"]


@pytest.mark.parametrize("policy", LATE_CASES)
def test_the_simulated_engine_chooses_the_victim_real_vllm_chose_for_a_late_arrival(policy: str) -> None:
    """The live late-arrival check's comparison against its recording: some arrival point of the
    late request reproduces vLLM's events, cached tokens and preemptions (``arrivals_reproducing``).
    Fails with the newest running request as the victim on a priority engine, and with the oldest
    on an fcfs engine (checked)."""
    recorded = LATE_ARRIVALS[late_arrival_key(policy)]
    assert recorded["preemptions"] >= 1
    assert arrivals_reproducing(policy, recorded), f"{policy}: no arrival point reproduces vLLM's events"


def test_the_late_arrival_recording_covers_every_live_case() -> None:
    assert sorted(LATE_ARRIVALS) == sorted(late_arrival_key(policy) for policy in LATE_CASES)
