"""q50's figures from a ``bench_quality_live`` run: K0 (the order without escalation) against K (with
it) and against REF, repeat by repeat (the k-th run of a target is its k-th repeat).

    python docs/results/q50/ratios.py OUT/quality.json"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from loadtest.bench_quality_live import runs_by_target

#: q39's script: its pair table.
_SPEC = importlib.util.spec_from_file_location(
    "q39_ratios", Path(__file__).resolve().parents[1] / "q39" / "ratios.py"
)
assert _SPEC is not None and _SPEC.loader is not None
Q39 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(Q39)

NAMES = {
    "REF": "kvroute:kv_fixed_credit#ref",
    "K": "kvroute:kv_fixed_credit#k@priority",
    "K0": "kvroute:kv_fixed_credit#k0@priority",
}
PAIRS = (("K", "K0"), ("REF", "K0"), ("REF", "K"))


def main() -> None:
    runs = runs_by_target(sys.argv[1])
    Q39.pair_table(runs, NAMES, PAIRS)
    print()
    for name, target in NAMES.items():
        counts = ", ".join(str(r["escalations"]) for r in runs.get(target, []))
        print(f"- {name} escalated turns a run: {counts}")


if __name__ == "__main__":
    main()
