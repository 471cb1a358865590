"""Route observers of the wired router: the Mooncake trace writer and the per-engine traffic count
(the silent-source watchdog compares it with the engines' own counters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from router.routing import RouteContext


class TraceObserver:
    """Writes every successful request as a Mooncake JSONL line (kvcore.trace.TraceRecorder)."""

    def __init__(self, path: str, key_block_size: int, trace_block_tokens: int) -> None:
        self._path = path
        self._key_block_size = key_block_size
        self._trace_block_tokens = trace_block_tokens
        self._recorder: Any = None

    async def start(self) -> None:
        from kvcore.trace import TraceRecorder

        self._recorder = TraceRecorder(
            Path(self._path), key_block_size=self._key_block_size, trace_block_size=self._trace_block_tokens
        )

    async def stop(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None

    def on_routed(self, ctx: RouteContext) -> None:
        return None

    def on_first_byte(self, ctx: RouteContext) -> None:
        return None

    def on_finished(self, ctx: RouteContext) -> None:
        if self._recorder is None or not ctx.ok:
            return
        usage = ctx.usage or {}
        prompt_tokens = usage.get("prompt_tokens") or ctx.route_request.prompt_tokens
        output_tokens = usage.get("completion_tokens") or 0
        self._recorder.record(int(prompt_tokens), int(output_tokens), ctx.route_request.block_keys)


class TrafficCounter:
    """Observer counting requests routed to each engine (the silent-source rule needs how many
    requests an engine's prefix-cache counters moved for). No start/stop: only the services
    object is a lifespan component, so exactly one EventManager exists."""

    def __init__(self) -> None:
        self.routed: dict[str, int] = {}

    def on_routed(self, ctx: RouteContext) -> None:
        if ctx.decision is not None:
            engine_id = ctx.decision.engine_id
            self.routed[engine_id] = self.routed.get(engine_id, 0) + 1

    def on_first_byte(self, ctx: RouteContext) -> None:
        return None

    def on_finished(self, ctx: RouteContext) -> None:
        return None
