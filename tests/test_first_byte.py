"""router/first_byte.py: the first-byte budget follows the measured time to first token (issue 28
item 5: a fixed 120 s default let requests wait two minutes on a stopped engine)."""

from __future__ import annotations

from router.config import RouterConfig
from router.first_byte import CEILING_S, FALLBACK_S, FLOOR_S, MIN_SAMPLES, FirstByteBudget


def test_the_default_budget_is_measured_not_two_minutes() -> None:
    assert RouterConfig().limits.first_byte_timeout_s == 0.0  # 0 = measured
    budget = FirstByteBudget(RouterConfig().limits.first_byte_timeout_s)
    assert budget.budget_s() == FALLBACK_S  # before enough data
    for _ in range(MIN_SAMPLES - 1):
        budget.record(0.05)
    assert budget.budget_s() == FALLBACK_S
    budget.record(0.05)
    assert budget.budget_s() == FLOOR_S  # a fast fleet: the floor, not 4 x 50 ms


def test_the_budget_is_four_times_the_p99_within_its_bounds() -> None:
    budget = FirstByteBudget()
    for i in range(1000):
        budget.record(2.5 if i % 50 == 0 else 0.5)  # 2 % slow: p99 = 2.5 s
    assert budget.budget_s() == 10.0
    for _ in range(1100):
        budget.record(40.0)  # a history of very slow prefills: bounded
    assert budget.budget_s() == CEILING_S


def test_a_fixed_budget_is_kept_and_bad_samples_are_ignored() -> None:
    fixed = FirstByteBudget(7.0)
    for _ in range(100):
        fixed.record(20.0)
    assert fixed.budget_s() == 7.0
    measured = FirstByteBudget()
    for _ in range(MIN_SAMPLES):
        measured.record(float("nan"))
        measured.record(-1.0)
    assert measured.budget_s() == FALLBACK_S
