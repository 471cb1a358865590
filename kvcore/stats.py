"""The project's statistics: one percentile definition and the A/B confidence intervals.

Percentiles are numpy's default (linear interpolation between closest ranks, "type 7"); every
report (router A/B, DES, benchmarks) uses ``percentile`` from here so figures compare. Intervals
for A/B arms resample whole conversations (cluster bootstrap): turns of one conversation share
an arm and a cache history, so treating them as independent would make intervals too narrow.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


def percentile(values: Sequence[float], q: float, *, empty: float = math.nan) -> float:
    """The q-th percentile (q in [0, 100]) by linear interpolation; ``empty`` (nan unless a table
    wants 0.0) when ``values`` is empty."""
    if len(values) == 0:
        return empty
    return float(np.percentile(np.asarray(values, dtype=float), q))


def percentiles(values: Sequence[float], qs: Sequence[float], *, empty: float = math.nan) -> list[float]:
    """Several percentiles of the same values in one pass (``empty`` each when there are none)."""
    if len(values) == 0:
        return [empty for _ in qs]
    return [float(x) for x in np.percentile(np.asarray(values, dtype=float), list(qs))]


def histogram_percentile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of a Prometheus histogram's observations from its
    cumulative buckets ``(upper bound, count at or below it)``, ending with ``(inf, total)``, as
    PromQL's ``histogram_quantile`` estimates it: linearly within the bucket that holds the rank,
    from 0 below the first bound; a rank in the last (+Inf) bucket reads the highest finite bound.
    nan when no observation is counted."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    ordered = sorted(buckets)
    if not math.isinf(ordered[-1][0]):
        raise ValueError("a histogram's buckets end with the +Inf bucket (its total count)")
    rank = q / 100.0 * ordered[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in ordered:
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def median_span(values: Sequence[float], fmt: str = ".3f", *, single_bare: bool = True) -> str:
    """The median of repeats or seeds with their range, "median [min-max]", each formatted with
    ``fmt``; one value alone is printed bare unless ``single_bare`` is False."""
    if single_bare and len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


@dataclass(frozen=True, slots=True)
class ConversationTotals:
    """Per conversation (one cluster): sums over its finished turns.

    ``ttft_sum_s`` / ``ttft_count`` cover turns with a measured TTFT (streams); ``cached_tokens`` /
    ``prompt_tokens`` cover turns with engine-reported usage.
    """

    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    cached_tokens: float = 0.0
    prompt_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Interval:
    """A point estimate of (treatment - control) and its confidence interval."""

    diff: float
    low: float
    high: float
    confidence: float
    #: Conversations (clusters) on each side that entered the estimate.
    clusters_control: int
    clusters_treatment: int
    method: str = "cluster_bootstrap_percentile"


def mean_ttft(rows: np.ndarray) -> float:
    """Mean TTFT over turns (ratio of sums) of a (n, 4) array of ConversationTotals rows."""
    count = rows[:, 1].sum()
    return float(rows[:, 0].sum() / count) if count > 0 else math.nan


def hit_rate(rows: np.ndarray) -> float:
    """Engine-reported cached tokens / prompt tokens (ratio of sums) of ConversationTotals rows."""
    prompt = rows[:, 3].sum()
    return float(rows[:, 2].sum() / prompt) if prompt > 0 else math.nan


def _as_rows(convs: Sequence[ConversationTotals]) -> np.ndarray:
    return np.array(
        [(c.ttft_sum_s, c.ttft_count, c.cached_tokens, c.prompt_tokens) for c in convs], dtype=float
    ).reshape(-1, 4)


def _resampled_sums(rows: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(resamples, 4): column sums of ``rows`` resampled with replacement, as multinomial counts
    times rows in chunks (memory stays O(chunk x conversations))."""
    n = len(rows)
    out = np.empty((resamples, rows.shape[1]))
    chunk = max(1, min(resamples, 2_000_000 // max(n, 1)))
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        counts = rng.multinomial(n, np.full(n, 1.0 / n), size=size)
        out[start : start + size] = counts @ rows
    return out


def cluster_bootstrap_diff(
    control: Sequence[ConversationTotals],
    treatment: Sequence[ConversationTotals],
    statistic: Callable[[np.ndarray], float],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Interval | None:
    """CI of statistic(treatment) - statistic(control), resampling conversations with replacement
    on each side independently (percentile method). None with fewer than 2 conversations on a side
    or an undefined statistic. Vectorised (multinomial counts x per-conversation sums)."""
    a, b = _as_rows(control), _as_rows(treatment)
    if len(a) < 2 or len(b) < 2:
        return None
    diff = statistic(b) - statistic(a)
    if not math.isfinite(diff):
        return None
    rng = np.random.default_rng(seed)
    sa, sb = _resampled_sums(a, resamples, rng), _resampled_sums(b, resamples, rng)
    diffs = np.array([statistic(sb[r : r + 1]) - statistic(sa[r : r + 1]) for r in range(resamples)])
    diffs = diffs[np.isfinite(diffs)]
    if len(diffs) == 0:
        return None
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(diffs, [tail, 100 - tail])
    return Interval(float(diff), float(low), float(high), confidence, len(a), len(b))
