"""q50's figures from a ``bench_quality_live`` run: K0 (the order without escalation) against K (with
it) and against REF, repeat by repeat, through q40's script (its table and per-run lines, which
include the escalated turns).

    python docs/results/q50/ratios.py OUT/quality.json"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
}
PAIRS = (("K", "K0"), ("REF", "K0"), ("REF", "K"))

if __name__ == "__main__":
    Q40.report(sys.argv[1], NAMES, PAIRS)
