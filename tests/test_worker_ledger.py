"""router/worker_ledger.py: the load board shared by `kvroute serve --workers N` processes. Two boards
on one descriptor stand for two workers (the end-to-end check with real processes is in
tests/test_serve_workers.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvcore.core import InMemoryLoadLedger
from router.worker_ledger import WorkerBoard, WorkerLoadLedger, create_board

ENGINES = ["e0", "e1", "e2"]


@pytest.fixture
def board_fd() -> Iterator[int]:
    """A two-worker board's file descriptor, closed after the test."""
    fd = create_board(2, ENGINES)
    yield fd
    os.close(fd)


@pytest.fixture
def ledgers(board_fd: int) -> list[WorkerLoadLedger]:
    """Two workers' ledgers on one board."""
    return [
        WorkerLoadLedger(InMemoryLoadLedger(ENGINES), WorkerBoard(board_fd, i, ENGINES)) for i in range(2)
    ]


def test_each_worker_sees_the_sum_of_every_workers_load(ledgers: list[WorkerLoadLedger]) -> None:
    a, b = ledgers
    ta = a.reserve("e1", 1000)
    tb = b.reserve("e1", 500)
    b.reserve("e2", 64)
    for ledger in (a, b):
        assert ledger.load("e1") == (2, 1500)
        assert ledger.load("e2") == (1, 64)
        assert ledger.load("e0") == (0, 0)
    assert a.local.load("e1") == (1, 1000)  # its own accounting stays its own
    a.first_token(ta)
    assert b.load("e1") == (2, 500)
    a.finish(ta)
    b.finish(tb)
    b.finish(tb)  # idempotent, as the protocol says
    assert a.load("e1") == (0, 0)
    assert next(iter(a.least_loaded())) in ("e0", "e1")
    assert list(a.least_loaded())[-1] == "e2"


def test_a_restarted_worker_clears_its_old_row_only(ledgers: list[WorkerLoadLedger], board_fd: int) -> None:
    a, b = ledgers
    a.reserve("e0", 10)
    b.reserve("e0", 20)
    WorkerBoard(board_fd, 1, ENGINES)  # worker 1 comes back: its in-flight requests died with it
    assert a.load("e0") == (1, 10)


def test_a_board_for_another_engine_list_is_refused(board_fd: int) -> None:
    with pytest.raises(ValueError, match="another engine list"):
        WorkerBoard(board_fd, 1, ["e0", "e1"])
    with pytest.raises(ValueError, match="worker index"):
        WorkerBoard(board_fd, 2, ENGINES)


def test_an_engine_added_after_start_is_counted_by_each_worker_alone(ledgers: list[WorkerLoadLedger]) -> None:
    a, b = ledgers
    a.reserve("e9", 5)
    assert a.load("e9") == (1, 5)
    assert b.load("e9") == (0, 0)


def test_a_dead_workers_row_stops_counting(ledgers: list[WorkerLoadLedger], board_fd: int) -> None:
    """Issue 28 item 4: a worker SIGKILLed while carrying requests cannot clear its row; the others
    must not count its load forever (they did: the board summed every row)."""
    import signal
    import subprocess
    import sys

    a, _ = ledgers
    a.reserve("e0", 10)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, signal, sys\n"
            "from router.worker_ledger import WorkerBoard\n"
            f"board = WorkerBoard({board_fd}, 1, {ENGINES!r})\n"
            "board.publish('e0', 5, 500)\n"
            "sys.stdout.write('published\\n'); sys.stdout.flush()\n"
            "signal.pause()\n",
        ],
        pass_fds=(board_fd,),
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"published\n"
        live = WorkerLoadLedger(InMemoryLoadLedger(ENGINES), WorkerBoard(board_fd, 0, ENGINES))
        live.reserve("e0", 10)
        assert live.load("e0") == (6, 510)  # the child's row counts while it lives
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    fresh = WorkerLoadLedger(InMemoryLoadLedger(ENGINES), WorkerBoard(board_fd, 0, ENGINES))
    fresh.reserve("e0", 10)
    assert fresh.load("e0") == (1, 10)
    assert fresh.board.live_workers() == [True, False]


def test_the_in_flight_gauge_reads_this_workers_own_requests_when_scraped(
    ledgers: list[WorkerLoadLedger],
) -> None:
    # Catches: the gauge (read from the ledger at scrape time, not written per change) showing the
    # board's sum (every worker's requests) instead of this worker's, or a stale count.
    from router.metrics import create_metrics

    a, b = ledgers
    metrics = create_metrics()
    metrics.watch_in_flight(a.local)
    ta = a.reserve("e1", 1000)
    b.reserve("e1", 500)
    assert a.load("e1") == (2, 1500)
    text = metrics.render().decode()
    assert 'kvroute_in_flight{engine="e1"} 1.0' in text and 'kvroute_in_flight{engine="e0"} 0.0' in text
    a.finish(ta)
    assert 'kvroute_in_flight{engine="e1"} 0.0' in metrics.render().decode()
