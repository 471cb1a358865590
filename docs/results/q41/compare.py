"""q41's tables (docs/results/q41.md): the DES runs of run.sh against q40's live runs.

    python docs/results/q41/compare.py OUT

Live: q40's runs, repeat by repeat, from the "Every run" tables of docs/results/q40/{none,pool}-
quality.md (the k-th row of a target is its k-th repeat). DES: OUT/<cell>-<engines>-<seed>/
results.json as run.sh writes them."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: q36's script: its readers of the live table and the DES runs, and its ratio and span.
_SPEC = importlib.util.spec_from_file_location("q36_compare", HERE.parent / "q36" / "compare.py")
assert _SPEC is not None and _SPEC.loader is not None
Q36 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(Q36)
CELLS = ("none", "pool")
_SPEC40 = importlib.util.spec_from_file_location("q40_ratios", HERE.parent / "q40" / "ratios.py")
assert _SPEC40 is not None and _SPEC40.loader is not None
Q40 = importlib.util.module_from_spec(_SPEC40)
_SPEC40.loader.exec_module(Q40)
#: q40's targets (its ratios.py names them): target -> name.
LIVE_NAMES = {target: name for name, target in Q40.NAMES.items()}
DES_NAMES = {
    ("fcfs", "kv_fixed_credit"): "REF",
    ("order", "kv_fixed_credit"): "K",
    ("order", "tier_cost:pressure_s_at_full=1"): "Q",
}
#: name -> (numerator, figure, denominator, figure): a p50 speed-up > 1 = the second is faster.
RATIOS: dict[str, tuple[str, str, str, str]] = {
    "REF p50 / Q p50": ("REF", "p50", "Q", "p50"),
    "K p50 / Q p50": ("K", "p50", "Q", "p50"),
    "REF p50 / K p50": ("REF", "p50", "K", "p50"),
    "Q p99 / REF p99": ("Q", "p99", "REF", "p99"),
}


def live_runs(cell: str) -> list[dict[str, dict[str, float]]]:
    return Q36.live_runs(HERE.parent / "q40" / f"{cell}-quality.md", LIVE_NAMES)


def des_runs(out: Path, cell: str) -> list[dict[str, dict[str, float]]]:
    return Q36.des_runs(out, cell, DES_NAMES)


ratio, span = Q36.ratio, Q36.span


def main() -> None:
    out = Path(sys.argv[1])
    print("| cell | ratio | live q40 (per repeat) | DES (per seed) | DES median in the live range |")
    print("|---|---|---|---|---|")
    placement: dict[str, float] = {}
    for cell in CELLS:
        live, des = live_runs(cell), des_runs(out, cell)
        for label, spec in RATIOS.items():
            lv = [x for x in (ratio(r, spec) for r in live) if x is not None]
            dv = [x for x in (ratio(r, spec) for r in des) if x is not None]
            inside = bool(lv and dv) and min(lv) <= statistics.median(dv) <= max(lv)
            print(f"| {cell} | {label} | {span(lv)} | {span(dv)} | {'in' if inside else 'out'} |")
            if label == "K p50 / Q p50" and dv:
                placement[cell] = statistics.median(dv)
    print()
    print("Absolute figures, median [min-max]: live / DES")
    print()
    print("| cell | name | p50 s | p99 s | cached share |")
    print("|---|---|---|---|---|")
    for cell in CELLS:
        live, des = live_runs(cell), des_runs(out, cell)
        for name in ("REF", "K", "Q"):
            cells = [
                f"{span([r[name][f] for r in live if name in r], '.3f')} / "
                f"{span([r[name][f] for r in des if name in r], '.3f')}"
                for f in ("p50", "p99", "cached")
            ]
            print(f"| {cell} | {name} | {' | '.join(cells)} |")
    if len(placement) == 2:
        print()
        none, pool = placement["none"], placement["pool"]
        verdict = "pool above none, as live" if pool > none else "not as live"
        print(f"Placement ranking (K p50 / Q p50): DES none {none:.2f}, pool {pool:.2f} -> {verdict}")


if __name__ == "__main__":
    main()
