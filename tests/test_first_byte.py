"""router/first_byte.py: the first-byte budget follows the measured time to first token (issue 28
item 5: a fixed 120 s default let requests wait two minutes on a stopped engine)."""

from __future__ import annotations

from router.config import RouterConfig
from router.first_byte import (
    CEILING_S,
    FALLBACK_S,
    FLOOR_S,
    MIN_SAMPLES,
    RECOMPUTE_EVERY,
    RECOMPUTE_INTERVAL_S,
    FirstByteBudget,
)


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


def test_at_a_high_stream_rate_the_p99_is_recomputed_once_per_interval() -> None:
    """Virtual time: thousands of streams within one interval cost one recomputation, not one per
    32 streams; the next stream after the interval brings the budget up to date; at a low rate
    every ``RECOMPUTE_EVERY`` streams still recompute."""
    budget = FirstByteBudget()
    for _ in range(MIN_SAMPLES):
        budget.record(0.5, now_s=100.0)
    assert budget.budget_s() == FLOOR_S
    for _ in range(5 * RECOMPUTE_EVERY):  # the engines turn slow within the same interval
        budget.record(10.0, now_s=100.0 + RECOMPUTE_INTERVAL_S / 2)
    assert budget.budget_s() == FLOOR_S  # not recomputed yet
    budget.record(10.0, now_s=100.0 + RECOMPUTE_INTERVAL_S)
    assert budget.budget_s() == 40.0  # 4 x the p99 of 10 s
    slow = FirstByteBudget()
    now_s = 0.0
    for _ in range(MIN_SAMPLES):
        now_s += RECOMPUTE_INTERVAL_S
        slow.record(0.5, now_s=now_s)
    for i in range(RECOMPUTE_EVERY):
        assert slow.budget_s() == FLOOR_S, i
        now_s += RECOMPUTE_INTERVAL_S
        slow.record(12.0, now_s=now_s)
    assert slow.budget_s() == 48.0
