"""Render the Grafana dashboard (deploy/grafana/dashboards/kvroute.json) as a PNG without Grafana.

Grafana has no Debian, PyPI or npm package to run here, so this runs the dashboard's own queries:
a simulated fleet, two router replicas sharing state through Redis, the Debian ``prometheus``
binary scraping them all with deploy/prometheus's job layout, and multi-turn chat load through a
round robin over the replicas; then every panel's PromQL is evaluated by that Prometheus
(query_range) and drawn with matplotlib in the dashboard's grid.

    python -m loadtest.dashboard_png --out docs/img/dashboard.png [--seconds 90]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest.bench_replicas import run_round_robin, start_routers
from loadtest.redis_server import RedisServer
from sim.fleet import PROFILES, Fleet
from sim.server import free_port
from sim.workloads import LadderConfig, ladder_workload

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvroute.json"


def _prometheus_config(path: Path, routers: Sequence[str], engines: Sequence[str]) -> None:
    def targets(urls: Sequence[str]) -> str:
        return json.dumps([u.removeprefix("http://") for u in urls])

    path.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        f"  - job_name: kvroute\n    static_configs:\n      - targets: {targets(routers)}\n"
        f"  - job_name: vllm\n    static_configs:\n      - targets: {targets(engines)}\n"
    )


def _query_range(base: str, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step_s})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{query}", timeout=30) as resp:
        doc = json.loads(resp.read())
    if doc.get("status") != "success":
        raise RuntimeError(f"query failed: {expr}: {doc}")
    return list(doc["data"]["result"])


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or str(labels)


PanelData = tuple[dict[str, Any], list[tuple[str, list[dict[str, Any]]]]]


def render(panels_data: list[PanelData], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p, _ in panels_data]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(24, rows * 0.62))
    grid = fig.add_gridspec(rows, 24, hspace=2.2, wspace=1.6)
    for panel, series in panels_data:
        pos = panel["gridPos"]
        if panel["type"] == "row":
            ax = fig.add_subplot(grid[pos["y"], :])
            ax.axis("off")
            ax.text(0, 0.5, panel["title"], fontsize=14, fontweight="bold", va="center")
            continue
        ax = fig.add_subplot(grid[pos["y"] + 1 : pos["y"] + pos["h"], pos["x"] : pos["x"] + pos["w"]])
        ax.set_title(panel["title"], fontsize=10)
        drawn = 0
        for fmt, results in series:
            for result in results:
                values = [
                    (float(t), float(v)) for t, v in result["values"] if v not in ("NaN", "+Inf", "-Inf")
                ]
                if not values:
                    continue
                t0 = values[0][0]
                label = _legend(fmt, result["metric"])
                ax.plot([t - t0 for t, _ in values], [v for _, v in values], label=label)
                drawn += 1
        if drawn:
            ax.legend(fontsize=6, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.tick_params(labelsize=7)
        ax.set_xlabel(f"s ({panel['fieldConfig']['defaults'].get('unit', '')})", fontsize=7)
    fig.suptitle("kvroute dashboard: panel queries evaluated by Prometheus over a sim fleet (2 replicas)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=70, bbox_inches="tight")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.dashboard_png", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "docs" / "img" / "dashboard.png"))
    p.add_argument("--seconds", type=float, default=90.0, help="length of the load (the plotted window)")
    args = p.parse_args(argv)
    binary = shutil.which("prometheus")
    if binary is None:
        print("prometheus binary not found (Debian package prometheus)", file=sys.stderr)
        return 2
    dashboard = json.loads(DASHBOARD.read_text())
    with tempfile.TemporaryDirectory(prefix="kvroute-dashboard-") as tmp:
        workdir = Path(tmp)
        profile = replace(
            PROFILES["tiered"], gpu_blocks=1200, cpu_blocks=2400, storage_blocks=20000, time_scale=5.0
        )
        with RedisServer(workdir / "redis") as redis, Fleet(workdir / "fleet") as fleet:
            engines = fleet.start(3, profile, storage_pool="shared-fs")
            routers = start_routers(workdir, engines, "tier_cost", 2, redis.url, "dash")
            prom_port = free_port()
            _prometheus_config(workdir / "prometheus.yml", [r.url for r in routers], [e.url for e in engines])
            log = open(workdir / "prometheus.log", "wb")  # the child writes to it
            prom = subprocess.Popen(
                [
                    binary,
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            base = f"http://127.0.0.1:{prom_port}"
            try:
                cfg = LadderConfig(
                    first_prompt_tokens=1500,
                    system_prefix_tokens=300,
                    tokens_per_turn=500,
                    turns=6,
                    answer_min_tokens=20,
                    answer_max_tokens=60,
                    think_time_mean_s=1.0,
                    concurrency=12,
                    duration_s=args.seconds,
                    seed=3,
                )
                start = time.time()
                asyncio.run(run_round_robin([r.url for r in routers], ladder_workload(cfg)))
                time.sleep(5)
                end = time.time()
                panels_data = []
                for panel in dashboard["panels"]:
                    series = [
                        (t.get("legendFormat", ""), _query_range(base, t["expr"], start, end, 2.0))
                        for t in panel.get("targets", [])
                    ]
                    panels_data.append((panel, series))
            finally:
                prom.terminate()
                prom.wait(timeout=10)
                log.close()
                for router in routers:
                    router.stop()
    render(panels_data, Path(args.out))
    print(f"wrote {args.out} ({end - start:.0f} s of load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
