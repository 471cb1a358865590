"""``kvroute sim``: sweeps of the offline fleet simulator (sim/des.py) over fleets, policies,
concurrencies, storage sizes and seeds, with result files and one progress bar."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcore.core import (
    ADMISSION_FORMS,
    ESCALATE_PICKS,
    HOLD_ORDERS,
    HOLD_PICKS,
    PRIORITY_FCFS_FACTOR,
    PRIORITY_MAX_OVERTAKE_S,
    PRIORITY_RECOMPUTE_BELOW,
    PRIORITY_RECOMPUTE_FCFS_FACTOR,
    PRIORITY_STRETCH,
    PRIORITY_WAITS,
    SCHEDULING_POLICIES,
    check_hold,
    check_priority_fcfs_factor,
    check_priority_max_overtake,
    check_priority_stretch,
    check_recompute_below,
)
from policies.base import (
    build_policy,
)
from sim.des import (
    DEFAULT_POLICIES,
    SimConfig,
    SimResult,
    _Progress,
    simulate,
)
from sim.engine import EngineProfile
from sim.fleets import (
    ENGINE_MODELS,
    ROUTER_PRIORS,
    SHARED_POOL_BANDWIDTH_PER_ENGINE,
    FleetSpec,
    b1_fleet,
    load_engine_profile,
    load_server_stages,
    parse_storage,
    storage_blocks_for,
    working_set_blocks,
)
from sim.workloads import (
    DATA_TRACES,
    NAMED_TRACES,
    LadderConfig,
    Workload,
    agentic_workload,
    ladder_workload,
    mooncake_workload,
    read_agentic_sessions,
    read_mooncake_records,
)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------- CLI


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _storage_list(text: str) -> list[str]:
    try:
        values = [parse_storage(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values:
        raise argparse.ArgumentTypeError("--storage needs at least one value")
    return values


def _storage_bandwidth(text: str) -> float | str | None:
    value = text.strip().lower()
    if value in ("default", "none"):
        return None if value == "none" else "default"
    try:
        bandwidth = float(value)
    except ValueError:
        bandwidth = -1.0
    if not bandwidth > 0:
        raise ValueError(
            f"--storage-bandwidth {text!r}: accepted values are default, none or bytes per second > 0"
        )
    return bandwidth


def _fleet_options(args: argparse.Namespace) -> dict[str, Any]:
    """b1_fleet keyword arguments from the fleet CLI options (storage size aside)."""
    if not 0 <= args.engine_variation < 1:
        raise ValueError(f"--engine-variation must be in [0, 1), got {args.engine_variation}")
    if args.counter_noise < 0:
        raise ValueError(f"--counter-noise must be >= 0, got {args.counter_noise}")
    return {
        "storage_shared_bytes_per_s": _storage_bandwidth(args.storage_bandwidth),
        "engine_model": args.engine_model,
        "engine_variation": args.engine_variation,
        "variation_seed": args.seed,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute sim",
        description="Discrete-event simulation of a simulated-vLLM fleet behind routing policies "
        "(virtual time, deterministic for a seed).",
    )
    src = p.add_argument_group("workload")
    src.add_argument(
        "--workload", default="ladder", choices=["ladder"], help="synthetic workload (default ladder)"
    )
    src.add_argument(
        "--trace",
        help="replay a trace instead: a Mooncake JSONL file, an agentic-session directory / JSON file, or "
        "a trace the repository carries: "
        + ", ".join(
            f"{name} ({path.relative_to(DATA_TRACES.parent.parent)})" for name, path in NAMED_TRACES.items()
        ),
    )
    src.add_argument(
        "--trace-format",
        choices=["mooncake", "agentic"],
        help="default: agentic for a directory or .json, mooncake otherwise",
    )
    src.add_argument("--speed", type=float, default=1.0, help="trace time compression (2 = twice as fast)")
    src.add_argument("--limit", type=int, help="trace: first N requests (Mooncake) or sessions (agentic)")
    src.add_argument("--stagger-s", type=float, default=30.0, help="agentic: start offset between sessions")
    src.add_argument(
        "--concurrency",
        type=_int_list,
        default=[16, 32, 64],
        help="ladder: comma-separated concurrent conversations (default 16,32,64: with the 8 default "
        "policies about 2 CPU-minutes, 1-2 minutes on 2 cores; the B1 figures use 16,32,64,128,256)",
    )
    src.add_argument(
        "--duration-s",
        type=float,
        default=None,
        metavar="D",
        help="ladder: conversations start for D seconds instead of --conversations; the ones started"
        " run all their turns (Locust's --run-time with the --stop-timeout loadtest/load.py gives:"
        " each user finishes its conversation)",
    )
    src.add_argument(
        "--conversations",
        type=float,
        default=2.0,
        help="ladder: conversations per run as a multiple of the concurrency (default 2)",
    )
    src.add_argument("--turns", type=int, default=8)
    src.add_argument("--first-prompt-tokens", type=int, default=12_000)
    src.add_argument("--system-tokens", type=int, default=1_000)
    src.add_argument("--tokens-per-turn", type=int, default=4_000)
    src.add_argument("--answer-tokens", default="200,500", help="ladder: min,max answer tokens")
    src.add_argument("--think-time-s", type=float, default=10.0, help="ladder: mean exponential think time")
    src.add_argument(
        "--block-size",
        type=int,
        default=64,
        help="ladder: tokens per KV block (engines and block ids; default 64: token counts and timings "
        "stay full size, the per-block work is 4x less than vLLM's 16); larger = faster, coarser",
    )
    fl = p.add_argument_group("fleet")
    fl.add_argument("--engines", type=_int_list, default=[4], help="engine counts (comma-separated)")
    fl.add_argument(
        "--fleet",
        choices=["b1", "hetero"],
        default="b1",
        help="b1 = homogeneous; hetero = B1b (slow CPU on 2 engines, slow storage on 1, "
        "noisy neighbour halfway)",
    )
    fl.add_argument(
        "--hbm-conversations",
        type=float,
        default=64.0,
        help="ladder: size GPU pools so the fleet's HBM holds this many average conversations",
    )
    fl.add_argument(
        "--gpu-blocks",
        type=int,
        default=None,
        metavar="N",
        help="ladder: each engine's GPU pool is exactly N blocks (a real fleet's, e.g. vLLM's"
        " --num-gpu-blocks-override), instead of the size from --hbm-conversations",
    )
    fl.add_argument(
        "--cpu-ratio",
        type=float,
        default=None,
        help="ladder: each engine's CPU offload tier in blocks, as a multiple of its GPU pool (default 2;"
        " 0 = no CPU tier, as vLLM's CPU build here)",
    )
    fl.add_argument(
        "--storage",
        type=_storage_list,
        default=["unbounded"],
        help="shared STORAGE pool size, comma-separated for a sweep: none, unbounded, a block count, "
        "or a fraction of the workload's working set (1/4, 0.5). Default unbounded",
    )
    fl.add_argument(
        "--storage-bandwidth",
        default="default",
        help="the shared pool's aggregate bytes/s (reads + writes of all engines), 'none' for no shared "
        f"limit; default {SHARED_POOL_BANDWIDTH_PER_ENGINE:g} x engines x one engine's storage read rate",
    )
    fl.add_argument(
        "--engine-model",
        choices=ENGINE_MODELS,
        default="vllm",
        help="vllm = asynchronous KV loads + context-dependent costs (docs/simulator.md); legacy = the "
        "model before issue 16 (loads stall the step), for before/after comparisons",
    )
    fl.add_argument(
        "--engine-variation",
        type=float,
        default=0.1,
        help="each engine's prefill rate and bandwidths scaled by a seeded factor in [1-v, 1+v] the "
        "router is not told (default 0.1; 0 = identical engines)",
    )
    fl.add_argument(
        "--counter-noise",
        type=float,
        default=0.2,
        help="log-normal sigma of the noise on the engines' offload time counters (default 0.2)",
    )
    fl.add_argument(
        "--engine-profile",
        help="JSON file of EngineProfile time fields (step_overhead_s, prefill_tokens_per_s, ...), e.g. "
        "the fit python -m loadtest.calibrate_vllm writes; default: the H100 figures (docs/simulator.md)",
    )
    fl.add_argument(
        "--server-stages",
        metavar="FILE",
        help="the engines' API-server stage and the router's (sim/frontend.py) from a calibration file"
        " (python -m loadtest.calibrate_vllm --out writes them under api_server and router_stage):"
        " each request is read and tokenized there before its engine core sees it, each output token"
        " relayed (default: none)",
    )
    fl.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="the engines' vLLM --scheduling-policy; priority: the router sends each request's "
        "predicted own service as its priority (shortest work first; docs/routing.md)",
    )
    fl.add_argument(
        "--priority-stretch",
        type=float,
        default=PRIORITY_STRETCH,
        help="priority engines: a request's deadline is this many times its own predicted service "
        f"after placement (default {PRIORITY_STRETCH:g}; larger = more shortest-first, 0 = arrival order)",
    )
    fl.add_argument(
        "--priority-max-overtake-s",
        type=float,
        default=PRIORITY_MAX_OVERTAKE_S,
        help="priority engines: no request is overtaken by one placed more than this many seconds "
        f"after it (default {PRIORITY_MAX_OVERTAKE_S:g}; inf = no bound)",
    )
    fl.add_argument(
        "--priority-fcfs-factor",
        type=float,
        default=PRIORITY_FCFS_FACTOR,
        help="priority engines: a request's deadline is never more than this many times its "
        "predicted first-come TTFT on its engine after placement (>= 1; default inf = off)",
    )
    fl.add_argument(
        "--priority-recompute-fcfs-factor",
        type=float,
        default=PRIORITY_RECOMPUTE_FCFS_FACTOR,
        metavar="KR",
        help="priority engines: a turn every engine holds less than --priority-recompute-below of (a"
        " recompute) gets a deadline of at most min(--priority-fcfs-factor, KR) times its predicted"
        " first-come TTFT; the other turns keep --priority-fcfs-factor (>= 1; default inf = off)",
    )
    fl.add_argument(
        "--priority-recompute-below",
        type=float,
        default=PRIORITY_RECOMPUTE_BELOW,
        metavar="FRACTION",
        help="the recompute gate of --priority-recompute-fcfs-factor, a fraction of the prompt in (0, 1]"
        f" (default {PRIORITY_RECOMPUTE_BELOW})",
    )
    fl.add_argument(
        "--priority-wait",
        choices=PRIORITY_WAITS,
        default=PRIORITY_WAITS[0],
        help="priority engines: the wait the router's cost model prices; all = every queued prefill "
        "token (first come, the default), ahead = only the queued prefill sent with a priority no "
        "larger than the request's (what the engine serves first), overtake = that / (1 - the engine's "
        "recent rate of earlier-deadline work), running = overtake with the engine's lowest-priority pending "
        "prefill (the one it serves) ahead",
    )
    fl.add_argument(
        "--admission-wait",
        action="store_true",
        help="the router prices the admission wait: on engines that admit a request only when its whole"
        " sequence fits the free KV blocks, the time until the sequences it placed there (prompt + expected"
        " output each) free room for the prompt, instead of in flight x the learned slot seconds",
    )
    fl.add_argument(
        "--admission-form",
        choices=ADMISSION_FORMS,
        default=ADMISSION_FORMS[0],
        help="with --admission-wait: how the placed sequences' KV is counted; reserved = each at prompt +"
        " expected output from now (the default), held = running ones at prompt + decoded so far and"
        " waiting ones at nothing, ahead = held plus the waiting sequences a priority engine serves"
        " first (earlier deadlines), overtake = ahead plus the expected earlier-deadline arrivals",
    )
    fl.add_argument(
        "--admission-recompute-below",
        type=float,
        default=None,
        metavar="FRACTION",
        help="with --admission-wait: price it only for turns that are recomputes on every engine anyway"
        " (no engine holds this fraction of the prompt in any tier; in (0, 1]); the others keep the"
        " learned slot term (default: every turn)",
    )
    fl.add_argument(
        "--hold-wait-s",
        type=float,
        default=None,
        metavar="W",
        help="late binding: the router holds turns in one queue while no engine's predicted queue wait"
        " (queued prefill / prefill rate + in flight x slot seconds) is below W seconds, and routes them"
        " when an engine has room (> 0; default off: each turn is routed when it arrives)",
    )
    fl.add_argument(
        "--hold-order",
        choices=HOLD_ORDERS,
        default=HOLD_ORDERS[0],
        help="with --hold-wait-s: release held turns in arrival order (fcfs, the default) or by the"
        " shortest-first priority the router would send (priority; ties by arrival)",
    )
    fl.add_argument(
        "--hold-pick",
        choices=HOLD_PICKS,
        default=HOLD_PICKS[0],
        help="with --hold-wait-s: route a released turn among every engine (all, the default) or only"
        " those with room (room)",
    )
    fl.add_argument(
        "--hold-recompute-below",
        type=float,
        default=None,
        metavar="X",
        help="with --hold-wait-s: hold only turns that no engine holds this fraction of the prompt of in"
        " any tier (recomputes; in (0, 1]); the others are routed on arrival (default: every turn)",
    )
    fl.add_argument(
        "--hold-max-s",
        type=float,
        default=None,
        metavar="M",
        help="with --hold-wait-s: route a turn held M seconds then, room or not (> 0; default: no bound)",
    )
    fl.add_argument(
        "--hold-aged",
        action="store_true",
        help="with --hold-wait-s: a held turn's shortest-first deadline on a priority engine counts from"
        " its arrival at the router, not from when it is routed (default: from when it is routed)",
    )
    fl.add_argument(
        "--escalate-after-s",
        type=float,
        default=None,
        metavar="E",
        help="priority engines: a turn with no first token E seconds after it arrived is cancelled"
        " there and sent again at priority 0, the most urgent, as the router's"
        " costs.priority_escalate_after_s does (> 0; default off)",
    )
    fl.add_argument(
        "--escalate-pick",
        choices=ESCALATE_PICKS,
        default=ESCALATE_PICKS[0],
        help="with --escalate-after-s: where the escalated turn is sent: its engine (same, the"
        " default), wherever the policy routes it then (route), or among the other engines (other)",
    )
    fl.add_argument(
        "--gpu-tokens",
        type=int,
        default=27_852 * 16,
        help="traces: GPU KV pool per engine in tokens (default one H100, Llama-3-8B)",
    )
    pol = p.add_argument_group("router")
    pol.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated policy names (registered ones, plus 'clairvoyant')",
    )
    pol.add_argument("--event-delay-ms", type=float, default=5.0, help="KV event delivery delay")
    pol.add_argument(
        "--router-priors",
        choices=ROUTER_PRIORS,
        default="defaults",
        help="the cost model's starting point: the router's configured defaults, or the fleet's "
        "nominal engine profile (the old what-if)",
    )
    pol.add_argument("--speculate-ttl-s", type=float, default=2.0)
    pol.add_argument("--scrape-interval-s", type=float, default=1.0)
    pol.add_argument(
        "--no-calibrate", action="store_true", help="do not feed simulated TTFTs to the cost model"
    )
    pol.add_argument(
        "--queue-whole-prompt",
        action="store_true",
        help="what-if (old router accounting): queue whole prompts as pending prefill, not the "
        "predicted uncached tokens",
    )
    pol.add_argument(
        "--no-ideal", action="store_true", help="skip the ideal hit rate (it keeps a set of every block id)"
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--out",
        help="directory for results.jsonl / results.md / results.json (written as each run finishes) "
        "and PNG plots (hits by tier; TTFT and throughput against concurrency)",
    )
    out.add_argument("--seed", type=int, default=0)
    out.add_argument(
        "--jobs", type=int, default=None, help="runs in parallel processes (default: one per CPU core)"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


@dataclass(slots=True)
class _RunSpec:
    label: str
    workload: Workload
    fleet: FleetSpec
    policy: str
    config: SimConfig
    #: Policy parameters parsed from "name:key=value:..." (the run is labelled with the whole spec).
    params: dict[str, Any] = field(default_factory=dict)
    spec: str = ""


_CREDIT_KEYS = ("gpu", "cpu", "storage")


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"tier_cost:work_weight=0.5"`` -> ("tier_cost", {"work_weight": 0.5}). Values are numbers;
    for kv_fixed_credit the keys gpu/cpu/storage set its per-tier credits."""
    name, *pairs = spec.split(":")
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"policy spec {spec!r}: expected key=value after ':', got {pair!r}")
        try:
            number: float | int = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise ValueError(f"policy spec {spec!r}: {key} must be a number, got {value!r}") from None
        if name == "kv_fixed_credit" and key in _CREDIT_KEYS:
            params.setdefault("credits", {})[key] = number
        else:
            params[key] = number
    return name, params


def _plan(args: argparse.Namespace) -> tuple[list[_RunSpec], str]:
    specs = [x.strip() for x in args.policies.split(",") if x.strip()]
    import policies as _registry  # noqa: F401  (fills the registry)
    from policies.base import REGISTRY

    parsed = [(spec, *parse_policy_spec(spec)) for spec in specs]
    profile_fields = load_engine_profile(args.engine_profile) if args.engine_profile else {}
    unknown = [name for _, name, _ in parsed if name != "clairvoyant" and name not in REGISTRY]
    if unknown:
        raise ValueError(
            f"unknown policies {unknown}; accepted: {', '.join(sorted([*REGISTRY, 'clairvoyant']))}"
        )
    for spec, name, params in parsed:
        if name != "clairvoyant":
            try:  # a bad parameter fails now, with the valid ones listed, not in the middle of a sweep
                build_policy(name, params)
            except ValueError as exc:
                raise ValueError(f"--policies {spec}: {exc}") from None
    config = SimConfig(
        seed=args.seed,
        event_delay_s=args.event_delay_ms / 1000.0,
        speculate_ttl_s=args.speculate_ttl_s,
        scrape_interval_s=args.scrape_interval_s,
        calibrate=not args.no_calibrate,
        track_ideal=not args.no_ideal,
        queue_whole_prompt=args.queue_whole_prompt,
        progress=not args.no_progress,
        router_priors=args.router_priors,
        priority_stretch=args.priority_stretch,
        priority_max_overtake_s=args.priority_max_overtake_s,
        priority_fcfs_factor=args.priority_fcfs_factor,
        priority_recompute_fcfs_factor=args.priority_recompute_fcfs_factor,
        priority_recompute_below=args.priority_recompute_below,
        priority_wait=args.priority_wait,
        admission_wait=args.admission_wait,
        admission_form=args.admission_form,
        admission_recompute_below=args.admission_recompute_below,
        hold_wait_s=args.hold_wait_s,
        hold_order=args.hold_order,
        hold_pick=args.hold_pick,
        hold_recompute_below=args.hold_recompute_below,
        hold_max_s=args.hold_max_s,
        hold_aged=args.hold_aged,
        escalate_after_s=args.escalate_after_s,
        escalate_pick=args.escalate_pick,
    )
    if args.duration_s is not None and not args.duration_s > 0:
        raise ValueError(f"--duration-s must be > 0 seconds, got {args.duration_s}")
    if args.escalate_after_s is not None and args.scheduling_policy != "priority":
        raise ValueError(
            "--escalate-after-s re-sends turns at a higher priority: add --scheduling-policy priority"
        )
    if args.gpu_blocks is not None and args.gpu_blocks < 1:
        raise ValueError(f"--gpu-blocks must be >= 1, got {args.gpu_blocks}")
    if args.cpu_ratio is not None and not args.cpu_ratio >= 0:
        raise ValueError(f"--cpu-ratio must be >= 0 (0 = no CPU tier), got {args.cpu_ratio}")
    ladder_only = {
        "--duration-s": args.duration_s is not None,
        "--gpu-blocks": args.gpu_blocks is not None,
        "--cpu-ratio": args.cpu_ratio is not None,
    }
    if args.trace and any(ladder_only.values()):
        given = ", ".join(flag for flag, on in ladder_only.items() if on)
        raise ValueError(f"{given}: ladder options; a trace's fleet is sized by --gpu-tokens")
    check_priority_stretch(args.priority_stretch, "--priority-stretch")
    check_priority_max_overtake(args.priority_max_overtake_s, "--priority-max-overtake-s")
    check_priority_fcfs_factor(args.priority_fcfs_factor, "--priority-fcfs-factor")
    check_priority_fcfs_factor(args.priority_recompute_fcfs_factor, "--priority-recompute-fcfs-factor")
    check_recompute_below(args.priority_recompute_below, "--priority-recompute-below")
    if args.admission_recompute_below is not None:
        if not args.admission_wait:
            raise ValueError("--admission-recompute-below gates the admission wait: add --admission-wait")
        check_recompute_below(args.admission_recompute_below, "--admission-recompute-below")
    check_hold(
        args.hold_wait_s,
        args.hold_order,
        args.hold_pick,
        args.hold_recompute_below,
        args.hold_max_s,
        args.hold_aged,
        (
            "--hold-wait-s",
            "--hold-order",
            "--hold-pick",
            "--hold-recompute-below",
            "--hold-max-s",
            "--hold-aged",
        ),
    )
    fleet_options = _fleet_options(args)
    api_stage, router_stage = load_server_stages(args.server_stages) if args.server_stages else (None, None)
    if args.server_stages and api_stage is None and router_stage is None:
        raise ValueError(f"--server-stages {args.server_stages}: no api_server or router_stage in it")
    storage_values: list[str] = args.storage

    def storage_label(label: str, storage: str) -> str:
        return label if len(storage_values) == 1 else f"{label} s={storage}"

    runs: list[_RunSpec] = []
    hetero = args.fleet == "hetero"
    if args.trace:
        path = NAMED_TRACES.get(args.trace, Path(args.trace))
        if not path.exists():
            raise ValueError(
                f"--trace {args.trace}: no such file or directory; named traces: {', '.join(NAMED_TRACES)}"
            )
        fmt = args.trace_format or ("agentic" if path.is_dir() or path.suffix == ".json" else "mooncake")
        if fmt == "mooncake":
            wl = mooncake_workload(
                read_mooncake_records(path, limit=args.limit), speed=args.speed, name=path.stem
            )
        else:
            wl = agentic_workload(
                read_agentic_sessions(path, limit=args.limit), stagger_s=args.stagger_s, speed=args.speed
            )
        base = EngineProfile(
            **{**profile_fields, "max_model_len": 1 << 22},
            counter_noise=args.counter_noise,
            scheduling_policy=args.scheduling_policy,
        )
        working_set = working_set_blocks(wl)
        for n in args.engines:
            gpu_blocks = max(8, args.gpu_tokens // wl.block_size)
            for storage in storage_values:
                fleet = b1_fleet(
                    n,
                    api_server=api_stage,
                    router_stage=router_stage,
                    block_size=wl.block_size,
                    hetero=hetero,
                    base=base,
                    conversations_in_hbm=gpu_blocks * n * wl.block_size,
                    mean_conversation_tokens=1.0,
                    storage_blocks=storage_blocks_for(storage, working_set),
                    **fleet_options,
                )
                for spec, pol, params in parsed:
                    label = storage_label(f"{n}e x{args.speed:g}", storage)
                    runs.append(_RunSpec(label, wl, fleet, pol, config, params, spec))
        return runs, "engines x speed"
    lo, hi = (int(x) for x in args.answer_tokens.split(","))
    for c in args.concurrency:
        lcfg = LadderConfig(
            first_prompt_tokens=args.first_prompt_tokens,
            system_prefix_tokens=args.system_tokens,
            tokens_per_turn=args.tokens_per_turn,
            turns=args.turns,
            answer_min_tokens=lo,
            answer_max_tokens=hi,
            think_time_mean_s=args.think_time_s,
            concurrency=c,
            total_conversations=None if args.duration_s else max(c, round(c * args.conversations)),
            duration_s=args.duration_s,
            block_size=args.block_size,
            seed=args.seed,
        )
        wl = ladder_workload(lcfg)
        working_set = working_set_blocks(wl)
        for n in args.engines:
            for storage in storage_values:
                fleet = b1_fleet(
                    n,
                    api_server=api_stage,
                    router_stage=router_stage,
                    block_size=args.block_size,
                    hetero=hetero,
                    conversations_in_hbm=args.hbm_conversations,
                    mean_conversation_tokens=lcfg.mean_prompt_tokens(),
                    gpu_blocks=args.gpu_blocks,
                    # (None: b1_fleet's own default CPU tier)
                    **({} if args.cpu_ratio is None else {"cpu_ratio": args.cpu_ratio}),
                    storage_blocks=storage_blocks_for(storage, working_set),
                    base=EngineProfile(
                        **profile_fields,
                        counter_noise=args.counter_noise,
                        scheduling_policy=args.scheduling_policy,
                    ),
                    **fleet_options,
                )
                for spec, pol, params in parsed:
                    label = storage_label(str(c) if len(args.engines) == 1 else f"{c}@{n}e", storage)
                    runs.append(_RunSpec(label, wl, fleet, pol, config, params, spec))
    return runs, "concurrency"


def _execute(spec: _RunSpec) -> SimResult:
    result = simulate(spec.workload, spec.policy, spec.fleet, spec.config, policy_params=spec.params)
    result.label = spec.label
    if spec.spec:
        result.policy = spec.spec
    result.ttfts_s = []
    result.ttft_by_request_s = {}
    return result


def _execute_indexed(item: tuple[int, _RunSpec]) -> tuple[int, SimResult]:
    index, spec = item
    return index, _execute(spec)


def worker_pool(
    jobs: int, initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()
) -> Any:
    """A fork pool of ``jobs`` simulation workers that ``Pool.terminate`` (run on leaving the
    ``with``) always stops. Terminate stops workers with SIGTERM; a worker that inherited a Python
    handler from its parent (a benchmark's ``exit_on_sigterm``, a server's graceful stop) and got
    the signal while starting could outlive it, and the pool's join then waited for ever (seen
    twice in the test suite, the worker blocked on the task queue's lock). So the workers are
    forked with SIGTERM blocked, and each puts it back to its default action before unblocking it:
    a SIGTERM sent while it starts waits, and then stops it."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return ctx.Pool(jobs, initializer=_init_worker, initargs=(initializer, initargs))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _init_worker(initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if initializer is not None:
        initializer(*initargs)


def _count_into(counter: Any) -> None:
    """Worker initializer: this process's runs report finished requests into ``counter``."""

    def add(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    _Progress.sink = add


def _run_line(result: SimResult) -> str:
    d = result.as_dict()
    return (
        f"{result.label} {result.policy}: TTFT p50 {d['ttft_p50_s']:.3f} s p99 {d['ttft_p99_s']:.3f} s, "
        f"hits GPU {d['hit_gpu']:.1%} CPU {d['hit_cpu']:.1%} STORAGE {d['hit_storage']:.1%} "
        f"miss {d['miss']:.1%}, {d['turns_per_s']:.3g} turns/s, wall {result.wall_s:.1f} s"
    )


class _ResultFiles:
    """``--out DIR``: results.jsonl gets a line as each run finishes; results.md and results.json
    are rewritten then too (plan order), so a stopped sweep leaves what it finished."""

    def __init__(self, out: Path | None, command: str, label_header: str, total_runs: int) -> None:
        self.out = out
        self.command = command
        self.label_header = label_header
        self.total_runs = total_runs
        self.done: dict[int, SimResult] = {}
        if out is not None:
            (out / "results.jsonl").write_text("")

    def add(self, index: int, result: SimResult) -> None:
        self.done[index] = result
        if self.out is None:
            return
        with open(self.out / "results.jsonl", "a") as fh:
            fh.write(json.dumps(result.as_dict()) + "\n")
        self._write_tables()

    def sync(self) -> None:
        """Rewrite every file from the finished runs: a Ctrl-C can land between the writes of
        ``add``, and the three files must then still agree."""
        if self.out is None:
            return
        ordered = [self.done[i] for i in sorted(self.done)]
        (self.out / "results.jsonl").write_text("".join(json.dumps(r.as_dict()) + "\n" for r in ordered))
        self._write_tables()

    def _write_tables(self) -> None:
        assert self.out is not None
        from sim.report import markdown_table

        ordered = [self.done[i] for i in sorted(self.done)]
        partial = (
            "" if len(ordered) == self.total_runs else f" ({len(ordered)} of {self.total_runs} runs so far)"
        )
        table = markdown_table(ordered, label_header=self.label_header)
        (self.out / "results.md").write_text(f"`{self.command}`{partial}\n\n{table}\n")
        (self.out / "results.json").write_text(json.dumps([r.as_dict() for r in ordered], indent=1))


def interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a Ctrl-C, or an error raised while one was being handled: tqdm's write,
    interrupted while it takes its lock, releases the lock it never took on the way out and raises
    RuntimeError over the KeyboardInterrupt (a stopped sweep must still keep what it finished)."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__context__
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """``kvroute sim ...``: run every (workload, engines, policy) combination with one progress bar
    over the sweep, print each run's figures as it finishes and a markdown table at the end; with
    --out, write results.jsonl / results.md / results.json as runs finish and PNG plots at the end."""
    from tqdm import tqdm

    argv_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv_list)
    # Ctrl-C must stop a sweep even when the parent passed SIGINT down as ignored (a test runner,
    # `cmd &` in a script): Python then never raises KeyboardInterrupt on its own.
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGINT, signal.default_int_handler)
    out = Path(args.out) if args.out else None
    if out is not None:
        # Checked before any run: a sweep must not end in an error about where to write.
        if out.exists() and not out.is_dir():
            print(
                f"kvroute sim: --out {out} is an existing file; --out names a directory for "
                "results.md, results.jsonl, results.json and the plots",
                file=sys.stderr,
            )
            return 2
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"kvroute sim: cannot create --out directory {out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    try:
        runs, label_header = _plan(args)
    except (ValueError, OSError) as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(runs)))
    files = _ResultFiles(out, "kvroute sim " + " ".join(argv_list), label_header, len(runs))
    total_requests = sum(r.workload.num_requests for r in runs)
    print(
        f"{len(runs)} runs ({total_requests:,} simulated requests) in {jobs} process(es)"
        + (f"; results in {out}/ as each run finishes" if out else ""),
        file=sys.stderr,
        flush=True,
    )
    bar = tqdm(
        total=total_requests,
        unit="req",
        desc="sweep",
        disable=args.no_progress,
        file=sys.stderr,
        dynamic_ncols=True,
        smoothing=0.05,
        mininterval=0.2 if sys.stderr.isatty() else 10.0,  # a log file gets a line every 10 s
        bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} requests "
        "[{elapsed} elapsed, ETA {remaining}]{postfix}",
    )
    wall0 = time.perf_counter()

    def finished(index: int, result: SimResult) -> None:
        files.add(index, result)
        bar.set_postfix_str(f"{len(files.done)}/{len(runs)} runs", refresh=False)
        bar.write(f"[{len(files.done)}/{len(runs)}] {_run_line(result)}", file=sys.stdout)

    try:
        if jobs == 1:
            _Progress.sink = bar.update
            try:
                for i, spec in enumerate(runs):
                    finished(i, _execute(spec))
            finally:
                _Progress.sink = None
        else:
            import multiprocessing

            counter = multiprocessing.get_context("fork").Value("q", 0)
            with worker_pool(jobs, _count_into, (counter,)) as pool:
                results_iter = pool.imap_unordered(_execute_indexed, list(enumerate(runs)), chunksize=1)
                while len(files.done) < len(runs):
                    try:
                        i, result = results_iter.next(timeout=0.5)
                    except multiprocessing.TimeoutError:
                        pass
                    else:
                        finished(i, result)
                    bar.update(counter.value - bar.n)
    except BaseException as exc:
        if not interrupted(exc):
            raise
        bar.close()
        files.sync()
        where = f"; they are in {out}/" if out is not None and files.done else ""
        print(f"kvroute sim: interrupted after {len(files.done)} of {len(runs)} runs{where}", file=sys.stderr)
        return 130
    bar.close()
    from sim.report import markdown_table, plot_hits_by_tier, plot_vs_concurrency

    results = [files.done[i] for i in range(len(runs))]
    table = markdown_table(results, label_header=label_header)
    print()
    print(table)
    children_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(
        f"\n{len(runs)} runs, wall {time.perf_counter() - wall0:.1f} s, peak RSS "
        f"{max(peak_rss_bytes(), children_rss) / 2**20:.0f} MiB (largest process)"
    )
    if out is not None:
        title = f"{results[0].workload.split('-')[0]} {args.fleet}, {args.engines[0]} engines"
        try:
            paths = plot_hits_by_tier(results, out, title=title, label_name=label_header)
            if label_header == "concurrency" and len(args.concurrency) > 1 and len(args.storage) == 1:
                paths += plot_vs_concurrency(results, out, title=title)
        except ImportError:
            print(
                "plots skipped: matplotlib is not installed (pip install 'kvroute[plots]')", file=sys.stderr
            )
        else:
            for path in paths:
                print(f"wrote {path}")
        print(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'results.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
