"""Two calibration rules of kvcore.calibration.CostModel against data generated from known true
engine parameters (not from the model's own formula run backwards): where a cached-token shortfall
is taken from, and the clip of outlying TTFTs. Before these, only the live timing tests caught a
change to either."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from kvcore.calibration import _P0, CostModel, _Rls, _rls_update, _updated
from policies.base import Tier
from policies.costs import EngineCosts, predict_parts

INF = math.inf
#: The engine as it really is: slower than the configured priors (22,000 tok/s, CPU 64 GB/s,
#: STORAGE 5 GB/s), with the priors' per-tier latencies.
TRUTH = EngineCosts(prefill_tokens_per_s=12_000.0, load_bandwidth_bytes_per_s=(INF, 20e9, 2e9))


def true_ttft_s(gpu_hit: float, storage_hit: float, prompt: float) -> float:
    """What the real engine takes, written out from TRUTH: a STORAGE load when it held storage
    blocks, then the prefill of what it did not hold (GPU hits cost nothing)."""
    load_s = 0.0
    if storage_hit > 0:
        load_s = TRUTH.load_latency_s[Tier.STORAGE] + storage_hit * TRUTH.kv_bytes_per_token / 2e9
    return load_s + (prompt - gpu_hit - storage_hit) / 12_000.0


def test_a_cached_token_shortfall_is_taken_from_the_deepest_tier_first() -> None:
    """The index promised GPU and STORAGE hits; on half the requests the engine had lost the
    STORAGE copy (the shared pool evicted it) and reports only the GPU tokens as cached. The
    shortfall must come off STORAGE (the deepest tier predicted) and go to the prefill: then the
    data are the truth's and the fit finds the true prefill rate and storage bandwidth. Taken from
    the GPU hits first instead, requests that loaded nothing look like STORAGE loads, and the
    learned storage bandwidth and prefill rate are both wrong."""
    rng = random.Random(11)
    model = CostModel()
    for i in range(1_500):
        prompt = float(rng.randint(4_000, 12_000))
        gpu = float(int(prompt * rng.uniform(0.2, 0.4)))
        storage = float(int(prompt * rng.uniform(0.2, 0.4)))
        pool_lost = rng.random() < 0.5
        real_storage = 0.0 if pool_lost else storage
        parts = predict_parts(model.estimates("e"), (gpu, 0.0, storage), prompt - gpu - storage, 0)
        observed = true_ttft_s(gpu, real_storage, prompt) * math.exp(rng.gauss(0.0, 0.02))
        model.observe("e", parts, observed, cached_tokens=gpu + real_storage, now=float(i))
    est = model.estimates("e")
    assert est.prefill_tokens_per_s == pytest.approx(12_000, rel=0.05)
    assert est.load_bandwidth_bytes_per_s[Tier.STORAGE] == pytest.approx(2e9, rel=0.1)


def test_outlying_ttfts_are_clipped_to_max_ratio_of_the_prediction() -> None:
    """Plain misses on an engine at 12,000 tok/s; one request in 25 stalls for 100x its true time
    (a GC pause, a preempted request). Clipped to 4x the prediction, the stalls bias the learned
    rate by little; unclipped, a few of them drag it far from the truth."""
    rng = random.Random(5)
    model = CostModel()
    for i in range(2_000):
        prompt = float(rng.randint(2_000, 16_000))
        parts = predict_parts(model.estimates("e"), (0.0, 0.0, 0.0), prompt, 0)
        observed = true_ttft_s(0.0, 0.0, prompt) * math.exp(rng.gauss(0.0, 0.02))
        if rng.random() < 0.04:
            observed *= 100.0
        model.observe("e", parts, observed, cached_tokens=0, now=float(i))
    assert model.estimates("e").prefill_tokens_per_s == pytest.approx(12_000, rel=0.3)


def test_the_updated_costs_keep_every_other_field() -> None:
    """``_updated`` names every field of EngineCosts (a new field would be dropped silently) and
    equals ``dataclasses.replace`` of the three learned figures."""
    assert [f.name for f in dataclasses.fields(EngineCosts)] == [
        "prefill_tokens_per_s",
        "load_bandwidth_bytes_per_s",
        "load_latency_s",
        "kv_bytes_per_token",
        "slot_s_per_request",
    ]
    costs = EngineCosts(1234.0, (1.0, 2.0, 3.0), (0.1, 0.2, 0.3), 77, 0.5)
    got = _updated(costs, 99.0, (4.0, 5.0, 6.0), 0.25)
    assert got == dataclasses.replace(
        costs, prefill_tokens_per_s=99.0, load_bandwidth_bytes_per_s=(4.0, 5.0, 6.0), slot_s_per_request=0.25
    )


def _textbook_rls_update(rls: _Rls, x: list[float], y: float, forgetting: float) -> None:
    """The recursive-least-squares step element by element (kvcore's before round dp23): the
    reference ``_rls_update``'s written-out form must equal, float for float."""
    n = len(x)
    cov = rls.cov
    px = [sum(cov[i][j] * x[j] for j in range(n)) for i in range(n)]
    denom = forgetting + sum(x[i] * px[i] for i in range(n))
    if denom <= 0:
        return
    gain = [v / denom for v in px]
    error = y - sum(rls.theta[i] * x[i] for i in range(n))
    for i in range(n):
        rls.theta[i] += gain[i] * error
    for i in range(n):
        for j in range(n):
            cov[i][j] = (cov[i][j] - gain[i] * px[j]) / forgetting
    for i in range(n):
        if cov[i][i] > _P0[i]:
            scale = math.sqrt(_P0[i] / cov[i][i])
            for j in range(n):
                cov[i][j] *= scale
                cov[j][i] *= scale


def test_the_rls_step_equals_the_element_wise_form_bit_for_bit() -> None:
    """Catches a written-out ``_rls_update`` that reorders a sum, drops the covariance cap's
    double scaling of the diagonal, or loses a zero's sign: sequences of observations with
    unexcited directions (x = 0, -0.0: the cap), large and tiny weights and every forgetting
    factor in use give the same theta and covariance, compared exactly (also the sign of zeros)."""
    rng = random.Random(23)
    for _ in range(200):
        got, want = _Rls(), _Rls()
        for _ in range(40):
            weight = 1.0 / max(1e-3, rng.uniform(0.0, 3.0))
            x = [weight] + [
                weight * rng.choice([0.0, -0.0, rng.uniform(0.0, 3.0), rng.expovariate(0.5)])
                for _ in range(4)
            ]
            y = rng.uniform(-1.0, 5.0) * weight
            forgetting = rng.choice([0.98, 0.995, 1.0])
            _rls_update(got, x, y, forgetting)
            _textbook_rls_update(want, x, y, forgetting)
            assert got.theta == want.theta and got.cov == want.cov
            flat = [*got.theta, *(v for row in got.cov for v in row)]
            flat_want = [*want.theta, *(v for row in want.cov for v in row)]
            assert [math.copysign(1.0, v) for v in flat] == [math.copysign(1.0, v) for v in flat_want]
