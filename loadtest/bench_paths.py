"""The router's CPU per request with the callback path off and on, paired in one process.

B3 (loadtest/bench_peers.py) runs every router as its own process, so two targets' figures differ
by whatever else the shared machine did while each ran. Here the same router is built twice in one
process - ``proxy.callback_path`` off and on, each served by uvicorn with kvroute's protocol on its
own thread and uvloop loop, behind the same two zero-delay ``fast`` upstreams - and wrk loads them
in turn, ``--repeats`` times; each figure is that server thread's CPU (utime + stime from
/proc/self/task) over the requests wrk completed. Non-stream chat, one prompt size; ``--stream yes``
(or ``yesN``) streams of 4 (N) events instead, as B3's ``--stream``.

    python -m loadtest.bench_paths --targets round_robin,tier_cost+tok --concurrency 64 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
import uvloop

from loadtest.bench_peers import chat_body, run_wrk, stream_label, stream_mode, zero_delay_engines
from router.config import load_config
from router.guard import guarded_http_protocol
from router.service import build_router_app
from sim.server import free_port

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


class ServedRouter:
    """``build_router_app`` for ``policy`` served on a thread of its own; ``cpu_s`` is that thread's."""

    def __init__(self, policy: str, callback_path: bool, engines: Sequence[Any]) -> None:
        config = load_config(
            environ={},
            overrides={
                "engines": [{"id": e.id, "url": e.url, "model": e.model} for e in engines],
                "policy": {"name": policy.removesuffix("+tok")},
                "tokenizer": {"backend": "sim" if policy.endswith("+tok") else "none"},
                "proxy": {"callback_path": callback_path},
                "log_level": "error",  # wrk's cut-off requests at the end of each run would log 499s
            },
        )
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                build_router_app(config),
                host="127.0.0.1",
                port=self.port,
                http=guarded_http_protocol(config.limits),
                proxy_headers=False,  # as `kvroute serve`: the app itself, not a middleware, is served
                lifespan="on",
                log_level="warning",
                access_log=False,
                timeout_keep_alive=30,
            )
        )
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        loop = uvloop.new_event_loop()
        loop.run_until_complete(self.server.serve())
        loop.close()

    def start(self) -> ServedRouter:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the router did not start")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        fields = Path(f"/proc/self/task/{self.thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--targets", default="round_robin,tier_cost+tok", help="POLICY[+tok], comma-separated"
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of wrk per router and repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stream", default="no", metavar="no|yes|yesN", help="as B3's --stream (one item)")
    args = parser.parse_args(argv)
    try:
        events = stream_mode(args.stream)
    except ValueError as exc:
        parser.error(str(exc))
    targets = [t for t in args.targets.split(",") if t]
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-paths-") as tmp,
        zero_delay_engines("fast", 2, Path(tmp)) as engines,
    ):
        body = chat_body(args.prompt_tokens, events > 0, max_tokens=events or 4, model=engines[0].model)
        rows = []
        for target in targets:
            routers = {mode: ServedRouter(target, mode == "on", engines).start() for mode in ("off", "on")}
            try:
                for router in routers.values():
                    run_wrk(router.url, body, args.concurrency, 1.0, Path(tmp))  # caches and pools warm
                figures: dict[str, list[float]] = {"off": [], "on": []}
                rates: dict[str, list[float]] = {"off": [], "on": []}
                for repeat in range(args.repeats):
                    order = ("off", "on") if repeat % 2 == 0 else ("on", "off")
                    for mode in order:
                        router = routers[mode]
                        before = router.cpu_s()
                        result = run_wrk(router.url, body, args.concurrency, args.duration, Path(tmp))
                        if result["errors"] or not result["requests"]:
                            raise RuntimeError(f"{target} callback_path={mode}: {result}")
                        figures[mode].append((router.cpu_s() - before) / result["requests"] * 1e6)
                        rates[mode].append(result["rps"])
                        print(
                            f"  r{repeat} {target:<16} callback_path={mode:<3} {result['rps']:7.0f} req/s "
                            f"{figures[mode][-1]:5.0f} µs/req",
                            file=sys.stderr,
                        )
            finally:
                for router in routers.values():
                    router.stop()
            lower = sum(on < off for off, on in zip(figures["off"], figures["on"], strict=True))
            for mode in ("off", "on"):
                cpu, rps = figures[mode], rates[mode]
                rows.append(
                    f"| {target} | {mode} | {statistics.median(rps):.0f} | {statistics.median(cpu):.0f} "
                    f"[{min(cpu):.0f}-{max(cpu):.0f}] | "
                    + (f"{lower} of {args.repeats}" if mode == "on" else "-")
                    + " |"
                )
    what = f"stream ({stream_label(events)})" if events else "non-stream"
    head = f"c{args.concurrency}, {args.prompt_tokens}-token {what} chat, {args.duration:g} s per router"
    print(f"\n{head} and repeat, {args.repeats} repeats alternating which path goes first; medians")
    print(f"[min-max]; load average {os.getloadavg()[0]:.1f} at the end.\n")
    print("| target | callback path | req/s | router thread CPU µs/req | repeats where on < off |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
