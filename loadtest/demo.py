"""`make demo`: a simulated 4-engine tiered fleet, the router with a 50/50 experiment
round_robin vs tier_cost, a short multi-turn streaming chat load, and the per-arm report.

Everything runs on loopback and is stopped on exit, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.chat_client import chat_workload, print_progress, run_load
from loadtest.procs import stop_process, wait_http_ok
from sim.fleet import Fleet, FleetProfile
from sim.server import free_port
from sim.workloads import Workload

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Pools sized so that the fleet's GPUs cannot hold every conversation (48 x ~3.5k tokens vs 4 x 16k
#: GPU tokens) but can hold the ones in flight: a router that keeps a conversation on its engine
#: reloads from GPU, others from CPU or the shared STORAGE pool. With 320 GPU blocks no engine could
#: keep even its active conversations, and affinity had nothing left to win (measured 1.27x).
DEMO_PROFILE = FleetProfile(
    gpu_blocks=1024, cpu_blocks=2048, storage_blocks=65536, shared_storage=True, time_scale=1.0
)


def _log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _get_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _wait_for_report(url: str, turns: int, deadline_s: float = 5.0) -> Any:
    """GET /v1/experiments once the router accounted every turn (the last ones finish in the
    router a moment after the client read their final bytes)."""
    end = time.monotonic() + deadline_s
    while True:
        report = _get_json(f"{url}/v1/experiments")
        if sum(a["requests"] for a in report.get("arms", [])) >= turns or time.monotonic() > end:
            return report
        time.sleep(0.1)


def write_router_config(path: Path, fleet_file: Path, port: int, arms: list[tuple[str, str]]) -> None:
    lines = [
        # info: one line per request (engine, arm, TTFT, cached tokens), so the log shows decisions.
        'log_level = "info"',
        f'fleet_file = "{fleet_file}"',
        "[listen]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "[tokenizer]",
        'backend = "sim"',
        "[experiment]",
        'name = "demo"',
    ]
    for name, policy in arms:
        lines += ["[[experiment.arms]]", f'name = "{name}"', f'policy = "{policy}"', "weight = 1.0"]
    path.write_text("\n".join(lines) + "\n")


def format_report(report: dict[str, Any]) -> str:
    """The per-arm table of GET /v1/experiments as text."""

    def ms(value: Any) -> str:
        return f"{value * 1000:8.1f}" if isinstance(value, int | float) else f"{'-':>8}"

    def num(value: Any) -> str:
        return f"{value:8.0f}" if isinstance(value, int | float) else f"{'-':>8}"

    head = (
        f"{'arm':<14}{'policy':<14}{'convs':>6}{'reqs':>6}{'errs':>6}{'p50 ms':>9}{'p90 ms':>9}"
        f"{'p99 ms':>9}{'hit rate':>9}{'pred gpu':>9}{'pred cpu':>9}{'pred sto':>9}"
    )
    rows = [head, "-" * len(head)]
    for arm in report.get("arms", []):
        predicted = (arm.get("predicted") or {}).get("mean_hit_tokens") or {}
        rate = arm.get("hit_rate")
        rows.append(
            f"{arm['name']:<14}{arm.get('policy') or '-':<14}{arm.get('conversations', 0):>6}"
            f"{arm['requests']:>6}{arm['errors']:>6}"
            f"{ms(arm.get('ttft_p50_s'))} {ms(arm.get('ttft_p90_s'))} {ms(arm.get('ttft_p99_s'))}"
            f"{(f'{rate:9.3f}' if isinstance(rate, float) else f'{chr(45):>9}')}"
            f"{num(predicted.get('gpu'))} {num(predicted.get('cpu'))} {num(predicted.get('storage'))}"
        )
        vs = arm.get("vs_control")
        if vs and vs.get("mean_ttft_diff_ci_s"):
            low, high = vs["mean_ttft_diff_ci_s"]
            line = (
                f"  vs {vs['control']}: mean TTFT {vs['mean_ttft_diff_s'] * 1000:+.1f} ms "
                f"({int(vs['confidence'] * 100)}% CI {low * 1000:+.1f} .. {high * 1000:+.1f})"
            )
            if vs.get("hit_rate_diff_ci"):
                h_low, h_high = vs["hit_rate_diff_ci"]
                line += f"; hit rate {vs['hit_rate_diff']:+.3f} (CI {h_low:+.3f} .. {h_high:+.3f})"
            convs = vs.get("conversations") or [0, 0]
            line += f"; conversations {convs[0]} vs {convs[1]}, cluster bootstrap"
            rows.append(line)
    rows += ["", *legend(report)]
    return "\n".join(rows)


def legend(report: dict[str, Any]) -> list[str]:
    """What the table's columns are, and how far its p99 can be trusted."""
    lines = [
        "convs, reqs, errs: conversations, turns and failed turns per arm (a conversation stays in its arm).",
        "p50/p90/p99 ms: time to first token per turn, measured by the router.",
        "hit rate: prompt tokens the engines reported cached / all prompt tokens.",
        "pred gpu/cpu/sto: mean hit tokens per request the router's index predicted, by tier (GPU, CPU,",
        "  STORAGE) - where the cached part of a prompt was expected to come from.",
    ]
    sizes = [a["requests"] - a["errors"] for a in report.get("arms", []) if a["requests"]]
    if sizes:
        n = min(sizes)
        tail = max(1, round(n * 0.01))
        lines.append(f"p99 rests on the slowest {tail} of ~{n} turns per arm: it moves from run to run.")
    return lines


def verdict(diff: float, low: float, high: float, confidence: float, unit: str, lower_is_better: bool) -> str:
    """One A/B difference (treatment - control) as words that follow its interval: "better" or
    "worse" only when the interval excludes zero, "no significant difference" when it holds zero."""
    scale, fmt = (1000.0, "{:+.1f} ms") if unit == "ms" else (1.0, "{:+.3f}")
    pct = f"{confidence * 100:.0f}%"
    figures = f"{fmt.format(diff * scale)} ({pct} CI {fmt.format(low * scale)} .. {fmt.format(high * scale)})"
    if low <= 0.0 <= high:
        return f"{figures}: no significant difference"
    better = (high < 0.0) == lower_is_better
    return f"{figures}: {'better' if better else 'worse'}"


def gain_line(report: dict[str, Any]) -> str:
    """The closing line: the treatment arm against control, worded by the intervals of the report
    (mean TTFT and hit rate), with the medians and p90s as figures, never as the verdict."""
    arms = {a["name"]: a for a in report.get("arms", [])}
    names = list(arms)
    if len(names) < 2:
        return ""
    base, ours = arms[names[0]], arms[names[1]]
    vs = ours.get("vs_control") or {}
    ttft_ci = vs.get("mean_ttft_diff_ci_s")
    if vs.get("mean_ttft_diff_s") is None or not ttft_ci:
        return (
            f"{ours['name']} vs {base['name']}: too few conversations for an interval; "
            "no conclusion (run more conversations)"
        )
    confidence = float(vs.get("confidence", 0.95))
    parts = [
        f"{ours['name']} vs {base['name']}: mean TTFT "
        + verdict(vs["mean_ttft_diff_s"], ttft_ci[0], ttft_ci[1], confidence, "ms", lower_is_better=True)
    ]
    hit_ci = vs.get("hit_rate_diff_ci")
    if vs.get("hit_rate_diff") is not None and hit_ci:
        parts.append(
            "hit rate "
            + verdict(vs["hit_rate_diff"], hit_ci[0], hit_ci[1], confidence, "", lower_is_better=False)
        )
    quantiles = [
        f"{label} {b * 1000:.0f} -> {o * 1000:.0f} ms"
        for label, b, o in (
            ("median", base.get("ttft_p50_s"), ours.get("ttft_p50_s")),
            ("p90", base.get("ttft_p90_s"), ours.get("ttft_p90_s")),
        )
        if isinstance(b, int | float) and isinstance(o, int | float)
    ]
    if quantiles:
        parts.append("TTFT " + ", ".join(quantiles))
    return "; ".join(parts)


def demo_workload(args: argparse.Namespace) -> Workload:
    """The demo's conversations (loadtest.chat_client.chat_workload, the B1 ladder scaled down)."""
    return chat_workload(
        conversations=args.conversations,
        concurrency=args.concurrency,
        turns=args.turns,
        think_time_s=args.think_time_s,
        seed=args.seed,
        block_size=DEMO_PROFILE.block_size,
    )


def run_demo(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-demo-"))
    router: subprocess.Popen[bytes] | None = None
    fleet = Fleet(workdir=workdir)
    try:
        _log(
            f"starting {args.engines} simulated engines (GPU {DEMO_PROFILE.gpu_blocks} blocks, "
            f"CPU {DEMO_PROFILE.cpu_blocks} blocks, one shared STORAGE pool) ..."
        )
        fleet.start(args.engines, DEMO_PROFILE)
        fleet_file = fleet.write_fleet_file(workdir / "fleet.json")
        port = free_port("127.0.0.1")
        config = workdir / "router.toml"
        arms = [("control", "round_robin"), ("tier_cost", "tier_cost")]
        write_router_config(config, fleet_file, port, arms)
        url = f"http://127.0.0.1:{port}"
        _log(f"starting the router on {url} with a 50/50 experiment round_robin vs tier_cost ...")
        with open(workdir / "router.log", "wb") as log:  # the child keeps its own descriptor
            router = subprocess.Popen(
                [sys.executable, "-m", "router.cli", "serve", "--config", str(config)],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        router_log = workdir / "router.log"
        wait_http_ok(f"{url}/health", router, 30.0, output=lambda: router_log.read_text(errors="replace"))
        workload = demo_workload(args)
        _log(
            f"driving {len(workload.conversations)} conversations x {args.turns} turns, "
            f"{workload.concurrency} at a time (streaming, full history resent each turn) ..."
        )
        result = asyncio.run(run_load(url, workload, progress=print_progress))
        summary = result.summary()
        _log(f"done in {result.wall_s:.1f}s: {summary['ok']} turns ok, {summary['errors']} errors")
        report = _wait_for_report(url, summary["ok"] + summary["errors"])
        if args.report_json:
            Path(args.report_json).write_text(json.dumps(report, indent=2))
        print()
        print(format_report(report))
        print()
        line = gain_line(report)
        if line:
            print("Result: " + line)
        lines = len(router_log.read_text(errors="replace").splitlines())
        print(f"router log: {router_log} ({lines} lines); engine logs and the fleet file: {workdir}")
        return 0 if summary["errors"] == 0 else 1
    finally:
        stop_process(router)
        fleet.stop()
        _log("fleet and router stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvroute demo", description=__doc__)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--think-time-s", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-json", help="also write the /v1/experiments report to this file")
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
