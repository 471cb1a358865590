"""kvcore.stats' histogram percentile (the engines' Prometheus histograms read as percentiles)."""

from __future__ import annotations

import math
import random

import pytest

from kvcore.stats import histogram_percentile, percentile


def test_a_percentile_interpolates_within_its_bucket_as_promql_does() -> None:
    # 2 at or below 0.5 s, 6 at or below 1 s, 10 in all: the 5th of 10 lies 3/4 of the way
    # through (0.5, 1]; the 9th lies in +Inf, read as the highest finite bound.
    buckets = [(0.5, 2.0), (1.0, 6.0), (math.inf, 10.0)]
    assert histogram_percentile(buckets, 50) == pytest.approx(0.875)
    assert histogram_percentile(buckets, 10) == pytest.approx(0.25)  # from 0 below the first bound
    assert histogram_percentile(buckets, 90) == 1.0
    assert histogram_percentile(list(reversed(buckets)), 50) == pytest.approx(0.875)  # any order


def test_it_matches_the_exact_percentile_of_values_spread_evenly_in_buckets() -> None:
    # Catches an off-by-one bucket or an interpolation from the wrong end.
    rng = random.Random(7)
    bounds = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0]
    values = [rng.uniform(0, 5.0) for _ in range(20_000)]
    buckets = [(b, float(sum(v <= b for v in values))) for b in bounds] + [(math.inf, float(len(values)))]
    for q in (50, 90, 99):
        assert histogram_percentile(buckets, q) == pytest.approx(percentile(values, q), rel=0.02)


def test_an_empty_or_malformed_histogram() -> None:
    assert math.isnan(histogram_percentile([], 50))
    assert math.isnan(histogram_percentile([(1.0, 0.0), (math.inf, 0.0)], 50))
    with pytest.raises(ValueError, match="end with the \\+Inf bucket"):
        histogram_percentile([(1.0, 3.0), (2.0, 5.0)], 50)
