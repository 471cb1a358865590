"""After q34's report (a diagnosis, not a result): per seed, Q's placement gain over K (K's p50 /
Q's p50) against the difference in hit rate, load imbalance, preemptions and escalations.

    python docs/results/q34/placement_vs_hit.py RUNS.jsonl [RUNS.jsonl ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from loadtest.frontier import load

ORDER = "priority:20:inf+escalate:40:route"
K, Q = "kv_fixed_credit", "tier_cost:pressure_s_at_full=1"


def main() -> None:
    for path in sys.argv[1:]:
        runs = {(r["policy"], r["scheduling"], r["seed"]): r for r in load([Path(path)])}
        pairs = [
            (runs[(K, ORDER, s)], runs[(Q, ORDER, s)])
            for s in sorted({key[2] for key in runs})
            if (K, ORDER, s) in runs and (Q, ORDER, s) in runs
        ]
        gain = np.array([k["ttft_p50_s"] / q["ttft_p50_s"] for k, q in pairs])
        print(f"{path}: {len(pairs)} seeds, per-seed placement gain median {np.median(gain):.3f}")
        for field in ("hit", "load_imbalance", "preemptions", "escalations"):
            kv = np.array([k.get(field, 0) for k, _ in pairs], dtype=float)
            qv = np.array([q.get(field, 0) for _, q in pairs], dtype=float)
            r = np.corrcoef(gain, qv - kv)[0, 1]
            medians = f"median K {np.median(kv):.3f}, Q {np.median(qv):.3f}"
            print(f"  {field}: {medians}; corr(gain, Q - K) {r:+.2f}")


if __name__ == "__main__":
    main()
