"""The simulator against real engines: one small ladder workload (same conversations, same seed) live
through ``kvroute serve`` in front of a real fleet, and in the DES (sim/des.py) with a calibrated
engine profile (loadtest/calibrate_vllm.py). Per policy: hit rate (engine-reported cached prompt
tokens / prompt tokens) and TTFT p50/p90, side by side. ``--policies direct`` sends the same
requests round robin straight to the engines (no router in the path).

The DES replays the prompts the engines saw, block for block: every (conversation, turn) prompt is
tokenized by the engine (``/tokenize``, chat template applied) and each full block of token ids
becomes a block id chained on its predecessor, so shared and unshared prefixes are exactly vLLM's.
Each live run uses its own ``cache_salt`` so no run hits another's blocks (the engines are not
restarted between runs; their pools hold the same number of blocks either way).

    python -m loadtest.calib_compare --fleet fleet.json --model-dir runs/vllm/model \\
        --profile runs/calib/profile.json --policies round_robin,kv_fixed_credit,tier_cost
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from kvcore.stats import median_span, percentiles
from loadtest.calibrate_vllm import VLLM_CPU_MAX_NUM_SEQS, run_threads
from loadtest.procs import stop_process, wait_http_ok, wait_sources_connected
from router.config import EngineConfig, load_fleet_file
from sim.des import FleetSimulator, SimConfig
from sim.engine import EngineProfile
from sim.fleets import EngineSpec, FleetSpec, load_engine_profile, load_server_stages
from sim.server import free_port
from sim.workloads import Conversation, LadderConfig, Turn, Workload, ladder_workload

REPO = Path(__file__).resolve().parents[1]
#: Pseudo-policy: the client deals requests round robin straight to the engines (no router in the
#: path; simulated as round_robin): how much of the live TTFT the router adds.
DIRECT = "direct"


@dataclass(slots=True)
class TurnRecord:
    conv: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    #: Sent at this many seconds after the run started; the last chunk arrived ``end_s`` after it.
    start_s: float = 0.0
    end_s: float = 0.0
    #: The engine that served it (the router's x-kvroute-engine header, or the dealt engine).
    engine: str = ""


@dataclass(slots=True)
class Row:
    policy: str
    source: str  # "live" or "des"
    hit: float
    ttft_p50_s: float
    ttft_p90_s: float
    requests: int


def block_chain(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One id per full block, chained on the previous id (equal ids <=> equal prefix up to there)."""
    ids: list[int] = []
    parent = b""
    for i in range(len(token_ids) // block_size):
        h = hashlib.sha256(
            parent + json.dumps(list(token_ids[i * block_size : (i + 1) * block_size])).encode()
        )
        parent = h.digest()
        ids.append(int.from_bytes(parent[:8], "big") >> 1)
    return ids


def tokenize(engine_url: str, model: str, messages: list[dict[str, str]]) -> list[int]:
    r = httpx.post(f"{engine_url}/tokenize", json={"model": model, "messages": messages}, timeout=60)
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


def engine_workload(wl: Workload, engine_url: str, model: str, block_size: int) -> Workload:
    """``wl`` with each turn's token count and block ids as the engine tokenizes its messages."""
    convs = []
    for conv in wl.conversations:
        turns = []
        for k, turn in enumerate(conv.turns):
            ids = tokenize(engine_url, model, conv.messages(k))
            turns.append(Turn(len(ids), turn.output_tokens, block_chain(ids, block_size), turn.think_time_s))
        convs.append(Conversation(conv.conversation_id, turns, conv.start_s))
    return dataclasses.replace(wl, conversations=convs, ramp_s=0.0)


def write_workload(path: Path, wl: Workload) -> None:
    """The engine-tokenized turns (prompt tokens, output tokens, block ids, think time) as JSON."""
    convs = [
        [[t.prompt_tokens, t.output_tokens, t.block_ids, t.think_time_s] for t in c.turns]
        for c in wl.conversations
    ]
    path.write_text(json.dumps(convs) + "\n")


def read_workload(path: Path, wl: Workload) -> Workload:
    """``wl`` with the turns of ``write_workload``'s file (same conversations, in order)."""
    convs = json.loads(path.read_text())
    if len(convs) != len(wl.conversations):
        raise ValueError(f"{path}: {len(convs)} conversations, the workload has {len(wl.conversations)}")
    out = [
        Conversation(c.conversation_id, [Turn(p, o, list(b), th) for p, o, b, th in turns], c.start_s)
        for c, turns in zip(wl.conversations, convs, strict=True)
    ]
    return dataclasses.replace(wl, conversations=out, ramp_s=0.0)


def live_run(
    urls: Sequence[str], model: str, wl: Workload, salt: str, engine_ids: Sequence[str] = ()
) -> list[TurnRecord]:
    """Closed loop like the DES: ``wl.concurrency`` workers, each takes the next conversation and
    runs its turns (think time before each turn after the first), all workers start at once.
    ``urls``: the router's, or the engines' (requests dealt round robin: no router in the path;
    ``engine_ids`` name them)."""
    clients = [openai.OpenAI(base_url=f"{u}/v1", api_key="unused", timeout=600, max_retries=0) for u in urls]
    t_run = time.perf_counter()
    sent = [0]
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(wl.conversations)):
        todo.put(i)
    records: list[TurnRecord] = []
    lock = threading.Lock()

    def worker(_thread: int) -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            conv = wl.conversations[i]
            for k, turn in enumerate(conv.turns):
                if k:
                    time.sleep(turn.think_time_s)
                with lock:
                    dealt = sent[0] % len(clients)
                    sent[0] += 1
                rec = one_turn(clients[dealt], model, conv, k, turn, salt, t_run)
                rec.conv = i
                if engine_ids:
                    rec.engine = engine_ids[dealt]
                with lock:
                    records.append(rec)

    run_threads(wl.concurrency or 1, worker, "conversation workers")
    return records


def one_turn(
    client: openai.OpenAI, model: str, conv: Conversation, k: int, turn: Turn, salt: str, t_run: float
) -> TurnRecord:
    messages: Any = conv.messages(k)  # plain role/content dicts, as the SDK sends them
    t0 = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=turn.output_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": turn.output_tokens, "cache_salt": salt},
        temperature=0.0,
    )
    engine = raw.headers.get("x-kvroute-engine", "")
    stream = raw.parse()
    ttft = -1.0
    prompt = cached = 0
    for chunk in stream:
        if ttft < 0 and chunk.choices:  # vLLM's role chunk: the first output (calibrate_vllm.stream_once)
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
    if ttft < 0 or not prompt:
        raise RuntimeError(f"turn {k} of {conv.conversation_id}: no token or no usage")
    end = time.perf_counter()
    return TurnRecord(0, k, prompt, cached, ttft, t0 - t_run, end - t_run, engine)


#: vLLM's request-phase histograms (sums and counts; vLLM 0.32 v1/metrics/loggers.py): the engine
#: client's arrival (after the API server tokenized the prompt) -> first token, time waiting for the
#: scheduler, time in prefill steps, arrival -> finish, first scheduled -> finish.
ENGINE_PHASES = (
    "time_to_first_token_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "e2e_request_latency_seconds",
    "request_inference_time_seconds",
)
#: The router's own histograms: body received -> sent to the engine (parse, tokenize, route), and
#: body received -> first streamed event from the engine.
ROUTER_PHASES = ("kvroute_router_seconds", "kvroute_ttft_seconds")


def scrape_phases(urls: Sequence[str], phases: Sequence[str] = ENGINE_PHASES) -> dict[str, float]:
    """Each phase's sum and count over the /metrics of ``urls``."""
    out = {f"{ph}_{k}": 0.0 for ph in phases for k in ("sum", "count")}
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            key = name.split("{")[0].removeprefix("vllm:")
            if key in out:
                out[key] += float(value.split()[0])
    return out


def phase_means(
    before: dict[str, float], after: dict[str, float], phases: Sequence[str] = ENGINE_PHASES
) -> dict[str, float]:
    """Mean seconds per request of each phase between two scrapes."""
    means = {}
    for ph in phases:
        n = after[f"{ph}_count"] - before[f"{ph}_count"]
        means[ph] = (after[f"{ph}_sum"] - before[f"{ph}_sum"]) / n if n else float("nan")
    return means


def listening_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` on this host (Linux /proc), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    return None


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (vLLM's API server starts the engine core as a child)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_processes(urls: Sequence[str]) -> dict[str, int]:
    """{"<url> api": pid, "<url> core": pid, ...}: each engine's API server and its children."""
    out: dict[str, int] = {}
    for url in urls:
        pid = listening_pid(int(url.rsplit(":", 1)[1].split("/")[0]))
        if pid is None:
            continue
        tree = process_tree(pid)
        out[f"{url} api"] = pid
        for i, child in enumerate(tree[1:]):
            try:  # vLLM names its processes: VLLM::EngineCore, VLLM::Worker
                comm = Path(f"/proc/{child}/comm").read_text().strip().replace(" ", "_")
            except OSError:
                comm = "gone"
            out[f"{url} child{i}:{comm}"] = child
    return out


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def load_average() -> str:
    """The 1, 5 and 15-minute load averages (what ``uptime`` prints)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def summarize(policy: str, source: str, hit: float, ttfts: Sequence[float]) -> Row:
    p50, p90 = percentiles(ttfts, (50, 90))
    return Row(policy, source, hit, p50, p90, len(ttfts))


def start_router(fleet: Path, model_dir: Path, policy: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port("127.0.0.1")
    args = [
        sys.executable, "-m", "router.cli", "serve",
        "--fleet", str(fleet), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
        "--tokenizer", "hf", "--tokenizer-path", str(model_dir), "--log-level", "warning",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/health", proc, timeout_s=120, output=lambda: log.read_text(errors="replace"))
        wait_sources_connected(url, timeout_s=120.0)
    except BaseException:
        stop_process(proc)
        raise
    return proc, url


def fmt_table(rows: Sequence[Row]) -> str:
    by = {(r.policy, r.source): r for r in rows}
    lines = [
        "| policy | hit live | hit DES | diff | TTFT p50 live / DES s | ratio "
        "| TTFT p90 live / DES s | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy in dict.fromkeys(r.policy for r in rows):
        live, des = by.get((policy, "live")), by.get((policy, "des"))
        if live is None or des is None:
            continue
        lines.append(
            f"| {policy} | {live.hit:.3f} | {des.hit:.3f} | {des.hit - live.hit:+.3f} "
            f"| {live.ttft_p50_s:.3f} / {des.ttft_p50_s:.3f} | {des.ttft_p50_s / live.ttft_p50_s:.2f} "
            f"| {live.ttft_p90_s:.3f} / {des.ttft_p90_s:.3f} | {des.ttft_p90_s / live.ttft_p90_s:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.calib_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--fleet", type=Path, help="fleet file (kvroute fleet --fleet-file)")
    p.add_argument(
        "--model-dir", type=Path, required=True, help="the engines' model folder (router tokenizer)"
    )
    p.add_argument("--profile", type=Path, required=True, help="engine profile JSON (calibrate_vllm --out)")
    p.add_argument("--policies", default="round_robin,kv_fixed_credit,tier_cost")
    p.add_argument("--gpu-blocks", type=int, default=400, help="the engines' --num-gpu-blocks-override")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-prompt-tokens", type=int, default=1500)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--tokens-per-turn", type=int, default=800)
    p.add_argument("--answer-tokens", default="16,48")
    p.add_argument("--think-time-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=Path("runs/calib"))
    p.add_argument(
        "--no-stages",
        action="store_true",
        help="ignore the profile's server stages (the engine core only, plus the fixed request overhead)",
    )
    p.add_argument("--json", type=Path, help="write the rows and the live runs' records here")
    p.add_argument(
        "--live-json",
        type=Path,
        nargs="+",
        default=[],
        help="take the live runs from these earlier --json files instead of running them (the DES side "
        "only; with several, the live median and range per policy); with --workload-json, no engine "
        "is asked anything and --fleet may be left out (the files name the fleet)",
    )
    p.add_argument(
        "--workload-json",
        type=Path,
        help="the engine-tokenized workload: written here after /tokenize, or read from here if it exists",
    )
    args = p.parse_args(argv)
    if args.fleet is not None:
        engines = load_fleet_file(args.fleet)
    elif args.live_json:
        engines = [EngineConfig(**e) for e in json.loads(args.live_json[0].read_text()).get("fleet", [])]
    else:
        p.error("--fleet is required (or --live-json files that name the fleet)")
    if not engines:
        p.error(f"{args.fleet or args.live_json[0]}: no engines")
    block_size = engines[0].block_size or 32
    model = engines[0].model or "kvroute-tiny-llama"
    lo, hi = (int(x) for x in args.answer_tokens.split(","))
    wl = ladder_workload(
        LadderConfig(
            first_prompt_tokens=args.first_prompt_tokens,
            system_prefix_tokens=args.system_tokens,
            tokens_per_turn=args.tokens_per_turn,
            turns=args.turns,
            answer_min_tokens=lo,
            answer_max_tokens=hi,
            think_time_mean_s=args.think_time_s,
            concurrency=args.concurrency,
            total_conversations=args.conversations,
            block_size=block_size,
            seed=args.seed,
        )
    )
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.workload_json is not None and args.workload_json.is_file():
        des_wl = read_workload(args.workload_json, wl)
    else:
        des_wl = engine_workload(wl, engines[0].url.rstrip("/"), model, block_size)
        if args.workload_json is not None:
            write_workload(args.workload_json, des_wl)
    profile = EngineProfile(
        # (a profile from before calibrate_vllm wrote max_num_seqs gets vLLM CPU's)
        **{"max_num_seqs": VLLM_CPU_MAX_NUM_SEQS, **load_engine_profile(args.profile)},
        block_size=block_size,
        # vLLM's override counts its null block, which never holds KV.
        num_gpu_blocks=args.gpu_blocks - 1,
        # The fleet file says how the engines schedule; a priority fleet gets the router's priorities
        # live and in the DES.
        scheduling_policy=engines[0].scheduling_policy or "fcfs",
    )
    # vLLM's API server and the router as server stages (sim/frontend.py) when the calibration fitted
    # them; else the API server's per-request cost (HTTP, chat template, tokenization) measured one
    # request at a time is added to each simulated TTFT.
    api_stage, router_stage = load_server_stages(args.profile) if not args.no_stages else (None, None)
    request_overhead_s = (
        0.0
        if api_stage is not None
        else float(json.loads(args.profile.read_text()).get("request_overhead_s", 0.0))
    )
    rows: list[Row] = []
    phases = [
        "| policy | client TTFT | router first event | router decision "
        "| engine TTFT (arrival -> first token) "
        "| queued | prefill | DES TTFT | run (UTC, load) | CPU s: vLLM workers / engine cores / API servers "
        "/ router, in wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    saved = [json.loads(f.read_text())["runs"] for f in args.live_json]
    runs: dict[str, Any] = {}
    repeats: dict[str, list[Row]] = {}
    for policy in [x.strip() for x in args.policies.split(",") if x.strip()]:
        for f, doc in zip(args.live_json, saved, strict=True):
            if policy not in doc:
                p.error(f"--live-json {f} has no run of {policy!r} ({', '.join(doc)})")
        fleet = FleetSpec(
            [EngineSpec(e.id, dataclasses.replace(profile)) for e in engines],
            api_server=api_stage,
            router_stage=None if policy == DIRECT else router_stage,
        )
        des_policy = "round_robin" if policy == DIRECT else policy
        res = FleetSimulator(des_wl, des_policy, fleet, SimConfig(seed=args.seed)).run()
        des_row = summarize(policy, "des", res.hit, [t + request_overhead_s for t in res.ttfts_s])
        live_runs = [doc[policy] for doc in saved] or [live_policy_run(policy, args, engines, model, wl)]
        runs[policy] = live_runs[0]
        for run in live_runs:
            recs = [TurnRecord(**r) for r in run["records"]]
            check_prompts(recs, des_wl)
            hit = sum(r.cached_tokens for r in recs) / sum(r.prompt_tokens for r in recs)
            live_row = summarize(policy, "live", hit, [r.ttft_s for r in recs])
            repeats.setdefault(policy, []).append(live_row)
            means, rmeans = run["engine_phases"], run["router_phases"]
            phases.append(
                f"| {policy} | {statistics.mean(r.ttft_s for r in recs):.3f} "
                f"| {rmeans.get('kvroute_ttft_seconds', math.nan):.3f} "
                f"| {rmeans.get('kvroute_router_seconds', math.nan):.4f} "
                f"| {means['time_to_first_token_seconds']:.3f} | {means['request_queue_time_seconds']:.3f} "
                f"| {means['request_prefill_time_seconds']:.3f} "
                f"| {statistics.mean(res.ttfts_s) + request_overhead_s:.3f} "
                f"| {run.get('utc', '?')} ({run['load'][0].split()[0]} -> {run['load'][1].split()[0]}) "
                f"| {cpu_split(run['cpu_s'])} in {run['wall_s']:.1f} |"
            )
        rows += [repeats[policy][0], des_row]
        print(f"{policy}: live {repeats[policy]}, des {des_row}", file=sys.stderr)
    if len(args.live_json) > 1:
        print(fmt_repeats_table(repeats, {r.policy: r for r in rows if r.source == "des"}))
    else:
        print(fmt_table(rows))
    print(
        "\nmean seconds per request: the client's TTFT; the router's (body received -> first event from "
        "the engine; decision: body received -> sent); vLLM's /metrics histograms (the engine client's "
        "arrival, after the API server tokenized the prompt, -> first token; waiting; prefill steps); "
        "the DES's TTFT"
    )
    print("\n".join(phases))
    if args.json:
        fleet_doc = [
            {"id": e.id, "url": e.url, "block_size": e.block_size, "model": e.model,
             "scheduling_policy": e.scheduling_policy}
            for e in engines
        ]  # fmt: skip
        args.json.write_text(
            json.dumps(
                {"rows": [dataclasses.asdict(r) for r in rows], "runs": runs, "fleet": fleet_doc}, indent=1
            )
            + "\n"
        )
    return 0


def cpu_split(cpu_s: dict[str, float]) -> str:
    """CPU seconds of a run by kind of process (``engine_processes`` names: "<url> api" the API
    server, "<url> childN:VLLM::EngineCore" / ":VLLM::Worker" its children; runs saved before the
    names were recorded say child0 / child1, which were the engine core and the worker)."""
    kinds = {"worker": 0.0, "core": 0.0, "api": 0.0}
    for name, secs in cpu_s.items():
        kind = name.rsplit(" ", 1)[-1]
        if kind == "api":
            kinds["api"] += secs
        elif kind.endswith("Worker") or kind == "child1":
            kinds["worker"] += secs
        elif kind.endswith("EngineCore") or kind == "child0":
            kinds["core"] += secs
    router = cpu_s.get("router", 0.0)
    return f"{kinds['worker']:.1f} / {kinds['core']:.1f} / {kinds['api']:.1f} / {router:.1f}"


def check_prompts(recs: Sequence[TurnRecord], des_wl: Workload) -> None:
    """Warn when the engine counted other prompt lengths than /tokenize gave the DES."""
    want = {
        (i, k): t.prompt_tokens for i, c in enumerate(des_wl.conversations) for k, t in enumerate(c.turns)
    }
    off = [
        (r.conv, r.turn, r.prompt_tokens, want[(r.conv, r.turn)])
        for r in recs
        if r.prompt_tokens != want[(r.conv, r.turn)]
    ]
    if off:
        print(f"  warning: {len(off)} prompts differ from /tokenize (first {off[0]})", file=sys.stderr)


def fmt_repeats_table(repeats: dict[str, list[Row]], des: dict[str, Row]) -> str:
    """Several live runs per policy against the one DES run: the live median [min - max] of each
    figure, and the DES over the live median."""

    lines = [
        "| policy | runs | hit live | hit DES | diff | TTFT p50 live | DES | DES/live "
        "| TTFT p90 live | DES | DES/live |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, live in repeats.items():
        d = des[policy]
        hit = statistics.median(r.hit for r in live)
        p50 = statistics.median(r.ttft_p50_s for r in live)
        p90 = statistics.median(r.ttft_p90_s for r in live)
        lines.append(
            f"| {policy} | {len(live)} | {median_span([r.hit for r in live], single_bare=False)} "
            f"| {d.hit:.3f} | {d.hit - hit:+.3f} "
            f"| {median_span([r.ttft_p50_s for r in live], single_bare=False)} "
            f"| {d.ttft_p50_s:.3f} | {d.ttft_p50_s / p50:.2f} "
            f"| {median_span([r.ttft_p90_s for r in live], single_bare=False)} "
            f"| {d.ttft_p90_s:.3f} | {d.ttft_p90_s / p90:.2f} |"
        )
    return "\n".join(lines)


def live_policy_run(
    policy: str, args: argparse.Namespace, engines: Sequence[Any], model: str, wl: Workload
) -> dict[str, Any]:
    """One live run of ``wl`` (through a fresh router, or ``direct``): per-turn records, vLLM's and the
    router's phase means, CPU seconds of each engine process, the load average before and after."""
    salt = f"calib-{policy}-{uuid.uuid4().hex[:8]}"
    engine_urls = [e.url.rstrip("/") for e in engines]
    pids = engine_processes(engine_urls)
    load_before = load_average()
    before = scrape_phases(engine_urls)
    rmeans: dict[str, float] = {}
    if policy == DIRECT:
        cpu0 = cpu_snapshot(pids)
        t0 = time.monotonic()
        recs = live_run(engine_urls, model, wl, salt, [e.id for e in engines])
    else:
        proc, url = start_router(args.fleet, args.model_dir, policy, args.workdir / f"router-{policy}.log")
        try:
            pids["router"] = proc.pid
            rbefore = scrape_phases([url], ROUTER_PHASES)
            cpu0 = cpu_snapshot(pids)
            t0 = time.monotonic()
            recs = live_run([url], model, wl, salt)
            rmeans = phase_means(rbefore, scrape_phases([url], ROUTER_PHASES), ROUTER_PHASES)
        finally:
            cpu1 = cpu_snapshot(pids)
            stop_process(proc)
    wall = time.monotonic() - t0
    if policy == DIRECT:
        cpu1 = cpu_snapshot(pids)
    return {
        "records": [dataclasses.asdict(r) for r in recs],
        "engine_phases": phase_means(before, scrape_phases(engine_urls)),
        "router_phases": rmeans,
        "cpu_s": {k: cpu1[k] - cpu0[k] for k in pids},
        "wall_s": wall,
        "load": [load_before, load_average()],
        "utc": time.strftime("%H:%M:%S", time.gmtime()),
    }


if __name__ == "__main__":
    raise SystemExit(main())
