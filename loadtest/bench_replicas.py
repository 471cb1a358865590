"""Router replicas benchmark: what sharing state through Redis costs, and what it buys.

Every router is its own ``kvroute serve`` process, the engines are simulated engine processes,
Redis is a real redis-server, and the load generator (this process) sends each request to the next
replica in turn (a round-robin front). Two parts:

- cost: one router in front of zero-delay engines, closed-loop load at a fixed concurrency, shared
  state off vs on: req/s, p50/p99 latency, and the Redis read each request waits for (the router's
  own kvroute_shared_state_read_seconds).
- quality: multi-turn chat (the ladder workload, scaled down) on a 4-engine tiered fleet through
  1, 2 and 4 replicas with sharing on, and 2 and 4 without: hit rate (cached prompt tokens the
  engines reported / prompt tokens), imbalance (max / mean prompt tokens per engine), TTFT.

    python -m loadtest.bench_replicas            # full run (a few minutes)
    python -m loadtest.bench_replicas --quick    # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvcore import sim_tokenizer
from kvcore.stats import percentile
from loadtest.chat_client import TurnResult, _one_turn
from loadtest.procs import stop_process, wait_http_ok
from loadtest.redis_server import RedisServer
from sim.fleet import PROFILES, Fleet, FleetEngine
from sim.server import free_port
from sim.workloads import LadderConfig, Workload, ladder_workload

REPO = Path(__file__).resolve().parents[1]


class Router:
    """One ``kvroute serve`` process; its log goes to a file; always stopped (process group)."""

    def __init__(self, config_path: Path, port: int, log_path: Path, redis_url: str = "") -> None:
        env = dict(os.environ)
        env.pop("KVROUTE_SHARED_REDIS_URL", None)
        if redis_url:
            env["KVROUTE_SHARED_REDIS_URL"] = redis_url
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "ab")  # the child writes to it
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(config_path), "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.log_path = log_path

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        wait_http_ok(self.url + "/health", self.popen, timeout_s, output=self.log_path.read_text)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name + json.dumps(sample.labels, sort_keys=True)
                out[key] = sample.value
        return out

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the router process has used, from /proc (Linux)."""
        fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        stop_process(self.popen)
        self._log.close()


#: Policy parameters used in the quality runs (approx_prefix: a match must cover half the prompt,
#: else the shared system prompt alone would pull every conversation onto one engine).
POLICY_PARAMS: dict[str, dict[str, Any]] = {"approx_prefix": {"min_match_ratio": 0.5}}


def write_config(path: Path, engines: Sequence[FleetEngine], policy: str, cluster: str) -> Path:
    params = ", ".join(f"{k} = {json.dumps(v)}" for k, v in POLICY_PARAMS.get(policy, {}).items())
    lines = [
        'log_level = "warning"',
        "[policy]",
        f'name = "{policy}"',
        f"params = {{ {params} }}",
        "[tokenizer]",
        'backend = "sim"',
        "[health]",
        "interval_s = 1.0",
        "[shared]",
        f'cluster = "{cluster}"',
    ]
    for e in engines:
        entry = e.fleet_entry()
        lines.append("[[engines]]")
        for key, value in entry.items():
            lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def start_routers(
    workdir: Path, engines: Sequence[FleetEngine], policy: str, count: int, redis_url: str, tag: str
) -> list[Router]:
    config = write_config(workdir / f"router-{tag}.toml", engines, policy, cluster=tag)
    routers = [
        Router(config, free_port(), workdir / f"router-{tag}-{i}.log", redis_url) for i in range(count)
    ]
    try:
        for router in routers:
            router.wait_ready()
    except BaseException:
        for router in routers:
            router.stop()
        raise
    time.sleep(1.0)  # event subscriptions and first health polls
    return routers


# ----------------------------------------------------------------------------- cost


async def _closed_loop(urls: list[str], concurrency: int, duration_s: float) -> list[float]:
    body = {
        "model": sim_tokenizer.NAME,
        "messages": [{"role": "user", "content": sim_tokenizer.filler_text(200, seed=5)}],
        "max_tokens": 4,
    }
    latencies: list[float] = []
    errors = 0
    turn = itertools.cycle(urls)
    deadline = time.perf_counter() + duration_s

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            async with session.post(next(turn) + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    errors += 1
                    continue
            latencies.append(time.perf_counter() - started)

    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    if errors:
        raise RuntimeError(f"{errors} requests failed")
    return latencies


def _read_stats(routers: list[Router]) -> tuple[float, float, float]:
    """(mean Redis read seconds, reads, shared-state errors) over the routers, from their metrics."""
    total_s = count = errors = 0.0
    for router in routers:
        for key, value in router.metrics().items():
            if key.startswith("kvroute_shared_state_read_seconds_sum"):
                total_s += value
            elif key.startswith("kvroute_shared_state_read_seconds_count"):
                count += value
            elif key.startswith("kvroute_shared_state_errors_total"):
                errors += value
    return (total_s / count if count else float("nan")), count, errors


def bench_cost(workdir: Path, redis: RedisServer, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with Fleet(workdir / "zero") as fleet:
        engines = fleet.start(2, PROFILES["zero-delay"])
        for run in range(args.runs):
            for shared in (False, True):
                tag = f"cost-{run}-{'on' if shared else 'off'}"
                routers = start_routers(workdir, engines, "tier_cost", 1, redis.url if shared else "", tag)
                try:
                    asyncio.run(_closed_loop([r.url for r in routers], args.concurrency, 0.5))  # warm
                    before = _read_stats(routers) if shared else (0.0, 0.0, 0.0)
                    cpu0 = routers[0].cpu_s()
                    started = time.perf_counter()
                    lat = asyncio.run(_closed_loop([r.url for r in routers], args.concurrency, args.seconds))
                    wall_s = time.perf_counter() - started
                    router_cpu_s = routers[0].cpu_s() - cpu0
                    after = _read_stats(routers) if shared else (0.0, 0.0, 0.0)
                    reads = after[1] - before[1]
                    errors = after[2]
                    read_s = (after[0] * after[1] - before[0] * before[1]) / reads if reads else float("nan")
                finally:
                    for router in routers:
                        router.stop()
                lat.sort()
                rows.append(
                    {
                        "run": run,
                        "shared": shared,
                        "req_s": len(lat) / wall_s,
                        "p50_ms": 1000 * percentile(lat, 50),
                        "p99_ms": 1000 * percentile(lat, 99),
                        "redis_read_ms": 1000 * read_s if shared else None,
                        "router_cpu_us_per_request": 1e6 * router_cpu_s / len(lat),
                        "requests": len(lat),
                        "reads": reads,
                        "shared_errors": errors,
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


# ----------------------------------------------------------------------------- micro


#: Time between a request's phases in the micro benchmark (routed -> first token -> finished): long
#: enough that each phase's writes leave in their own batch when requests come one at a time.
ENGINE_PHASE_S = 0.0005


async def _micro(redis_url: str, n: int, concurrency: int) -> dict[str, Any]:
    """The shared-state work of one request, alone: read the others' load, reserve, publish the
    routing record (32 block keys), first token, finish, with ``ENGINE_PHASE_S`` between the phases
    (wall time includes them; CPU time does not); ``concurrency`` requests at a time."""
    from router.shared_state import SharedState

    state = SharedState(redis_url, cluster=f"micro-{concurrency}", replica_id="micro")
    other = SharedState(redis_url, cluster=f"micro-{concurrency}", replica_id="other")
    await state.start()
    await other.start()
    other.reserve("e1", 10)  # a second replica with load, so the read has something to sum
    tailed: list[str] = []
    other.add_routed_listener(lambda engine, keys, age_s: tailed.append(engine))
    keys = list(range(1000, 1032))
    try:

        async def one(i: int) -> None:
            engine = f"e{i % 4}"
            await state.refresh()
            state.reserve(engine, 500)
            state.routed(engine, keys)
            await asyncio.sleep(ENGINE_PHASE_S)  # the engine prefills; the writer sends the reservation
            state.first_byte(engine, 500)
            await asyncio.sleep(ENGINE_PHASE_S)  # the engine decodes
            state.end(engine)

        async def lane(lane_no: int) -> None:
            for i in range(lane_no, n, concurrency):
                await one(i)

        await asyncio.gather(*(lane(k) for k in range(min(concurrency, 8))))  # warm up
        for _ in range(200):  # the other replica tails this one's routing records (steady state)
            if tailed:
                break
            await asyncio.sleep(0.05)
        for _ in range(1000):
            if state._queue.empty():
                break
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        counts0 = await _redis_counts(state)
        batches0, reads0 = state.write_batches, _read_count(state)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(lane(k) for k in range(concurrency)))
        for _ in range(1000):  # the writer's backlog belongs to these requests
            if state._queue.empty():
                break
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        counts1 = await _redis_counts(state)
        # Minus the two INFO calls of the first count (commands, reads, and about 60 bytes).
        commands, socket_reads, bytes_in = (b - a - 2 for a, b in zip(counts0, counts1, strict=True))
        return {
            "concurrency": concurrency,
            "requests": n,
            "wall_us_per_request": 1e6 * wall_s / n,
            "cpu_us_per_request": 1e6 * cpu_s / n,
            "requests_per_s": n / wall_s,
            "redis_commands_per_request": commands / n,
            "redis_socket_reads_per_request": socket_reads / n,
            "redis_bytes_in_per_request": bytes_in / n,
            "write_round_trips_per_request": (state.write_batches - batches0) / n,
            "read_round_trips_per_request": (_read_count(state) - reads0) / n,
        }
    finally:
        await state.stop()
        await other.stop()


async def _redis_counts(state: Any) -> tuple[int, int, int]:
    """What the Redis server has counted so far, for all its clients (both replicas here): commands
    executed (those a script calls included), socket reads (about one per client round trip) and
    bytes received. Each call adds its own INFO commands and read."""
    commands = await state._writer.info("commandstats")
    stats = await state._writer.info("stats")
    return (
        sum(int(v["calls"]) for k, v in commands.items() if k.startswith("cmdstat_")),
        int(stats["total_reads_processed"]),
        int(stats["total_net_input_bytes"]),
    )


def _read_count(state: Any) -> float:
    return sum(s.value for m in state.m_read_s.collect() for s in m.samples if s.name.endswith("_count"))


def bench_micro(redis: RedisServer, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for run in range(args.runs):
        for concurrency in (1, 16):
            row = asyncio.run(_micro(redis.url, args.micro_requests, concurrency))
            row["run"] = run
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


# ----------------------------------------------------------------------------- quality


async def run_round_robin(urls: list[str], workload: Workload) -> list[TurnResult]:
    """Closed-loop multi-turn load; each request goes to the next replica (round robin)."""
    results: list[TurnResult] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(workload.conversations)):
        queue.put_nowait(i)
    next_url = itertools.cycle(urls)
    concurrency = workload.concurrency or len(workload.conversations)

    async def worker(session: aiohttp.ClientSession, slot: int) -> None:
        await asyncio.sleep(workload.ramp_s * slot / concurrency)
        while not queue.empty():
            index = queue.get_nowait()
            conv = workload.conversations[index]
            answers: list[str] = []
            for k, turn in enumerate(conv.turns):
                if k > 0 and turn.think_time_s > 0:
                    await asyncio.sleep(turn.think_time_s)
                messages = list(conv.messages(k, answers))
                result, answer = await _one_turn(
                    session,
                    next(next_url),
                    sim_tokenizer.NAME,
                    conv.conversation_id,
                    index,
                    k,
                    messages,
                    turn.output_tokens,
                )
                results.append(result)
                if not result.ok:
                    break
                answers.append(answer)

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session, s) for s in range(concurrency)))
    return results


@dataclass(frozen=True)
class Setup:
    replicas: int
    shared: bool

    @property
    def name(self) -> str:
        plural = "s" if self.replicas > 1 else ""
        return f"{self.replicas} replica{plural}, sharing {'on' if self.shared else 'off'}"


def bench_quality(workdir: Path, redis: RedisServer, args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = LadderConfig(
        first_prompt_tokens=1500,
        system_prefix_tokens=300,
        tokens_per_turn=500,
        turns=args.turns,
        answer_min_tokens=20,
        answer_max_tokens=60,
        think_time_mean_s=0.3,
        concurrency=args.conversations,
        total_conversations=args.conversations,
        seed=7,
    )
    workload = ladder_workload(cfg)
    # GPU pools that hold a few conversations each: where a turn goes decides whether it hits.
    profile = replace(
        PROFILES["tiered"], gpu_blocks=1200, cpu_blocks=0, storage_blocks=0, time_scale=args.time_scale
    )
    setups = [Setup(1, True), Setup(2, True), Setup(4, True), Setup(2, False), Setup(4, False)]
    rows = []
    with Fleet(workdir / "tiered") as fleet:
        engines = fleet.start(4, profile)
        for policy in args.policies:
            for run in range(args.runs):
                for setup in setups:
                    for engine in engines:
                        urllib.request.urlopen(
                            urllib.request.Request(engine.url + "/reset_prefix_cache", method="POST")
                        ).close()
                    tag = f"q-{policy}-{run}-{setup.replicas}-{int(setup.shared)}"
                    routers = start_routers(
                        workdir, engines, policy, setup.replicas, redis.url if setup.shared else "", tag
                    )
                    try:
                        results = asyncio.run(run_round_robin([r.url for r in routers], workload))
                    finally:
                        for router in routers:
                            router.stop()
                    rows.append(_quality_row(policy, run, setup, results))
                    print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _quality_row(policy: str, run: int, setup: Setup, results: list[TurnResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_engine: Counter[str] = Counter()
    for r in ok:
        per_engine[r.engine] += r.prompt_tokens
    loads = list(per_engine.values()) + [0] * max(0, 4 - len(per_engine))
    ttfts = sorted(r.ttft_s for r in ok)
    return {
        "policy": policy,
        "run": run,
        "setup": setup.name,
        "turns": len(results),
        "errors": len(results) - len(ok),
        "hit_rate": cached / prompt if prompt else 0.0,
        "imbalance": max(loads) / statistics.mean(loads) if loads and statistics.mean(loads) else 0.0,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p90_ms": 1000 * percentile(ttfts, 90),
    }


# ----------------------------------------------------------------------------- report


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(
    micro: list[dict[str, Any]],
    cost: list[dict[str, Any]],
    quality: list[dict[str, Any]],
    args: argparse.Namespace,
) -> str:
    load = os.getloadavg()
    out = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"runs: {args.runs} (medians); load average at the end {load[0]:.1f} (shared machine)",
    ]
    if micro:
        out += [
            "",
            f"Shared-state work of one request alone (read, reserve, routing record with 32 keys, first "
            f"token, finish; {1000 * ENGINE_PHASE_S:g} ms between the phases) against a local "
            f"redis-server, {args.micro_requests} requests. Both replicas live in this process (the "
            "other one tails the routing records); the Redis figures are the server's own counts for "
            "both (INFO: commands executed, scripts' inner calls included; socket reads ~ round "
            "trips; bytes received); round trips are this replica's writer batches and load reads.",
            "",
            "| concurrent requests | wall us / request | CPU us / request (this process) | requests/s "
            "| write + read round trips / request | Redis socket reads / request "
            "| Redis commands / request | bytes to Redis / request |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for concurrency in (1, 16):
            rows = [r for r in micro if r["concurrency"] == concurrency]
            out.append(
                f"| {concurrency} | {_median(rows, 'wall_us_per_request'):.0f} "
                f"| {_median(rows, 'cpu_us_per_request'):.0f} | {_median(rows, 'requests_per_s'):.0f} "
                f"| {_median(rows, 'write_round_trips_per_request'):.2f} + "
                f"{_median(rows, 'read_round_trips_per_request'):.2f} "
                f"| {_median(rows, 'redis_socket_reads_per_request'):.2f} "
                f"| {_median(rows, 'redis_commands_per_request'):.2f} "
                f"| {_median(rows, 'redis_bytes_in_per_request'):.0f} |"
            )
    if cost:
        out += [
            "",
            f"Cost: 1 router (tier_cost, sim tokenizer), 2 zero-delay engines, {args.concurrency} "
            f"concurrent clients, {args.seconds} s per point; router CPU from /proc",
            "",
            "| shared state | req/s | p50 ms | p99 ms | router CPU us / request | Redis read, mean ms "
            "| reads per request | errors |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for shared in (False, True):
            rows = [r for r in cost if r["shared"] is shared]
            read = f"{_median(rows, 'redis_read_ms'):.3f}" if shared else "-"
            per_request = statistics.median(r["reads"] / r["requests"] for r in rows) if shared else 0.0
            out.append(
                f"| {'on' if shared else 'off'} | {_median(rows, 'req_s'):.0f} "
                f"| {_median(rows, 'p50_ms'):.2f} | {_median(rows, 'p99_ms'):.2f} "
                f"| {_median(rows, 'router_cpu_us_per_request'):.0f} "
                f"| {read} | {per_request:.2f} | {sum(r['shared_errors'] for r in rows):.0f} |"
            )
        off = [r for r in cost if not r["shared"]]
        on = [r for r in cost if r["shared"]]
        # Side by side within each run (the machine's load drifts between runs).
        cpu_ratio = statistics.median(
            a["router_cpu_us_per_request"] / b["router_cpu_us_per_request"]
            for a, b in zip(on, off, strict=True)
        )
        out += [
            "",
            f"on/off: req/s x{_median(on, 'req_s') / _median(off, 'req_s'):.3f}, "
            f"p50 +{_median(on, 'p50_ms') - _median(off, 'p50_ms'):.2f} ms, "
            f"router CPU per request x{cpu_ratio:.3f} (median of per-run ratios)",
        ]
    for policy in args.policies if quality else ():
        out += [
            "",
            f"Quality: {policy} {POLICY_PARAMS.get(policy, {})}, ladder chat "
            f"({args.conversations} conversations x {args.turns} turns, "
            f"1500-token first prompt, +500 per turn), 4 simulated engines (1200 GPU blocks each), "
            "round robin over the replicas",
            "",
            "| setup | hit rate | imbalance (max/mean prompt tokens) | TTFT p50 ms | TTFT p90 ms | errors |",
            "|---|---|---|---|---|---|",
        ]
        names = list(dict.fromkeys(r["setup"] for r in quality if r["policy"] == policy))
        for name in names:
            rows = [r for r in quality if r["policy"] == policy and r["setup"] == name]
            out.append(
                f"| {name} | {_median(rows, 'hit_rate'):.3f} | {_median(rows, 'imbalance'):.2f} "
                f"| {_median(rows, 'ttft_p50_ms'):.1f} | {_median(rows, 'ttft_p90_ms'):.1f} "
                f"| {sum(r['errors'] for r in rows)} |"
            )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_replicas", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny load, one run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0, help="cost: seconds per point")
    p.add_argument("--concurrency", type=int, default=16, help="cost: concurrent clients")
    p.add_argument("--conversations", type=int, default=16, help="quality: concurrent conversations")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--policies", nargs="+", default=["tier_cost", "approx_prefix"])
    p.add_argument("--micro-requests", type=int, default=5000)
    p.add_argument("--json", help="also write all rows to this file")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=("micro", "cost", "quality"),
        default=["micro", "cost", "quality"],
        help="which parts to run (default: all)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.seconds, args.conversations, args.turns = 1, 0.5, 3, 2
        args.micro_requests = 200
        args.policies = args.policies[:1]
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-replicas-") as tmp:
        workdir = Path(tmp)
        with RedisServer(workdir / "redis") as redis:
            micro = bench_micro(redis, args) if "micro" in args.parts else []
            cost = bench_cost(workdir, redis, args) if "cost" in args.parts else []
            quality = bench_quality(workdir, redis, args) if "quality" in args.parts else []
    text = report(micro, cost, quality, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"micro": micro, "cost": cost, "quality": quality}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
