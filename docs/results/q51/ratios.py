"""q51's figures from a ``bench_quality_live`` run: Q, K and K0 against REF and each other, repeat by
repeat, through q40's script (its pair table and per-run lines), and the turns cut at each run's end.

    python docs/results/q51/ratios.py OUT/quality.json"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from loadtest.bench_quality_live import runs_by_target

_SPEC = importlib.util.spec_from_file_location(
    "q40_ratios", Path(__file__).resolve().parents[1] / "q40" / "ratios.py"
)
assert _SPEC is not None and _SPEC.loader is not None
Q40 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(Q40)

NAMES = {
    "REF": "kvroute:kv_fixed_credit#ref",
    "K": "kvroute:kv_fixed_credit#k@priority",
    "K0": "kvroute:kv_fixed_credit#k0@priority",
    "Q": "kvroute:tier_cost#q@priority",
}
PAIRS = (("REF", "Q"), ("K", "Q"), ("REF", "K"), ("REF", "K0"), ("K", "K0"))

if __name__ == "__main__":
    Q40.report(sys.argv[1], NAMES, PAIRS)
    runs = runs_by_target(sys.argv[1])
    print()
    print("Per run: measured turns (cut at the end), turns/s")
    for name, target in NAMES.items():
        cells = [f"{r['turns']} ({r['unfinished']}), {r['turns_per_s']:.2f}" for r in runs.get(target, [])]
        print(f"- {name}: {'; '.join(cells)}")
