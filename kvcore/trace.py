"""Records routed requests as a Mooncake-format JSONL trace (hash ids only, no text) that the
offline simulator replays. Pure: the router's trace observer and the simulator both use it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO


class TraceRecorder:
    """Writes requests as Mooncake-format JSONL (timestamp ms, input_length, output_length,
    hash_ids), hashes only, no text; ``sim/des.py --trace FILE`` replays it.

    Router keys of ``key_block_size``-token blocks are grouped into ``trace_block_size`` blocks
    (Mooncake: 512); the key at the end of each group identifies the whole prefix, and is remapped to
    a small int. A trailing partial group gets a fresh id (its content beyond the last full key is
    unknown, so it must never look equal to another request's). Not thread-safe; call from one
    event loop. Lines are buffered and written every ``flush_every`` records (and on close).
    """

    def __init__(
        self,
        out: str | Path | IO[str],
        *,
        key_block_size: int = 16,
        trace_block_size: int = 512,
        clock: Callable[[], float] = time.monotonic,
        flush_every: int = 256,
    ) -> None:
        if trace_block_size % key_block_size:
            raise ValueError(
                f"trace_block_size ({trace_block_size}) must be a multiple of "
                f"key_block_size ({key_block_size})"
            )
        self._own_file = isinstance(out, str | Path)
        self._fh: IO[str] = open(out, "w", encoding="utf-8") if isinstance(out, str | Path) else out
        self._group = trace_block_size // key_block_size
        self._trace_block_size = trace_block_size
        self._clock = clock
        self._t0: float | None = None
        self._ids: dict[int, int] = {}
        self._next_id = 0
        self._buffer: list[str] = []
        self._flush_every = flush_every
        self.records = 0

    def _small_id(self, key: int | None) -> int:
        if key is None:
            self._next_id += 1
            return self._next_id - 1
        small = self._ids.get(key)
        if small is None:
            small = self._ids[key] = self._next_id
            self._next_id += 1
        return small

    def record(
        self,
        input_length: int,
        output_length: int,
        block_keys: Sequence[int],
        timestamp_s: float | None = None,
    ) -> None:
        """Record one request: prompt tokens, output tokens, its router block keys."""
        now = self._clock() if timestamp_s is None else timestamp_s
        if self._t0 is None:
            self._t0 = now
        g = self._group
        n_full = min(len(block_keys) // g, input_length // self._trace_block_size)
        hash_ids = [self._small_id(block_keys[(i + 1) * g - 1]) for i in range(n_full)]
        if input_length > n_full * self._trace_block_size:
            hash_ids.append(self._small_id(None))
        line = {
            "timestamp": round((now - self._t0) * 1000.0, 3),
            "input_length": int(input_length),
            "output_length": int(output_length),
            "hash_ids": hash_ids,
        }
        self._buffer.append(json.dumps(line, separators=(", ", ": ")))
        self.records += 1
        if len(self._buffer) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            self._fh.write("\n".join(self._buffer) + "\n")
            self._buffer.clear()
            self._fh.flush()

    def close(self) -> None:
        self.flush()
        if self._own_file:
            self._fh.close()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
