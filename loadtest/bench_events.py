"""KV-event ingestion under stress (issue 10): `kvroute bench events flood|rate|scenarios`.

flood      a real router process (`kvroute serve`) subscribed to a publisher process that floods
           vLLM-shaped batches (per-block BlockStored/BlockRemoved events) at --rate events/s; the
           bench polls the router's GET /health every 10 ms and prints p50/p99/max, router RSS, and
           what the router applied, lost (seq gaps) and how long it took to drain.
rate       the same at increasing rates: the highest sustained rate with no lost batch.
scenarios  publisher restart with its first batches lost; router restart under load against real
           simulated engines (index vs the engines' own caches); late join after 10,000 batches
           (time to replay a full default buffer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import zmq

from kvcore.stats import percentile
from kvcore.wire import BatchEncoder

TOPIC = "kv-events"
BLOCK_TOKENS = 16


# ----------------------------------------------------------------------------- helpers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _stored(block: int) -> dict[str, Any]:
    tokens = list(range(block * BLOCK_TOKENS, (block + 1) * BLOCK_TOKENS))
    return {
        "type": "BlockStored",
        "block_hashes": [block + 1],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BLOCK_TOKENS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def _removed(block: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [block + 1], "medium": "GPU"}


def build_payloads(num_batches: int, events_per_batch: int, window_blocks: int = 20_000) -> list[bytes]:
    """Batches of per-block events like vLLM's GPU pool under churn: stores of new blocks, and once
    the window is full one removal per store (the index stays bounded like a real GPU pool)."""
    encoder = BatchEncoder()
    payloads = []
    block = 0
    for _ in range(num_batches):
        events: list[dict[str, Any]] = []
        while len(events) < events_per_batch:
            events.append(_stored(block))
            if block >= window_blocks and len(events) < events_per_batch:
                events.append(_removed(block - window_blocks))
            block += 1
        payloads.append(encoder.encode(time.time(), events))
    return payloads


# ----------------------------------------------------------------------------- publisher process


def publish_main(argv: list[str]) -> int:
    """Publisher process: bind PUB, wait for the subscription, send paced batches, print a JSON
    line {"batches": sent, "seconds": ...}."""
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--rate", type=float, required=True, help="events per second")
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--events-per-batch", type=int, default=10)
    args = p.parse_args(argv)
    num_batches = int(args.rate * args.duration / args.events_per_batch)
    payloads = build_payloads(num_batches, args.events_per_batch)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default hwm
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(args.endpoint)
    if not pub.poll(30_000):
        print(json.dumps({"error": "no subscriber"}), flush=True)
        return 1
    pub.recv()
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # the bench says go
    batches_per_s = args.rate / args.events_per_batch
    started = time.perf_counter()
    topic = TOPIC.encode()
    for seq, payload in enumerate(payloads):
        due = started + seq / batches_per_s
        delay = due - time.perf_counter()
        if delay > 0.001:
            time.sleep(delay)
        pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), copy=False)
    elapsed = time.perf_counter() - started
    print(json.dumps({"batches": num_batches, "seconds": elapsed}), flush=True)
    sys.stdin.readline()
    pub.close(0)
    ctx.term()
    return 0


# ----------------------------------------------------------------------------- flood


@contextlib.contextmanager
def _router_process(
    event_port: int, workdir: Path, src: str | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = _free_port()
    config = workdir / "router.toml"
    config.write_text(
        f"""log_level = "warning"
[health]
interval_s = 0
[costs]
scrape_interval_s = 0
[[engines]]
id = "e0"
url = "http://127.0.0.1:{_free_port()}"
kv_events_endpoint = "tcp://127.0.0.1:{event_port}"
kv_events_topic = "{TOPIC}"
"""
    )
    env = dict(os.environ)
    if src:  # another checkout of kvroute (e.g. the code before a fix), same interpreter
        env["PYTHONPATH"] = src
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        env=env,
        cwd=src or None,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("router did not start")
            time.sleep(0.1)
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _source(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/debug/index", timeout=60).json()["events"]["sources"]["e0/dp0"]


def run_flood(
    rate: float, duration_s: float, events_per_batch: int, *, quiet: bool = False, src: str | None = None
) -> dict[str, Any]:
    """One flood against a fresh router process (from ``src`` if given); returns the figures."""
    event_port = _free_port()
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-events-") as tmp:
        publisher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loadtest.bench_events",
                "_publish",
                "--endpoint",
                f"tcp://127.0.0.1:{event_port}",
                "--rate",
                str(rate),
                "--duration",
                str(duration_s),
                "--events-per-batch",
                str(events_per_batch),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert publisher.stdin is not None and publisher.stdout is not None
        try:
            with _router_process(event_port, Path(tmp), src) as (router, url):
                ready = json.loads(publisher.stdout.readline())
                if not ready.get("ready"):
                    raise RuntimeError(f"publisher: {ready}")
                time.sleep(0.5)
                rss_before = _rss_mb(router.pid)
                latencies_ms: list[float] = []
                rss_peak = rss_before
                stop = threading.Event()

                def poll_health() -> None:
                    nonlocal rss_peak
                    with httpx.Client(timeout=120) as client:
                        while not stop.is_set():
                            t0 = time.perf_counter()
                            with contextlib.suppress(httpx.HTTPError):  # a timeout counts as its time
                                client.get(f"{url}/health")
                            latencies_ms.append((time.perf_counter() - t0) * 1000)
                            rss_peak = max(rss_peak, _rss_mb(router.pid))
                            time.sleep(0.01)

                # The same polling for 3 s before the flood: the machine's own latency floor.
                idle_ms: list[float] = []
                with httpx.Client(timeout=30) as client:
                    idle_until = time.monotonic() + 3.0
                    while time.monotonic() < idle_until:
                        t0 = time.perf_counter()
                        client.get(f"{url}/health")
                        idle_ms.append((time.perf_counter() - t0) * 1000)
                        time.sleep(0.01)
                poller = threading.Thread(target=poll_health, daemon=True)
                publisher.stdin.write(b"go\n")
                publisher.stdin.flush()
                flood_started = time.monotonic()
                poller.start()
                done = json.loads(publisher.stdout.readline())
                flood_s = time.monotonic() - flood_started
                stop.set()
                poller.join(30)
                # Drain: until every batch is either applied or counted lost.
                sent = int(done["batches"])
                drain_started = time.monotonic()
                doc: dict[str, Any] = {"batches": 0, "missed_batches": 0, "stale": None}
                while time.monotonic() - drain_started < 120:
                    try:  # a frozen router answers late or not at all
                        doc = _source(url)
                    except httpx.HTTPError:
                        continue
                    if doc["batches"] + doc["missed_batches"] >= sent:
                        break
                    time.sleep(0.05)
                drain_s = time.monotonic() - drain_started
                rss_after = _rss_mb(router.pid)
                publisher.stdin.write(b"bye\n")
                publisher.stdin.flush()
        finally:
            with contextlib.suppress(OSError, ValueError):
                publisher.stdin.close()
            try:
                publisher.wait(10)
            except subprocess.TimeoutExpired:
                publisher.kill()
    result = {
        "rate_events_per_s": rate,
        "events_per_batch": events_per_batch,
        "sent_batches": sent,
        "publish_s": round(float(done["seconds"]), 2),
        "achieved_events_per_s": round(sent * events_per_batch / float(done["seconds"])),
        "applied_batches": doc["batches"],
        "lost_batches": doc["missed_batches"],
        "stale": doc["stale"],
        "drain_after_flood_s": round(drain_s, 2),
        "idle_health_p50_ms": round(percentile(idle_ms, 50), 2),
        "idle_health_p99_ms": round(percentile(idle_ms, 99), 2),
        "health_samples": len(latencies_ms),
        "health_p50_ms": round(percentile(latencies_ms, 50), 2),
        "health_p99_ms": round(percentile(latencies_ms, 99), 2),
        "health_max_ms": round(max(latencies_ms) if latencies_ms else float("nan"), 2),
        "rss_mb_before_peak_after": [round(rss_before), round(rss_peak), round(rss_after)],
        "flood_wall_s": round(flood_s, 2),
    }
    if not quiet:
        print(json.dumps(result), flush=True)
    return result


def flood_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench events flood")
    p.add_argument("--rate", type=float, default=100_000, help="events per second")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--events-per-batch", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--baseline-src",
        default=None,
        help="also flood a router run from this kvroute checkout (e.g. before a fix), interleaved",
    )
    args = p.parse_args(argv)
    arms: dict[str, str | None] = {"current": None}
    if args.baseline_src:
        arms = {"baseline": args.baseline_src, **arms}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, src in arms.items():
            print(f"[{name}]", end=" ", flush=True)
            results[name].append(run_flood(args.rate, args.duration, args.events_per_batch, src=src))
    for name, runs in results.items():
        p99 = [r["health_p99_ms"] for r in runs]
        p50 = [r["health_p50_ms"] for r in runs]
        idle99 = [r["idle_health_p99_ms"] for r in runs]
        drain = [r["drain_after_flood_s"] for r in runs]
        print(
            f"{name}: flood {args.rate:,.0f} events/s x {args.duration:g} s, {args.events_per_batch} "
            f"events/batch, {args.repeats} runs: /health p50 median {statistics.median(p50):.1f} ms, "
            f"p99 median {statistics.median(p99):.1f} ms (runs {p99}; idle router before the flood: "
            f"p99 {idle99}); backlog drained "
            f"{statistics.median(drain):.1f} s after the flood; lost batches "
            f"{[r['lost_batches'] for r in runs]} of {runs[0]['sent_batches']}; peak RSS MB "
            f"{[r['rss_mb_before_peak_after'][1] for r in runs]}"
        )
    return 0


def rate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench events rate")
    p.add_argument("--rates", default="5000,10000,20000,40000,80000,160000")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--events-per-batch", type=int, default=10)
    args = p.parse_args(argv)
    best = 0.0
    for rate in (float(r) for r in args.rates.split(",")):
        r = run_flood(rate, args.duration, args.events_per_batch)
        if r["lost_batches"] == 0 and r["drain_after_flood_s"] < 1.0:
            best = max(best, r["achieved_events_per_s"])
    print(f"highest sustained rate with no lost batch and < 1 s backlog at the end: {best:,.0f} events/s")
    return 0


# ----------------------------------------------------------------------------- scenarios


async def _wait(predicate: Any, timeout_s: float = 60.0) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError("scenario did not converge")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def scenario_publisher_restart() -> None:
    from kvcore.index import PrefixIndex
    from kvcore.keys import block_keys
    from router.events import EventManager, EventSource
    from sim.zmq_publisher import KVEventsConfig, ZmqEventPublisher

    port, replay_port = _free_port(), _free_port()
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        topic=TOPIC,
    )
    index = PrefixIndex()
    source = EventSource("e0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic=TOPIC)
    manager = EventManager(index, [source])
    old = ZmqEventPublisher(cfg)
    old.start()
    await manager.start()
    health = manager.source_health()["e0/dp0"]
    await _wait(lambda: health.peer_connected and health.replays >= 1)

    def blocks(base: int, n: int) -> int:
        tokens = list(range(base, base + BLOCK_TOKENS * n))
        return index.match(block_keys(tokens, BLOCK_TOKENS), ["e0"])["e0"].blocks

    def event(base: int, i: int) -> dict[str, Any]:
        ev = _stored(0)
        ev["token_ids"] = list(range(base + 16 * i, base + 16 * i + 16))
        ev["block_hashes"] = [base + i + 1]
        ev["parent_block_hash"] = base + i if i else None
        return ev

    for i in range(3):
        old.publish([event(10_000, i)])
    await _wait(lambda: health.last_seq == 2)
    await old.close()
    new = ZmqEventPublisher(cfg)
    new.start()
    restarted_at = time.monotonic()
    new.publish([event(50_000, 0)])  # its first batch: published before the SUB reconnects
    took = await _wait(lambda: health.restarts == 1 and blocks(50_000, 1) == 1)
    new.publish([event(50_000, 1)])
    await _wait(lambda: health.last_seq == 1)
    print(
        f"publisher restart, first batch lost live: restart detected and index rebuilt "
        f"{took * 1000:.0f} ms after the new incarnation bound "
        f"(time={time.monotonic() - restarted_at:.2f} s); "
        f"old incarnation blocks left: {blocks(10_000, 3)}, new incarnation blocks: {blocks(50_000, 2)}/2, "
        f"stale={health.stale}, replays={health.replays}",
        flush=True,
    )
    await manager.stop()
    await new.close()


async def scenario_late_join(repeats: int = 3) -> None:
    from kvcore.index import PrefixIndex
    from router.events import EventManager, EventSource
    from sim.zmq_publisher import KVEventsConfig, ZmqEventPublisher

    times = []
    for _ in range(repeats):
        port, replay_port = _free_port(), _free_port()
        cfg = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{replay_port}",
            topic=TOPIC,
        )
        # The engine side runs on its own thread and event loop, as a real engine is another process.
        pub_loop = asyncio.new_event_loop()
        pub_thread = threading.Thread(target=pub_loop.run_forever, daemon=True)
        pub_thread.start()

        async def make(c: KVEventsConfig = cfg) -> ZmqEventPublisher:
            made = ZmqEventPublisher(c)
            made.start()
            return made

        pub = asyncio.run_coroutine_threadsafe(make(), pub_loop).result(10)
        for block in range(10_000):
            ev = _stored(block)
            ev["parent_block_hash"] = block if block else None
            pub.publish([ev])
        index = PrefixIndex()
        source = EventSource("e0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic=TOPIC)
        manager = EventManager(index, [source])
        started = time.monotonic()
        await manager.start()
        health = manager.source_health()["e0/dp0"]
        await _wait(lambda h=health: h.replayed_batches >= 10_000 and h.last_replay_s is not None)
        times.append((time.monotonic() - started, health.last_replay_s or 0.0, health.stale))
        await manager.stop()
        asyncio.run_coroutine_threadsafe(pub.close(), pub_loop).result(10)
        pub_loop.call_soon_threadsafe(pub_loop.stop)
        pub_thread.join(10)
        pub_loop.close()
    print(
        "late join after 10,000 batches: full replay "
        + ", ".join(
            f"{replay:.2f} s (join to converged {total:.2f} s, stale={stale})"
            for total, replay, stale in times
        )
        + f"; median replay {statistics.median(t[1] for t in times):.2f} s",
        flush=True,
    )


async def scenario_router_restart(load_s: float = 8.0) -> None:
    """Two simulated engines (1,024 GPU blocks each) under chat load; the router's EventManager is
    replaced by a fresh one (new index) mid-load; after the load the index must equal each
    engine's own GPU cache."""
    from kvcore.index import PrefixIndex
    from router.events import EventManager, EventSource
    from sim.server import EngineServerConfig, ThreadedEngineServer
    from sim.zmq_publisher import KVEventsConfig

    engines = []
    for i in range(2):
        port, replay_port = _free_port(), _free_port()
        cfg = EngineServerConfig(
            port=0,
            engine_id=f"e{i}",
            gpu_blocks=1024,
            time_scale=50.0,
            kv_events=KVEventsConfig(
                enable_kv_cache_events=True,
                endpoint=f"tcp://*:{port}",
                replay_endpoint=f"tcp://*:{replay_port}",
                topic=TOPIC,
            ),
        )
        engines.append((ThreadedEngineServer(cfg).start(), port, replay_port))
    stop = threading.Event()
    sent = [0]

    def load(engine_url: str, seed: int) -> None:
        with httpx.Client(timeout=60) as client:
            turn = 0
            while not stop.is_set():
                # 300 conversations per engine, up to 31 blocks each: far more than 1,024 blocks, so
                # the engines evict all the time and removals matter as much as stores.
                conv = (seed * 7919 + turn * 31) % 300
                prompt = [conv * 100_000 + t for t in range(64 + 48 * (turn % 10))]
                client.post(
                    f"{engine_url}/v1/completions",
                    json={"model": "kvroute-sim", "prompt": prompt, "max_tokens": 8},
                )
                sent[0] += 1
                turn += 1

    def sources() -> list[EventSource]:
        return [
            EventSource(srv.config.engine_id, f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}", topic=TOPIC)
            for srv, p, r in engines
        ]

    threads = [
        threading.Thread(target=load, args=(srv.url, k), daemon=True)
        for k, (srv, _p, _r) in enumerate(engines)
    ]
    index = PrefixIndex()
    manager = EventManager(index, sources())
    await manager.start()
    for t in threads:
        t.start()
    await asyncio.sleep(load_s / 2)
    await manager.stop()  # the router dies ...
    await asyncio.sleep(0.5)
    index = PrefixIndex()  # ... and comes back with an empty index, under load
    manager = EventManager(index, sources())
    restarted = time.monotonic()
    await manager.start()
    await asyncio.sleep(load_s / 2)
    stop.set()
    for t in threads:
        t.join(60)

    def equal() -> bool:
        for srv, _p, _r in engines:
            cached = srv.app.state.sim.runner.core.gpu.cached_hashes()
            if index.engine_hashes(srv.config.engine_id) != cached:
                return False
        return True

    converge_s = await _wait(equal, timeout_s=30)
    rows = []
    for srv, _p, _r in engines:
        engine_id = srv.config.engine_id
        h = manager.source_health()[f"{engine_id}/dp0"]
        cached = srv.app.state.sim.runner.core.gpu.cached_hashes()
        rows.append(
            f"{engine_id}: index GPU blocks {index.stats()['engines'][engine_id]['gpu_blocks']} "
            "vs engine cache "
            f"{len(cached)} (capacity 1,024), batches seen by the engine "
            f"{srv.app.state.sim.publisher.next_seq if srv.app.state.sim.publisher else '?'}, replayed "
            f"{h.replayed_batches} in {h.last_replay_s or 0:.2f} s, stale={h.stale}"
        )
    print(
        f"router restart under load ({sent[0]} requests over {load_s:g} s, restart at half time): "
        f"index equals both engines' GPU caches {converge_s:.2f} s after the load stopped "
        f"({time.monotonic() - restarted:.1f} s after the restart); " + "; ".join(rows),
        flush=True,
    )
    await manager.stop()
    for srv, _p, _r in engines:
        srv.stop()


def scenarios_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench events scenarios")
    p.add_argument("--load-s", type=float, default=8.0)
    args = p.parse_args(argv)

    async def run() -> None:
        await scenario_publisher_restart()
        await scenario_router_restart(args.load_s)
        await scenario_late_join()

    asyncio.run(run())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {"flood": flood_main, "rate": rate_main, "scenarios": scenarios_main, "_publish": publish_main}
    if not args or args[0] not in commands:
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return commands[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(main())
