"""Pooled calibration (``costs.calibration.pool_observations``): engines that share a prior share
evidence, so one slow early TTFT cannot lock an engine out, while an engine that is really slower
is still learned from its own observations. The truth is the simulated request's own cost
(``predict_parts`` with the true EngineCosts), not the model under test."""

from __future__ import annotations

import math
import random

import pytest

from kvcore.calibration import CostModel
from policies.costs import EngineCosts, predict_parts

PRIOR = EngineCosts()  # 22,000 tok/s
FAST = EngineCosts(prefill_tokens_per_s=40_000.0)


def _fresh_prompt(
    model: CostModel, engine: str, truth: EngineCosts, rng: random.Random, now: float, slow: float = 1.0
) -> None:
    """One clean (nothing in flight) fresh 1,000-3,000-token prompt on ``engine``, its TTFT the
    truth's x ``slow`` with 5% noise."""
    prefill = float(rng.randint(1_000, 3_000))
    parts = predict_parts(model.estimates(engine), (0.0, 0.0, 0.0), prefill, 0.0)
    observed = (
        predict_parts(truth, (0.0, 0.0, 0.0), prefill, 0.0).total_s * slow * math.exp(rng.gauss(0, 0.05))
    )
    model.observe(engine, parts, observed, cached_tokens=0.0, now=now)


def _lock_in(model: CostModel) -> tuple[float, float]:
    """Twin engines as fast as each other: a gets 60 observations; b gets two (the first 4x slow:
    a busy moment of the machine) and then none, as tier_cost would leave it. Returns both
    engines' prefill estimates."""
    rng = random.Random(7)
    _fresh_prompt(model, "a", FAST, rng, 0.0)
    _fresh_prompt(model, "b", FAST, rng, 1.0, slow=4.0)
    _fresh_prompt(model, "b", FAST, rng, 2.0)
    for i in range(60):
        _fresh_prompt(model, "a", FAST, rng, 3.0 + i)
    return model.estimates("a").prefill_tokens_per_s, model.estimates("b").prefill_tokens_per_s


def test_without_pooling_one_slow_ttft_locks_a_twin_out() -> None:
    a, b = _lock_in(CostModel())
    assert a == pytest.approx(40_000, rel=0.1)
    assert b < a / 2  # looks more than twice as slow, and nothing will correct it


def test_pooling_keeps_a_twin_near_the_fleet_after_one_slow_ttft() -> None:
    a, b = _lock_in(CostModel.from_config({"calibration": {"pool_observations": 8}}))
    assert a == pytest.approx(40_000, rel=0.1)
    assert b == pytest.approx(a, rel=0.3)


def test_pooling_still_learns_an_engine_that_is_really_slower() -> None:
    model = CostModel.from_config({"calibration": {"pool_observations": 8}})
    rng = random.Random(11)
    slow = EngineCosts(prefill_tokens_per_s=10_000.0)
    for i in range(80):
        _fresh_prompt(model, "a", FAST, rng, float(i))
        _fresh_prompt(model, "b", slow, rng, float(i) + 0.5)
    assert model.estimates("a").prefill_tokens_per_s == pytest.approx(40_000, rel=0.2)
    assert model.estimates("b").prefill_tokens_per_s == pytest.approx(10_000, rel=0.2)


def test_a_newcomer_starts_from_its_twins_and_other_priors_do_not_pool() -> None:
    model = CostModel(engine_priors={"other": EngineCosts(prefill_tokens_per_s=5_000.0)})
    model.calibration.pool_observations = 8
    rng = random.Random(3)
    for i in range(40):
        _fresh_prompt(model, "a", FAST, rng, float(i))
    # "new" shares a's prior (the fleet's): it starts near what a has shown, not at the prior.
    assert model.estimates("new").prefill_tokens_per_s == pytest.approx(40_000, rel=0.2)
    # "other" has its own prior: a's observations say nothing about it.
    assert model.estimates("other").prefill_tokens_per_s == 5_000.0


def test_pool_observations_must_be_a_finite_non_negative_number() -> None:
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="pool_observations"):
            CostModel.from_config({"calibration": {"pool_observations": bad}})
