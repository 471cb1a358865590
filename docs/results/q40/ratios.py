"""q40's verdict from a ``bench_quality_live`` run: Q against REF and K, and K against REF, repeat by
repeat (the k-th run of a target is its k-th repeat: the bench interleaves the repeats).

    python docs/results/q40/ratios.py OUT/quality.json"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from loadtest.bench_quality_live import runs_by_target

#: q39's script: its pair table (the same figures, other targets).
_SPEC = importlib.util.spec_from_file_location(
    "q39_ratios", Path(__file__).resolve().parents[1] / "q39" / "ratios.py"
)
assert _SPEC is not None and _SPEC.loader is not None
Q39 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(Q39)

NAMES = {
    "REF": "kvroute:kv_fixed_credit#ref",
    "K": "kvroute:kv_fixed_credit#k@priority",
    "Q": "kvroute:tier_cost#q@priority",
}
PAIRS = (("REF", "Q"), ("K", "Q"), ("REF", "K"))


def report(path: str, names: dict[str, str], pairs: tuple[tuple[str, str], ...]) -> None:
    """The pair table of ``pairs`` and each target's runs, from a run's quality.json (q50 calls it
    with its own targets)."""
    runs = runs_by_target(path)
    Q39.pair_table(runs, names, pairs)
    print()
    print("Per run: cached share of the prompt (GPU + CPU + STORAGE) / imbalance / escalated turns")
    for name, target in names.items():
        cells = []
        for r in runs.get(target, []):
            c = r["cached"] or {}
            share = {t: c.get(t, 0.0) / r["prompt_tokens"] for t in ("GPU", "CPU", "STORAGE")}
            cells.append(
                f"{sum(share.values()):.2f} ({share['GPU']:.2f}+{share['CPU']:.2f}+{share['STORAGE']:.2f})"
                f" / {r['imbalance']:.2f} / {r['escalations']}"
            )
        print(f"- {name}: {', '.join(cells)}")


def main() -> None:
    report(sys.argv[1], NAMES, PAIRS)


if __name__ == "__main__":
    main()
