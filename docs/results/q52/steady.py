"""Round q52 (docs/results/q52.md): q48's report configurations in B1 128 none and 1/2, each run once
as issue 27's cell (128 conversations, all started together, run to their end) and once with three
times the conversations (128 at a time, each replaced as one ends), read over all turns and over
the middle third of the conversations only (those that start after the first wave and before the
last: the fleet under steady load, no synchronized start, no drain).

    python docs/results/q52/steady.py OUT [--seeds 29401,...] [--jobs 2]"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
from pathlib import Path
from typing import Any

from kvcore.stats import median_span, percentile
from loadtest.bench_quality import Cell, ladder_index, run_cell, steady_window

CONCURRENCY = 128
#: q48's choice of E per cell (docs/results/q48.md) and the report's three targets (q43/report.sh).
E = {"none": 10, "1/2": 20}
REFS = ("kv_fixed_credit@fcfs", "kv_fixed_credit:cpu=0.5:storage=0.1@fcfs")


def targets(storage: str) -> dict[str, str]:
    e = E[storage]
    return {
        "R1": REFS[0],
        "R2": REFS[1],
        "K": f"kv_fixed_credit@priority:20:inf+escalate:{e}:route",
        "Q": f"tier_cost:pressure_s_at_full=1@priority:20:inf+escalate:{e}:route",
    }


def one(job: tuple[str, str, str, int, int]) -> dict[str, Any]:
    storage, name, spec, seed, waves = job
    policy, _, scheduling = spec.partition("@")
    cell = Cell(
        f"b1 {CONCURRENCY}", storage, policy, seed, scheduling=scheduling, concurrency=CONCURRENCY,
        block_size=128, conversations=float(waves),
    )  # fmt: skip
    row = run_cell(cell)
    ttfts: dict[str, float] = row["ttft_by_request_s"]
    out = {"storage": storage, "target": name, "seed": seed, "waves": waves}
    windows = {"all": (0, waves * CONCURRENCY)}
    if waves >= 3:  # (bench_quality's "steady" reading since q53)
        windows["middle"] = steady_window(CONCURRENCY, waves * CONCURRENCY)
    for window, (lo, hi) in windows.items():
        xs = [t for rid, t in ttfts.items() if lo <= ladder_index(rid) < hi]
        out[window] = {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs), "turns": len(xs)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", default="29401,29402,29403,29404,29405")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [
        (storage, name, spec, seed, waves)
        for waves in (1, 3)
        for storage in E
        for name, spec in targets(storage).items()
        for seed in seeds
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        rows = pool.map(one, jobs, chunksize=1)
    (args.out / "runs.json").write_text(json.dumps(rows, indent=1))
    report(rows, seeds)


def report(rows: list[dict[str, Any]], seeds: list[int]) -> None:
    """Per cell and reading: REF = the better of R1 and R2 by p50 per seed; Q's p50 speed-up over REF
    and over K, K's over REF, Q's p99 and max over REF's: medians over the seeds [min-max]."""
    get = {(r["storage"], r["target"], r["seed"], r["waves"]): r for r in rows}
    heads = ("Q p50 vs REF", "Q p50 vs K", "K p50 vs REF", "Q p99 / REF", "Q max / REF", "REF p50 / p99 s")
    print(f"| cell | reading | {' | '.join(heads)} |")
    print("|---|---|---|---|---|---|---|---|")
    for storage in E:
        for waves, window in ((1, "all"), (3, "all"), (3, "middle")):
            r: dict[str, list[float]] = {k: [] for k in ("qr", "qk", "kr", "p99", "max", "rp50", "rp99")}
            for seed in seeds:
                fig = {t: get[(storage, t, seed, waves)][window] for t in ("R1", "R2", "K", "Q")}
                ref = min(fig["R1"], fig["R2"], key=lambda f: f["p50"])
                r["qr"].append(ref["p50"] / fig["Q"]["p50"])
                r["qk"].append(fig["K"]["p50"] / fig["Q"]["p50"])
                r["kr"].append(ref["p50"] / fig["K"]["p50"])
                r["p99"].append(fig["Q"]["p99"] / ref["p99"])
                r["max"].append(fig["Q"]["max"] / ref["max"])
                r["rp50"].append(ref["p50"])
                r["rp99"].append(ref["p99"])
            label = "128 conversations, all turns" if waves == 1 else f"384 conversations, {window}"
            spans = " | ".join(median_span(r[k], ".2f") for k in ("qr", "qk", "kr", "p99", "max"))
            ref_s = f"{statistics.median(r['rp50']):.2f} / {statistics.median(r['rp99']):.2f}"
            print(f"| {storage} | {label} | {spans} | {ref_s} |")


if __name__ == "__main__":
    main()
