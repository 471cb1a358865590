"""q50's figures from a ``bench_quality_live`` run: K0 (the order without escalation) against K (with
it) and against REF, repeat by repeat (q40's report: its table and per-run lines, which include the
escalated turns).

    python docs/results/q50/ratios.py OUT/quality.json"""

from __future__ import annotations

import sys

from loadtest.bench_quality_live import round_report

NAMES = {
    "REF": "kvroute:kv_fixed_credit#ref",
    "K": "kvroute:kv_fixed_credit#k@priority",
    "K0": "kvroute:kv_fixed_credit#k0@priority",
}
PAIRS = (("K", "K0"), ("REF", "K0"), ("REF", "K"))

if __name__ == "__main__":
    round_report(sys.argv[1], NAMES, PAIRS)
