"""How often the CPU tier's promotion churn serves a CPU-resident block from STORAGE (issue 27).

The hypothesis of stop 58: vLLM serves a prefix that continues from a full CPU tier into STORAGE
wholly from STORAGE (a promotion evicts the request's own older CPU hits, which are promoted again
and count as STORAGE), while the router prices the CPU part at CPU cost. This counts, in one DES
run of a q44 cell, every request that reached the offload tiers: the blocks resident in the CPU
tier and in STORAGE at its first lookup (what the router's index saw, near enough), and the tier
each was served from at its last lookup (the one that admitted it). A block resident in the CPU
tier at the first lookup but served from STORAGE is one the router priced too cheaply.

Reads only: ``EngineCore._offload_lookup`` is wrapped, the run is the same.

    python docs/results/q44/churn.py --storage 1/2 --seeds 29221 \
        --policies "tier_cost:pressure_s_at_full=1@priority:20:inf+escalate:10:route"
"""

from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest import bench_quality
from sim import engine as sim_engine

#: Per request (the request object kept alive, so ids are not reused): [CPU and STORAGE blocks
#: resident at its first lookup, blocks served from CPU and from STORAGE at its last lookup].
_SEEN: dict[int, tuple[Any, list[int]]] = {}


def _wrap(original: Any) -> Any:
    def lookup(self: Any, req: Any, hashes: list[int], start: int, end: int, events: list[Any]) -> list[int]:
        entry = _SEEN.get(id(req))
        if entry is None:
            cpu = sto = 0
            for b in range(start, end):
                if self.cpu is not None and hashes[b] in self.cpu:
                    cpu += 1
                elif self.storage is not None and hashes[b] in self.storage:
                    sto += 1
                else:
                    break
            entry = _SEEN[id(req)] = (req, [cpu, sto, 0, 0])
        tiers = original(self, req, hashes, start, end, events)
        counts = entry[1]
        counts[2] = tiers.count(sim_engine._CPU)
        counts[3] = tiers.count(sim_engine._STORAGE)
        return tiers

    return lookup


def main(argv: list[str]) -> int:
    sim_engine.EngineCore._offload_lookup = _wrap(sim_engine.EngineCore._offload_lookup)  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="kvroute-churn-") as tmp:
        out = Path(tmp) / "run.md"
        args = ["--block-size", "128", "--conversations", "1", "--concurrency", "128", "--jobs", "1"]
        bench_quality.main([*args, *argv, "--out", str(out)])
    c: collections.Counter[str] = collections.Counter()
    for _req, (cpu, sto, served_cpu, served_sto) in _SEEN.values():
        c["requests"] += 1
        c["resident CPU blocks"] += cpu
        c["resident STORAGE blocks"] += sto
        c["served from CPU"] += served_cpu
        c["served from STORAGE"] += served_sto
        c["requests mixed CPU then STORAGE"] += bool(cpu and sto)
        if served_cpu < cpu:
            c["requests with CPU blocks served from STORAGE"] += 1
            c["CPU blocks served from STORAGE"] += cpu - served_cpu
            c["  of them in mixed requests"] += bool(cpu and sto)
    print("| count | value |\n|---|---|")
    for name, value in c.items():
        print(f"| {name} | {value:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
