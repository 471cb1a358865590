"""q39's verdict from a ``bench_quality_live`` run: Q0 and QP against K0, and QP against Q0, repeat by
repeat (the k-th run of a target is its k-th repeat: the bench interleaves the repeats).

    python docs/results/q39/ratios.py OUT/quality.json"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from loadtest.bench_quality_live import runs_by_target

NAMES = {
    "K0": "kvroute:kv_fixed_credit#k0@priority",
    "Q0": "kvroute:tier_cost#n@priority",
    "QP": "kvroute:tier_cost#qp@priority",
}
PAIRS = (("K0", "Q0"), ("K0", "QP"), ("Q0", "QP"))


def pair_table(
    runs: dict[str, list[dict[str, Any]]], names: dict[str, str], pairs: tuple[tuple[str, str], ...]
) -> None:
    """Per pair (base, other): the p50 speed-ups and p99 ratios repeat by repeat, and their medians."""
    print("| pair | p50 speed-up (base / other), per repeat | median | p99 ratio (other / base) | median |")
    print("|---|---|---|---|---|")
    for base, other in pairs:
        a, b = runs[names[base]], runs[names[other]]
        up = [x["ttft_p50_s"] / y["ttft_p50_s"] for x, y in zip(a, b, strict=True)]
        tail = [y["ttft_p99_s"] / x["ttft_p99_s"] for x, y in zip(a, b, strict=True)]
        print(
            f"| {other} vs {base} | {', '.join(f'{v:.2f}' for v in up)} | {statistics.median(up):.2f} "
            f"| {', '.join(f'{v:.2f}' for v in tail)} | {statistics.median(tail):.2f} |"
        )


def main() -> None:
    runs = runs_by_target(sys.argv[1])
    pair_table(runs, NAMES, PAIRS)
    print()
    print("Per run: cached share / imbalance")
    for name, target in NAMES.items():
        rs = runs.get(target, [])
        cells = ", ".join(
            f"{sum((r['cached'] or {}).values()) / r['prompt_tokens']:.3f} / {r['imbalance']:.2f}" for r in rs
        )
        print(f"- {name}: {cells}")


if __name__ == "__main__":
    main()
