"""q32's cost rule: per seed, Q's p50 at a storage_spread S against Q's p50 with the calibration off.

    python docs/results/q32/sign_test.py OFF.jsonl S.jsonl [POLICY@SCHEDULING]

Prints each seed's two p50s (and p99s) and how many seeds are worse at S; the protocol calls S
costly in the cell at 7 or more of 8 (one-sided sign test, p = 0.035)."""

from __future__ import annotations

import json
import sys
from math import comb

Q = "tier_cost:pressure_s_at_full=1@priority:20:inf+escalate:40:route"


def runs(path: str, point: str) -> dict[int, dict[str, float]]:
    policy, scheduling = point.split("@", 1)
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r["policy"] == policy and r["scheduling"] == scheduling:
                out[r["seed"]] = r
    return out


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
