"""q37's verdict from a ``bench_quality_live`` run: K0 and K against REF, repeat by repeat (the k-th
run of a target is its k-th repeat: the bench interleaves the repeats), for the client's TTFT p99
and the engines' own phases (``Run.phases``: engine TTFT, queue, prefill p99).

    python docs/results/q37/ratios.py OUT/quality.json"""

from __future__ import annotations

import statistics
import sys

from loadtest.bench_quality_live import runs_by_target

NAMES = {
    "REF": "kvroute:kv_fixed_credit",
    "K0": "kvroute:kv_fixed_credit#k0@priority",
    "K": "kvroute:kv_fixed_credit#e48m@priority",
}
FIGURES = {
    "client TTFT p99": lambda r: r["ttft_p99_s"],
    "engine TTFT p99": lambda r: r["phases"]["engine_ttft"][1],
    "queue p99": lambda r: r["phases"]["queue"][1],
    "prefill p99": lambda r: r["phases"]["prefill"][1],
    "client TTFT p50": lambda r: r["ttft_p50_s"],
    "engine TTFT p50": lambda r: r["phases"]["engine_ttft"][0],
}


def main() -> None:
    runs = runs_by_target(sys.argv[1])
    ref = runs[NAMES["REF"]]
    print("| figure | vs REF | per repeat | median |")
    print("|---|---|---|---|")
    for label, get in FIGURES.items():
        for name in ("K0", "K"):
            ratios = [get(a) / get(b) for a, b in zip(runs[NAMES[name]], ref, strict=True)]
            each = ", ".join(f"{x:.2f}" for x in ratios)
            print(f"| {label} | {name} | {each} | {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
