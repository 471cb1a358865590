"""q51's figures from a ``bench_quality_live`` run: Q, K and K0 against REF and each other, repeat by
repeat (q40's report: its pair table and per-run lines), and the turns cut at each run's end.

    python docs/results/q51/ratios.py OUT/quality.json"""

from __future__ import annotations

import sys

from loadtest.bench_quality_live import round_report, runs_by_target

NAMES = {
    "REF": "kvroute:kv_fixed_credit#ref",
    "K": "kvroute:kv_fixed_credit#k@priority",
    "K0": "kvroute:kv_fixed_credit#k0@priority",
    "Q": "kvroute:tier_cost#q@priority",
}
PAIRS = (("REF", "Q"), ("K", "Q"), ("REF", "K"), ("REF", "K0"), ("K", "K0"))

if __name__ == "__main__":
    round_report(sys.argv[1], NAMES, PAIRS)
    runs = runs_by_target(sys.argv[1])
    print()
    print("Per run: measured turns (cut at the end), turns/s")
    for name, target in NAMES.items():
        cells = [f"{r['turns']} ({r['unfinished']}), {r['turns_per_s']:.2f}" for r in runs.get(target, [])]
        print(f"- {name}: {'; '.join(cells)}")
