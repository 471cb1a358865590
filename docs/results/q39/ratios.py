"""q39's verdict from a ``bench_quality_live`` run: Q0 and QP against K0, and QP against Q0, repeat by
repeat (the k-th run of a target is its k-th repeat: the bench interleaves the repeats).

    python docs/results/q39/ratios.py OUT/quality.json"""

from __future__ import annotations

import sys

from loadtest.bench_quality_live import pair_table, runs_by_target

NAMES = {
    "K0": "kvroute:kv_fixed_credit#k0@priority",
    "Q0": "kvroute:tier_cost#n@priority",
    "QP": "kvroute:tier_cost#qp@priority",
}
PAIRS = (("K0", "Q0"), ("K0", "QP"), ("Q0", "QP"))


def main() -> None:
    runs = runs_by_target(sys.argv[1])
    pair_table(runs, NAMES, PAIRS)
    print()
    print("Per run: cached share / imbalance")
    for name, target in NAMES.items():
        rs = runs.get(target, [])
        cells = ", ".join(
            f"{sum((r['cached'] or {}).values()) / r['prompt_tokens']:.3f} / {r['imbalance']:.2f}" for r in rs
        )
        print(f"- {name}: {cells}")


if __name__ == "__main__":
    main()
