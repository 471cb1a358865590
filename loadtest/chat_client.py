"""A small async multi-turn chat load generator for any OpenAI-compatible endpoint.

It drives a synthetic ``loadtest.workloads.Workload`` (the same conversations the offline simulator
replays): each conversation resends its whole history every turn (shared system prompt, growing user text and
the previous answers), streams the answer, measures TTFT at the client and records what the router
said in its response headers (engine, arm) and what the engine reported as cached prompt tokens.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvcore.sim_tokenizer import NAME as SIM_MODEL
from kvcore.stats import percentile
from loadtest.workloads import Workload


@dataclass(slots=True)
class TurnResult:
    conversation: int
    turn: int
    ok: bool
    status: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    engine: str = ""
    arm: str = ""
    error: str = ""


@dataclass(slots=True)
class LoadResult:
    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        ok = [t for t in self.turns if t.ok]
        ttfts = sorted(t.ttft_s for t in ok)
        prompt = sum(t.prompt_tokens for t in ok)
        cached = sum(t.cached_tokens for t in ok)
        return {
            "turns": len(self.turns),
            "ok": len(ok),
            "errors": len(self.turns) - len(ok),
            "ttft_p50_s": _quantile(ttfts, 0.5),
            "ttft_p90_s": _quantile(ttfts, 0.9),
            "cached_fraction": cached / prompt if prompt else 0.0,
            "turns_per_s": len(ok) / self.wall_s if self.wall_s else 0.0,
        }


def _quantile(sorted_values: list[float], q: float) -> float:
    """The project's one percentile definition (kvcore.stats), q in [0, 1]."""
    return percentile(sorted_values, q * 100)


async def _one_turn(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    session_id: str,
    conversation: int,
    turn: int,
    messages: list[dict[str, Any]],
    max_tokens: int,
) -> tuple[TurnResult, str]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-session-id": session_id}
    start = time.perf_counter()
    ttft = float("nan")
    answer: list[str] = []
    usage: dict[str, Any] = {}
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            engine = resp.headers.get("x-kvroute-engine", "")
            arm = resp.headers.get("x-kvroute-arm", "")
            if resp.status != 200:
                text = await resp.text()
                elapsed = time.perf_counter() - start
                return TurnResult(
                    conversation,
                    turn,
                    False,
                    resp.status,
                    elapsed,
                    elapsed,
                    engine=engine,
                    arm=arm,
                    error=text[:200],
                ), ""
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if not answer:
                            ttft = time.perf_counter() - start
                        answer.append(piece)
    except (TimeoutError, aiohttp.ClientError) as exc:
        elapsed = time.perf_counter() - start
        return TurnResult(conversation, turn, False, 0, elapsed, elapsed, error=repr(exc)), ""
    latency = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    result = TurnResult(
        conversation,
        turn,
        True,
        200,
        ttft if ttft == ttft else latency,
        latency,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        engine=engine,
        arm=arm,
    )
    return result, "".join(answer)


async def run_load(
    url: str,
    workload: Workload,
    *,
    model: str = SIM_MODEL,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 120.0,
) -> LoadResult:
    """Run every conversation of ``workload``, ``workload.concurrency`` at a time (closed loop: a
    turn is sent its think time after the previous answer ended), sending the real answers back."""
    concurrency = workload.concurrency or len(workload.conversations)
    total_turns = workload.num_requests
    result = LoadResult()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for c in range(len(workload.conversations)):
        queue.put_nowait(c)

    async def worker(session: aiohttp.ClientSession, slot: int) -> None:
        # The first conversations start spread over workload.ramp_s, not as one burst.
        await asyncio.sleep(workload.ramp_s * slot / concurrency)
        while True:
            try:
                index = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            conv = workload.conversations[index]
            answers: list[str] = []
            for k, turn in enumerate(conv.turns):
                if k > 0 and turn.think_time_s > 0:
                    await asyncio.sleep(turn.think_time_s)
                messages: list[dict[str, Any]] = list(conv.messages(k, answers))
                turn_result, answer = await _one_turn(
                    session, url, model, conv.conversation_id, index, k, messages, turn.output_tokens
                )
                result.turns.append(turn_result)
                if progress:
                    progress(len(result.turns), total_turns)
                if not turn_result.ok:
                    break
                answers.append(answer)

    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(worker(session, slot) for slot in range(concurrency)))
    result.wall_s = time.perf_counter() - start
    return result


def print_progress(done: int, total: int) -> None:
    """Progress on stderr: a redrawn bar on a terminal, a line every 10% otherwise (logs, CI)."""
    if sys.stderr.isatty():
        width = 30
        filled = int(width * done / max(total, 1))
        sys.stderr.write(f"\r  turns [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
    elif done == total or (done * 10 // max(total, 1)) != ((done - 1) * 10 // max(total, 1)):
        sys.stderr.write(f"  turns {done}/{total} ({100 * done // max(total, 1)}%)\n")
    sys.stderr.flush()
