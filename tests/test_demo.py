"""Smoke run of ``make demo`` (loadtest/demo.py) with tiny sizes: a real fleet, the router as a
subprocess, both experiment arms served and reported."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from loadtest import demo

pytestmark = pytest.mark.slow  # the whole demo


def test_demo_runs_end_to_end_and_reports_both_arms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The demo keeps its folder (logs, fleet file) for the user and names it; here it goes in the
    # test's own folder, not the system's temp folder.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report_path = tmp_path / "report.json"
    code = demo.main(
        [
            "--engines", "2",
            "--conversations", "4",
            "--turns", "2",
            "--concurrency", "2",
            "--think-time-s", "0",
            "--report-json", str(report_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(report_path.read_text())
    arms = {a["name"]: a for a in report["arms"]}
    assert set(arms) == {"control", "tier_cost"}
    assert all(a["requests"] > 0 and a["errors"] == 0 for a in arms.values())
    assert sum(a["requests"] for a in arms.values()) == 8
    assert "tier_cost     tier_cost" in out and "fleet and router stopped" in out
    assert "mean hit tokens per request" in out and "p99 rests on the slowest" in out
    # The log the demo points to shows the router's start and one line per routed request.
    log_path = Path(out.split("router log: ")[1].split(" (")[0])
    assert log_path.parent.parent == tmp_path
    log = log_path.read_text()
    assert "kvroute serve: listening on" in log
    assert sum(" arm control " in line or " arm tier_cost " in line for line in log.splitlines()) == 8
