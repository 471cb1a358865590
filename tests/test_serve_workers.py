"""`kvroute serve --workers 2`: two router processes on one port (SO_REUSEPORT), both serving; stopping
the first stops the other. Real processes, a real zero-delay simulated engine, the openai SDK.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from kvcore.sim_tokenizer import NAME
from loadtest.load import wait_http_ok
from sim.fleet import PROFILES, Fleet
from sim.server import free_port

pytestmark = pytest.mark.slow  # router worker processes

REPO = Path(__file__).resolve().parents[1]


def _group_members(pgid: int) -> set[int]:
    members = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.add(int(stat.parent.name))
    return members


def _listening_pids(port: int, pids: set[int]) -> set[int]:
    """Which of ``pids`` hold a listening socket on ``port`` (inode match via /proc/net/tcp)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if int(cols[1].split(":")[1], 16) == port and cols[3] == "0A":  # 0A = LISTEN
            inodes.add(cols[9])
    holders = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                holders.add(pid)
    return holders


def _wait_for_both_workers(url: str, port: int, proc: subprocess.Popen[bytes]) -> None:
    """The first worker answers /health and the second holds a listening socket on the port."""
    wait_http_ok(f"{url}/health", proc)
    deadline = time.monotonic() + 30
    while len(_listening_pids(port, _group_members(proc.pid))) < 2:
        assert time.monotonic() < deadline, "the second worker never listened on the port"
        time.sleep(0.2)


def test_two_workers_share_the_port_and_both_route(tmp_path: Path) -> None:
    with Fleet(tmp_path) as fleet:
        (engine,) = fleet.start(1, "zero-delay")
        port = free_port()
        args = ["serve", "--engine", f"e0={engine.url}", "--port", str(port), "--policy", "round_robin"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", *args, "--workers", "2", "--log-level", "warning"],
            cwd=REPO,
            start_new_session=True,
        )
        try:
            _wait_for_both_workers(f"http://127.0.0.1:{port}", port, proc)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            for _ in range(20):  # new connections: the kernel spreads them over both listeners
                fresh = client.with_options(http_client=None)
                resp = fresh.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                assert resp.choices[0].message.content
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
        # The first worker stopped its sibling on the way out.
        deadline = time.monotonic() + 15
        while _group_members(proc.pid):
            assert time.monotonic() < deadline, f"workers left running: {_group_members(proc.pid)}"
            time.sleep(0.2)


def test_workers_see_each_others_load(tmp_path: Path) -> None:
    """Load-aware routing in a multi-worker router must see the whole machine's in-flight requests,
    not only those the kernel happened to hand its own process: with 6 requests in flight, every
    worker's GET /ready reports all 6 (it would report only its own share without the board)."""
    import threading

    import httpx

    shm = Path("/dev/shm")
    boards_before = set(shm.glob("kvroute-workers-*")) if shm.is_dir() else set()
    with Fleet(tmp_path) as fleet:
        engines = fleet.start(2, "zero-delay")
        port = free_port()
        args = ["serve", "--port", str(port), "--policy", "least_loaded", "--log-level", "warning"]
        for e in engines:
            args += ["--engine", f"{e.id}={e.url}"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", *args, "--workers", "2"], cwd=REPO, start_new_session=True
        )
        url = f"http://127.0.0.1:{port}"
        threads: list[threading.Thread] = []
        stopped: list[int] = []
        try:
            _wait_for_both_workers(url, port, proc)
            # Stopped engines (SIGSTOP) accept the connections but never answer: the requests stay
            # in flight until SIGCONT, however slowly this machine runs (a slow engine's requests
            # could finish before both workers were read).
            for e in engines:
                os.killpg(e.pid, signal.SIGSTOP)
                stopped.append(e.pid)

            def long_request() -> None:
                body = {"model": NAME, "messages": [{"role": "user", "content": "x " * 50}], "max_tokens": 4}
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)

            threads = [threading.Thread(target=long_request, daemon=True) for _ in range(6)]
            for t in threads:
                t.start()
            seen: dict[int, list[int]] = {}  # worker index -> total in-flight it reported
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                len(seen) == 2 and all(v[-3:] == [6] * 3 for v in seen.values())
            ):
                doc = httpx.get(f"{url}/ready", timeout=10).json()  # a new connection each time
                assert doc["worker"]["workers"] == 2
                seen.setdefault(doc["worker"]["index"], []).append(
                    sum(e["in_flight"] for e in doc["engines"].values())
                )
                time.sleep(0.02)
            assert set(seen) == {0, 1}, f"only worker(s) {sorted(seen)} answered"
            for index, totals in seen.items():
                assert totals[-3:] == [6, 6, 6], f"worker {index} saw in-flight totals {totals[-10:]}, not 6"
        finally:
            for pid in stopped:
                os.killpg(pid, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
            for t in threads:
                t.join(5)
    boards_after = set(shm.glob("kvroute-workers-*")) if shm.is_dir() else set()
    assert boards_after <= boards_before, "the workers' load board was left behind"


def test_a_killed_worker_leaves_no_phantom_load_and_is_replaced(tmp_path: Path) -> None:
    """Issue 28 item 4: SIGKILL the second worker while it carries streams. Its rows on the shared
    board stop counting (before: /ready reported its streams as in flight forever) and the first
    worker starts a new second worker on the same port."""
    import threading

    import httpx

    slow = replace(PROFILES["gpu-only"], time_scale=0.05)
    with Fleet(tmp_path) as fleet:
        engines = fleet.start(2, slow)
        port = free_port()
        args = ["serve", "--port", str(port), "--policy", "least_loaded", "--log-level", "warning"]
        for e in engines:
            args += ["--engine", f"{e.id}={e.url}"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", *args, "--workers", "2"], cwd=REPO, start_new_session=True
        )
        url = f"http://127.0.0.1:{port}"
        outcomes: list[str] = []
        threads: list[threading.Thread] = []

        def ready_of(index: int, deadline_s: float) -> dict:
            while time.monotonic() < deadline_s:
                with contextlib.suppress(httpx.HTTPError):
                    doc = httpx.get(f"{url}/ready", timeout=5).json()  # a new connection each time
                    if doc["worker"]["index"] == index:
                        return doc
                time.sleep(0.02)
            raise AssertionError(f"worker {index} never answered /ready")

        try:
            _wait_for_both_workers(url, port, proc)

            def stream() -> None:
                body = {
                    "model": NAME,
                    "messages": [{"role": "user", "content": "x " * 50}],
                    "max_tokens": 64,
                    "stream": True,
                }
                try:
                    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
                        text = "".join(resp.iter_text())
                    outcomes.append("done" if "[DONE]" in text else "cut")
                except httpx.HTTPError:
                    outcomes.append("cut")

            threads = [threading.Thread(target=stream, daemon=True) for _ in range(12)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 20
            doc = ready_of(1, deadline)
            while sum(e["in_flight"] for e in doc["engines"].values()) < 12:
                assert time.monotonic() < deadline, "the streams never were all in flight"
                doc = ready_of(1, deadline)
            victim = doc["worker"]["pid"]
            os.kill(victim, signal.SIGKILL)
            for t in threads:
                t.join(60)
            assert "cut" in outcomes, "the killed worker carried none of the streams"
            deadline = time.monotonic() + 30
            for index in (0, 1):
                doc = ready_of(index, deadline)
                while sum(e["in_flight"] for e in doc["engines"].values()):
                    assert time.monotonic() < deadline, f"worker {index} still reports {doc['engines']}"
                    doc = ready_of(index, deadline)
                if index == 1:
                    assert doc["worker"]["pid"] != victim, "the dead worker was not replaced"
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
            for t in threads:
                t.join(5)
        deadline = time.monotonic() + 15
        while _group_members(proc.pid):
            assert time.monotonic() < deadline, f"workers left running: {_group_members(proc.pid)}"
            time.sleep(0.2)
