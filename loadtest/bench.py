"""`kvroute bench` / `make bench`: run the project's benchmarks, each a program that prints figures.

  kvroute bench proxy [...]   router overhead over a direct call (B3 baseline; loadtest/bench_proxy.py)
  kvroute bench index [...]   event ingestion, match latency, bytes per entry (B4; loadtest/bench_index.py)
  kvroute bench engine [...]  engine-model steps/s and events/s (loadtest/bench_engine.py)
  kvroute bench sim [...]     offline fleet simulation, e.g. the B1 ladder (sim/des.py; same as `kvroute sim`)
  kvroute bench peers [...]   B3 side by side: direct vs kvroute vs vllm-router/sglang-router/smg, wrk load
                              (loadtest/bench_peers.py; peers installed into their own venvs)
  kvroute bench quality [...] live routing quality vs the peers + B1 live vs DES, Locust workload
                              (loadtest/bench_quality_live.py)
  kvroute bench events [...] KV-event ingestion under floods, restarts and late joins
                              (loadtest/bench_events.py)
  kvroute bench annotate [...] router CPU per request before the policy (tokenise, keys, match),
                              conversation caches on vs off (loadtest/bench_annotate.py)
  kvroute bench speculate [...] CPU per speculation and its expiry, checkouts interleaved
                              (loadtest/bench_speculate.py)
  kvroute bench split [...]   router CPU per request with the network taken out of the proxied
                              path: B3's CPU split into kvroute's own work and the network's
                              (loadtest/bench_split.py)
  kvroute bench paths [...]   router CPU per request with proxy.callback_path off and on, both in
                              one process, wrk alternating (loadtest/bench_paths.py)
  kvroute bench all           each of the above at its default size, one after the other
Results and the commands that produced them are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

BENCHES: dict[str, str] = {
    "proxy": "loadtest.bench_proxy",
    "index": "loadtest.bench_index",
    "engine": "loadtest.bench_engine",
    "sim": "sim.des_cli",
    "peers": "loadtest.bench_peers",
    "quality": "loadtest.bench_quality_live",
    "events": "loadtest.bench_events",
    "annotate": "loadtest.bench_annotate",
    "speculate": "loadtest.bench_speculate",
    "split": "loadtest.bench_split",
    "paths": "loadtest.bench_paths",
}
#: What `all` runs: moderate sizes that finish in minutes on 2 cores.
ALL_ARGS: dict[str, list[str]] = {
    "engine": ["--steps", "2000", "--repeats", "3"],
    "index": ["--repeats", "3"],
    "proxy": ["--concurrency", "1,64", "--duration", "5", "--runs", "3"],
    "sim": ["--workload", "ladder", "--concurrency", "16,64,128", "--engines", "4", "--block-size", "64"],
    "peers": ["--prompt-tokens", "1000", "--duration", "3", "--repeats", "3", "--out", "runs/bench/b3"],
    "quality": ["--time", "45", "--des", "--out", "runs/bench/quality"],
    "events": ["flood", "--rate", "100000", "--duration", "10", "--repeats", "3"],
    "annotate": [],
    "speculate": [],
    "split": [],
    "paths": ["--repeats", "3"],
}


def run(name: str, argv: Sequence[str]) -> int:
    """Run one benchmark's main with ``argv`` (mains that read sys.argv get it there)."""
    module = importlib.import_module(BENCHES[name])
    entry: Callable[..., int | None] = module.main
    saved = sys.argv
    sys.argv = [f"kvroute bench {name}", *argv]
    try:
        try:
            result = entry(list(argv))
        except TypeError:  # a main() that takes no argv parses sys.argv itself
            result = entry()
    finally:
        sys.argv = saved
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(__doc__)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name == "all":
        status = 0
        for bench, bench_args in ALL_ARGS.items():
            print(f"\n=== kvroute bench {bench} {' '.join(bench_args)}", flush=True)
            status |= run(bench, bench_args)
        return status
    if name not in BENCHES:
        print(f"unknown benchmark {name!r}; accepted: {', '.join([*BENCHES, 'all'])}", file=sys.stderr)
        return 2
    return run(name, rest)


if __name__ == "__main__":
    sys.exit(main())
