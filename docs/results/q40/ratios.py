"""q40's verdict from a ``bench_quality_live`` run: Q against REF and K, and K against REF, repeat by
repeat (the k-th run of a target is its k-th repeat: the bench interleaves the repeats).

    python docs/results/q40/ratios.py OUT/quality.json"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

NAMES = {
    "REF": "kvroute:kv_fixed_credit#ref",
    "K": "kvroute:kv_fixed_credit#k@priority",
    "Q": "kvroute:tier_cost#q@priority",
}
PAIRS = (("REF", "Q"), ("K", "Q"), ("REF", "K"))


def main() -> None:
    runs: dict[str, list[dict[str, Any]]] = {}
    for run in json.loads(open(sys.argv[1]).read())["runs"]:
        if not run["error"]:
            runs.setdefault(run["target"], []).append(run)
    print("| pair | p50 speed-up (base / other), per repeat | median | p99 ratio (other / base) | median |")
    print("|---|---|---|---|---|")
    for base, other in PAIRS:
        a, b = runs[NAMES[base]], runs[NAMES[other]]
        up = [x["ttft_p50_s"] / y["ttft_p50_s"] for x, y in zip(a, b, strict=True)]
        tail = [y["ttft_p99_s"] / x["ttft_p99_s"] for x, y in zip(a, b, strict=True)]
        print(
            f"| {other} vs {base} | {', '.join(f'{v:.2f}' for v in up)} | {statistics.median(up):.2f} "
            f"| {', '.join(f'{v:.2f}' for v in tail)} | {statistics.median(tail):.2f} |"
        )
    print()
    print("Per run: cached share of the prompt (GPU + CPU + STORAGE) / imbalance / escalated turns")
    for name, target in NAMES.items():
        cells = []
        for r in runs.get(target, []):
            c = r["cached"] or {}
            share = {t: c.get(t, 0.0) / r["prompt_tokens"] for t in ("GPU", "CPU", "STORAGE")}
            cells.append(
                f"{sum(share.values()):.2f} ({share['GPU']:.2f}+{share['CPU']:.2f}+{share['STORAGE']:.2f})"
                f" / {r['imbalance']:.2f} / {r['escalations']}"
            )
        print(f"- {name}: {', '.join(cells)}")


if __name__ == "__main__":
    main()
