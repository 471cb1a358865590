"""Fault injection against a real ``kvroute serve`` process and simulated engine processes.

Each phase starts a fresh fleet (3 engines) and router, drives ``--conversations`` streaming
multi-turn conversations, injects one fault (engine SIGKILL, engine SIGSTOP, router SIGKILL,
router SIGTERM, a KV-event flood) and classifies every request: answered (200 and ``[DONE]``),
clear error (an HTTP error status, an SSE error event, or a connection error the client sees),
lost (a 200 stream that ended cleanly without ``[DONE]`` or error: a silent truncation, or no
answer within --request-timeout-s). /health of the router is sampled every 100 ms meanwhile.
``--inputs`` adds the input table (schemathesis against the router's schema + hand cases);
``--soak-s`` adds a soak with RSS and open FDs of the router at start, middle and end.

    python -m loadtest.bench_faults [--phases all] [--inputs] [--soak-s 600]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kvcore.stats import percentile
from router.cli import TRACEMALLOC_ENV
from sim.fleet import PROFILES, Fleet, FleetEngine
from sim.server import free_port
from sim.zmq_publisher import KVEventsConfig, ZmqEventPublisher

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_TOPIC = "kv-events"
PHASES = ("baseline", "engine_sigkill", "engine_sigstop", "router_sigkill", "router_sigterm", "event_flood")


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    clear_error: int = 0
    lost: int = 0
    kinds: Counter[str] = field(default_factory=Counter)

    def add(self, outcome: str, kind: str) -> None:
        self.sent += 1
        setattr(self, outcome, getattr(self, outcome) + 1)
        self.kinds[f"{outcome}:{kind}"] += 1


class RouterProc:
    """``python -m router.cli serve --config FILE`` on a fixed port (restartable)."""

    def __init__(
        self,
        workdir: Path,
        config_toml: str,
        port: int,
        *,
        repo: Path = REPO_ROOT,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port
        self.path = workdir / "router.toml"
        self.path.write_text(config_toml)
        self.log = workdir / "router.log"
        self.repo = repo
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        env["PYTHONPATH"] = str(self.repo)
        env.update(self.extra_env)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "router.cli", "serve", "--config", str(self.path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.repo,
            )
        deadline = time.monotonic() + 300  # a busy machine (or tracemalloc) can take minutes to import
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        self.proc.kill()  # never leave a router behind
        self.proc.wait(10)
        tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
        raise RuntimeError(f"router did not become ready; its log ends:\n{tail}")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)
        self.wait(15)

    def rss_fds(self) -> tuple[float, int]:
        assert self.proc is not None
        pid = self.proc.pid
        rss_kib = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
        return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def _path_label(lead: str, callback_path: bool | str | None) -> str:
    """How a report names the router's proxy.callback_path ("" for the default)."""
    if callback_path is None:
        return ""
    return f"{lead}proxy.callback_path {str(callback_path).lower()}"


def router_toml(
    engines: list[dict[str, Any]],
    port: int,
    *,
    first_byte_timeout_s: float,
    policy: str = "kv_gpu",
    callback_path: bool | str | None = None,
) -> str:
    sections: dict[str, dict[str, Any]] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "policy": {"name": policy},
        "tokenizer": {"backend": "sim"},
        "health": {"interval_s": 0.5, "timeout_s": 1.0},
        "limits": {"first_byte_timeout_s": first_byte_timeout_s, "read_timeout_s": 15.0},
        "costs": {"scrape_interval_s": 1.0},
    }
    if callback_path is not None:  # (None: the router's default)
        sections["proxy"] = {"callback_path": callback_path}
    lines = ['log_level = "warning"']
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {_toml(v)}" for k, v in values.items())
    for engine in engines:
        lines.append("[[engines]]")
        lines.extend(f"{k} = {_toml(v)}" for k, v in engine.items() if v != "")
    return "\n".join(lines) + "\n"


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout_s: float
) -> tuple[str, str, str]:
    """(outcome, kind, assistant text) of one streaming request."""
    text_parts: list[str] = []
    saw_error = False
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return "clear_error", f"http_{resp.status_code}", ""
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return "answered", "done", "".join(text_parts)
                    doc = json.loads(data)
                    if "error" in doc:
                        saw_error = True
                        continue
                    for choice in doc.get("choices") or ():
                        text_parts.append((choice.get("delta") or {}).get("content") or "")
                if saw_error:
                    return "clear_error", "error_event", ""
                return "lost", "truncated_without_error", ""
    except TimeoutError:
        return "lost", "no_answer_in_time", ""
    except httpx.HTTPError as exc:
        return "clear_error", ("error_event+abort" if saw_error else type(exc).__name__), ""


async def conversation(
    i: int, url: str, stop_at: float, tally: Tally, timeout_s: float, max_tokens: int
) -> None:
    rng = random.Random(i)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": f"You are assistant {i}. " + "Be brief and precise. " * 20}
    ]
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        while time.monotonic() < stop_at:
            messages.append({"role": "user", "content": f"question {rng.randrange(10**6)} " * 8})
            body = {"model": "kvroute-sim", "messages": messages, "stream": True, "max_tokens": max_tokens}
            outcome, kind, text = await one_request(client, url, body, timeout_s)
            tally.add(outcome, kind)
            if outcome == "answered":
                messages.append({"role": "assistant", "content": text})
            else:
                messages.pop()
                await asyncio.sleep(0.2)
            if len(messages) > 12:
                del messages[1:3]


async def health_sampler(url: str, stop_at: float, out: list[float], failures: list[int]) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                resp = await client.get(url + "/health")
                if resp.status_code == 200:
                    out.append(time.monotonic() - started)
                else:
                    failures[0] += 1
            except httpx.HTTPError:
                failures[0] += 1
            await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - started)))


async def flood_events(endpoint: str, stop_at: float, counter: list[int]) -> None:
    """Publish BlockStored batches for a pseudo engine as fast as the loop allows."""
    publisher = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, topic=MODEL_TOPIC)
    )
    rng = random.Random(7)
    try:
        await asyncio.sleep(0.5)
        while time.monotonic() < stop_at:
            events = [
                {
                    "type": "BlockStored",
                    "block_hashes": [rng.getrandbits(63) for _ in range(16)],
                    "parent_block_hash": None,
                    "token_ids": list(range(16 * 16)),
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
                for _ in range(8)
            ]
            publisher.publish(events)
            counter[0] += len(events) * 16
            await asyncio.sleep(0)
    finally:
        publisher._close_sockets()


@dataclass
class PhaseResult:
    name: str
    tally: Tally
    health_s: list[float]
    health_failures: int
    note: str = ""


async def run_phase(name: str, args: argparse.Namespace, workdir: Path) -> PhaseResult:
    profile = replace(PROFILES["gpu-only"], time_scale=args.time_scale, gpu_blocks=4096)
    note = ""
    with Fleet(workdir / f"fleet-{name}") as fleet:
        engines = fleet.start(3, profile)
        entries = [e.fleet_entry() for e in engines]
        flood_ep = ""
        if name == "event_flood":
            flood_port = free_port()
            flood_ep = f"tcp://127.0.0.1:{flood_port}"
            entries.append(
                {
                    "id": "flood",
                    "url": f"http://127.0.0.1:{free_port()}",  # nothing listens: never routed to
                    "model": engines[0].model,
                    "kv_events_endpoint": flood_ep,
                    "kv_events_topic": MODEL_TOPIC,
                }
            )
        port = free_port()
        router = RouterProc(
            workdir,
            router_toml(
                entries,
                port,
                first_byte_timeout_s=args.first_byte_timeout_s,
                policy=args.policy,
                callback_path=args.callback_path,
            ),
            port,
        )
        router.start()
        tally = Tally()
        health: list[float] = []
        health_failures = [0]
        start = time.monotonic()
        stop_at = start + args.phase_s
        tasks = [
            asyncio.create_task(
                conversation(i, router.url, stop_at, tally, args.request_timeout_s, args.max_tokens)
            )
            for i in range(args.conversations)
        ]
        tasks.append(asyncio.create_task(health_sampler(router.url, stop_at, health, health_failures)))
        flooded = [0]
        try:
            await asyncio.sleep(args.fault_at_s)
            victim: FleetEngine = engines[0]
            if name == "engine_sigkill":
                os.killpg(victim.pid, signal.SIGKILL)
                note = f"SIGKILL engine {victim.id} at {args.fault_at_s:.0f} s"
            elif name == "engine_sigstop":
                os.killpg(victim.pid, signal.SIGSTOP)
                await asyncio.sleep(args.stop_s)
                os.killpg(victim.pid, signal.SIGCONT)
                note = f"SIGSTOP engine {victim.id} for {args.stop_s:.0f} s"
            elif name == "router_sigkill":
                router.signal(signal.SIGKILL)
                router.wait(5)
                await asyncio.sleep(1.0)
                restart_s = time.monotonic()
                await asyncio.to_thread(router.start)
                note = (
                    f"SIGKILL router, restarted after 1 s (ready {time.monotonic() - restart_s:.0f} s later)"
                )
            elif name == "router_sigterm":
                router.signal(signal.SIGTERM)
                await asyncio.to_thread(router.wait, 30)
                restart_s = time.monotonic()
                await asyncio.to_thread(router.start)
                note = (
                    f"SIGTERM router (graceful), restarted (ready {time.monotonic() - restart_s:.0f} s later)"
                )
            elif name == "event_flood":
                await flood_events(flood_ep, start + args.fault_at_s + args.stop_s, flooded)
                note = f"{flooded[0]:,} BlockStored hashes in {args.stop_s:.0f} s from a pseudo engine"
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                os.killpg(engines[0].pid, signal.SIGCONT)
            router.stop()
    return PhaseResult(name, tally, health, health_failures[0], note)


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    return f"{percentile(values, q * 100) * 1000:.1f}"


def print_phases(results: list[PhaseResult]) -> None:
    print("| fault | sent | answered | clear error | lost | /health p50 / p99 / max ms (failed) | detail |")
    print("|---|---:|---:|---:|---:|---|---|")
    for r in results:
        t = r.tally
        errors = ", ".join(
            f"{k.split(':', 1)[1]} {v}" for k, v in sorted(t.kinds.items()) if not k.startswith("answered")
        )
        health = (
            f"{_ms(r.health_s, 0.5)} / {_ms(r.health_s, 0.99)} / {_ms(r.health_s, 1.0)} ({r.health_failures})"
        )
        print(
            f"| {r.note or r.name} | {t.sent} | {t.answered} | {t.clear_error} | {t.lost} | {health} "
            f"| {errors or '-'} |"
        )


# -- inputs ----------------------------------------------------------------------------------


def hand_cases() -> list[tuple[str, str, dict[str, str], bytes]]:
    """(name, path, headers, body) of hand-made hostile or malformed requests."""
    chat, comp, explain = "/v1/chat/completions", "/v1/completions", "/v1/route/explain"
    j = {"content-type": "application/json"}
    m = "kvroute-sim"

    cases: list[tuple[str, str, dict[str, str], bytes]] = []
    for path in (chat, comp, explain):
        cases += [
            ("empty body", path, j, b""),
            ("not json", path, j, b"{nope"),
            ("json array", path, j, b"[1,2]"),
            ("null", path, j, b"null"),
            ("nested 1000", path, j, b'{"model": "m", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"),
            ("nested 100000", path, j, b"[" * 100000 + b"]" * 100000),
            ("text/plain", path, {"content-type": "text/plain"}, body({"model": m, "prompt": "x"})),
            ("form", path, {"content-type": "application/x-www-form-urlencoded"}, b"model=m&prompt=x"),
            ("no content type", path, {}, body({"model": m, "prompt": "x"})),
            (
                "model 1 MB",
                path,
                j,
                body({"model": "m" * 1_000_000, "messages": [{"role": "user", "content": "x"}]}),
            ),
            ("model int", path, j, body({"model": 5, "prompt": "x"})),
            ("body 17 MB", path, j, b'{"model": "m", "prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}'),
            ("prompt 2 MB", path, j, body({"model": m, "prompt": "word " * 400_000})),
            (
                "text part int",
                path,
                j,
                body({"model": m, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
            ),
            (
                "content dict",
                path,
                j,
                body({"model": m, "messages": [{"role": "user", "content": {"a": 1}}]}),
            ),
            ("part not object", path, j, body({"model": m, "messages": [{"role": "user", "content": [5]}]})),
            ("role missing", path, j, body({"model": m, "messages": [{"content": "x"}]})),
            ("messages empty", path, j, body({"model": m, "messages": []})),
            ("prompt mixed", path, j, body({"model": m, "prompt": [1, "a"]})),
            ("prompt bools", path, j, body({"model": m, "prompt": [True, False]})),
            ("max_tokens 0", path, j, body({"model": m, "prompt": "x", "max_tokens": 0})),
            ("max_tokens -5", path, j, body({"model": m, "prompt": "x", "max_tokens": -5})),
            ("max_tokens huge", path, j, body({"model": m, "prompt": "x", "max_tokens": 10**30})),
            ("n string", path, j, body({"model": m, "prompt": "x", "n": "2"})),
            ("temperature -1", path, j, body({"model": m, "prompt": "x", "temperature": -1})),
            ("top_p 5", path, j, body({"model": m, "prompt": "x", "top_p": 5})),
            ("stream string", path, j, body({"model": m, "prompt": "x", "stream": "yes"})),
            ("stream_options list", path, j, body({"model": m, "prompt": "x", "stream_options": [1]})),
            ("user 1 MB", path, j, body({"model": m, "prompt": "x", "user": "u" * 1_000_000})),
            ("user int", path, j, body({"model": m, "prompt": "x", "user": 5})),
            ("cache_salt empty", path, j, body({"model": m, "prompt": "x", "cache_salt": ""})),
            ("cache_salt int", path, j, body({"model": m, "prompt": "x", "cache_salt": 5})),
            ("unicode", path, j, body({"model": m, "prompt": "\ud800\u0000\uffff" * 100})),
            ("nan", path, j, b'{"model": "m", "prompt": "x", "temperature": NaN}'),
            ("huge number", path, j, b'{"model": "m", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"),
            (
                "x-request-id 10 KB",
                path,
                {**j, "x-request-id": "r" * 10_000},
                body({"model": m, "prompt": "x"}),
            ),
            ("forced unknown arm", path, {**j, "x-kvroute-arm": "nope"}, body({"model": m, "prompt": "x"})),
            ("session id 8 KB", path, {**j, "x-session-id": "s" * 8000}, body({"model": m, "prompt": "x"})),
        ]
    return cases


def run_inputs(args: argparse.Namespace, workdir: Path) -> None:
    report = workdir / "fuzz.txt"
    env = dict(os.environ, KVROUTE_FUZZ_EXAMPLES=str(args.fuzz_examples), KVROUTE_FUZZ_REPORT=str(report))
    if args.callback_path in (True, False):  # tests/conftest.py's switch: the test routers' path
        env["TEST_KVROUTE_CALLBACK_PATH"] = "1" if args.callback_path else "0"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_app_fuzz.py"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    fuzz = (
        Counter(line.split()[2] for line in report.read_text().splitlines()) if report.exists() else Counter()
    )
    print(
        f"schemathesis (tests/test_app_fuzz.py, {args.fuzz_examples} examples per operation and mode): "
        f"{sum(fuzz.values())} requests; pytest: {_last_line(proc.stdout) or proc.returncode}"
        + _path_label("; every router with ", args.callback_path)
    )
    print("| source | requests | statuses | 5xx from the router |")
    print("|---|---:|---|---:|")
    print(f"| schemathesis | {sum(fuzz.values())} | {_statuses(fuzz)} | {_count_5xx(fuzz)} |")
    hand: Counter[str] = Counter()
    with Fleet(workdir / "fleet-inputs") as fleet:
        engines = fleet.start(1, replace(PROFILES["gpu-only"], time_scale=100.0))
        port = free_port()
        router = RouterProc(
            workdir,
            router_toml(
                [e.fleet_entry() for e in engines],
                port,
                first_byte_timeout_s=10.0,
                callback_path=args.callback_path,
            ),
            port,
        )
        router.start()
        try:
            with httpx.Client(base_url=router.url, timeout=60) as client:
                for _name, path, headers, raw_body in hand_cases():
                    try:
                        status = str(client.post(path, content=raw_body, headers=headers).status_code)
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    hand[status] += 1
                # Keep-alive survives errors: bad, good, bad, good on one connection.
                good = json.dumps({"model": "kvroute-sim", "prompt": "hello", "max_tokens": 2}).encode()
                bad = body(
                    {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
                )
                seq = []
                for raw in (bad, good, bad, good):
                    seq.append(
                        client.post(
                            "/v1/completions" if raw is good else "/v1/chat/completions",
                            content=raw,
                            headers={"content-type": "application/json"},
                        ).status_code
                    )
                hand["keep-alive bad,good,bad,good: " + ",".join(map(str, seq))] += 1
        finally:
            router.stop()
    print(f"| hand cases | {sum(hand.values())} | {_statuses(hand)} | {_count_5xx(hand)} |")


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def _count_5xx(counts: Counter[str]) -> int:
    return sum(v for k, v in counts.items() if k.startswith("5"))


def body(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def _statuses(counts: Counter[str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


# -- connections -----------------------------------------------------------------------------

FLOOD_OPENINGS = {
    "slowloris": b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ",
    "partial body": (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 10000\r\n\r\n{"model": '
    ),
    "idle": b"",
}


async def _half_sent_header(port: int, line_bytes: int, hold: asyncio.Event) -> None:
    """One connection sending an unterminated header line of ``line_bytes``, held until ``hold``."""
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return
    try:
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nx-endless: ")
        for _ in range(line_bytes // 65536):
            writer.write(b"a" * 65536)
            await writer.drain()
        await hold.wait()
    except OSError:
        await hold.wait()  # refused early: the socket is closed, nothing to hold
    finally:
        writer.close()


async def header_memory(router: RouterProc, connections: int, line_bytes: int) -> tuple[float, float, float]:
    """Router RSS MiB before, while ``connections`` each sent ``line_bytes`` of one unterminated header
    line, and 3 s after they closed."""
    before, _ = router.rss_fds()
    hold = asyncio.Event()
    tasks = [
        asyncio.create_task(_half_sent_header(router.port, line_bytes, hold)) for _ in range(connections)
    ]
    await asyncio.sleep(8.0)  # below the 10 s header timeout: everything sent is held (or refused)
    during, _ = router.rss_fds()
    hold.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(3.0)
    after, _ = router.rss_fds()
    return before, during, after


async def _attacker(port: int, opening: bytes, stop: asyncio.Event, reconnects: list[int]) -> None:
    """One attacker slot: connect, send ``opening``, wait until the router closes it, reconnect."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        try:
            if opening:
                writer.write(opening)
            read = asyncio.ensure_future(reader.read(65536))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
            read.cancel()
            stopped.cancel()
        except OSError:
            pass
        finally:
            writer.close()
        reconnects[0] += 1


async def flood_probes(router: RouterProc, kind: str, attackers: int, probes: int) -> tuple[int, int, int]:
    """(probes answered 200, probes sent, attacker reconnects) during a reconnecting ``kind`` flood
    of ``attackers`` connections; probes are fresh connections, every 0.5 s, 5 s timeout each."""
    stop = asyncio.Event()
    reconnects = [0]
    tasks = [
        asyncio.create_task(_attacker(router.port, FLOOD_OPENINGS[kind], stop, reconnects))
        for _ in range(attackers)
    ]
    await asyncio.sleep(3.0)  # let the flood fill the table
    answered = 0
    body = {"model": "kvroute-sim", "messages": [{"role": "user", "content": "probe"}], "max_tokens": 2}
    for i in range(probes):
        started = time.monotonic()
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                if i % 2:
                    resp = await client.post(router.url + "/v1/chat/completions", json=body)
                else:
                    resp = await client.get(router.url + "/health")
            answered += resp.status_code == 200
        except httpx.HTTPError:
            pass
        await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - started)))
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return answered, probes, reconnects[0]


async def run_connections(args: argparse.Namespace, workdir: Path) -> None:
    """Half-sent headers (RSS) and reconnecting floods at the connection cap (probes answered), for
    this checkout and, with --baseline-repo, for another one, interleaved scenario by scenario."""
    repos = [("this", REPO_ROOT)]
    if args.baseline_repo:
        repos.insert(0, ("baseline", Path(args.baseline_repo)))  # absolute (main() resolves it)
    memory: dict[str, tuple[float, float, float]] = {}
    floods: dict[tuple[str, str], tuple[int, int, int]] = {}
    with Fleet(workdir / "fleet-connections") as fleet:
        engines = fleet.start(1, replace(PROFILES["gpu-only"], time_scale=100.0))
        for scenario in ["header memory", *FLOOD_OPENINGS]:
            for name, repo in repos:
                port = free_port()
                router = RouterProc(
                    workdir,
                    router_toml([e.fleet_entry() for e in engines], port, first_byte_timeout_s=10.0),
                    port,
                    repo=repo,
                )
                router.start()
                try:
                    if scenario == "header memory":
                        memory[name] = await header_memory(router, args.header_connections, 1_000_000)
                    else:
                        floods[(scenario, name)] = await flood_probes(
                            router, scenario, args.flood_connections, args.flood_probes
                        )
                finally:
                    router.stop()
                print(f"[connections: {scenario} on {name} done]", file=sys.stderr, flush=True)
    print(
        f"{args.header_connections} connections each sending an unterminated 1 MB header line "
        "(held 8 s, below the 10 s header timeout), default limits:"
    )
    print("| router | RSS before MiB | while held | 3 s after they closed |")
    print("|---|---:|---:|---:|")
    for name, (before, during, after) in memory.items():
        print(f"| {name} | {before:.0f} | {during:.0f} | {after:.0f} |")
    print(
        f"\nreconnecting floods of {args.flood_connections} connections against the default cap of 900; "
        f"{args.flood_probes} probes (fresh connections, GET /health and a chat completion alternately, "
        "one every 0.5 s, 5 s timeout):"
    )
    print("| flood | router | probes answered | attacker reconnects |")
    print("|---|---|---:|---:|")
    for (kind, name), (answered, sent, reconnects) in floods.items():
        print(f"| {kind} | {name} | {answered}/{sent} | {reconnects} |")


# -- soak ------------------------------------------------------------------------------------


async def run_soak(args: argparse.Namespace, workdir: Path) -> None:
    """The soak: RSS and open FDs of the router at start, every --soak-sample-s and at the end; with
    --soak-tracemalloc also its traced Python allocations (tracemalloc, by source line: where the
    bytes go), via the router's SIGUSR1 report (router/cli.py)."""
    profile = replace(PROFILES["gpu-only"], time_scale=args.time_scale, gpu_blocks=4096)
    report = workdir / "allocations.txt"
    env = {TRACEMALLOC_ENV: str(report)} if args.soak_tracemalloc else {}
    with Fleet(workdir / "fleet-soak") as fleet:
        engines = fleet.start(3, profile)
        port = free_port()
        router = RouterProc(
            workdir,
            router_toml([e.fleet_entry() for e in engines], port, first_byte_timeout_s=10.0),
            port,
            env=env,
        )
        router.start()
        tally = Tally()
        start = time.monotonic()
        stop_at = start + args.soak_s
        tasks = [
            asyncio.create_task(soak_conversation(i, router.url, stop_at, tally, args)) for i in range(16)
        ]
        at_s = [min(10.0, args.soak_s / 50)]
        while at_s[-1] + args.soak_sample_s < args.soak_s:
            at_s.append(at_s[-1] + args.soak_sample_s if len(at_s) > 1 else args.soak_sample_s)
        at_s.append(args.soak_s)
        samples: list[tuple[float, float, int, int, dict[str, int]]] = []
        try:
            for at in at_s:
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                rss, fds = router.rss_fds()
                allocations = await _allocations(router, report) if args.soak_tracemalloc else {}
                samples.append((time.monotonic() - start, rss, fds, tally.sent, allocations))
                print(f"[soak {at:.0f} s: RSS {rss:.1f} MiB]", file=sys.stderr, flush=True)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            router.stop()
    print(
        f"soak: 16 conversations for {args.soak_s:.0f} s, new conversation every 6 turns, "
        "1 MB `user` every 50th request" + (" (router under tracemalloc)" if args.soak_tracemalloc else "")
    )
    traced = args.soak_tracemalloc
    print("| at | router RSS MiB | open FDs | requests so far |" + (" traced Python MiB |" if traced else ""))
    print("|---|---:|---:|---:|" + ("---:|" if traced else ""))
    for at, rss, fds, sent, allocations in samples:
        extra = f" {allocations.get('total', 0) / 2**20:.1f} |" if traced else ""
        print(f"| {at:.0f} s | {rss:.1f} | {fds} | {sent} |{extra}")
    if traced and len(samples) >= 2:
        first, last = samples[0][4], samples[-1][4]
        lines = sorted((k for k in last if k != "total"), key=lambda k: -last[k])[:12]
        print("\nlargest traced allocations by source line (MiB at the first and the last sample):")
        print("| source line | first | last |")
        print("|---|---:|---:|")
        for line in lines:
            print(f"| `{line}` | {first.get(line, 0) / 2**20:.1f} | {last[line] / 2**20:.1f} |")
    print(
        f"requests: {tally.sent} sent, {tally.answered} answered, {tally.clear_error} clear errors, "
        f"{tally.lost} lost ({_statuses(tally.kinds)})"
    )


async def _allocations(router: RouterProc, report: Path) -> dict[str, int]:
    """The router's traced allocations: {"total": bytes, "<file>:<line>": bytes, ...} (the 25
    largest lines), from the snapshot it dumps on SIGUSR1."""
    before = _mtime_ns(report)
    router.signal(signal.SIGUSR1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if _mtime_ns(report) != before:
            break
        await asyncio.sleep(0.2)
    return await asyncio.to_thread(_read_allocations, report)


def _mtime_ns(path: Path) -> int:
    return path.stat().st_mtime_ns if path.exists() else 0


def _read_allocations(report: Path) -> dict[str, int]:
    import tracemalloc

    if not report.exists():
        return {}
    stats = tracemalloc.Snapshot.load(str(report)).statistics("lineno")
    out = {"total": sum(stat.size for stat in stats)}
    for stat in stats[:25]:
        frame = stat.traceback[0]
        where = frame.filename.replace(str(REPO_ROOT) + "/", "").replace(sys.prefix + "/", "")
        out[f"{where}:{frame.lineno}"] = stat.size
    return out


async def soak_conversation(i: int, url: str, stop_at: float, tally: Tally, args: argparse.Namespace) -> None:
    rng = random.Random(1000 + i)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s, connect=10.0)) as client:
        n = 0
        while time.monotonic() < stop_at:
            # A fresh conversation every few turns: new prefixes keep filling the caches.
            messages = [{"role": "system", "content": f"conv {i}-{n} " + "context " * rng.randrange(50, 400)}]
            for _turn in range(6):
                n += 1
                messages.append({"role": "user", "content": f"q{rng.randrange(10**9)} " * 20})
                body: dict[str, Any] = {
                    "model": "kvroute-sim",
                    "messages": messages,
                    "stream": True,
                    "max_tokens": 16,
                }
                if n % 50 == 0:
                    body["user"] = "u" * 1_000_000
                outcome, kind, text = await one_request(client, url, body, args.request_timeout_s)
                tally.add(outcome, kind)
                messages.append({"role": "assistant", "content": text or "ok"})
                if time.monotonic() >= stop_at:
                    return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", default="all", help=f"comma list of {', '.join(PHASES)} (or all, none)")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--phase-s", type=float, default=30.0)
    p.add_argument("--fault-at-s", type=float, default=6.0)
    p.add_argument("--stop-s", type=float, default=12.0, help="SIGSTOP length and event-flood length")
    p.add_argument("--time-scale", type=float, default=1.0, help="engine speed (1 = the model's real time)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--first-byte-timeout-s", type=float, default=3.0)
    p.add_argument("--policy", default="kv_gpu", help="routing policy of the router under test")
    p.add_argument(
        "--callback-path",
        nargs="?",
        const=True,
        default=None,
        type=lambda value: {"true": True, "false": False, "idle": "idle"}[value],
        metavar="true|false|idle",
        help="the router under test with this proxy.callback_path (alone: true; without: the "
        "router's default) in the fault phases and the input table",
    )
    p.add_argument("--inputs", action="store_true", help="also run the input table")
    p.add_argument("--fuzz-examples", type=int, default=50)
    p.add_argument(
        "--connections", action="store_true", help="also run half-sent headers and connection floods"
    )
    p.add_argument("--header-connections", type=int, default=600)
    p.add_argument("--flood-connections", type=int, default=1000)
    p.add_argument("--flood-probes", type=int, default=20)
    p.add_argument("--baseline-repo", help="--connections also against the router of this checkout")
    p.add_argument("--soak-s", type=float, default=0.0, help="also run a soak of this many seconds")
    p.add_argument("--soak-sample-s", type=float, default=300.0, help="RSS sample period of the soak")
    p.add_argument(
        "--soak-tracemalloc", action="store_true", help="trace the soak router's Python allocations by line"
    )
    args = p.parse_args(argv)
    if args.baseline_repo:
        args.baseline_repo = str(Path(args.baseline_repo).resolve())
    phases = PHASES if args.phases == "all" else tuple(x for x in args.phases.split(",") if x and x != "none")
    with tempfile.TemporaryDirectory(prefix="kvroute-faults-") as tmp:
        workdir = Path(tmp)
        results = []
        for name in phases:
            results.append(asyncio.run(run_phase(name, args, workdir)))
            print(f"[{name} done]", file=sys.stderr, flush=True)
        if results:
            print(
                f"{args.conversations} streaming conversations per phase ({args.policy}), "
                f"{args.phase_s:.0f} s each, "
                f"fault at {args.fault_at_s:.0f} s; router first_byte_timeout_s={args.first_byte_timeout_s}, "
                "read_timeout_s=15" + _path_label(", ", args.callback_path)
            )
            print_phases(results)
        if args.inputs:
            run_inputs(args, workdir)
        if args.connections:
            asyncio.run(run_connections(args, workdir))
        if args.soak_s > 0:
            asyncio.run(run_soak(args, workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
