"""A test run killed with SIGTERM (a CI job's timeout) still stops what its fixtures started in
sessions of their own: ``tests.conftest.interrupt_on_sigterm``, which the live tests' session fleet
runs under."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from router.worker_ledger import process_alive

REPO = Path(__file__).resolve().parents[1]

STARTED = """
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import interrupt_on_sigterm

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def child():
    with {guard}:
        proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
        (HERE / "child.pid").write_text(str(proc.pid))
        try:
            yield proc
        finally:
            proc.kill()
            proc.wait()


def test_runs_until_killed(child):
    (HERE / "ready").write_text("1")
    time.sleep(600)
"""


def _killed_run(folder: Path, guard: str) -> int:
    """A pytest run of STARTED (its fixture under ``guard``) in ``folder``, sent SIGTERM once its test
    runs; the pid of the process its fixture started."""
    folder.mkdir()
    (folder / "test_started.py").write_text(textwrap.dedent(STARTED.format(guard=guard)))
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_started.py"],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (folder / "ready").exists():
            assert run.poll() is None and time.monotonic() < deadline, "the test run never started its test"
            time.sleep(0.05)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
    finally:
        run.kill()
        run.wait()
    return int((folder / "child.pid").read_text())


def test_a_sigterm_to_a_test_run_stops_what_its_session_fixture_started(tmp_path: Path) -> None:
    """Would catch the live tests' session fleet outliving a killed run. Without the guard (the
    second run) the process is still running after the run has ended: the check can fail."""
    guarded = _killed_run(tmp_path / "guarded", "interrupt_on_sigterm()")
    bare = _killed_run(tmp_path / "bare", "__import__('contextlib').nullcontext()")
    try:
        assert not process_alive(guarded)
        assert process_alive(bare)
    finally:
        for pid in (guarded, bare):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
