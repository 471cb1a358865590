"""`make load`: a simulated tiered fleet + the router + Locust (loadtest/locustfile.py) headless for a
given time; prints Locust's summary and the per-turn table, writes the CSVs into ``--out``.

    python -m loadtest.load --policy tier_cost --users 16 --time 60s --out runs/load
    python -m loadtest.load --url http://MY-ROUTER:9000 --model MY-MODEL ...   # no fleet, your endpoint

Everything started here binds 127.0.0.1 and is stopped on exit, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from loadtest.demo import DEMO_PROFILE
from loadtest.procs import stop_process, wait_http_ok
from sim.fleet import Fleet
from sim.server import free_port

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"


@contextlib.contextmanager
def kvroute_router(
    fleet: Fleet, policy: str, workdir: Path, *, tokenizer: str = "sim", extra: Sequence[str] = ()
) -> Iterator[str]:
    """`kvroute serve` over ``fleet`` with ``policy``; yields its URL, stops it on exit."""
    fleet_file = fleet.write_fleet_file(workdir / "fleet.json")
    port = free_port("127.0.0.1")
    args = [
        sys.executable, "-m", "router.cli", "serve",
        "--fleet", str(fleet_file),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--policy", policy,
        "--log-level", "warning",
        *extra,
    ]  # fmt: skip
    log = open(workdir / f"router-{policy}.log", "wb")
    env = {**os.environ, "KVROUTE_TOKENIZER_BACKEND": tokenizer}
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/health", proc)
        yield url
    finally:
        stop_process(proc)


def locust_command(
    url: str, users: int, spawn_rate: float, run_time: str, csv_prefix: str, locust_args: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable, "-m", "locust",
        "-f", str(LOCUSTFILE),
        "--headless",
        "--host", url,
        "-u", str(users),
        "-r", str(spawn_rate),
        "-t", run_time,
        "--csv", csv_prefix,
        "--only-summary",
        "--stop-timeout", "30",
        *locust_args,
    ]  # fmt: skip


def run_locust(
    url: str,
    users: int,
    spawn_rate: float,
    run_time: str,
    csv_prefix: str,
    locust_args: Sequence[str] = (),
    *,
    capture: bool = False,
) -> subprocess.CompletedProcess[str]:
    Path(csv_prefix).parent.mkdir(parents=True, exist_ok=True)
    cmd = locust_command(url, users, spawn_rate, run_time, csv_prefix, locust_args)
    return subprocess.run(cmd, cwd=REPO, text=True, capture_output=capture, check=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.load", description=__doc__)
    parser.add_argument("--url", help="an existing OpenAI-compatible endpoint: start no fleet or router")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--policy", default="tier_cost", help="kvroute policy (with the started fleet)")
    parser.add_argument("--users", type=int, default=16, help="concurrent conversations")
    parser.add_argument("--spawn-rate", type=float, default=4.0)
    parser.add_argument("--time", default="60s", help="Locust run time (e.g. 30s, 2m)")
    parser.add_argument("--out", default="runs/load", help="folder for the CSVs (<out>/locust_*.csv)")
    parser.add_argument("--time-scale", type=float, default=DEMO_PROFILE.time_scale)
    args, locust_args = parser.parse_known_args(argv)
    csv_prefix = str(Path(args.out) / "locust")
    if args.url:
        return run_locust(
            args.url, args.users, args.spawn_rate, args.time, csv_prefix, locust_args
        ).returncode
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-load-"))
    profile = replace(DEMO_PROFILE, time_scale=args.time_scale)
    with Fleet(workdir) as fleet:
        print(
            f"[load] starting {args.engines} simulated engines (tiered: GPU/CPU/shared STORAGE) ...",
            flush=True,
        )
        fleet.start(args.engines, profile)
        with kvroute_router(fleet, args.policy, workdir) as url:
            print(
                f"[load] router {url} policy {args.policy}; Locust: {args.users} users for {args.time}",
                flush=True,
            )
            code = run_locust(url, args.users, args.spawn_rate, args.time, csv_prefix, locust_args).returncode
    print(
        f"[load] CSVs: {csv_prefix}_stats.csv, _stats_history.csv, _failures.csv, _turns.csv; "
        f"logs in {workdir}"
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
