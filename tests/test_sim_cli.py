"""``kvroute sim`` as a user runs it: --out at an existing file is refused before any run, results
are written as each run finishes (a stopped sweep keeps what it finished), one progress bar covers
the whole sweep, and the per-tier plot is drawn."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: A few seconds of simulation per run: 2 engines, tiny ladder conversations.
TINY = [
    "--engines", "2", "--conversations", "1", "--turns", "2", "--first-prompt-tokens", "600",
    "--tokens-per-turn", "200", "--system-tokens", "100", "--answer-tokens", "10,20", "--block-size", "32",
]  # fmt: skip


def sim(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "router.cli", "sim", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def assert_sim_refuses(args: list[str], message: str) -> None:
    """``kvroute sim *args`` exits 2 with ``message`` and no traceback, before running anything."""
    proc = sim(*args)
    stdout, stderr = proc.communicate(timeout=100)
    assert proc.returncode == 2 and message in stderr and "Traceback" not in stderr, stderr
    assert stdout == ""


def test_out_at_an_existing_file_is_refused_before_running(tmp_path: Path) -> None:
    target = tmp_path / "results.md"
    target.write_text("keep me")
    proc = sim("--out", str(target))  # the defaults: minutes of work if it started
    stdout, stderr = proc.communicate(timeout=100)
    assert proc.returncode == 2, stderr
    assert f"--out {target} is an existing file" in stderr and "Traceback" not in stderr
    assert "runs (" not in stderr and stdout == ""  # no run was planned or started
    assert target.read_text() == "keep me"


@pytest.mark.slow
def test_priority_options_are_checked_and_a_priority_fleet_runs() -> None:
    proc = sim(*TINY, "--scheduling-policy", "priority", "--priority-stretch", "-1")
    _, stderr = proc.communicate(timeout=100)
    assert proc.returncode == 2 and "--priority-stretch must be >= 0" in stderr, stderr
    proc = sim(*TINY, "--scheduling-policy", "priority", "--priority-fcfs-factor", "0.9")
    _, stderr = proc.communicate(timeout=100)
    assert proc.returncode == 2 and "--priority-fcfs-factor must be >= 1" in stderr, stderr
    proc = sim(*TINY, "--scheduling-policy", "priority", "--priority-wait", "fifo")
    _, stderr = proc.communicate(timeout=100)
    assert proc.returncode == 2 and "--priority-wait: invalid choice: 'fifo'" in stderr, stderr
    proc = sim(
        *TINY, "--concurrency", "2", "--policies", "tier_cost", "--scheduling-policy", "priority",
        "--priority-wait", "overtake", "--admission-wait", "--admission-form", "overtake",
    )  # fmt: skip
    stdout, stderr = proc.communicate(timeout=200)
    assert proc.returncode == 0, stderr
    assert "tier_cost" in stdout


@pytest.mark.slow
@pytest.mark.timeout(400)  # 4 small runs in 2 processes; slow on a busy machine
def test_sweep_writes_each_run_shows_one_bar_and_plots_tiers(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = sim(
        *TINY, "--concurrency", "2,3", "--policies", "round_robin,tier_cost", "--jobs", "2", "--out", str(out)
    )
    stdout, stderr = proc.communicate(timeout=350)
    assert proc.returncode == 0, stderr
    assert "4 runs (" in stderr
    # One bar over the whole sweep (the requests of all 4 runs), finished.
    assert stderr.count("sweep 100%") >= 1 and "4/4 runs" in stderr
    assert all(f"[{k}/4] " in stdout for k in range(1, 5))
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4 and {json.loads(x)["policy"] for x in lines} == {"round_robin", "tier_cost"}
    rows = json.loads((out / "results.json").read_text())
    assert [(r["label"], r["policy"]) for r in rows] == [
        ("2", "round_robin"), ("2", "tier_cost"), ("3", "round_robin"), ("3", "tier_cost"),
    ]  # fmt: skip
    assert "so far" not in (out / "results.md").read_text()
    assert (out / "hits_by_tier.png").stat().st_size > 5000
    assert (out / "ttft_p50.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_interrupted_sweep_keeps_the_runs_it_finished(tmp_path: Path) -> None:
    out = tmp_path / "partial"
    many = ",".join(str(c) for c in range(2, 12))  # 10 runs one after another
    proc = sim(*TINY, "--concurrency", many, "--policies", "round_robin", "--jobs", "1", "--out", str(out))
    jsonl = out / "results.jsonl"
    deadline = time.monotonic() + 250
    while not (jsonl.exists() and jsonl.read_text().strip()):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no run finished"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=100)
    if proc.returncode == 0:  # the machine finished all 10 before the signal landed: nothing to check
        return
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted after" in stderr
    done = len(jsonl.read_text().splitlines())
    assert 1 <= done < 10
    assert f"({done} of 10 runs so far)" in (out / "results.md").read_text()
    assert len(json.loads((out / "results.json").read_text())) == done


def test_an_error_raised_while_ctrl_c_is_handled_still_ends_the_sweep_as_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C that lands inside tqdm's write (while it takes its lock) comes out as RuntimeError
    ("cannot release un-acquired lock") over the KeyboardInterrupt, seen in a `make test` run of
    the test above. The sweep must still stop as interrupted: exit 130 with the runs it finished
    written, not a traceback. Deterministic: the second run raises that chain itself. Catches a
    handler for KeyboardInterrupt alone; and a real error (no Ctrl-C under it) must still raise."""
    import sim.des_cli as des_cli

    real = des_cli._execute
    calls = {"n": 0}

    def execute(spec: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("cannot release un-acquired lock") from None
        return real(spec)  # type: ignore[arg-type]

    monkeypatch.setattr(des_cli, "_execute", execute)
    out = tmp_path / "partial"
    argv = [*TINY, "--concurrency", "2,3,4", "--policies", "round_robin", "--jobs", "1", "--out", str(out)]
    assert des_cli.main(argv) == 130
    assert "interrupted after 1 of 3 runs" in capsys.readouterr().err
    assert len((out / "results.jsonl").read_text().strip().splitlines()) == 1
    assert des_cli.interrupted(RuntimeError("x")) is False

    def broken(spec: object) -> object:
        raise RuntimeError("a real bug")

    monkeypatch.setattr(des_cli, "_execute", broken)
    with pytest.raises(RuntimeError, match="a real bug"):
        des_cli.main([*argv[:-1], str(tmp_path / "other")])
