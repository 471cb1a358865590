"""Smoke run of the proxy-overhead benchmark: real upstream, router and load-generator processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark run

REPO = Path(__file__).resolve().parents[1]


def test_bench_proxy_quick(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_proxy", "--quick", "--targets", "kvroute", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["target"], r["stream"]) for r in rows} == {
        ("direct", False),
        ("direct", True),
        ("kvroute", False),
        ("kvroute", True),
    }
    for row in rows:
        assert row["errors"] == 0
        assert row["rps"][0] > 0
        assert row["p99_ms"][0] >= row["p50_ms"][0] > 0
    assert "| kvroute | 4 | yes |" in proc.stdout
