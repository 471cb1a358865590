"""B3 router overhead side by side: direct vs kvroute (each policy, tokenizer on/off) vs the Rust peers
(vllm-router, sglang-router, smg) on the same zero-delay simulated engines, load from `wrk`.

The peers are installed by this script, each into its OWN virtual environment under ``--peers-dir``
(never into the project's dependencies). Per repeat every target is measured at every concurrency,
stream mode and prompt size, the targets' order rotated by one place a repeat (``repeat_order``);
"added" latency and the req/s ratio are taken against `direct` in the same repeat, then the median
over repeats is reported. Writes ``b3.md``, ``b3.json`` and PNGs into
``--out``.

``--stream no,yes,yes64``: ``yes`` streams 4 events per answer, ``yesN`` N events (the engine sends
max_tokens events); with two event counts the notes price the relay per streamed event (router CPU
difference over the event difference). ``--checkout LABEL=DIR`` adds targets ``LABEL:POLICY[+tok]``:
kvroute run from another checkout (e.g. ``git archive`` of the commit before a change), so before and
after are measured interleaved in one run. ``--python LABEL=PATH`` adds targets ``LABEL:POLICY[+tok]``:
this checkout's kvroute run by another Python interpreter (one with the project's dependencies
installed), so two builds of CPython are measured interleaved on the same code.

    python -m loadtest.bench_peers --out runs/bench/b3                    # the default matrix
    python -m loadtest.bench_peers --quick                                 # smoke run (kvroute only)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

import policies  # noqa: F401  (registers every policy)
from kvcore.sim_tokenizer import NAME as SIM_MODEL
from kvcore.sim_tokenizer import filler_text
from loadtest.bench_proxy import MODEL as BENCH_PROXY_MODEL
from loadtest.load import stop_process
from policies.base import REGISTRY
from sim.fleet import PROFILES, Fleet
from sim.server import free_port

REPO = Path(__file__).resolve().parents[1]
FAST_MODEL = BENCH_PROXY_MODEL

#: name -> (PyPI package pinned, console script). Pinned so that a rerun measures the same code.
PEER_PACKAGES: dict[str, tuple[str, str]] = {
    "vllm-router": ("vllm-router==0.1.17", "vllm-router"),
    "sglang-router": ("sglang-router==0.3.2", "sglang-router"),
    "smg": ("smg==1.13.0", "smg"),
}
DEFAULT_TARGETS = (
    "direct",
    "raw_proxy",
    "kvroute:round_robin",
    "kvroute:round_robin+tok",
    "kvroute:session_affinity",
    "kvroute:kv_fixed_credit+tok",
    "kvroute:tier_cost+tok",
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
    "sglang-router:cache_aware",
    "smg:cache_aware",
)
#: Every registered kvroute policy (policies/ registers each module by name on import).
KVROUTE_POLICIES = tuple(sorted(REGISTRY))


def default_peers_dir() -> Path:
    return Path(os.environ.get("KVROUTE_PEERS_DIR", Path.home() / ".cache" / "kvroute" / "peers"))


# -- peers: install into their own venvs -------------------------------------------------------------


def peer_binary(peers_dir: Path, peer: str) -> Path:
    return peers_dir / peer / "bin" / PEER_PACKAGES[peer][1]


def install_peer(peers_dir: Path, peer: str) -> Path:
    """The peer's console script, installing ``peer`` into ``peers_dir/peer`` first if needed.
    Raises RuntimeError with pip's own error when it cannot be installed here."""
    binary = peer_binary(peers_dir, peer)
    if binary.exists():
        return binary
    env_dir = peers_dir / peer
    print(f"installing {PEER_PACKAGES[peer][0]} into its own venv {env_dir} ...", file=sys.stderr, flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    proc = subprocess.run(
        [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", PEER_PACKAGES[peer][0]],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not binary.exists():
        errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("WARNING: Location")]
        raise RuntimeError(f"pip install {PEER_PACKAGES[peer][0]} failed: {' | '.join(errors[-5:])}")
    return binary


# -- targets --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """``direct``, ``raw_proxy`` (loadtest/bench_proxy.py's reference proxy: what Python can reach
    here), ``kvroute:POLICY[+tok][+cb|+cbidle|+cbN|+nocb][+defer|+nodefer][xN]`` or ``PEER:POLICY``; ``+cb``:
    kvroute with the callback path on (proxy.callback_path true), ``+cbidle``: on while the router
    is idle ("idle"), ``+cbN``: on while fewer than N other exchanges are in progress (N), ``+nocb``:
    off (false), none of them: the checkout's default ("idle" since
    it has the value, off before); ``+defer``: with
    proxy.defer_accounting on, ``+nodefer``: off (without either: the checkout's default, on since
    round dp26)."""

    spec: str
    kind: str
    policy: str = ""
    tokenizer: bool = False
    workers: int = 1
    #: kvroute from this checkout instead of this one (``--checkout LABEL=DIR``).
    checkout: str = ""
    #: kvroute run by this Python interpreter instead of the bench's own (``--python LABEL=PATH``).
    python: str = ""
    #: proxy.callback_path: True ``+cb``, "idle" ``+cbidle``, "N" ``+cbN``, False ``+nocb``, None the
    #: checkout's default.
    callback_path: bool | str | None = None
    #: ``raw_proxy+workN``: the raw proxy spending N µs of pure-Python busy work per request before it
    #: forwards (a probe: what N µs of a router's own work costs it per request over sockets).
    work_us: float = 0.0
    #: proxy.defer_accounting: True ``+defer``, False ``+nodefer``, None the checkout's default.
    defer_accounting: bool | None = None

    @staticmethod
    def parse(
        spec: str, checkouts: dict[str, str] | None = None, pythons: dict[str, str] | None = None
    ) -> Target:
        if spec in ("direct", "raw_proxy"):
            return Target(spec, spec)
        if m := re.fullmatch(r"raw_proxy\+work(\d+(?:\.\d+)?)", spec):
            return Target(spec, "raw_proxy", work_us=float(m.group(1)))
        kind, _, rest = spec.partition(":")
        checkout = (checkouts or {}).get(kind, "")
        python = (pythons or {}).get(kind, "")
        if checkout or python:
            kind = "kvroute"
        if kind not in ("kvroute", *PEER_PACKAGES) or not rest:
            raise ValueError(
                f"target {spec!r}: expected direct, raw_proxy[+workUS], "
                "kvroute:POLICY[+tok][+cb|+cbidle|+cbN|+nocb][+defer|+nodefer][xN] or PEER:POLICY with "
                f"PEER in {', '.join(PEER_PACKAGES)}"
            )
        workers = 1
        m = re.fullmatch(r"(.*)x(\d+)", rest)
        if m and kind == "kvroute":
            rest, workers = m.group(1), int(m.group(2))
        defer: bool | None = None
        if kind == "kvroute" and rest.endswith(("+defer", "+nodefer")):
            defer = rest.endswith("+defer")
            rest = rest.removesuffix("+defer" if defer else "+nodefer")
        callback_path: bool | str | None = None
        for suffix, value in (("+cb", True), ("+cbidle", "idle"), ("+nocb", False)):
            if kind == "kvroute" and rest.endswith(suffix):
                callback_path, rest = value, rest.removesuffix(suffix)
                break
        m = re.fullmatch(r"(.*)\+cb(\d+)", rest)
        if m and kind == "kvroute" and callback_path is None:
            rest, callback_path = m.group(1), m.group(2)
        tok = rest.endswith("+tok")
        policy = rest.removesuffix("+tok")
        if kind == "kvroute" and policy not in KVROUTE_POLICIES:
            raise ValueError(f"target {spec!r}: kvroute policy must be one of {', '.join(KVROUTE_POLICIES)}")
        return Target(
            spec, kind, policy, tok, workers, checkout, python, callback_path, defer_accounting=defer
        )


def interpreters(items: Sequence[str]) -> dict[str, str]:
    """``--python LABEL=PATH`` items -> LABEL: PATH, each checked to run and to import what the router
    needs (ValueError naming the item otherwise)."""
    out: dict[str, str] = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"--python {item!r}: expected LABEL=PATH")
        if not os.access(path, os.X_OK):
            raise ValueError(f"--python {label}={path}: not an executable")
        check = "import fastapi, uvicorn, uvloop, httptools, msgspec, xxhash, zmq, prometheus_client, numpy"
        proc = subprocess.run([path, "-c", check], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise ValueError(
                f"--python {label}={path}: cannot run the router ({last}); install the project there"
            )
        out[label] = path
    return out


def peer_command(
    binary: Path, peer: str, policy: str, port: int, engines: Sequence[Any], extra: Sequence[str] = ()
) -> list[str]:
    """How each peer is started (flags checked against their --help: the sglang-router and smg CLIs
    take a ``launch`` subcommand; every one binds a Prometheus port, 29000 by default, so each gets
    its own)."""
    urls = [e.url for e in engines]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy]
    common += ["--prometheus-port", str(free_port())]
    if peer == "vllm-router":
        return [str(binary), *common, "--log-level", "warning", *extra]
    return [str(binary), "launch", *common, "--log-level", "warn", *extra]


def stream_mode(text: str) -> int:
    """``--stream`` item -> streamed events per answer: no = 0 (non-stream), yes = 4, yesN = N."""
    text = text.strip()
    if text == "no":
        return 0
    if text == "yes":
        return 4
    if text.startswith("yes") and text[3:].isdigit() and int(text[3:]) > 0:
        return int(text[3:])
    raise ValueError(f"--stream item {text!r}: expected no, yes or yesN (N events per answer)")


def stream_label(events: int) -> str:
    return "no" if not events else "yes" if events == 4 else f"yes ({events} ev.)"


def chat_body(prompt_tokens: int, stream: bool, max_tokens: int = 4, model: str = SIM_MODEL) -> bytes:
    text = filler_text(max(1, prompt_tokens - 3), seed=prompt_tokens)
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def wait_routes(
    url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float = 60.0, model: str = SIM_MODEL
) -> None:
    """Wait until a chat request through ``url`` comes back 200 (the router started AND routes)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    body = chat_body(50, False, model=model)
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with code {proc.returncode} while starting")
        try:
            resp = httpx.post(
                url + "/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=5,
            )
            if resp.status_code == 200 and resp.json().get("choices"):
                return
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{url} does not route a chat request after {timeout_s:.0f} s: {last}")


@contextlib.contextmanager
def start_target(
    target: Target, engines: Sequence[Any], workdir: Path, peers_dir: Path
) -> Iterator[tuple[str, int | None]]:
    """Start ``target`` in front of ``engines``; yield (URL to load, its process group id); stop it
    on exit."""
    if target.kind == "direct":
        yield engines[0].url, None
        return
    port = free_port()
    log_path = workdir / f"{target.spec.replace(':', '_').replace('+', '_')}.log"
    # KVROUTE_* variables are router config; the bench's own (KVROUTE_PEERS_DIR) would be refused.
    env = {k: v for k, v in os.environ.items() if k != "KVROUTE_PEERS_DIR"}
    if target.kind == "kvroute":
        python = target.python or sys.executable
        args = [python, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--policy", target.policy, "--log-level", "warning"]
        for e in engines:
            args += ["--engine", f"{e.id}={e.url}"]
        if target.workers > 1:
            args += ["--workers", str(target.workers)]
        env["KVROUTE_TOKENIZER_BACKEND"] = "sim" if target.tokenizer else "none"
        if target.callback_path is None:  # the checkout's default (one from before the key would
            env.pop("KVROUTE_PROXY_CALLBACK_PATH", None)  # refuse the variable)
        else:
            env["KVROUTE_PROXY_CALLBACK_PATH"] = str(target.callback_path).lower()  # true, false, idle, N
        if target.defer_accounting is None:  # the checkout's default (one from before the key
            env.pop("KVROUTE_PROXY_DEFER_ACCOUNTING", None)  # would refuse the variable)
        else:
            env["KVROUTE_PROXY_DEFER_ACCOUNTING"] = "true" if target.defer_accounting else "false"
    elif target.kind == "raw_proxy":
        args = [
            sys.executable,
            "-m",
            "loadtest.bench_proxy",
            "_raw_proxy",
            str(port),
            *[e.url for e in engines],
            *(["--work-us", str(target.work_us)] if target.work_us else []),
        ]
    else:
        args = peer_command(install_peer(peers_dir, target.kind), target.kind, target.policy, port, engines)
    with open(log_path, "wb") as log:
        # python -m router.cli from another checkout's folder imports that checkout's router.
        cwd = Path(target.checkout) if target.checkout else REPO
        proc = subprocess.Popen(
            args, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_routes(url, proc, model=engines[0].model)
        except RuntimeError as exc:
            tail = log_path.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"{target.spec}: {exc}\n--- log tail ---\n{tail}") from None
        yield url, proc.pid
    finally:
        stop_process(proc)


def group_cpu_s(pgid: int | None) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (all threads, all
    workers), from /proc: the cost of the router itself, whatever else the shared machine runs."""
    if pgid is None:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the ")": state ppid pgrp ... utime is field 14, stime 15 of the full line.
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / ticks


# -- load: wrk -------------------------------------------------------------------------------------------

_WRK_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]
"""


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def parse_wrk(out: str) -> dict[str, Any]:
    """req/s, latency percentiles (ms), errors from ``wrk --latency`` output."""
    result: dict[str, Any] = {"errors": 0}
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not m:
        raise RuntimeError(f"wrk printed no Requests/sec:\n{out[-1500:]}")
    result["rps"] = float(m.group(1))
    for pct, value, unit in re.findall(r"^\s+(50|75|90|99)(?:\.000)?%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M):
        result[f"p{pct}_ms"] = _ms(value, unit)
    m = re.search(r"(\d+) requests in", out)
    result["requests"] = int(m.group(1)) if m else 0
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if m:
        result["errors"] += int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        result["errors"] += sum(int(x) for x in m.groups())
    return result


def run_wrk(url: str, body: bytes, concurrency: int, duration_s: float, workdir: Path) -> dict[str, Any]:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk not found: install it with `apt-get install wrk` (Debian package)")
    script = workdir / f"post-{len(body)}.lua"
    if not script.exists():
        script.write_text(_WRK_LUA.format(body=body.decode()))
    args = [
        wrk,
        "-t1",
        f"-c{concurrency}",
        f"-d{max(1, round(duration_s))}s",
        "--latency",
        "--timeout",
        "10s",
    ]
    args += ["-s", str(script), url + "/v1/chat/completions"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=duration_s + 60, check=True)
    return parse_wrk(out.stdout)


# -- the benchmark ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Matrix:
    targets: list[Target]
    concurrencies: list[int]
    #: Streamed events per answer; 0 = non-stream.
    streams: list[int]
    prompt_tokens: list[int]
    duration_s: float = 5.0
    warmup_s: float = 1.0
    repeats: int = 3
    engines: int = 2
    engine_kind: str = "fast"
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Upstream:
    """A fast zero-delay OpenAI-shaped upstream (loadtest/bench_proxy.py's aiohttp server)."""

    id: str
    url: str
    model: str = FAST_MODEL


@contextlib.contextmanager
def zero_delay_engines(kind: str, n: int, workdir: Path) -> Iterator[list[Any]]:
    """``n`` zero-delay engines: ``sim`` = sim/server.py --zero-delay (FastAPI; tokenises the prompt,
    ~300-700 req/s per process here), ``fast`` = a bare aiohttp upstream with a fixed answer (several
    thousand req/s), so that the routers, not the engines, are what saturates."""
    if kind == "sim":
        with Fleet(workdir / "fleet") as fleet:
            yield fleet.start(n, replace(PROFILES["zero-delay"], default_max_tokens=4))
        return
    procs: list[subprocess.Popen[bytes]] = []
    ups: list[Upstream] = []
    try:
        for i in range(n):
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "loadtest.bench_proxy", "_upstream", str(port)],
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
            ups.append(Upstream(f"e{i}", f"http://127.0.0.1:{port}"))
        for up, proc in zip(ups, procs, strict=True):
            wait_routes(up.url, proc, model=FAST_MODEL)
        yield ups
    finally:
        for proc in procs:
            stop_process(proc)


def repeat_order(targets: Sequence[Target], repeat: int) -> list[Target]:
    """The targets in the order repeat ``repeat`` runs them: rotated by one place a repeat, so that
    over as many repeats as targets each target runs once in every place. In a fixed order a drift
    within a repeat (the upstreams' state, the host's clock or caches after a given neighbour) would
    land on the same target every time and bias a pair of targets compared repeat by repeat."""
    shift = repeat % len(targets) if targets else 0
    return [*targets[shift:], *targets[:shift]]


def run_matrix(m: Matrix, peers_dir: Path, workdir: Path) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    with zero_delay_engines(m.engine_kind, m.engines, workdir) as engines:
        for repeat in range(m.repeats):
            for target in repeat_order(m.targets, repeat):
                if target.spec in m.unavailable:
                    continue
                try:
                    ctx = start_target(target, engines, workdir, peers_dir)
                    url, pgid = ctx.__enter__()
                except RuntimeError as exc:
                    m.unavailable[target.spec] = str(exc)
                    print(f"  {target.spec}: UNAVAILABLE: {exc}", file=sys.stderr, flush=True)
                    continue
                try:
                    for prompt in m.prompt_tokens:
                        for stream in m.streams:
                            body = chat_body(
                                prompt, stream > 0, max_tokens=stream or 4, model=engines[0].model
                            )
                            if m.warmup_s > 0:
                                run_wrk(url, body, 4, m.warmup_s, workdir)
                            for conc in m.concurrencies:
                                cpu0 = group_cpu_s(pgid)
                                point = run_wrk(url, body, conc, m.duration_s, workdir)
                                cpu_s = group_cpu_s(pgid) - cpu0
                                if pgid is not None and point["requests"]:
                                    point["cpu_us_per_req"] = cpu_s / point["requests"] * 1e6
                                point.update(
                                    target=target.spec,
                                    concurrency=conc,
                                    stream=stream,
                                    prompt=prompt,
                                    repeat=repeat,
                                )
                                points.append(point)
                                print(
                                    f"  r{repeat} {target.spec:<28} {prompt:>6} tok c={conc:<3} "
                                    f"stream={stream_label(stream)} {point['rps']:8.0f} req/s "
                                    f"p50 {point.get('p50_ms', float('nan')):7.2f} ms "
                                    f"p99 {point.get('p99_ms', float('nan')):7.2f} ms err {point['errors']}",
                                    file=sys.stderr,
                                    flush=True,
                                )
                    if target.kind == "kvroute":
                        refuse_distrusted(httpx.get(f"{url}/ready", timeout=10).json(), target.spec)
                finally:
                    ctx.__exit__(None, None, None)
    return points


def refuse_distrusted(ready: dict[str, Any], spec: str) -> None:
    """Refuse the figures of a kvroute whose ``GET /ready`` answer (``ready``) says it distrusts its
    engines' prompt counts: they would be of a blind index."""
    mismatch = (ready.get("events") or {}).get("prompt_token_mismatch") or {}
    if mismatch:
        raise RuntimeError(f"{spec}: the router distrusts the engines' prompt counts: {mismatch}")


def summarise(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (target, prompt, stream, concurrency): medians over repeats of req/s, p50, p99, and of the
    per-repeat added p50/p99 and req/s ratio against direct."""
    direct = {
        (p["prompt"], p["stream"], p["concurrency"], p["repeat"]): p
        for p in points
        if p["target"] == "direct"
    }
    groups: dict[tuple[str, int, bool, int], list[dict[str, Any]]] = {}
    for p in points:
        d = direct.get((p["prompt"], p["stream"], p["concurrency"], p["repeat"]))
        p["added_p50_ms"] = p["p50_ms"] - d["p50_ms"] if d else float("nan")
        p["added_p99_ms"] = p["p99_ms"] - d["p99_ms"] if d else float("nan")
        p["rps_vs_direct"] = p["rps"] / d["rps"] if d and d["rps"] else float("nan")
        groups.setdefault((p["target"], p["prompt"], p["stream"], p["concurrency"]), []).append(p)
    rows = []
    for (target, prompt, stream, conc), ps in groups.items():
        row: dict[str, Any] = dict(
            target=target, prompt=prompt, stream=stream, concurrency=conc, repeats=len(ps),
            errors=sum(p["errors"] for p in ps),
        )  # fmt: skip
        keys = ("rps", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "rps_vs_direct", "cpu_us_per_req")
        for key in keys:
            values = [p[key] for p in ps if key in p]
            row[key] = statistics.median(values) if values else float("nan")
            row[key + "_range"] = (min(values), max(values)) if values else (float("nan"),) * 2
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], target_order: Sequence[str]) -> str:
    lines = [
        "| prompt | stream | conc. | target | req/s | x direct | p50 ms | p99 ms | added p50 ms "
        "| added p99 ms | router CPU µs/req | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def rng(r: dict[str, Any], key: str, digits: int) -> str:
        lo, hi = r[key + "_range"]
        med = r[key]
        if r["repeats"] > 1 and lo == lo:
            return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"
        return f"{med:.{digits}f}"

    order = {t: i for i, t in enumerate(target_order)}
    for r in sorted(
        rows, key=lambda r: (r["prompt"], r["stream"], r["concurrency"], order.get(r["target"], 99))
    ):
        is_direct = r["target"] == "direct"
        lines.append(
            f"| {r['prompt']} | {stream_label(r['stream'])} | {r['concurrency']} | {r['target']} "
            f"| {rng(r, 'rps', 0)} | {'-' if is_direct else format(r['rps_vs_direct'], '.2f')} "
            f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
            f"| {'-' if is_direct else rng(r, 'added_p50_ms', 2)} "
            f"| {'-' if is_direct else rng(r, 'added_p99_ms', 2)} "
            f"| {'-' if is_direct else format(r['cpu_us_per_req'], '.0f')} | {r['errors']} |"
        )
    return "\n".join(lines)


def per_event_costs(rows: list[dict[str, Any]]) -> list[str]:
    """Router CPU per streamed event, per target, prompt and concurrency: the CPU per request of its
    longest and shortest streams, their difference over the difference in events."""
    lines = []
    keyed: dict[tuple[str, int, int], dict[int, float]] = {}
    for r in rows:
        if r["stream"] and r["target"] != "direct" and r["cpu_us_per_req"] == r["cpu_us_per_req"]:
            keyed.setdefault((r["target"], r["prompt"], r["concurrency"]), {})[r["stream"]] = r[
                "cpu_us_per_req"
            ]
    for (target, prompt, conc), by_events in keyed.items():
        if len(by_events) >= 2:
            low, high = min(by_events), max(by_events)
            per_event = (by_events[high] - by_events[low]) / (high - low)
            cpu = f"{by_events[low]:.0f} | {by_events[high]:.0f}"
            lines.append(f"| {prompt} | {conc} | {target} | {cpu} | {per_event:.2f} |")
    if not lines:
        return []
    head = "| prompt | conc. | target | CPU µs/req, fewest events | most events | µs per event |"
    return [head, "|---|---|---|---|---|---|", *lines]


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (extra 'plots'): no PNGs", file=sys.stderr)
        return []
    paths = []
    for prompt in sorted({r["prompt"] for r in rows}):
        for stream in sorted({r["stream"] for r in rows}):
            sel = [r for r in rows if r["prompt"] == prompt and r["stream"] == stream]
            if not sel:
                continue
            fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
            for target in sorted({r["target"] for r in sel}):
                pts = sorted(
                    (r["concurrency"], r["rps"], r["added_p50_ms"]) for r in sel if r["target"] == target
                )
                xs = [p[0] for p in pts]
                axes[0].plot(xs, [p[1] for p in pts], marker="o", label=target)
                if target != "direct":
                    axes[1].plot(xs, [p[2] for p in pts], marker="o", label=target)
            for ax, title in zip(axes, ("requests/s", "added p50 latency over direct (ms)"), strict=True):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("concurrency (closed-loop connections, wrk)")
                ax.set_title(title)
                ax.grid(alpha=0.3)
            axes[0].legend(fontsize=7)
            what = f"stream, {stream} events" if stream else "non-stream"
            fig.suptitle(f"B3 overhead, {prompt}-token prompt, {what}")
            fig.tight_layout()
            path = out / f"b3_{prompt}tok_{f'stream{stream}' if stream else 'nostream'}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            paths.append(path)
    return paths


def exit_on_sigterm() -> None:
    """SIGTERM runs the cleanup (finally blocks stop every child) instead of orphaning them."""
    import signal

    def _raise(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def machine_note() -> str:
    load = os.getloadavg()
    return (
        f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, load average {load[0]:.1f} at the end (shared machine)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma list (see the doc)")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument(
        "--stream", default="no,yes", help="comma list of no, yes (4 events), yesN (N events)"
    )
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="targets LABEL:POLICY[+tok] run kvroute from checkout DIR (repeatable)",
    )
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="targets LABEL:POLICY[+tok] run this checkout's kvroute with interpreter PATH (repeatable)",
    )
    parser.add_argument("--prompt-tokens", default="1000,16000")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", type=int, default=2, help="zero-delay engines behind every router")
    parser.add_argument(
        "--engine", choices=("fast", "sim"), default="fast", help="zero-delay engine kind (see the doc)"
    )
    parser.add_argument("--peers-dir", type=Path, default=default_peers_dir())
    parser.add_argument("--out", type=Path, default=Path("runs/bench/b3"))
    parser.add_argument("--quick", action="store_true", help="smoke run: kvroute only, c4, 1 s, 1 repeat")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    exit_on_sigterm()
    try:
        checkouts = dict(item.split("=", 1) for item in args.checkout)
        for label, folder in checkouts.items():
            if not (Path(folder) / "router" / "cli.py").is_file():
                raise ValueError(f"--checkout {label}={folder}: no kvroute checkout there (router/cli.py)")
        pythons = interpreters(args.python)
        targets = [Target.parse(t, checkouts, pythons) for t in args.targets.split(",") if t]
        streams = [stream_mode(s) for s in args.stream.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    if not any(t.kind == "direct" for t in targets):
        targets.insert(0, Target.parse("direct"))
    m = Matrix(
        targets=targets,
        concurrencies=[int(c) for c in args.concurrency.split(",")],
        streams=streams,
        prompt_tokens=[int(p) for p in args.prompt_tokens.split(",")],
        duration_s=args.duration,
        warmup_s=args.warmup,
        repeats=args.repeats,
        engines=args.engines,
        engine_kind=args.engine,
    )
    if args.quick:
        m = replace(
            m,
            targets=[Target.parse("direct"), Target.parse("kvroute:round_robin")],
            concurrencies=[4],
            streams=[0, 4],
            prompt_tokens=[1000],
            duration_s=1.0,
            warmup_s=0.0,
            repeats=1,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvroute-b3-") as tmp:
        points = run_matrix(m, args.peers_dir, Path(tmp))
    rows = summarise(points)
    table = markdown(rows, [t.spec for t in m.targets])
    pngs = plot(rows, args.out)
    command = "python -m loadtest.bench_peers " + " ".join(sys.argv[1:] if argv is None else argv)
    notes = [f"Command: `{command}`", f"Machine: {machine_note()}; wall {time.time() - started:.0f} s."]
    notes.append(
        f"wrk -t1, {m.duration_s:g} s per point after a {m.warmup_s:g} s warm-up; {m.engines} zero-delay "
        f"engines ({m.engine_kind}) behind every router, `direct` = engine e0 alone; medians of {m.repeats} "
        "repeats [min-max]; added latency and x direct are per repeat against direct, then medians."
    )
    for spec, why in m.unavailable.items():
        notes.append(f"**{spec} unavailable**: {why.splitlines()[0]}")
    events = per_event_costs(rows)
    if events:
        table += "\n\nRouter CPU per streamed event:\n\n" + "\n".join(events)
    text = "\n\n".join([*notes, table, *[f"![{p.stem}]({p.name})" for p in pngs]]) + "\n"
    (args.out / "b3.md").write_text(text)
    (args.out / "b3.json").write_text(json.dumps({"points": points, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
