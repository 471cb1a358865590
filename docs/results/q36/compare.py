"""q36's tables (docs/results/q36.md): the DES runs of run.sh against q35d's live runs.

    python docs/results/q36/compare.py OUT

Live: q35d's runs, repeat by repeat, read from the "Every run" table of
docs/results/q35/q35d-quality.md (the k-th row of a target is its k-th repeat). DES: OUT/<model>-
<engines>-<seed>/results.json as run.sh writes them."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIVE_TABLE = HERE.parent / "q35" / "q35d-quality.md"
LIVE_NAMES = {
    "kvroute:kv_fixed_credit": "REF",
    "kvroute:kv_fixed_credit#e48m@priority": "K",
    "kvroute:tier_cost#q48m@priority": "Q",
    "kvroute:tier_cost#n@priority": "Q0",
}
#: (engines, policy) of run.sh -> the name in q35's terms; K0 is K without escalation (DES only).
DES_NAMES = {
    ("fcfs", "kv_fixed_credit"): "REF",
    ("order", "kv_fixed_credit"): "K0",
    ("order", "tier_cost:pressure_s_at_full=1"): "Q0",
    ("escalate", "kv_fixed_credit"): "K",
    ("escalate", "tier_cost:pressure_s_at_full=1"): "Q",
}
Row = dict[str, float]
#: The ratios: name -> (numerator's name, figure, denominator's name, figure). > 1 on a p50
#: speed-up means the second is faster; on a p99 ratio it means the first's tail is longer.
RATIOS: dict[str, tuple[str, str, str, str]] = {
    "REF p50 / Q0 p50": ("REF", "p50", "Q0", "p50"),
    "Q0 p99 / REF p99": ("Q0", "p99", "REF", "p99"),
    "REF p50 / K p50": ("REF", "p50", "K", "p50"),
    "K p99 / REF p99": ("K", "p99", "REF", "p99"),
    "REF p50 / Q p50": ("REF", "p50", "Q", "p50"),
    "K p50 / Q p50": ("K", "p50", "Q", "p50"),
    "Q p99 / REF p99": ("Q", "p99", "REF", "p99"),
    "K0 p50 / Q0 p50": ("K0", "p50", "Q0", "p50"),
}


def live_runs(table: Path = LIVE_TABLE, names: dict[str, str] = LIVE_NAMES) -> list[dict[str, Row]]:
    """One dict per repeat: name -> p50, p99, turns/s, cached share (a bench_quality_live table's
    "Every run" rows; ``names``: target -> name)."""
    repeats: list[dict[str, Row]] = []
    seen: dict[str, int] = {}
    rows = table.read_text().split("Every run:", 1)[1].splitlines()
    for line in rows:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 16 or cells[2] not in names:
            continue
        name = names[cells[2]]
        k = seen[name] = seen.get(name, -1) + 1
        while len(repeats) <= k:
            repeats.append({})
        repeats[k][name] = {
            "p50": float(cells[3]),
            "p99": float(cells[5]),
            "turns_s": float(cells[6]),
            "cached": float(cells[10]),
        }
    return repeats


def des_runs(out: Path, model: str, names: dict[tuple[str, str], str] = DES_NAMES) -> list[dict[str, Row]]:
    """One dict per seed: name -> p50, p99, turns/s, cached share (hit rate), escalations (runs in
    OUT/<model>-<engines>-<seed>/; ``names``: (engines, policy) -> name)."""
    seeds: dict[str, dict[str, Row]] = {}
    for path in sorted(out.glob(f"{model}-*-*/results.json")):
        engines, seed = path.parent.name.split("-")[1:3]
        for r in json.loads(path.read_text()):
            name = names[(engines, r["policy"])]
            seeds.setdefault(seed, {})[name] = {
                "p50": r["ttft_p50_s"],
                "p99": r["ttft_p99_s"],
                "turns_s": r["turns_per_s"],
                "cached": r["hit"],
                "escalations": r["escalations"],
            }
    return [seeds[s] for s in sorted(seeds)]


def figure(runs: list[dict[str, Row]], name: str, fig: str) -> list[float]:
    return [r[name][fig] for r in runs if name in r]


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
    live = live_runs()
    models = {m: des_runs(out, m) for m in ("D1", "D2", "D3")}
    counts = ", ".join(f"{m} {len(v)}" for m, v in models.items())
    print(f"Seeds per model: {counts}; live repeats {len(live)}")
    print()
    print("Absolute figures: median [min-max] over the live repeats / the DES seeds")
    print()
    print("| name | figure | live | D1 | D2 | D3 |")
    print("|---|---|---|---|---|---|")
    figures: list[tuple[str, str]] = [("p50", ".3f"), ("p99", ".3f"), ("turns_s", ".1f"), ("cached", ".3f")]
    for name in ("REF", "K0", "K", "Q0", "Q"):
        for fig, fmt in figures:
            cells = [span(figure(runs, name, fig), fmt) for runs in (live, *models.values())]
            print(f"| {name} | {fig} | {' | '.join(cells)} |")
    print()
    print("Ratios: median [min-max] over the live repeats (paired by repeat) / the DES seeds (paired by")
    print("seed); 'in' = the DES median lies within the live repeats' range")
    print()
    print("| ratio | live | D1 | D2 | D3 |")
    print("|---|---|---|---|---|")
    for label, spec in RATIOS.items():
        lv = [x for x in (ratio(r, spec) for r in live) if x is not None]
        cells = [span(lv)]
        for runs in models.values():
            dv = [x for x in (ratio(r, spec) for r in runs) if x is not None]
            if not dv:
                cells.append("-")
                continue
            verdict = ""
            if lv:
                verdict = " in" if min(lv) <= statistics.median(dv) <= max(lv) else " out"
            cells.append(span(dv) + verdict)
        print(f"| {label} | {' | '.join(cells)} |")
    print()
    print("Escalations a run, K / Q (live q35d: 5-29 / 19-48):")
    for m, runs in models.items():
        k, q = (span(figure(runs, name, "escalations"), ".0f") for name in ("K", "Q"))
        print(f"- {m}: {k} / {q}")


if __name__ == "__main__":
    main()
