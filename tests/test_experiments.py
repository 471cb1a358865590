"""Experiments: sticky weighted assignment (chi-square), forced arm, reload, and report numbers."""

from __future__ import annotations

import math
import random

import pytest

from router.experiments import Experiments, parse_experiment_config, percentile, t_quantile, welch_interval

# Chi-square critical values at p = 0.001: 1 degree of freedom.
CHI2_CRIT_1DF = 10.83


def chi2(counts: list[int], weights: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * w) ** 2 / (total * w) for c, w in zip(counts, weights, strict=True))


def two_arms(w_a: float, w_b: float) -> Experiments:
    return Experiments(
        {
            "arms": [
                {"name": "control", "policy": "kv_fixed_credit", "weight": w_a},
                {"name": "treat", "policy": "tier_cost", "params": {"stale_hit_factor": 0.3}, "weight": w_b},
            ]
        }
    )


@pytest.mark.parametrize("weights", [(50, 50), (80, 20)])
def test_weights_hold_over_many_sessions(weights: tuple[int, int]) -> None:
    exp = two_arms(*weights)
    counts = {"control": 0, "treat": 0}
    for i in range(20_000):
        counts[exp.assign(f"session-{i}").name] += 1
    total = sum(weights)
    stat = chi2([counts["control"], counts["treat"]], [weights[0] / total, weights[1] / total])
    assert stat < CHI2_CRIT_1DF, counts


def test_assignment_is_sticky_and_same_across_replicas() -> None:
    a, b = two_arms(50, 50), two_arms(50, 50)
    sessions = [f"conv-{i}" for i in range(500)]
    first = [a.assign(s).name for s in sessions]
    assert [a.assign(s).name for s in sessions] == first  # sticky
    assert [b.assign(s).name for s in sessions] == first  # another replica / after a restart
    assert a.assign("conv-1").policy.name in {"kv_fixed_credit", "tier_cost"}
    assert a.arm("treat").policy.stale_hit_factor == 0.3  # type: ignore[attr-defined]


def test_forced_arm_and_unknown_arm() -> None:
    exp = two_arms(100, 0)
    assert all(exp.assign(f"s{i}").name == "control" for i in range(200))
    assert exp.assign("s1", forced_arm="treat").name == "treat"
    assert exp.assign("s1").name == "control"  # forcing does not re-stick the session
    with pytest.raises(ValueError, match="accepted: control, treat"):
        exp.assign("s1", forced_arm="nope")


def test_reload_keeps_seen_sessions_and_new_ones_follow_new_weights() -> None:
    exp = two_arms(50, 50)
    seen = {f"old-{i}": exp.assign(f"old-{i}").name for i in range(400)}
    treat_policy = exp.arm("treat").policy
    exp.reload(
        {
            "arms": [
                {"name": "control", "policy": "kv_fixed_credit", "weight": 0},
                {"name": "treat", "policy": "tier_cost", "params": {"stale_hit_factor": 0.3}, "weight": 1},
            ]
        }
    )
    assert {s: exp.assign(s).name for s in seen} == seen
    assert all(exp.assign(f"new-{i}").name == "treat" for i in range(300))
    assert exp.arm("treat").policy is treat_policy  # unchanged arm keeps its policy object (and state)
    # An arm that disappears releases its sessions to the new weights.
    exp.reload([{"name": "treat", "policy": "tier_cost", "params": {"stale_hit_factor": 0.3}}])
    assert all(exp.assign(s).name == "treat" for s in seen)


def test_single_policy_config_and_errors() -> None:
    exp = Experiments({"policy": "tier_cost"})
    assert [a.name for a in exp.arms] == ["tier_cost"]
    with pytest.raises(ValueError, match="unknown policy"):
        Experiments({"policy": "no_such_policy"})
    with pytest.raises(ValueError, match="unique"):
        parse_experiment_config([{"policy": "tier_cost"}, {"policy": "tier_cost"}])
    with pytest.raises(ValueError, match="unknown keys"):
        parse_experiment_config([{"policy": "tier_cost", "wieght": 2}])


def test_report_numbers_on_known_samples() -> None:
    exp = two_arms(50, 50)
    for i in range(1, 101):
        exp.record("control", i / 100, ok=True, hit_tokens_by_tier=(100, 50, 0), prompt_tokens=300)
        exp.record("treat", i / 100 - 0.2, ok=True, hit_tokens_by_tier=(0, 0, 200), prompt_tokens=400)
    exp.record("treat", None, ok=False)
    report = exp.report()
    assert report["control"] == "control"
    control, treat = report["arms"]
    assert control["requests"] == 100 and control["errors"] == 0
    assert treat["requests"] == 101 and treat["errors"] == 1
    assert control["ttft_p50_s"] == pytest.approx(0.505)
    assert control["ttft_p90_s"] == pytest.approx(0.901)
    assert control["ttft_p99_s"] == pytest.approx(0.9901)
    assert control["mean_hit_tokens"] == {"gpu": 100, "cpu": 50, "storage": 0}
    assert control["hit_rate"] == pytest.approx(0.5)
    assert treat["hit_rate"] == pytest.approx(0.5)
    vs = treat["vs_control"]
    assert vs["median_diff_s"] == pytest.approx(-0.2)
    assert vs["mean_diff_s"] == pytest.approx(-0.2)
    # Same spread on both sides: se = sqrt(2 x var/100), var of 0.01..1.00 = 0.084167.
    se = math.sqrt(2 * 0.0841666 / 100)
    low, high = vs["mean_diff_ci_s"]
    assert low == pytest.approx(-0.2 - 1.9720 * se, rel=1e-3)  # t(0.975, df=198) = 1.9720
    assert high == pytest.approx(-0.2 + 1.9720 * se, rel=1e-3)
    assert "vs_control" not in control


def test_reservoir_is_bounded_and_uniform() -> None:
    exp = Experiments({"policy": "tier_cost"}, reservoir_size=500)
    for i in range(20_000):
        exp.record("tier_cost", float(i), ok=True)
    arm = exp.report()["arms"][0]
    assert arm["ttft_samples"] == 500 and arm["requests"] == 20_000
    assert 8_000 < arm["ttft_p50_s"] < 12_000  # the median of 0..19,999 is ~10,000


def test_statistics_helpers() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99) == 3.0
    assert t_quantile(0.975, 10) == pytest.approx(2.228, abs=0.005)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.960, abs=0.001)
    assert welch_interval([1.0], [1.0, 2.0]) is None
    rng = random.Random(5)
    covered = 0
    for _ in range(200):
        a = [rng.gauss(1.0, 0.3) for _ in range(40)]
        b = [rng.gauss(1.1, 0.6) for _ in range(25)]
        ci = welch_interval(a, b)
        assert ci is not None
        covered += ci["low"] <= 0.1 <= ci["high"]
    assert 180 <= covered <= 199  # ~95% coverage of the true difference
