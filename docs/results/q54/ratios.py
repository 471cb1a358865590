"""q54's verdict from bench_quality's JSON lines (docs/results/q54.md): per cell, each tier_cost
configuration against REF (kv_fixed_credit@fcfs) and K (kv_fixed_credit with the order at E = 20),
and each +readq configuration against the same one without it; medians over the seeds and the
worst seed. The corner (issue 27): p50 >= 1.2x REF's and >= 1.1x K's, p99 and max <= REF's.

    python docs/results/q54/ratios.py OUT/1-2.jsonl OUT/1-4.jsonl"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict

REF = "kv_fixed_credit@fcfs"
K = "kv_fixed_credit@priority:20:inf+escalate:20:route"
READQ = "+readq"


def load(path: str) -> tuple[str, dict[str, dict[int, tuple[float, float, float]]]]:
    """(the cell's storage, per policy@scheduling: per seed (p50, p99, max))."""
    runs: dict[str, dict[int, tuple[float, float, float]]] = defaultdict(dict)
    storage = ""
    with open(path) as fh:
        for line in fh:
            row = json.loads(line)
            storage = row["storage"]
            key = f"{row['policy']}@{row['scheduling']}"
            runs[key][row["seed"]] = (row["ttft_p50_s"], row["ttft_p99_s"], row["ttft_max_s"])
    return storage, runs


def medians(by_seed: dict[int, tuple[float, float, float]]) -> tuple[float, float, float]:
    return (
        statistics.median(v[0] for v in by_seed.values()),
        statistics.median(v[1] for v in by_seed.values()),
        statistics.median(v[2] for v in by_seed.values()),
    )


def compare(
    runs: dict[str, dict[int, tuple[float, float, float]]], base: str, key: str
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """((p50 gain, p99 ratio, max ratio) of the medians, the worst seed's: lowest gain, highest
    ratios) of ``key`` against ``base``."""
    b, q = medians(runs[base]), medians(runs[key])
    seeds = sorted(set(runs[base]) & set(runs[key]))
    per_seed = [
        (
            runs[base][s][0] / runs[key][s][0],
            runs[key][s][1] / runs[base][s][1],
            runs[key][s][2] / runs[base][s][2],
        )
        for s in seeds
    ]
    worst = (min(g for g, _, _ in per_seed), max(p for _, p, _ in per_seed), max(m for _, _, m in per_seed))
    return (b[0] / q[0], q[1] / b[1], q[2] / b[2]), worst


def report(path: str) -> list[str]:
    storage, runs = load(path)
    n = len(runs[REF])
    out = [
        f"### storage {storage} ({n} seeds): REF medians p50 {medians(runs[REF])[0]:.3f} / p99"
        f" {medians(runs[REF])[1]:.2f} / max {medians(runs[REF])[2]:.1f} s",
        "",
        "| configuration | p50 / p99 / max s (medians) | p50 vs REF | vs K | p99 / REF | max / REF | corner"
        " | worst seed: gain REF, p99, max | without +readq: p50 gain, p99, max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in runs:
        if key == REF:
            continue
        m = medians(runs[key])
        (gain, p99, mx), (wg, wp, wm) = compare(runs, REF, key)
        vs_k = compare(runs, K, key)[0][0] if key != K else 1.0
        corner = "met" if gain >= 1.2 and vs_k >= 1.1 and p99 <= 1 and mx <= 1 else "missed"
        if key == K:
            corner = "-"
        off = re.sub(r"\+readq(:\w+)?", "", key)
        against = "-"
        if READQ in key and off in runs:
            (g, p, x), _ = compare(runs, off, key)
            against = f"{g:.2f}x, {p:.2f}, {x:.2f}"
        out.append(
            f"| {key} | {m[0]:.3f} / {m[1]:.2f} / {m[2]:.1f} | {gain:.2f}x | {vs_k:.2f}x | {p99:.2f}"
            f" | {mx:.2f} | {corner} | {wg:.2f}x, {wp:.2f}, {wm:.2f} | {against} |"
        )
    return out


if __name__ == "__main__":
    lines: list[str] = []
    for path in sys.argv[1:]:
        lines += report(path) + [""]
    print("\n".join(lines))
