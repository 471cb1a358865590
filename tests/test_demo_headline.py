"""`make demo`'s closing line follows the statistics: a difference is called better or worse only
when its interval excludes zero (loadtest.demo.verdict / gain_line, pure functions)."""

from __future__ import annotations

from typing import Any

from loadtest.demo import gain_line, verdict


def _report(ttft_ci: list[float] | None, hit_ci: list[float] | None) -> dict[str, Any]:
    control = {"name": "control", "ttft_p50_s": 0.114, "ttft_p90_s": 0.300, "hit_rate": 0.40}
    treatment: dict[str, Any] = {
        "name": "tier_cost",
        "ttft_p50_s": 0.091,
        "ttft_p90_s": 0.320,
        "hit_rate": 0.55,
        "vs_control": {
            "control": "control",
            "mean_ttft_diff_s": -0.0105 if ttft_ci else None,
            "mean_ttft_diff_ci_s": ttft_ci,
            "hit_rate_diff": 0.15 if hit_ci else None,
            "hit_rate_diff_ci": hit_ci,
            "confidence": 0.95,
        },
    }
    return {"control": "control", "arms": [control, treatment]}


def test_interval_holding_zero_says_no_significant_difference() -> None:
    # The run: median 114 -> 91 ms, but the interval -23.4 .. +2.4 ms holds zero.
    text = verdict(-0.0105, -0.0234, 0.0024, 0.95, "ms", lower_is_better=True)
    assert text == "-10.5 ms (95% CI -23.4 ms .. +2.4 ms): no significant difference"


def test_interval_below_zero_is_better_for_ttft_and_worse_for_hit_rate() -> None:
    assert verdict(-0.030, -0.045, -0.012, 0.95, "ms", lower_is_better=True).endswith(": better")
    assert verdict(-0.10, -0.15, -0.05, 0.90, "", lower_is_better=False) == (
        "-0.100 (90% CI -0.150 .. -0.050): worse"
    )


def test_interval_above_zero_is_worse_for_ttft_and_better_for_hit_rate() -> None:
    assert verdict(0.030, 0.012, 0.045, 0.95, "ms", lower_is_better=True).endswith(": worse")
    assert verdict(0.15, 0.08, 0.21, 0.95, "", lower_is_better=False).endswith(": better")


def test_interval_touching_zero_is_not_significant() -> None:
    assert verdict(-0.01, -0.02, 0.0, 0.95, "ms", lower_is_better=True).endswith("no significant difference")


def test_headline_with_zero_in_the_ttft_interval_claims_no_speed_up() -> None:
    line = gain_line(_report([-0.0234, 0.0024], [0.08, 0.21]))
    assert line.startswith("tier_cost vs control: mean TTFT -10.5 ms (95% CI -23.4 ms .. +2.4 ms)")
    assert "mean TTFT -10.5 ms (95% CI -23.4 ms .. +2.4 ms): no significant difference" in line
    assert "hit rate +0.150 (95% CI +0.080 .. +0.210): better" in line
    # Medians and p90 are reported as figures, the worse p90 included, never as a ratio headline.
    assert "TTFT median 114 -> 91 ms, p90 300 -> 320 ms" in line
    assert "x)" not in line


def test_headline_with_the_interval_below_zero_says_better() -> None:
    line = gain_line(_report([-0.020, -0.004], None))
    assert "mean TTFT -10.5 ms (95% CI -20.0 ms .. -4.0 ms): better" in line
    assert "hit rate" not in line


def test_headline_without_an_interval_draws_no_conclusion() -> None:
    line = gain_line(_report(None, None))
    assert line == (
        "tier_cost vs control: too few conversations for an interval; no conclusion (run more conversations)"
    )
    assert gain_line({"arms": [{"name": "control"}]}) == ""
