"""q35's verdict from a ``bench_quality_live`` run: per target the medians over repeats, and Q's
p50 against REF's and K's, of the medians and repeat by repeat (the k-th run of a target is its
k-th repeat: the bench interleaves the repeats).

    python docs/results/q35/ratios.py OUT/quality.json [E-SUFFIX]

E-SUFFIX is the suffix of the K and Q variant names: "" for q35, 75 for q35b, 48 for q35c, 48m
for q35d (docs/results/q35.md)."""

from __future__ import annotations

import statistics
import sys
from typing import Any

from loadtest.bench_quality_live import runs_by_target


def main() -> None:
    suffix = sys.argv[2] if len(sys.argv) > 2 else ""
    names = {
        "REF": "kvroute:kv_fixed_credit",
        "K": f"kvroute:kv_fixed_credit#e{suffix}@priority",
        "Q": f"kvroute:tier_cost#q{suffix}@priority",
        "Q0": "kvroute:tier_cost#n@priority",
    }
    runs = runs_by_target(sys.argv[1])
    med: dict[str, dict[str, float]] = {}
    print("| name | target | runs | p50 s | p90 s | p99 s | turns/s | escalated per run | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, target in names.items():
        rs = runs.get(target, [])
        if not rs:
            print(f"| {name} | `{target}` | 0 | - | - | - | - | - | - |")
            continue
        m = med[name] = {
            k: statistics.median(r[k] for r in rs)
            for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "turns_per_s", "escalations", "failures")
        }
        print(
            f"| {name} | `{target}` | {len(rs)} | {m['ttft_p50_s']:.3f} | {m['ttft_p90_s']:.3f} "
            f"| {m['ttft_p99_s']:.3f} | {m['turns_per_s']:.2f} | {m['escalations']:g} | {m['failures']:g} |"
        )
    print()
    for q in ("Q", "Q0"):
        if q not in med or "REF" not in med or "K" not in med:
            continue
        gain_ref = med["REF"]["ttft_p50_s"] / med[q]["ttft_p50_s"]
        gain_k = med["K"]["ttft_p50_s"] / med[q]["ttft_p50_s"]
        p99 = med[q]["ttft_p99_s"] / med["REF"]["ttft_p99_s"]
        met = gain_ref >= 1.2 and gain_k >= 1.1 and p99 <= 1.0
        per_ref = p50_ratios(runs[names["REF"]], runs[names[q]])
        per_k = p50_ratios(runs[names["K"]], runs[names[q]])
        print(
            f"{q}: p50 {gain_ref:.2f}x REF's (1.2x), {gain_k:.2f}x K's (1.1x), p99 {p99:.2f} of REF's:"
            f" {'met' if met else 'missed'}; per repeat vs REF {', '.join(f'{x:.2f}' for x in per_ref)};"
            f" vs K {', '.join(f'{x:.2f}' for x in per_k)}"
        )
    print()
    print(
        "Per run, repeat by repeat: TTFT p50 s / p90 s"
        " (imbalance: max / mean prompt tokens an engine; cached share)"
    )
    for name, target in names.items():
        cells = [
            f"{r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} ({r['imbalance']:.2f}; {cached_share(r):.3f})"
            for r in runs.get(target, [])
        ]
        print(f"- {name}: " + ", ".join(cells))


def p50_ratios(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[float]:
    """Repeat by repeat: ``base``'s TTFT p50 over ``other``'s (a gain of ``other``)."""
    return [a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in zip(base, other, strict=True)]


def cached_share(run: dict[str, Any]) -> float:
    """The engines' cached prompt tokens over the prompt tokens of the run's measured turns."""
    prompt = run["prompt_tokens"]
    return sum((run["cached"] or {}).values()) / prompt if prompt else float("nan")


if __name__ == "__main__":
    main()
