"""Load shared by the workers of one ``kvroute serve --workers N`` (one machine, one port).

Each worker keeps its own ledger (``kvcore.core.InMemoryLoadLedger``: its tickets, its in-flight
gauge) and mirrors its per-engine (in-flight requests, queued prefill tokens) into its own row of a
small memory-mapped file that every worker maps; ``load`` sums the rows, so every worker's policy
sees the whole machine's load, as one process would. One writer per row and aligned 8-byte stores:
no lock. Without it each worker would balance only the requests the kernel happened to give it.

Layout (native-endian int64): a header ``[MAGIC, workers, slots, engine-list hash]`` then one row per
worker, ``[pid, slots x 2 counters]``. A row counts only while its pid is a live process (checked at
most every ``LIVENESS_CHECK_S``): a SIGKILLed worker cannot clean up, and its streams must not stay
on the board as phantom load; its replacement (``kvroute serve`` restarts a dead sibling) takes the
row over. Slots are the engines of the config the first worker started with,
in order; engines added later by a reload are counted per worker only (logged). Replicas across
machines share load through Redis instead (``router/shared_state.py``), which takes precedence.
"""

from __future__ import annotations

import array
import logging
import mmap
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import xxhash

from kvcore.core import InMemoryLoadLedger, LoadTicket

log = logging.getLogger("kvroute.workers")

MAGIC = 0x6B76_726F_7574_6532  # "kvroute2"
_HEADER_WORDS = 4
#: Seconds a reader trusts its last look at which workers are alive.
LIVENESS_CHECK_S = 0.5


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie - dead, not yet reaped - is not alive)."""
    if pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def engines_hash(engine_ids: Sequence[str]) -> int:
    return xxhash.xxh64_intdigest("\0".join(engine_ids).encode()) & 0x7FFF_FFFF_FFFF_FFFF


def create_board(workers: int, engine_ids: Sequence[str]) -> int:
    """A zeroed board for ``workers`` workers; returns an open file descriptor of it. The file is
    unlinked at once (in /dev/shm when there is one): the first worker passes the descriptor to the
    others, and nothing is left behind however the workers end."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix="kvroute-workers-", dir=directory)
    os.unlink(path)
    words = [MAGIC, workers, len(engine_ids), engines_hash(engine_ids)]
    words += [0] * (workers * (1 + len(engine_ids) * 2))
    os.write(fd, array.array("q", words).tobytes())
    return fd


class WorkerBoard:
    """One worker's view of the board file: its own row to write, every row to read."""

    def __init__(self, fd: int, worker: int, engine_ids: Sequence[str]) -> None:
        self._map = mmap.mmap(fd, 0)
        words = memoryview(self._map).cast("q")
        magic, workers, slots, digest = (int(words[i]) for i in range(_HEADER_WORDS))
        if magic != MAGIC:
            raise ValueError(f"file descriptor {fd} is not a kvroute worker board")
        if slots != len(engine_ids) or digest != engines_hash(engine_ids):
            raise ValueError(
                f"the worker board was made for another engine list ({slots} engines); "
                "every worker must start from the same config"
            )
        if not 0 <= worker < workers:
            raise ValueError(f"worker index {worker} outside 0..{workers - 1}")
        self.workers, self.worker = workers, worker
        self.slots = {engine_id: i for i, engine_id in enumerate(engine_ids)}
        self._words = words
        self._stride = 1 + len(engine_ids) * 2
        self._row = _HEADER_WORDS + worker * self._stride + 1  # the counters; the pid before them
        for i in range(len(engine_ids) * 2):  # a restarted worker's old counts are void
            words[self._row + i] = 0
        words[self._row - 1] = os.getpid()
        self._alive: list[bool] = [True] * workers
        self._alive_checked_s = float("-inf")

    def live_workers(self, now_s: float | None = None) -> list[bool]:
        """Which rows count: their worker's process is alive (cached for ``LIVENESS_CHECK_S``)."""
        now_s = time.monotonic() if now_s is None else now_s
        if now_s - self._alive_checked_s >= LIVENESS_CHECK_S:
            self._alive_checked_s = now_s
            words, stride = self._words, self._stride
            for w in range(self.workers):
                alive = w == self.worker or process_alive(int(words[_HEADER_WORDS + w * stride]))
                if not alive and self._alive[w]:
                    log.warning(
                        "worker %d (pid %d) is gone: its load no longer counts",
                        w,
                        words[_HEADER_WORDS + w * stride],
                    )
                self._alive[w] = alive
        return self._alive

    def publish(self, engine_id: str, in_flight: int, queued_tokens: int) -> None:
        slot = self.slots.get(engine_id)
        if slot is not None:
            at = self._row + 2 * slot
            self._words[at] = in_flight
            self._words[at + 1] = queued_tokens

    def total(self, slot: int) -> tuple[int, int]:
        """(in-flight, queued prefill tokens) on engine ``slot`` summed over the live workers."""
        words, stride = self._words, self._stride
        at = _HEADER_WORDS + 1 + 2 * slot
        in_flight = queued = 0
        for alive in self.live_workers():
            if alive:
                in_flight += words[at]
                queued += words[at + 1]
            at += stride
        return in_flight, queued

    def close(self) -> None:
        self._words.release()
        self._map.close()


class WorkerLoadLedger:
    """The routing core's ledger in a multi-worker router: ``local`` does the accounting, the board
    carries every worker's totals (``kvcore.core.LoadLedger`` protocol)."""

    def __init__(self, local: InMemoryLoadLedger, board: WorkerBoard) -> None:
        self.local = local
        self.board = board
        self._warned: set[str] = set()

    def _mirror(self, engine_id: str) -> None:
        in_flight, queued = self.local.load(engine_id)
        self.board.publish(engine_id, in_flight, queued)

    def reserve(self, engine_id: str, prefill_tokens: int) -> LoadTicket:
        ticket = self.local.reserve(engine_id, prefill_tokens)
        self._mirror(engine_id)
        return ticket

    def first_token(self, ticket: LoadTicket) -> None:
        self.local.first_token(ticket)
        self._mirror(ticket.engine_id)

    def finish(self, ticket: LoadTicket) -> None:
        self.local.finish(ticket)
        self._mirror(ticket.engine_id)

    def load(self, engine_id: str) -> tuple[int, int]:
        slot = self.board.slots.get(engine_id)
        if slot is None:
            if engine_id not in self._warned:
                self._warned.add(engine_id)
                log.warning(
                    "engine %s joined after the workers started: each worker counts only its own "
                    "load on it until the router restarts",
                    engine_id,
                )
            return self.local.load(engine_id)
        return self.board.total(slot)

    def least_loaded(self) -> Iterator[str]:
        loads = {e: self.load(e) for e in set(self.board.slots) | set(self.local.least_loaded())}
        return iter(sorted(loads, key=lambda e: (loads[e][1], loads[e][0])))
