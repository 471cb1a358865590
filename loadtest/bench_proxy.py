"""Proxy overhead benchmark (B3 baseline): direct vs the raw-Python reference proxy vs minimal
httpx/aiohttp proxies vs kvroute.

Every part is its own process: a zero-delay OpenAI-shaped upstream (aiohttp.web), the proxy under
test (uvicorn + uvloop; ``raw_proxy`` is asyncio + httptools on both sides, the labelled bound of
what a Python data path reaches, also a target of loadtest/bench_peers.py), and a closed-loop
aiohttp load generator. Prints, per target, concurrency
and stream mode: req/s and p50/p99 latency, and the latency added over a direct call (medians of
``--runs`` runs, min-max in brackets).

    python -m loadtest.bench_proxy            # full: concurrency 1 and 64, 5 s per point, 3 runs
    python -m loadtest.bench_proxy --quick    # smoke test: 0.5 s per point, 1 run
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Module level, because FastAPI resolves the (string) annotations of the proxy's handlers here.
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvcore.stats import percentile
from loadtest.procs import stop_process, wait_http_ok

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-model"
TARGETS = ("direct", "raw_proxy", "httpx_proxy", "aiohttp_proxy", "kvroute")
BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 4}
).encode()
STREAM_BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello " * 50}],
        "max_tokens": 4,
        "stream": True,
    }
).encode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the zero-delay upstream ---------------------------------------------------------------------


def run_upstream(port: int) -> None:
    from aiohttp import web

    from kvcore.sim_tokenizer import encode_chat

    def answer_of(prompt_tokens: int) -> bytes:
        return json.dumps(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "a b c d"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": 4,
                    "total_tokens": prompt_tokens + 4,
                },
            }
        ).encode()

    # The answer's usage.prompt_tokens is the chat's count through the simulator's template, as a
    # router with the sim tokenizer counts it (a fixed count would fail the router's tokenizer parity
    # check and leave its index distrusted). Counted once per distinct body: the benchmarks send
    # the same few bodies again and again.
    @functools.lru_cache(maxsize=64)
    def answer_for(body: bytes) -> bytes:
        return answer_of(len(encode_chat(json.loads(body).get("messages") or [])))

    chunk = (
        b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"%s "}}]}'
    )
    # Streamed events per answer: the request's max_tokens (4 when absent), or BENCH_UPSTREAM_CHUNKS
    # when set; a second event count prices the relay per chunk (loadtest/bench_peers.py).
    fixed = os.environ.get("BENCH_UPSTREAM_CHUNKS")
    max_tokens = re.compile(rb'"max_tokens": *(\d+)')
    events: dict[int, list[bytes]] = {}

    def stream_of(n_chunks: int) -> list[bytes]:
        found = events.get(n_chunks)
        if found is None:
            words = [b"abcdefghijklmnopqrstuvwxyz"[i % 26 : i % 26 + 1] for i in range(n_chunks)]
            found = events[n_chunks] = [chunk % w + b"\n\n" for w in words] + [b"data: [DONE]\n\n"]
        return found

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream": true' not in body:
            return web.Response(body=answer_for(body), content_type="application/json")
        asked = max_tokens.search(body)
        chunks = stream_of(int(fixed) if fixed else min(4096, int(asked.group(1))) if asked else 4)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# -- minimal proxies (the client-library comparison) ----------------------------------------------


def run_minimal_proxy(variant: str, port: int, upstream: str) -> None:
    from contextlib import asynccontextmanager

    import uvicorn
    from fastapi import FastAPI

    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        if variant == "httpx":
            import httpx

            state["client"] = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
            )
        else:
            import aiohttp

            state["client"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await state["client"].aclose() if variant == "httpx" else await state["client"].close()

    app = FastAPI(lifespan=lifespan)
    url = upstream + "/v1/chat/completions"

    @app.get("/health")
    async def health() -> Response:
        return Response()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.body()
        headers = {"content-type": "application/json"}
        client = state["client"]
        stream = b'"stream": true' in body
        if variant == "httpx":
            req = client.build_request("POST", url, content=body, headers=headers)
            resp = await client.send(req, stream=stream)
            if not stream:
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")

            async def gen_httpx():  # type: ignore[no-untyped-def]
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()

            return StreamingResponse(gen_httpx(), media_type="text/event-stream")
        aresp = await client.post(url, data=body, headers=headers)
        if not stream:
            data = await aresp.read()
            return Response(data, status_code=aresp.status, media_type="application/json")

        async def gen_aiohttp():  # type: ignore[no-untyped-def]
            try:
                async for chunk in aresp.content.iter_any():
                    yield chunk
            finally:
                aresp.close()

        return StreamingResponse(gen_aiohttp(), media_type="text/event-stream")

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


# -- the raw-Python reference proxy (B3's labelled baseline) -------------------------------------------


def run_raw_proxy(port: int, upstreams: Sequence[str], work_us: float = 0.0) -> None:
    """round_robin's job and nothing more, in the cheapest Python there is: an asyncio server with
    httptools on both sides, a keep-alive pool per upstream, the engine's answer relayed byte for byte
    (its framing parsed only to know where it ends). It parses the body (as every router must, to
    route) but keeps no metrics, limits, errors or fail-over: what a Python data path can reach on
    this machine, not a router. GET /health answers 200; anything that breaks closes the client.
    ``work_us``: spin that many µs of Python per request before forwarding (bench_peers'
    ``raw_proxy+workN`` probe: what a router's own work costs it per request over sockets)."""
    import itertools
    from urllib.parse import urlsplit

    import httptools
    import msgspec

    loop_policy: Any = None
    try:
        import uvloop

        loop_policy = uvloop.EventLoopPolicy()
    except ImportError:
        pass
    decode = msgspec.json.decode
    perf_counter = time.perf_counter

    class Pool:
        def __init__(self, url: str) -> None:
            parts = urlsplit(url)
            self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
            self.idle: list[UpstreamConn] = []
            self.head = b"host: %s:%d\r\ncontent-type: application/json\r\n" % (self.host.encode(), self.port)

        def send(self, client: ClientConn, path: bytes, body: bytes) -> None:
            request = b"POST %s HTTP/1.1\r\n%scontent-length: %d\r\n\r\n%s" % (
                path,
                self.head,
                len(body),
                body,
            )
            if self.idle:
                conn = self.idle.pop()
                conn.client = client
                conn.transport.write(request)
                return
            task = asyncio.get_running_loop().create_task(self._connect(client, request))
            task.add_done_callback(_ignore)

        async def _connect(self, client: ClientConn, request: bytes) -> None:
            try:
                _, conn = await asyncio.get_running_loop().create_connection(
                    lambda: UpstreamConn(self), self.host, self.port
                )
            except OSError:
                client.transport.close()
                return
            conn.client = client
            conn.transport.write(request)

    def _ignore(task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            task.exception()

    class UpstreamConn(asyncio.Protocol):
        def __init__(self, pool: Pool) -> None:
            self.pool = pool
            self.client: ClientConn | None = None
            self.parser = httptools.HttpResponseParser(self)
            self.transport: Any = None

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            client = self.client
            if client is not None:
                client.transport.write(data)  # relayed as it arrives
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_message_complete(self) -> None:
            self.client = None
            self.pool.idle.append(self)

        def connection_lost(self, exc: Exception | None) -> None:
            if self in self.pool.idle:
                self.pool.idle.remove(self)
            if self.client is not None:
                self.client.transport.close()

    pools = [Pool(u) for u in upstreams]
    choose = itertools.cycle(pools).__next__
    health = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"

    class ClientConn(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            self.body: list[bytes] = []
            self.url = b""
            self.transport: Any = None

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_url(self, url: bytes) -> None:
            self.url = url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            if self.parser.get_method() != b"POST":
                self.transport.write(health)
                return
            body = b"".join(self.body)
            self.body = []
            doc = decode(body)  # routing needs the body parsed (model, stream)
            if not isinstance(doc, dict) or "model" not in doc:
                self.transport.close()
                return
            if work_us:
                until = perf_counter() + work_us / 1e6
                while perf_counter() < until:
                    pass
            choose().send(self, self.url, body)

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(ClientConn, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    if loop_policy is not None:
        asyncio.set_event_loop_policy(loop_policy)
    asyncio.run(serve())


# -- closed-loop load generator ---------------------------------------------------------------------


async def _load(
    url: str, concurrency: int, duration_s: float, warmup_s: float, stream: bool
) -> dict[str, Any]:
    import aiohttp

    body = STREAM_BODY if stream else BODY
    latencies_s: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.monotonic()
        measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s

        async def worker() -> None:
            nonlocal errors
            while True:
                t0 = time.monotonic()
                if t0 >= stop_at:
                    return
                try:
                    async with session.post(
                        url, data=body, headers={"content-type": "application/json"}
                    ) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                t1 = time.monotonic()
                if t0 >= measure_from and t1 <= stop_at:
                    if ok:
                        latencies_s.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    latencies_s.sort()

    def pct(q: float) -> float:
        return percentile(latencies_s, q * 100)  # the project's one definition (kvcore.stats)

    return {
        "requests": len(latencies_s),
        "errors": errors,
        "rps": len(latencies_s) / duration_s,
        "p50_ms": pct(0.50) * 1000,
        "p99_ms": pct(0.99) * 1000,
    }


def run_load(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args(list(argv))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(_load(args.url, args.concurrency, args.duration, args.warmup, args.stream))))


# -- orchestration ----------------------------------------------------------------------------------


class Proc:
    """A child process of this benchmark, killed (process group) on exit."""

    def __init__(self, args: list[str], health_url: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.health_url = health_url

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        def stderr() -> str:
            return self.popen.stderr.read().decode(errors="replace") if self.popen.stderr else ""

        wait_http_ok(self.health_url, self.popen, timeout_s, output=stderr)

    def stop(self) -> None:
        stop_process(self.popen)
        if self.popen.stderr:
            self.popen.stderr.close()


def start_target(target: str, upstream_url: str) -> tuple[Proc | None, str]:
    if target == "direct":
        return None, upstream_url
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    me = "loadtest.bench_proxy"
    if target == "kvroute":
        args = [
            "-m",
            "router.cli",
            "serve",
            "--engine",
            f"up={upstream_url}",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--log-level",
            "warning",
        ]
    elif target == "raw_proxy":
        args = ["-m", me, "_raw_proxy", str(port), upstream_url]
    else:
        args = ["-m", me, "_proxy", target.split("_")[0], str(port), upstream_url]
    proc = Proc(args, url + "/health")
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    return proc, url


def measure(url: str, concurrency: int, duration_s: float, stream: bool) -> dict[str, Any]:
    args = [
        sys.executable,
        "-m",
        "loadtest.bench_proxy",
        "_load",
        "--url",
        url + "/v1/chat/completions",
        "--concurrency",
        str(concurrency),
        "--duration",
        str(duration_s),
        "--warmup",
        str(min(1.0, duration_s / 2)),
    ]
    if stream:
        args.append("--stream")
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=duration_s + 120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_bench(
    targets: Sequence[str],
    concurrencies: Sequence[int],
    streams: Sequence[bool],
    duration_s: float,
    runs: int,
) -> list[dict[str, Any]]:
    up_port = free_port()
    upstream = Proc(
        ["-m", "loadtest.bench_proxy", "_upstream", str(up_port)], f"http://127.0.0.1:{up_port}/health"
    )
    results: list[dict[str, Any]] = []
    try:
        upstream.wait_ready()
        for run in range(runs):
            for target in targets:
                proc, url = start_target(target, f"http://127.0.0.1:{up_port}")
                try:
                    for stream in streams:
                        for concurrency in concurrencies:
                            point = measure(url, concurrency, duration_s, stream)
                            point.update(target=target, concurrency=concurrency, stream=stream, run=run)
                            results.append(point)
                            print(
                                f"  run {run} {target:<14} c={concurrency:<3} stream={stream!s:<5} "
                                f"{point['rps']:8.0f} req/s  p50 {point['p50_ms']:6.2f} ms  "
                                f"p99 {point['p99_ms']:6.2f} ms  errors {point['errors']}",
                                file=sys.stderr,
                            )
                finally:
                    if proc:
                        proc.stop()
    finally:
        upstream.stop()
    return results


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median (and min, max) over runs per point, plus latency added over 'direct' in the same run."""
    direct = {(r["concurrency"], r["stream"], r["run"]): r for r in results if r["target"] == "direct"}
    groups: dict[tuple[str, int, bool], list[dict[str, Any]]] = {}
    for r in results:
        d = direct.get((r["concurrency"], r["stream"], r["run"]))
        r["added_p50_ms"] = r["p50_ms"] - d["p50_ms"] if d else float("nan")
        r["added_p99_ms"] = r["p99_ms"] - d["p99_ms"] if d else float("nan")
        groups.setdefault((r["target"], r["concurrency"], r["stream"]), []).append(r)
    rows = []
    for (target, concurrency, stream), points in groups.items():
        row: dict[str, Any] = {
            "target": target,
            "concurrency": concurrency,
            "stream": stream,
            "runs": len(points),
            "errors": sum(p["errors"] for p in points),
        }
        for key in ("rps", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms"):
            values = [p[key] for p in points]
            row[key] = (statistics.median(values), min(values), max(values))
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def fmt(v: tuple[float, float, float], digits: int) -> str:
        med, lo, hi = v
        return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]" if lo != hi else f"{med:.{digits}f}"

    lines = [
        "| target | conc. | stream | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["stream"], r["concurrency"], TARGETS.index(r["target"]))):
        lines.append(
            f"| {r['target']} | {r['concurrency']} | {'yes' if r['stream'] else 'no'} | {fmt(r['rps'], 0)} "
            f"| {fmt(r['p50_ms'], 2)} | {fmt(r['p99_ms'], 2)} | "
            f"{'-' if r['target'] == 'direct' else fmt(r['added_p50_ms'], 2)} | "
            f"{'-' if r['target'] == 'direct' else fmt(r['added_p99_ms'], 2)} | {r['errors']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_upstream":
        run_upstream(int(argv[1]))
        return 0
    if argv and argv[0] == "_proxy":
        run_minimal_proxy(argv[1], int(argv[2]), argv[3])
        return 0
    if argv and argv[0] == "_raw_proxy":
        rest, work_us = argv[2:], 0.0
        if "--work-us" in rest:
            at = rest.index("--work-us")
            work_us = float(rest[at + 1])
            rest = rest[:at] + rest[at + 2 :]
        run_raw_proxy(int(argv[1]), rest, work_us)
        return 0
    if argv and argv[0] == "_load":
        run_load(argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_proxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 0.5 s per point, concurrency 4, 1 run"
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    parser.add_argument("--concurrency", default="1,64", help="comma list of closed-loop client counts")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="also write the summary rows to this JSON file")
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    for t in targets:
        if t not in TARGETS:
            parser.error(f"unknown target {t!r}; accepted: {', '.join(TARGETS)}")
    if "direct" not in targets:
        targets.insert(0, "direct")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    duration_s, runs = args.duration, args.runs
    if args.quick:
        concurrencies, duration_s, runs = [4], 0.5, 1
    print(
        f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}",
        file=sys.stderr,
    )
    rows = summarise(run_bench(targets, concurrencies, (False, True), duration_s, runs))
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
