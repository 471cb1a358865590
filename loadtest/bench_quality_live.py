"""Routing quality, live, side by side: kvroute's policies and the peers' cache-aware modes on the same
tiered simulated fleet, driven by the same Locust workload (loadtest/locustfile.py).

Per (workload, target) a FRESH fleet is started (empty caches), the router in front of it, then
Locust headless for ``--time``. Reported: TTFT p50/p90/p99 at the client, turns/s, and the cached
prompt tokens by tier as the engines count them (``vllm:prompt_tokens_cached_by_source`` summed
over the fleet's /metrics). The engines run vLLM's sha256_cbor block hashes so that vllm-router's
kv_aware policy (which recomputes them from ``/v1/chat/completions/render``) can read their events.
With ``--des`` the ladder rows of kvroute's policies are also simulated in virtual time (sim/des.py)
on the same fleet and workload: the B1-live table. Writes quality.md / quality.json / PNGs to --out.

    python -m loadtest.bench_quality_live --out runs/bench/quality --des

``--backend vllm-cpu``: the same measuring on REAL vLLM engines (its CPU build, sim/vllm_cpu.py).
Real engines take minutes to start, so two fleets are started once (or given as the fleet files of
running ``kvroute fleet --backend vllm-cpu --dev-mode --enable-scale-out --hash-algo sha256_cbor``):
one fcfs, one with ``--scheduling-policy priority``; a target ``kvroute:POLICY@priority`` runs on the
second. Before every run each engine's prefix cache is emptied (POST /reset_prefix_cache, which
vLLM serves with VLLM_SERVER_DEV_MODE=1; it also publishes AllBlocksCleared), so every run starts
cold. Cached tokens: the engines' ``usage.prompt_tokens_details.cached_tokens`` summed over the
measured turns; evictions: the BlockRemoved events the engines published during the run. The
fleets started here keep their engine logs in ``--out``/engine-logs/ once stopped; the rest of
their temp folders (model folder, STORAGE pool) is removed.

    python -m loadtest.bench_quality_live --backend vllm-cpu --fleet-file fcfs.json \
        --priority-fleet-file prio.json --model-dir runs/vllm/model --repeats 5 --out runs/bench/vllmq
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvcore.core import SCHEDULING_POLICIES
from kvcore.stats import histogram_percentile, median_span
from kvcore.wire import EventBatch, decode_payload, parse_live_frames
from loadtest.bench_peers import (
    Target,
    default_peers_dir,
    exit_on_sigterm,
    install_peer,
    machine_note,
    peer_command,
    wait_routes,
)
from loadtest.demo import DEMO_PROFILE
from loadtest.load import kvroute_router, run_locust, stop_process
from loadtest.procs import wait_sources_connected
from policies.base import Tier
from router.scrape import parse_engine_metrics, tier_of_label
from sim.fleet import Fleet, FleetEngine, FleetProfile
from sim.server import free_port
from sim.vllm_cpu import VLLM_CPU_VERSION, VllmCpuFleet, VllmCpuProfile

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TARGETS = (
    "kvroute:round_robin",
    "kvroute:session_affinity",
    "kvroute:kv_fixed_credit",
    "kvroute:tier_cost",
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
    "vllm-router:kv_aware",
    "sglang-router:cache_aware",
)
#: --backend vllm-cpu: every kvroute policy the issue compares, on the fcfs fleet and on the priority
#: fleet, and the peers' cache-aware modes (on the fcfs fleet: they send no priorities).
VLLM_TARGETS = (
    *(f"kvroute:{p}{fleet}" for p in ("round_robin", "kv_fixed_credit", "tier_cost", "horizon_cost")
      for fleet in ("", "@priority")),
    "sglang-router:cache_aware",
    "vllm-router:kv_aware",
)  # fmt: skip
#: The real engines: 2 per fleet, 400 x 32-token blocks (12,800 tokens) of KV each, so that 8
#: conversations of the ladder evict; sha256_cbor hashes + the render endpoint for vllm-router's
#: kv_aware; dev mode for POST /reset_prefix_cache.
VLLM_PROFILE = VllmCpuProfile(hash_algo="sha256_cbor", enable_scale_out=True, dev_mode=True)
#: The live fleet: the demo's tiered engines (GPU 1,024 x 16-token blocks = 16K tokens each, CPU 2x,
#: one shared STORAGE pool), in vLLM's sha256_cbor hash mode, real time (time_scale 1).
QUALITY_PROFILE = replace(DEMO_PROFILE, hash_algo="sha256_cbor")
#: The scaled-down ladder (loadtest/locustfile.py defaults): 2,400-token first prompt with a
#: 600-token shared system prompt, +448 tokens a turn, 5 turns, 48-token answers.
LADDER = {"first": 2400, "system": 600, "per_turn": 448, "turns": 5, "answer": 48}


@dataclass(slots=True)
class Run:
    workload: str
    users: int
    target: str
    backend: str = "sim"
    ttft_p50_s: float = float("nan")
    ttft_p90_s: float = float("nan")
    ttft_p99_s: float = float("nan")
    turns: int = 0
    failures: int = 0
    turns_per_s: float = 0.0
    prompt_tokens: float = 0.0
    cached: dict[str, float] | None = None
    #: max / mean prompt tokens per engine (from the engines' prefix-cache query counters).
    imbalance: float = float("nan")
    #: kvroute only: measured engine TTFTs over the TTFTs its cost model predicted (router metrics).
    ttft_over_predicted: float = float("nan")
    #: kvroute only: streams the router escalated during the run (``kvroute_escalations_total``).
    escalations: int = 0
    #: KV events the engines published during the run (BlockRemoved > 0: the run evicted).
    stored_blocks: int = 0
    removed_blocks: int = 0
    #: Real engines: per ``PHASE_HISTOGRAMS`` phase, [p50 s, p99 s, requests] over the run.
    phases: dict[str, list[float]] = field(default_factory=dict)
    #: Measured turns still in flight 30 s after the run's end (Locust's stop timeout), cut, so not
    #: in the percentiles.
    unfinished: int = 0
    error: str = ""


@dataclass(slots=True)
class Backend:
    """What differs between the simulated and the real engines, for one run."""

    name: str = "sim"
    #: the router's tokenizer back-end and its path (real vLLM: hf, the model folder).
    tokenizer: str = "sim"
    tokenizer_path: str = ""
    #: the block size vllm-router's kv_aware hashes with (the engines' own).
    block_size: int = QUALITY_PROFILE.block_size
    #: ``--variant NAME=FILE``: kvroute targets ``kvroute:POLICY#NAME`` run with ``--config FILE``.
    variants: dict[str, str] = field(default_factory=dict)


def split_spec(spec: str) -> tuple[str, str]:
    """``ROUTER[#VARIANT][@SCHEDULING]`` -> (router spec, the engines' scheduling policy or "" for the
    default). ``#VARIANT`` (kvroute only) names a ``--variant`` config file (``variant_of``)."""
    router, _, scheduling = spec.partition("@")
    if scheduling and scheduling not in SCHEDULING_POLICIES:
        raise ValueError(
            f"target {spec!r}: after '@' expected a scheduling policy ({', '.join(SCHEDULING_POLICIES)})"
        )
    router, _, variant = router.partition("#")
    target = Target.parse(router)
    if variant and target.kind != "kvroute":
        raise ValueError(f"target {spec!r}: a #VARIANT config applies to kvroute targets only")
    return router, scheduling


def variant_of(spec: str) -> str:
    """The ``#VARIANT`` of a target spec ("" for none)."""
    return spec.partition("@")[0].partition("#")[2]


class EventCounter:
    """Counts the KV events the engines publish while it runs (its own ZMQ subscriptions to their PUB
    sockets, next to the router's): evidence that a run evicted, whichever router is in front.
    With ``keep_batches`` it also keeps every decoded batch, in arrival order (``batches``)."""

    def __init__(self, engines: Sequence[FleetEngine], *, keep_batches: bool = False) -> None:
        self.counts: dict[str, int] = {}
        self.batches: list[EventBatch] | None = [] if keep_batches else None
        self._ctx = zmq.Context()
        self._sockets = []
        for e in engines:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(e.kv_events_endpoint)
            self._sockets.append(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-counter", daemon=True)

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                parsed = parse_live_frames(sock.recv_multipart())
                if parsed is None:
                    continue
                batch = decode_payload(parsed[1])
                if self.batches is not None:
                    self.batches.append(batch)
                for event in batch.events:
                    name = type(event).__name__.removeprefix("Legacy")
                    self.counts[name] = self.counts.get(name, 0) + 1

    def __enter__(self) -> EventCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()
        self._ctx.term()


def reset_prefix_caches(engines: Sequence[FleetEngine], timeout_s: float = 60.0) -> None:
    """Empty every engine's prefix cache (vLLM's POST /reset_prefix_cache, served in dev mode), its
    CPU tier with it (``reset_external``), and the block files of the STORAGE folders the engines
    share (vLLM keeps a secondary tier's data across resets; the folder is the engines' storage pool,
    ``sim.vllm_cpu.storage_pool_of``). vLLM refuses (success false) while blocks are held, e.g. by
    requests still finishing: retried until ``timeout_s``."""
    for e in engines:
        deadline = time.monotonic() + timeout_s
        while True:
            resp = httpx.post(e.url + "/reset_prefix_cache", params={"reset_external": "true"}, timeout=30)
            if resp.status_code == 404:
                raise RuntimeError(
                    f"engine {e.id} ({e.url}) has no /reset_prefix_cache: start it with"
                    " VLLM_SERVER_DEV_MODE=1 (kvroute fleet --backend vllm-cpu --dev-mode)"
                )
            resp.raise_for_status()
            if resp.json().get("success"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"engine {e.id}: /reset_prefix_cache still refused after {timeout_s:.0f} s"
                )
            time.sleep(0.5)
    folders = {storage_folder(e.storage_pool) for e in engines}
    for folder in sorted(f for f in folders if f is not None):
        for block in folder.rglob("*.bin"):  # vLLM's fs tier: one file a block (its config.json stays)
            block.unlink(missing_ok=True)


def storage_folder(storage_pool: str) -> Path | None:
    """The folder of a vllm-cpu fleet's STORAGE pool (``fs:PATH``), None for any other pool."""
    return Path(storage_pool[3:]) if storage_pool.startswith("fs:") else None


@dataclass(slots=True)
class FleetFile:
    """Engines somebody else runs, read from their fleet file (``kvroute fleet ... --fleet-file``)."""

    path: Path
    engines: list[FleetEngine] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> FleetFile:
        from router.config import load_fleet_file

        engines = [
            FleetEngine(
                id=e.id,
                url=e.url,
                model=e.model or "",
                kv_events_endpoint=e.kv_events_endpoint or "",
                replay_endpoint=e.kv_replay_endpoint or "",
                kv_events_topic=e.kv_events_topic or "",
                storage_pool=e.storage_pool or "",
                block_size=e.block_size or 0,
                pid=0,
                log_path="",
                scheduling_policy=e.scheduling_policy,
            )
            for e in load_fleet_file(path)
        ]
        return cls(path, engines)

    def write_fleet_file(self, path: str | Path) -> Path:
        Path(path).write_bytes(self.path.read_bytes())
        return Path(path)


#: vLLM's request-phase histograms (vLLM 0.32 v1/metrics/loggers.py), read per run on real engines:
#: the engine client's arrival (after its API server rendered and tokenized the prompt) -> first
#: token; the wait for the scheduler (arrival -> first scheduled); the prefill steps. With the
#: client's TTFT they say where a run's time went: the front end, the engine's queue or its work.
#: (loadtest/calib_compare.py's ENGINE_PHASES reads the same histograms' sums and counts as means.)
PHASE_HISTOGRAMS = {
    "engine_ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
#: A histogram's cumulative bucket counts, by upper bound, summed over the fleet.
Buckets = dict[float, float]


@dataclass(slots=True)
class EngineScrape:
    """One scrape of every engine's /metrics."""

    #: Cached prompt tokens by tier, summed over the engines.
    cached_by_tier: dict[str, float]
    #: Prompt tokens each engine was asked to prefill (its prefix-cache queries).
    queried: list[float]
    #: ``PHASE_HISTOGRAMS``' histograms, by phase.
    phases: dict[str, Buckets]


def scrape_engines(engines: Sequence[FleetEngine]) -> EngineScrape:
    """The engines' cached tokens by tier, prefix-cache queries and phase histograms, one GET each
    (the counters as the router reads them: ``router.scrape.parse_engine_metrics``)."""
    by_tier: dict[str, float] = {}
    per_engine: list[float] = []
    phase_of = {name: phase for phase, name in PHASE_HISTOGRAMS.items()}
    phases: dict[str, Buckets] = {phase: {} for phase in PHASE_HISTOGRAMS}
    for e in engines:
        text = httpx.get(e.url + "/metrics", timeout=10).text
        parsed = parse_engine_metrics(text)
        for source, value in parsed.prompt_tokens_cached_by_source.items():
            by_tier[source] = by_tier.get(source, 0.0) + value
        per_engine.append(parsed.prefix_cache_queries_total or 0.0)
        for family in text_string_to_metric_families(text):
            phase = phase_of.get(family.name)
            if phase is None:
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    phases[phase][le] = phases[phase].get(le, 0.0) + sample.value
    return EngineScrape(by_tier, per_engine, phases)


def cached_by_tier_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Cached prompt tokens by tier (GPU, CPU, STORAGE) between two scrapes of the engines'
    ``prompt_tokens_cached_by_source`` (the simulator's sources are tier names, vLLM's ``device``,
    ``host``, ``disk``...: ``router.scrape.tier_of_label`` reads both)."""
    out = {tier.name: 0.0 for tier in Tier}
    for source, value in after.items():
        out[tier_of_label(source).name] += value - before.get(source, 0.0)
    return out


def split_like(total: float, parts: Mapping[str, float]) -> dict[str, float]:
    """``total`` split in the proportions of ``parts`` (all of it GPU when the parts are empty)."""
    whole = sum(parts.values())
    if whole <= 0:
        return {tier.name: total if tier == Tier.GPU else 0.0 for tier in Tier}
    return {name: total * value / whole for name, value in parts.items()}


def phase_percentiles(before: EngineScrape, after: EngineScrape) -> dict[str, list[float]]:
    """Per phase with observations between two scrapes: [p50, p99, requests] of them (PromQL's
    interpolation within the engines' buckets: ``kvcore.stats.histogram_percentile``)."""
    out: dict[str, list[float]] = {}
    for phase, now in after.phases.items():
        then = before.phases.get(phase, {})
        delta = [(le, count - then.get(le, 0.0)) for le, count in now.items()]
        total = max((c for le, c in delta if math.isinf(le)), default=0.0)
        if total > 0:
            out[phase] = [histogram_percentile(delta, 50), histogram_percentile(delta, 99), total]
    return out


def scrape_router_counters(router_url: str, names: Sequence[str]) -> dict[str, float]:
    """Per sample name in ``names``: its value summed over every label set on the router's /metrics."""
    sums = dict.fromkeys(names, 0.0)
    text = httpx.get(router_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums


_TTFT_SUMS = ("kvroute_ttft_engine_seconds_total", "kvroute_ttft_predicted_seconds_total")
#: Streams escalated (cancelled and sent again at priority 0: docs/routing.md, "Escalation").
_ESCALATIONS = "kvroute_escalations_total"
_ROUTER_COUNTERS = (*_TTFT_SUMS, _ESCALATIONS)


def scrape_ttft_sums(router_url: str) -> tuple[float, float]:
    """(measured, predicted) engine TTFT seconds of the router's streamed requests, all engines."""
    sums = scrape_router_counters(router_url, _TTFT_SUMS)
    return sums[_TTFT_SUMS[0]], sums[_TTFT_SUMS[1]]


def locust_args(workload: str, think_mean_s: float) -> list[str]:
    if workload == "ladder":
        return [
            "--first-prompt-tokens", str(LADDER["first"]), "--system-prefix-tokens", str(LADDER["system"]),
            "--tokens-per-turn", str(LADDER["per_turn"]), "--turns", str(LADDER["turns"]),
            "--answer-tokens", str(LADDER["answer"]), "--think-time-mean", str(think_mean_s),
        ]  # fmt: skip
    # Agentic sessions scaled 16x down (a 64-token trace block = 4 tokens; median call ~6.5K tokens),
    # calls over 12K tokens skipped (they would not fit a 16K-token GPU pool with anything else).
    return [
        "--workload", "agentic", "--trace-token-scale", "16", "--max-prompt-tokens", "12000",
        "--max-output-tokens", "32", "--think-scale", "0.1",
    ]  # fmt: skip


def start_peer(
    target: Target, engines: Sequence[FleetEngine], workdir: Path, peers_dir: Path, block_size: int
) -> tuple[Any, str]:
    port = free_port()
    extra: list[str] = []
    if target.policy == "kv_aware":
        # vllm-router reads each engine's ZMQ events itself (no discovery offline), recomputes vLLM's
        # sha256_cbor hashes from /render's token ids; --kv-event-model is required with static sources.
        extra = [
            "--kv-event-block-size",
            str(block_size),
            "--kv-event-model",
            engines[0].model,
        ]
        for e in engines:
            extra += ["--kv-event-source", f"{e.url}={e.kv_events_endpoint}"]
    args = peer_command(
        install_peer(peers_dir, target.kind), target.kind, target.policy, port, engines, extra
    )
    import subprocess

    log = open(workdir / f"{target.kind}-{target.policy}.log", "wb")
    proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_routes(url, proc, model=engines[0].model)
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


def one_run(
    workload: str,
    users: int,
    spec: str,
    *,
    engines_n: int,
    profile: FleetProfile,
    run_time_s: int,
    think_mean_s: float,
    peers_dir: Path,
    out: Path,
    variants: dict[str, str] | None = None,
    warmup_s: int = 0,
) -> Run:
    """One run on a FRESH simulated fleet (empty caches)."""
    _router_spec, scheduling = split_spec(spec)
    with run_folder() as workdir, Fleet(workdir) as fleet:
        engines = fleet.start(
            engines_n, replace(profile, scheduling_policy=scheduling or profile.scheduling_policy)
        )
        run = measure(
            workload, users, spec, fleet, engines, workdir, Backend(variants=variants or {}),
            run_time_s=run_time_s, think_mean_s=think_mean_s, peers_dir=peers_dir, out=out,
            warmup_s=warmup_s,
        )  # fmt: skip
    return _tidy(run, workdir)


def measure(
    workload: str,
    users: int,
    spec: str,
    fleet: Any,
    engines: Sequence[FleetEngine],
    workdir: Path,
    backend: Backend,
    *,
    run_time_s: int,
    think_mean_s: float,
    peers_dir: Path,
    out: Path,
    warmup_s: int = 0,
) -> Run:
    """Start ``spec``'s router in front of running ``engines`` (``fleet`` writes their fleet file), drive
    Locust through it for ``run_time_s``, stop the router. One definition of the measuring for both
    back-ends; a failure is recorded in the Run, not raised. At the end each user finishes the turn
    it has in flight and sends no other (loadtest/locustfile.py). ``warmup_s``: Locust runs that
    much longer first, and the turns sent in it are not measured. The client's figures (TTFT,
    turns, cached tokens) are the measured turns'; the engines' (events, phases, the tier split of
    cached tokens) cover the whole run, warm-up and the end's last turns included."""
    target = Target.parse(split_spec(spec)[0])
    run = Run(workload, users, spec, backend.name)
    proc = None
    stack = contextlib.ExitStack()
    try:
        with stack:
            if target.kind == "kvroute":
                extra = ["--tokenizer-path", backend.tokenizer_path] if backend.tokenizer_path else []
                variant = variant_of(spec)
                if variant:
                    extra += ["--config", backend.variants[variant]]
                url = stack.enter_context(
                    kvroute_router(fleet, target.policy, workdir, tokenizer=backend.tokenizer, extra=extra)
                )
                wait_sources_connected(url)
            else:
                proc, url = start_peer(target, engines, workdir, peers_dir, backend.block_size)
            scraped_before = scrape_engines(engines)
            # The router's counters, before and after the run in one scrape each (kvroute only).
            counters_before = (
                scrape_router_counters(url, _ROUTER_COUNTERS) if target.kind == "kvroute" else {}
            )
            prefix = str(out / "csv" / f"{workload}-u{users}-{spec.replace(':', '_').replace('@', '_')}")
            spawn = max(1.0, users / max(think_mean_s, 1.0))
            args = [*locust_args(workload, think_mean_s), "--model", engines[0].model]
            args += ["--measure-after", str(warmup_s)] if warmup_s else []
            with EventCounter(engines) as events:
                res = run_locust(url, users, spawn, f"{warmup_s + run_time_s}s", prefix, args, capture=True)
            run.stored_blocks = events.counts.get("BlockStored", 0)
            run.removed_blocks = events.counts.get("BlockRemoved", 0)
            if res.returncode not in (0, 1):  # 1 = some requests failed: still a result
                raise RuntimeError(f"locust exited {res.returncode}: {res.stderr[-800:]}")
            scraped = scrape_engines(engines)
            before, after = scraped_before.cached_by_tier, scraped.cached_by_tier
            if backend.name != "sim":  # (the simulated engines' TTFT histogram is in model seconds)
                run.phases = phase_percentiles(scraped_before, scraped)
            if target.kind == "kvroute":
                after_run = scrape_router_counters(url, _ROUTER_COUNTERS)
                delta = {name: after_run[name] - counters_before[name] for name in _ROUTER_COUNTERS}
                measured, predicted = delta[_TTFT_SUMS[0]], delta[_TTFT_SUMS[1]]
                run.ttft_over_predicted = measured / predicted if predicted > 0 else float("nan")
                run.escalations = round(delta[_ESCALATIONS])
            loads = [a - b for a, b in zip(scraped.queried, scraped_before.queried, strict=True)]
            run.imbalance = max(loads) / (sum(loads) / len(loads)) if sum(loads) else float("nan")
            rows = list(csv.DictReader(open(f"{prefix}_turns.csv")))
            overall = rows[-1]
            run.ttft_p50_s = float(overall["ttft_p50_ms"]) / 1000
            run.ttft_p90_s = float(overall["ttft_p90_ms"]) / 1000
            run.ttft_p99_s = float(overall["ttft_p99_ms"]) / 1000
            run.turns = int(overall["requests"])
            run.unfinished = int(overall["unfinished"])
            run.turns_per_s = run.turns / run_time_s
            run.prompt_tokens = float(overall["prompt_tokens"])
            by_tier = cached_by_tier_delta(before, after)
            if backend.name == "sim":
                run.cached = by_tier
            else:
                # The cached tokens the engines reported in each measured turn's usage, split by
                # tier as the engines' own counters split theirs over the run (vLLM's sources:
                # device, host, disk).
                run.cached = split_like(float(overall["cached_tokens"]), by_tier)
            with open(f"{prefix}_stats.csv") as fh:
                run.failures = sum(int(r["Failure Count"]) for r in csv.DictReader(fh) if r["Type"] == "POST")
    except Exception as exc:
        run.error = str(exc).splitlines()[0][:300]
        print(
            f"  {workload} u={users} {spec}: FAILED: {exc} (logs in {workdir})", file=sys.stderr, flush=True
        )
    finally:
        stop_process(proc)
    return run


@contextlib.contextmanager
def run_folder() -> Iterator[Path]:
    """A run's folder in the temp folder (router and engine logs, fleet file). ``_tidy`` keeps it
    for a failed run; a run interrupted (Ctrl-C, SIGTERM) has no result to read it with, so it goes."""
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-quality-"))
    try:
        yield workdir
    except (KeyboardInterrupt, SystemExit):  # (an error keeps it: its logs explain it)
        shutil.rmtree(workdir, ignore_errors=True)
        raise


def _tidy(run: Run, workdir: Path) -> Run:
    """Remove a run's folder (router and engine logs, fleet file) unless the run failed: then its
    logs stay for the reader, named in the error."""
    if not run.error:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        run.error = f"{run.error} (logs in {workdir})"
    return run


def vllm_runs(
    cells: Sequence[tuple[str, int, str]],
    fleets: dict[str, Any],
    backend: Backend,
    *,
    run_time_s: int,
    think_mean_s: float,
    peers_dir: Path,
    out: Path,
    on_run: Any,
    warmup_s: int = 0,
) -> list[Run]:
    """The cells on running real fleets (``fleets``: scheduling policy -> a fleet with ``engines`` and
    ``write_fleet_file``), each run after emptying that fleet's prefix caches."""
    runs: list[Run] = []
    for workload, users, spec in cells:
        scheduling = split_spec(spec)[1] or "fcfs"
        fleet = fleets[scheduling]
        with run_folder() as workdir:
            try:
                reset_prefix_caches(fleet.engines)
            except (RuntimeError, httpx.HTTPError) as exc:
                run = Run(workload, users, spec, backend.name, error=f"reset: {exc}"[:300])
            else:
                run = measure(
                    workload, users, spec, fleet, fleet.engines, workdir, backend, run_time_s=run_time_s,
                    think_mean_s=think_mean_s, peers_dir=peers_dir, out=out, warmup_s=warmup_s,
                )  # fmt: skip
        runs.append(_tidy(run, workdir))
        on_run(run)
    return runs


def keep_logs_and_remove(workdir: Path, logs_to: Path) -> None:
    """Copy a stopped fleet's engine logs (``*.log``) into ``logs_to``, then remove its work folder."""
    logs = sorted(workdir.glob("*.log"))
    if logs:
        logs_to.mkdir(parents=True, exist_ok=True)
        for log in logs:
            shutil.copyfile(log, logs_to / log.name)
    shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def vllm_fleets(args: argparse.Namespace, schedulings: set[str]) -> Iterator[tuple[dict[str, Any], Path]]:
    """The real fleets the targets need ({scheduling: fleet}) and the model folder: the given fleet
    files, else fleets of ``--engines`` vLLM CPU engines started here (minutes) and stopped after."""
    given = {"fcfs": args.fleet_file, "priority": args.priority_fleet_file}
    fleets: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        model_dir = args.model_dir
        for scheduling in sorted(schedulings):
            if given[scheduling] is not None:
                if model_dir is None:
                    raise SystemExit(
                        "--model-dir: the running fleets' model folder (for the router's tokenizer)"
                    )
                fleets[scheduling] = FleetFile.read(given[scheduling])
                pools = sorted(
                    {e.storage_pool for e in fleets[scheduling].engines if storage_folder(e.storage_pool)}
                )
                if pools:
                    # Its block files would carry one run's history into the next; the bench empties
                    # only the pools of the fleets it starts (--storage), never somebody else's.
                    raise SystemExit(
                        f"{given[scheduling]}: the engines keep a STORAGE pool on disk ({', '.join(pools)}),"
                        " which the bench will not empty between runs; start the fleets here with --storage"
                    )
                continue
            workdir = Path(tempfile.mkdtemp(prefix=f"vllmq-{scheduling}-"))
            # Runs after the fleet has stopped (an ExitStack unwinds last in, first out): the engine
            # logs go to --out beside the results, the rest (the model folder, the STORAGE pool's
            # block files, hundreds of MB) goes.
            stack.callback(keep_logs_and_remove, workdir, args.out / "engine-logs" / scheduling)
            storage = str(workdir / "kv-storage") if args.storage else ""
            fleet = stack.enter_context(VllmCpuFleet(workdir))
            print(f"starting {args.engines} vLLM CPU engines ({scheduling}; minutes) ...", file=sys.stderr)
            fleet.start(
                args.engines,
                replace(
                    VLLM_PROFILE,
                    gpu_blocks=args.gpu_blocks,
                    cpu_blocks=args.cpu_blocks,
                    storage_dir=storage,
                    scheduling_policy=scheduling,
                ),
            )
            fleets[scheduling] = fleet
            model_dir = model_dir or fleet.model_dir
        yield fleets, Path(model_dir)


def des_ladder(
    policy: str, users: int, run_time_s: int, think_mean_s: float, engines_n: int, prof: FleetProfile
) -> dict[str, Any]:
    """The same ladder on the same fleet in the offline simulator (virtual time)."""
    from sim.des import SimConfig, simulate
    from sim.engine import EngineProfile
    from sim.fleets import EngineSpec, FleetSpec
    from sim.workloads import LadderConfig, ladder_workload

    workload = ladder_workload(
        LadderConfig(
            first_prompt_tokens=LADDER["first"],
            system_prefix_tokens=LADDER["system"],
            tokens_per_turn=LADDER["per_turn"],
            turns=LADDER["turns"],
            answer_min_tokens=LADDER["answer"],
            answer_max_tokens=LADDER["answer"],
            think_time_mean_s=think_mean_s,
            concurrency=users,
            duration_s=float(run_time_s),
            block_size=prof.block_size,
        )
    )
    engine = EngineProfile(
        block_size=prof.block_size,
        num_gpu_blocks=prof.gpu_blocks,
        num_cpu_blocks=prof.cpu_blocks,
        scheduling_policy=prof.scheduling_policy,
    )
    fleet = FleetSpec(
        [EngineSpec(f"e{i}", engine) for i in range(engines_n)], storage_pool_blocks=prof.storage_blocks
    )
    r = simulate(workload, policy, fleet, SimConfig(token_mode=True, seed=0))
    return {
        "ttft_p50_s": r.ttft_p50_s,
        "ttft_p90_s": r.ttft_p90_s,
        "ttft_p99_s": r.ttft_p99_s,
        "turns_per_s": r.turns_per_s,
        "hit_gpu": r.hit_gpu,
        "hit_cpu": r.hit_cpu,
        "hit_storage": r.hit_storage,
    }


def fmt_runs(runs: Sequence[Run]) -> str:
    lines = [
        "| workload | users | router | TTFT p50 s | p90 s | p99 s | turns/s | cached GPU | CPU | STORAGE "
        "| cached / prompt | imbalance | TTFT / predicted | escalated | evicted blocks | failed "
        "| cut at the end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if r.error:
            lines.append(f"| {r.workload} | {r.users} | {r.target} | failed: {r.error} ||||||||||||||")
            continue
        c = r.cached or {}
        frac = sum(c.values()) / r.prompt_tokens if r.prompt_tokens else float("nan")
        lines.append(
            f"| {r.workload} | {r.users} | {r.target} | {r.ttft_p50_s:.3f} | {r.ttft_p90_s:.3f} "
            f"| {r.ttft_p99_s:.3f} | {r.turns_per_s:.2f} | {c.get('GPU', 0):.0f} | {c.get('CPU', 0):.0f} "
            f"| {c.get('STORAGE', 0):.0f} | {frac:.3f} | {r.imbalance:.2f} | {_ratio(r.ttft_over_predicted)}"
            f" | {r.escalations} | {r.removed_blocks} | {r.failures} | {r.unfinished} |"
        )
    return "\n".join(lines)


def _ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"  # a peer predicts nothing: "-"


def runs_by_target(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """A quality.json this bench wrote, read back: each target's successful runs, in run order (the
    k-th is its k-th repeat: the bench interleaves the repeats). The round scripts' reader."""
    out: dict[str, list[dict[str, Any]]] = {}
    for run in json.loads(Path(path).read_text())["runs"]:
        if not run["error"]:
            out.setdefault(run["target"], []).append(run)
    return out


def pair_table(
    runs: dict[str, list[dict[str, Any]]], names: dict[str, str], pairs: Sequence[tuple[str, str]]
) -> None:
    """Print, per pair (base, other) of ``names`` (short name -> target), the p50 speed-ups and p99
    ratios repeat by repeat and their medians: the round scripts' verdict table."""
    print("| pair | p50 speed-up (base / other), per repeat | median | p99 ratio (other / base) | median |")
    print("|---|---|---|---|---|")
    for base, other in pairs:
        a, b = runs[names[base]], runs[names[other]]
        up = [x["ttft_p50_s"] / y["ttft_p50_s"] for x, y in zip(a, b, strict=True)]
        tail = [y["ttft_p99_s"] / x["ttft_p99_s"] for x, y in zip(a, b, strict=True)]
        print(
            f"| {other} vs {base} | {', '.join(f'{v:.2f}' for v in up)} | {statistics.median(up):.2f} "
            f"| {', '.join(f'{v:.2f}' for v in tail)} | {statistics.median(tail):.2f} |"
        )


def round_report(path: str | Path, names: dict[str, str], pairs: Sequence[tuple[str, str]]) -> None:
    """A live round's report from its quality.json: ``pair_table``, then each target's runs (the
    cached share of the prompt by tier, the imbalance, the escalated turns)."""
    runs = runs_by_target(path)
    pair_table(runs, names, pairs)
    print()
    print("Per run: cached share of the prompt (GPU + CPU + STORAGE) / imbalance / escalated turns")
    for name, target in names.items():
        cells = []
        for r in runs.get(target, []):
            c = r["cached"] or {}
            share = {t: c.get(t, 0.0) / r["prompt_tokens"] for t in ("GPU", "CPU", "STORAGE")}
            cells.append(
                f"{sum(share.values()):.2f} ({share['GPU']:.2f}+{share['CPU']:.2f}+{share['STORAGE']:.2f})"
                f" / {r['imbalance']:.2f} / {r['escalations']}"
            )
        print(f"- {name}: {', '.join(cells)}")


def by_cell(runs: Sequence[Run]) -> dict[tuple[str, int, str], list[Run]]:
    """The runs without an error, by (workload, users, router), in run order."""
    groups: dict[tuple[str, int, str], list[Run]] = {}
    for r in runs:
        if not r.error:
            groups.setdefault((r.workload, r.users, r.target), []).append(r)
    return groups


def fmt_phases(runs: Sequence[Run]) -> str:
    """Per (workload, users, router), medians over the repeats [min-max]: the client's TTFT against
    the engines' own phases (``PHASE_HISTOGRAMS``), p50 and p99 each."""
    groups = by_cell([r for r in runs if r.phases])
    lines = [
        "| workload | users | router | runs | client TTFT p50 / p99 s | engine TTFT p50 / p99 s "
        "| queue p50 / p99 s | prefill p50 / p99 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (workload, users, target), rs in groups.items():
        cells = [f"{median_span([r.ttft_p50_s for r in rs])} / {median_span([r.ttft_p99_s for r in rs])}"]
        for phase in PHASE_HISTOGRAMS:
            got = [r.phases[phase] for r in rs if phase in r.phases]
            cells.append(
                f"{median_span([g[0] for g in got])} / {median_span([g[1] for g in got])}" if got else "-"
            )
        lines.append(f"| {workload} | {users} | {target} | {len(rs)} | {' | '.join(cells)} |")
    return "\n".join(lines)


def fmt_summary(runs: Sequence[Run]) -> str:
    """Per (workload, users, router): median [min-max] over the repeats."""
    groups = by_cell(runs)
    lines = [
        "| workload | users | router | runs | TTFT p50 s | p90 s | p99 s | turns/s | cached / prompt "
        "| x rr | TTFT / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, users, target), rs in groups.items():
        rr = groups.get((workload, users, "kvroute:round_robin"))
        p50 = statistics.median(r.ttft_p50_s for r in rs)
        ratio = f"{statistics.median(r.ttft_p50_s for r in rr) / p50:.2f}" if rr and p50 > 0 else "-"
        fracs = [sum((r.cached or {}).values()) / r.prompt_tokens for r in rs if r.prompt_tokens]
        preds = [r.ttft_over_predicted for r in rs if not math.isnan(r.ttft_over_predicted)]
        lines.append(
            f"| {workload} | {users} | {target} | {len(rs)} | {median_span([r.ttft_p50_s for r in rs])} "
            f"| {median_span([r.ttft_p90_s for r in rs])} | {median_span([r.ttft_p99_s for r in rs])} "
            f"| {median_span([r.turns_per_s for r in rs], '.2f')} "
            f"| {median_span(fracs) if fracs else '-'} | {ratio} "
            f"| {median_span(preds, '.2f') if preds else '-'} |"
        )
    return "\n".join(lines)


def fmt_b1_live(runs: Sequence[Run], des: dict[tuple[str, int], dict[str, Any]]) -> str:
    lines = [
        "| users | policy | live TTFT p50 s | DES p50 s | live p90 s | DES p90 s | live turns/s "
        "| DES turns/s "
        "| live cached/prompt | DES hit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if r.workload != "ladder" or not r.target.startswith("kvroute:") or r.error:
            continue
        d = des.get((r.target.split(":", 1)[1], r.users))
        if d is None:
            continue
        c = r.cached or {}
        frac = sum(c.values()) / r.prompt_tokens if r.prompt_tokens else float("nan")
        lines.append(
            f"| {r.users} | {r.target.split(':', 1)[1]} | {r.ttft_p50_s:.3f} | {d['ttft_p50_s']:.3f} "
            f"| {r.ttft_p90_s:.3f} | {d['ttft_p90_s']:.3f} | {r.turns_per_s:.2f} | {d['turns_per_s']:.2f} "
            f"| {frac:.3f} | {d['hit_gpu'] + d['hit_cpu'] + d['hit_storage']:.3f} |"
        )
    return "\n".join(lines)


def plot(runs: Sequence[Run], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ladder = [r for r in runs if r.workload == "ladder" and not r.error]
    if not ladder:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for target in dict.fromkeys(r.target for r in ladder):
        pts = sorted((r.users, r.ttft_p50_s, r.turns_per_s) for r in ladder if r.target == target)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=target)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=target)
    axes[0].set_title("TTFT p50 (s), live ladder")
    axes[1].set_title("turns/s")
    for ax in axes:
        ax.set_xlabel("concurrent conversations (Locust users)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "quality_ladder.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_quality_live", description=__doc__)
    parser.add_argument(
        "--backend",
        choices=("sim", "vllm-cpu"),
        default="sim",
        help="sim: a fresh simulated fleet per run; vllm-cpu: real vLLM CPU engines, started once (or"
        " --fleet-file), their prefix caches emptied before every run",
    )
    parser.add_argument(
        "--targets",
        default=None,
        help="ROUTER[#VARIANT][@priority],...: @priority runs on engines with --scheduling-policy priority;"
        " #VARIANT (kvroute) runs with a --variant config (default:"
        f" sim {','.join(DEFAULT_TARGETS)}; vllm-cpu {','.join(VLLM_TARGETS)})",
    )
    parser.add_argument(
        "--ladder-users",
        default=None,
        help="ladder concurrencies (default sim 32,64: HBM holds ~20; vllm-cpu 8)",
    )
    parser.add_argument(
        "--agentic-users", default=None, help="agentic concurrencies ('' = skip; default sim 8)"
    )
    parser.add_argument("--time", type=int, default=60, help="seconds of Locust per run (measured)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="seconds of Locust before --time whose turns are not measured (the users' ramp-up)",
    )
    parser.add_argument("--think-time-mean", type=float, default=2.0)
    parser.add_argument(
        "--engines", type=int, default=None, help="engines per fleet (default sim 4, vllm-cpu 2)"
    )
    parser.add_argument(
        "--storage-blocks",
        type=int,
        default=QUALITY_PROFILE.storage_blocks,
        help="sim: shared STORAGE pool size in blocks (0 = no storage tier: misses are recomputed)",
    )
    parser.add_argument(
        "--scheduling",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="sim: the engines' vLLM --scheduling-policy for targets without @; priority: kvroute sends each"
        " request's predicted own service as its priority (the peers send none, so their requests are"
        " served in arrival order)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per cell, interleaved: repeat r runs every target once, in an order rotated by r;"
        " medians and ranges reported",
    )
    parser.add_argument(
        "--des", action="store_true", help="sim: also simulate kvroute's ladder rows (B1 live)"
    )
    parser.add_argument("--fleet-file", type=Path, default=None, help="vllm-cpu: a running fcfs fleet's file")
    parser.add_argument(
        "--priority-fleet-file", type=Path, default=None, help="vllm-cpu: a running priority fleet's file"
    )
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="vllm-cpu: the running fleets' model folder"
    )
    parser.add_argument(
        "--gpu-blocks",
        type=int,
        default=VLLM_PROFILE.gpu_blocks,
        help=f"vllm-cpu fleets started here: KV blocks per engine (default {VLLM_PROFILE.gpu_blocks})",
    )
    parser.add_argument(
        "--cpu-blocks",
        type=int,
        default=0,
        help="vllm-cpu fleets started here: a CPU tier of N blocks per engine (sim/vllm_host_offload.py;"
        " default 0, none)",
    )
    parser.add_argument(
        "--storage",
        action="store_true",
        help="vllm-cpu fleets started here: a STORAGE tier behind the CPU tier, vLLM's fs tier on one"
        " folder per fleet (one pool; its block files are deleted before every run)",
    )
    parser.add_argument("--peers-dir", type=Path, default=default_peers_dir())
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a kvroute config variant: target kvroute:POLICY#NAME runs `kvroute serve --config FILE`"
        " (e.g. an A/B of one config key, interleaved like any two targets)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench/quality"))
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    real = args.backend == "vllm-cpu"
    if real and args.des:
        parser.error("--des simulates the sim fleet's rows; with vllm-cpu use loadtest/calib_compare.py")
    if (args.cpu_blocks or args.storage) and not real:
        parser.error("--cpu-blocks and --storage are for --backend vllm-cpu (the sim fleet has its tiers)")
    if args.storage and args.cpu_blocks < 1:
        parser.error("--storage sits behind a CPU tier: give --cpu-blocks N (at least one request's blocks)")
    exit_on_sigterm()
    targets = [
        t for t in (args.targets or ",".join(VLLM_TARGETS if real else DEFAULT_TARGETS)).split(",") if t
    ]
    variants: dict[str, str] = {}
    for item in args.variant:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path).is_file():
            parser.error(
                f"--variant {item!r}: expected NAME=FILE with FILE a kvroute TOML config that exists"
            )
        variants[name] = str(Path(path).resolve())
    for t in targets:
        try:
            split_spec(t)
        except ValueError as exc:
            parser.error(str(exc))
        if variant_of(t) and variant_of(t) not in variants:
            parser.error(f"target {t!r}: no --variant {variant_of(t)}=FILE given")
    ladder_users = args.ladder_users if args.ladder_users is not None else ("8" if real else "32,64")
    agentic_users = args.agentic_users if args.agentic_users is not None else ("" if real else "8")
    args.engines = args.engines or (2 if real else 4)
    args.out.mkdir(parents=True, exist_ok=True)
    plan = [("ladder", int(u)) for u in ladder_users.split(",") if u]
    plan += [("agentic", int(u)) for u in agentic_users.split(",") if u]
    profile = replace(QUALITY_PROFILE, storage_blocks=args.storage_blocks, scheduling_policy=args.scheduling)
    started = time.time()
    # Repeats are interleaved (every cell once, then again) and each repeat's order is rotated, so a
    # noisy spell of the machine, or a slot in the order, hits every router rather than one.
    cells = []
    for r in range(max(1, args.repeats)):
        shift = r % len(targets)
        order = targets[shift:] + targets[:shift]
        cells += [(w, u, spec) for w, u in plan for spec in order]

    def show(run: Run) -> None:
        print(time.strftime("%H:%M:%S ") + fmt_runs([run]).splitlines()[-1], file=sys.stderr, flush=True)

    runs: list[Run] = []
    if real:
        schedulings = {split_spec(t)[1] or "fcfs" for t in targets}
        with vllm_fleets(args, schedulings) as (fleets, model_dir):
            some = next(iter(fleets.values())).engines
            backend = Backend("vllm-cpu", "hf", str(model_dir), some[0].block_size, variants)
            fleet_note = (
                f"Fleet: real vLLM {VLLM_CPU_VERSION} CPU engines (sim/vllm_cpu.py), "
                + "; ".join(f"{k}: {len(f.engines)} engines" for k, f in sorted(fleets.items()))
                + f", {backend.block_size}-token blocks, "
                + (
                    "KV blocks and tiers as the given fleets were started"
                    if args.fleet_file or args.priority_fleet_file
                    else f"GPU KV {args.gpu_blocks} and CPU tier {args.cpu_blocks} blocks an engine"
                    + (", one STORAGE pool per fleet (vLLM's fs tier)" if args.storage else "")
                )
                + "; started once, prefix caches (tiers too) emptied (POST /reset_prefix_cache) before"
                " every run. kvroute: `--tokenizer hf` on the model folder."
            )
            runs = vllm_runs(
                cells, fleets, backend, run_time_s=args.time, think_mean_s=args.think_time_mean,
                peers_dir=args.peers_dir, out=args.out, on_run=show, warmup_s=args.warmup,
            )  # fmt: skip
    else:
        fleet_note = (
            f"Fleet: {args.engines} simulated engines, GPU {profile.gpu_blocks} x "
            f"{profile.block_size}-token blocks each, CPU {profile.cpu_blocks}, shared STORAGE "
            f"{profile.storage_blocks}, sha256_cbor hashes, vLLM scheduling {profile.scheduling_policy}, real"
            " time; fresh fleet per run."
        )
        for workload, users, spec in cells:
            run = one_run(
                workload, users, spec, engines_n=args.engines, profile=profile, run_time_s=args.time,
                think_mean_s=args.think_time_mean, peers_dir=args.peers_dir, out=args.out,
                variants=variants, warmup_s=args.warmup,
            )  # fmt: skip
            runs.append(run)
            show(run)
    des: dict[tuple[str, int], dict[str, Any]] = {}
    if args.des:
        for workload, users in plan:
            if workload != "ladder":
                continue
            for spec in targets:
                if spec.startswith("kvroute:") and "@" not in spec and "#" not in spec:
                    policy = spec.split(":", 1)[1]
                    des[(policy, users)] = des_ladder(
                        policy, users, args.time, args.think_time_mean, args.engines, profile
                    )
    command = "python -m loadtest.bench_quality_live " + " ".join(sys.argv[1:] if argv is None else argv)
    cached_note = (
        "Cached tokens: the engines' `usage.prompt_tokens_details.cached_tokens` over the measured turns."
        if real
        else "Cached tokens: the engines' own counters, summed over the fleet."
    )
    parts = [
        f"Command: `{command}`",
        f"Machine: {machine_note()}; wall {time.time() - started:.0f} s.",
        f"{fleet_note} Ladder: {LADDER}, think time exp(mean {args.think_time_mean} s), {args.time} s of"
        f" Locust per run. {cached_note}",
        "Medians over repeats [min-max]; `x rr` = kvroute round_robin's median TTFT p50 / this one's:",
        fmt_summary(runs),
        "Every run:",
        fmt_runs(runs),
    ]
    if any(r.phases for r in runs):
        parts += [
            "Where the time went: the client's TTFT against the engines' own histograms (vLLM's"
            " arrival, after its API server tokenized the prompt -> first token; the wait for the"
            " scheduler; the prefill), p50 and p99 interpolated within vLLM's buckets, medians over"
            " repeats [min-max]:",
            fmt_phases(runs),
        ]
    if des:
        parts += ["B1 live vs DES (kvroute policies, same ladder and fleet):", fmt_b1_live(runs, des)]
    parts += [f"![{p.stem}]({p.name})" for p in plot(runs, args.out)]
    text = "\n\n".join(parts) + "\n"
    (args.out / "quality.md").write_text(text)
    (args.out / "quality.json").write_text(
        json.dumps(
            {
                "runs": [r.__dict__ if hasattr(r, "__dict__") else _asdict(r) for r in runs],
                "des": {f"{k[0]}@{k[1]}": v for k, v in des.items()},
            },
            indent=1,
        )
    )
    print(text)
    return 0


def _asdict(run: Run) -> dict[str, Any]:
    return {name: getattr(run, name) for name in run.__slots__}  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
