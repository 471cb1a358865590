"""``kvroute fleet`` as the README's "Run it without GPUs" uses it: every flag described, fixed
ports, the fleet file written while it runs and removed when it stops, a clean Ctrl-C, and no
dependency outside the package's own (the test-only httpx is not imported)."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from sim.fleet import build_arg_parser

REPO = Path(__file__).resolve().parents[1]


def test_every_fleet_flag_is_described() -> None:
    actions = [a for a in build_arg_parser()._actions if a.dest != "help"]
    assert len(actions) >= 13
    undescribed = [a.option_strings for a in actions if not a.help]
    assert undescribed == []


@pytest.mark.slow
def test_fleet_module_does_not_import_httpx() -> None:
    code = "import sys, sim.fleet, sim.server; print(sorted(m for m in sys.modules if m.startswith('httpx')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(300)  # two engine processes start and stop; slow on a busy 2-core machine
def test_fixed_ports_fleet_file_and_clean_stop(tmp_path: Path) -> None:
    rng = random.Random()
    base = next(
        b
        # Below Linux's ephemeral range (32768+), where other tests' clients and servers take ports.
        for b in (rng.randrange(10_000, 32_000) for _ in range(50))
        if all(_free(b + off) for off in (0, 1, 100, 101, 200, 201))
    )
    fleet_file = tmp_path / "fleet.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "fleet", "--engines", "2", "--base-port", str(base),
         "--fleet-file", str(fleet_file), "--workdir", str(tmp_path / "work"), "--profile", "tiny"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("fleet file:"):
                break
        else:
            raise AssertionError("".join(seen))
        assert f"kvroute serve --fleet {fleet_file} --tokenizer sim" in seen[-1]
        doc = json.loads(fleet_file.read_text())
        assert [(e["url"], e["kv_events_endpoint"], e["kv_replay_endpoint"]) for e in doc["engines"]] == [
            (
                f"http://127.0.0.1:{base + i}",
                f"tcp://127.0.0.1:{base + 100 + i}",
                f"tcp://127.0.0.1:{base + 200 + i}",
            )
            for i in range(2)
        ]
        for i in range(2):
            with urllib.request.urlopen(f"http://127.0.0.1:{base + i}/health", timeout=10) as resp:
                assert resp.status == 200
        proc.send_signal(signal.SIGINT)
        # Fleet.stop is bounded (SIGTERM, 5 s, SIGKILL); the margin is for a starved machine.
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            # SIGTERM first: the fleet stops its engines (own sessions) on it; a bare SIGKILL
            # would leave them running.
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 0, "".join(seen) + rest
    assert "Traceback" not in rest
    assert not fleet_file.exists()  # it described engines that are gone
    for i in range(2):  # the engines are gone: nothing answers on their ports
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", base + i)) != 0
