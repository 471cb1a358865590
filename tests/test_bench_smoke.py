"""Smoke runs of the benchmarks that have no smoke test of their own: they run and print figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.bench", *args], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_bench_index_quick_prints_figures() -> None:
    out = _run("index", "--quick", "--no-memory")
    rate = re.search(r"ingest[^\n]*?([\d,]+)\s*blocks/s", out) or re.search(r"([\d,]{5,})", out)
    assert rate, out
    assert "match" in out and "64 engines" in out, out


def test_bench_engine_small_prints_figures() -> None:
    out = _run("engine", "--steps", "150", "--repeats", "1", "--conversations", "8")
    assert "steps/s" in out, out


def test_bench_unknown_name_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.bench", "nope"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "accepted" in proc.stderr
