"""q40's verdict from a ``bench_quality_live`` run: Q against REF and K, and K against REF, repeat by
repeat (the k-th run of a target is its k-th repeat: the bench interleaves the repeats).

    python docs/results/q40/ratios.py OUT/quality.json"""

from __future__ import annotations

import sys

from loadtest.bench_quality_live import round_report

NAMES = {
    "REF": "kvroute:kv_fixed_credit#ref",
    "K": "kvroute:kv_fixed_credit#k@priority",
    "Q": "kvroute:tier_cost#q@priority",
}
PAIRS = (("REF", "Q"), ("K", "Q"), ("REF", "K"))

if __name__ == "__main__":
    round_report(sys.argv[1], NAMES, PAIRS)
