"""Experiments: sticky weighted assignment (chi-square), forced arm, reload, and report numbers."""

from __future__ import annotations

import math
import random

import pytest

from kvcore.stats import ConversationTotals, cluster_bootstrap_diff, hit_rate, mean_ttft, percentile
from router.experiments import Experiments, parse_experiment_config

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
        conv = f"c{i % 20}"  # 20 conversations of 5 turns per arm
        exp.record_turn(
            "control",
            conv,
            ok=True,
            ttft_s=i / 100,
            cached_tokens=150,
            prompt_tokens=300,
            predicted_hit_tokens_by_tier=(100, 50, 0),
        )
        exp.record_turn(
            "treat",
            conv,
            ok=True,
            ttft_s=i / 100 - 0.2,
            cached_tokens=300,
            prompt_tokens=400,
            predicted_hit_tokens_by_tier=(0, 0, 400),
        )
    exp.record_turn("treat", "c1", ok=False, ttft_s=None, cached_tokens=None, prompt_tokens=10)
    # A non-stream turn: no TTFT, but its usage counts for the hit rate.
    exp.record_turn("treat", "c1", ok=True, ttft_s=None, cached_tokens=0, prompt_tokens=400)
    report = exp.report()
    assert report["control"] == "control"
    control, treat = report["arms"]
    assert control["requests"] == 100 and control["errors"] == 0
    assert treat["requests"] == 102 and treat["errors"] == 1
    assert treat["requests_without_ttft"] == 1 and treat["ttft_samples"] == 100
    assert control["conversations"] == 20
    assert control["ttft_p50_s"] == pytest.approx(0.505)
    assert control["ttft_p90_s"] == pytest.approx(0.901)
    assert control["ttft_p99_s"] == pytest.approx(0.9901)
    # The hit rate is what the engines reported; the index's tier split is labelled a prediction.
    assert control["hit_rate"] == pytest.approx(0.5)
    assert treat["hit_rate"] == pytest.approx(30_000 / 40_400)
    assert control["predicted"]["mean_hit_tokens"] == {"gpu": 100, "cpu": 50, "storage": 0}
    assert treat["predicted"]["hit_rate"] == pytest.approx(40_000 / 40_400)
    vs = treat["vs_control"]
    assert vs["median_diff_s"] == pytest.approx(-0.2)
    assert vs["mean_ttft_diff_s"] == pytest.approx(-0.2)
    low, high = vs["mean_ttft_diff_ci_s"]
    assert low < -0.2 < high
    assert vs["hit_rate_diff"] == pytest.approx(30_000 / 40_400 - 0.5)
    assert vs["conversations"] == [20, 20]
    assert "vs_control" not in control


def test_reservoir_is_bounded_and_uniform() -> None:
    exp = Experiments({"policy": "tier_cost"}, reservoir_size=500)
    for i in range(20_000):
        exp.record_turn("tier_cost", f"c{i}", ok=True, ttft_s=float(i), cached_tokens=None, prompt_tokens=1)
    arm = exp.report()["arms"][0]
    assert arm["ttft_samples"] == 500 and arm["requests"] == 20_000
    assert 8_000 < arm["ttft_p50_s"] < 12_000  # the median of 0..19,999 is ~10,000


def test_percentile_is_numpy_linear() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)


def _clustered_arm(rng: random.Random, mean_s: float, conversations: int) -> list[ConversationTotals]:
    """Conversations of 8 turns sharing a strong per-conversation effect (sd 0.5 s) plus turn noise
    (sd 0.1 s): turns of one conversation are far from independent."""
    out = []
    for _ in range(conversations):
        effect = rng.gauss(0.0, 0.5)
        ttfts = [mean_s + effect + rng.gauss(0.0, 0.1) for _ in range(8)]
        out.append(ConversationTotals(sum(ttfts), len(ttfts), 0.0, 1.0))
    return out


@pytest.mark.slow
def test_cluster_bootstrap_covers_the_true_difference_where_per_request_intervals_do_not() -> None:
    rng = random.Random(7)
    trials, cluster_cover, naive_cover = 120, 0, 0
    for trial in range(trials):
        a = _clustered_arm(rng, 1.0, 30)
        b = _clustered_arm(rng, 1.2, 30)
        ci = cluster_bootstrap_diff(a, b, mean_ttft, resamples=400, seed=trial)
        assert ci is not None
        cluster_cover += ci.low <= 0.2 <= ci.high
        # The same data as 240 independent requests per arm (what a per-request Welch interval
        # assumes): each conversation becomes 8 requests at its mean, the interval shrinks ~sqrt(8).
        flat_a = [ConversationTotals(c.ttft_sum_s / 8, 1, 0, 1) for c in a for _ in range(8)]
        flat_b = [ConversationTotals(c.ttft_sum_s / 8, 1, 0, 1) for c in b for _ in range(8)]
        naive = cluster_bootstrap_diff(flat_a, flat_b, mean_ttft, resamples=400, seed=trial)
        assert naive is not None
        naive_cover += naive.low <= 0.2 <= naive.high
    assert cluster_cover / trials >= 0.88  # nominal 95%, percentile bootstrap with 30 clusters
    assert naive_cover / trials <= 0.70  # treating turns as independent is far too narrow


def _binomial_quantile(n: int, p: float, q: float) -> tuple[int, float]:
    """The smallest k with P(Binomial(n, p) <= k) >= q, and how far that CDF step lies from q
    (the smaller distance of q to the CDF at k - 1 and at k): exact, with math.comb."""
    cdf = 0.0
    for k in range(n + 1):
        below = cdf
        cdf += math.comb(n, k) * p**k * (1 - p) ** (n - k)
        if cdf >= q:
            return k, min(q - below, cdf - q)
    return n, 0.0


@pytest.mark.parametrize("confidence", [0.95, 0.90])
def test_bootstrap_interval_ends_are_the_exact_quantiles_of_its_confidence(confidence: float) -> None:
    """An independent truth for the interval's ends: 20 conversations of one turn, 2 of them at
    1 s and 18 at 0 s, against a control that is always 0 s. A resample's mean is then exactly
    Binomial(20, 0.1) / 20, whose quantiles are computed here from the binomial CDF. For 95% the
    upper end is its 97.5% quantile, 5/20 = 0.25 s; a 90% interval labelled 95% (the 95% quantile)
    would end at 4/20 = 0.2 s. Both quantiles sit > 0.005 from a CDF step, ~4 sd of the empirical
    CDF at 20,000 resamples, so the seed is not what makes this pass."""
    n, resamples = 20, 20_000
    upper_q = 1 - (1 - confidence) / 2
    k, margin = _binomial_quantile(n, 0.1, upper_q)
    assert margin > 0.005
    assert k == {0.95: 5, 0.90: 4}[confidence]  # the two confidences are told apart
    zero = [ConversationTotals(0.0, 1, 0.0, 1.0)] * n
    ones = [ConversationTotals(1.0, 1, 0.0, 1.0)] * 2 + [ConversationTotals(0.0, 1, 0.0, 1.0)] * (n - 2)
    up = cluster_bootstrap_diff(zero, ones, mean_ttft, confidence=confidence, resamples=resamples)
    assert up is not None and up.confidence == confidence
    assert up.diff == pytest.approx(0.1) and up.high == pytest.approx(k / n)
    # The other end: the same distribution on the control side gives -quantile for the low end.
    down = cluster_bootstrap_diff(ones, zero, mean_ttft, confidence=confidence, resamples=resamples)
    assert down is not None and down.low == pytest.approx(-k / n)


def test_bootstrap_needs_two_conversations_per_side() -> None:
    one = [ConversationTotals(1.0, 1, 0.0, 1.0)]
    assert cluster_bootstrap_diff(one, one * 3, mean_ttft) is None
    no_usage = [ConversationTotals(1.0, 1, 0.0, 0.0)] * 3  # streamed, but no usage reported
    assert cluster_bootstrap_diff(no_usage, no_usage, hit_rate) is None
