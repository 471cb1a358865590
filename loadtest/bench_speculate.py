"""Speculation cost per routed request (``PrefixIndex.speculate``, its expiry included), in process,
CPU time: ``same`` re-sends one prompt every millisecond to 2 engines in turn (B3's load: every key
refreshed, none due), ``fresh`` sends a new prompt every time (every entry expires and is dropped).
``--checkout LABEL=DIR`` imports ``kvcore`` from another checkout, so before and after run
interleaved in one command.

    python -m loadtest.bench_speculate --checkout before=/tmp/before --checkout after=.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvcore.stats import median_span

PATTERNS = ("same", "fresh")


def measure(pattern: str, blocks: int, requests: int, ttl_s: float = 2.0) -> float:
    """CPU µs per ``speculate`` call."""
    from kvcore.index import PrefixIndex

    rng = random.Random(1)
    same = [rng.getrandbits(63) for _ in range(blocks)]
    index = PrefixIndex()
    spent = 0.0
    clock = time.process_time
    for i in range(requests):
        keys = same if pattern == "same" else [rng.getrandbits(63) for _ in range(blocks)]
        start = clock()
        index.speculate(f"e{i % 2}", keys, ttl_s, i * 0.001)
        spent += clock() - start
    return spent / requests * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_speculate", description=__doc__)
    parser.add_argument("--checkout", action="append", default=[], metavar="LABEL=DIR")
    parser.add_argument("--blocks", default="62,1000", help="keys per prompt (62 = B3's 1K-token prompt)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--_one", nargs=3, help=argparse.SUPPRESS)  # pattern blocks requests, in a child
    args = parser.parse_args(argv)
    if args._one:
        print(measure(args._one[0], int(args._one[1]), int(args._one[2])))
        return 0
    checkouts = dict(item.split("=", 1) for item in args.checkout) or {"here": "."}
    results: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.repeats):  # interleaved: every checkout once per repeat and cell
        for blocks in (int(b) for b in args.blocks.split(",")):
            for pattern in PATTERNS:
                for label, folder in checkouts.items():
                    # This file, with the checkout's kvcore first on the path (it need not have this file).
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--_one", pattern]
                    cmd += [str(blocks), str(args.requests)]
                    env = {**os.environ, "PYTHONPATH": str(Path(folder).resolve())}
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                    results.setdefault((label, pattern, blocks), []).append(float(out.stdout))
    print("| keys per prompt | pattern | checkout | CPU µs per speculate, median [min-max] |")
    print("|---|---|---|---|")
    for (label, pattern, blocks), values in results.items():
        print(f"| {blocks} | {pattern} | {label} | {median_span(values, '.1f', single_bare=False)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
