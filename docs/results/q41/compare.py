"""q41's tables (docs/results/q41.md): the DES runs of run.sh against q40's live runs.

    python docs/results/q41/compare.py OUT

Live: q40's runs, repeat by repeat, from the "Every run" tables of docs/results/q40/{none,pool}-
quality.md (the k-th row of a target is its k-th repeat). DES: OUT/<cell>-<engines>-<seed>/
results.json as run.sh writes them."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CELLS = ("none", "pool")
LIVE_NAMES = {
    "kvroute:kv_fixed_credit#ref": "REF",
    "kvroute:kv_fixed_credit#k@priority": "K",
    "kvroute:tier_cost#q@priority": "Q",
}
DES_NAMES = {
    ("fcfs", "kv_fixed_credit"): "REF",
    ("order", "kv_fixed_credit"): "K",
    ("order", "tier_cost:pressure_s_at_full=1"): "Q",
}
Row = dict[str, float]
#: name -> (numerator, figure, denominator, figure): a p50 speed-up > 1 = the second is faster.
RATIOS: dict[str, tuple[str, str, str, str]] = {
    "REF p50 / Q p50": ("REF", "p50", "Q", "p50"),
    "K p50 / Q p50": ("K", "p50", "Q", "p50"),
    "REF p50 / K p50": ("REF", "p50", "K", "p50"),
    "Q p99 / REF p99": ("Q", "p99", "REF", "p99"),
}


def live_runs(cell: str) -> list[dict[str, Row]]:
    repeats: list[dict[str, Row]] = []
    seen: dict[str, int] = {}
    table = (HERE.parent / "q40" / f"{cell}-quality.md").read_text()
    for line in table.split("Every run:", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 16 or cells[2] not in LIVE_NAMES:
            continue
        name = LIVE_NAMES[cells[2]]
        k = seen[name] = seen.get(name, -1) + 1
        while len(repeats) <= k:
            repeats.append({})
        repeats[k][name] = {"p50": float(cells[3]), "p99": float(cells[5]), "cached": float(cells[10])}
    return repeats


def des_runs(out: Path, cell: str) -> list[dict[str, Row]]:
    seeds: dict[str, dict[str, Row]] = {}
    for path in sorted(out.glob(f"{cell}-*-*/results.json")):
        engines, seed = path.parent.name.split("-")[1:3]
        for r in json.loads(path.read_text()):
            seeds.setdefault(seed, {})[DES_NAMES[(engines, r["policy"])]] = {
                "p50": r["ttft_p50_s"],
                "p99": r["ttft_p99_s"],
                "cached": r["hit"],
            }
    return [seeds[s] for s in sorted(seeds)]


def ratio(run: dict[str, Row], spec: tuple[str, str, str, str]) -> float | None:
    a, fa, b, fb = spec
    if a not in run or b not in run or run[b][fb] <= 0:
        return None
    return run[a][fa] / run[b][fb]


def span(values: list[float], fmt: str = ".2f") -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


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
