"""q32's cost rule: per seed, Q's p50 at a storage_spread S against Q's p50 with the calibration off.

    python docs/results/q32/sign_test.py OFF.jsonl S.jsonl [POLICY@SCHEDULING]

Prints each seed's two p50s (and p99s) and how many seeds are worse at S; the protocol calls S
costly in the cell at 7 or more of 8 (one-sided sign test, p = 0.035)."""

from __future__ import annotations

import sys
from math import comb
from pathlib import Path
from typing import Any

from loadtest.frontier import load

Q = "tier_cost:pressure_s_at_full=1@priority:20:inf+escalate:40:route"


def runs(path: str, point: str) -> dict[int, dict[str, Any]]:
    """``point``'s runs in ``path`` by seed (read as ``loadtest.frontier`` reads them)."""
    policy, scheduling = point.split("@", 1)
    return {
        r["seed"]: r for r in load([Path(path)]) if r["policy"] == policy and r["scheduling"] == scheduling
    }


def main() -> None:
    off_path, s_path = sys.argv[1], sys.argv[2]
    point = sys.argv[3] if len(sys.argv) > 3 else Q
    off, at = runs(off_path, point), runs(s_path, point)
    seeds = sorted(set(off) & set(at))
    worse = 0
    for seed in seeds:
        a, b = off[seed], at[seed]
        worse += b["ttft_p50_s"] > a["ttft_p50_s"]
        print(
            f"seed {seed}: p50 {a['ttft_p50_s']:.3f} -> {b['ttft_p50_s']:.3f}"
            f" ({b['ttft_p50_s'] / a['ttft_p50_s']:.3f}x), p99 {a['ttft_p99_s']:.2f} -> {b['ttft_p99_s']:.2f}"
        )
    n = len(seeds)
    p = sum(comb(n, k) for k in range(worse, n + 1)) / 2**n
    print(f"worse at S in {worse} of {n} seeds (one-sided sign test p = {p:.3f})")


if __name__ == "__main__":
    main()
