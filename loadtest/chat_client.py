"""A small async multi-turn chat load generator for any OpenAI-compatible endpoint.

Each conversation resends its whole history every turn (shared system prompt, growing user text and
the previous answers), streams the answer, measures TTFT at the client and records what the router
said in its response headers (engine, arm) and what the engine reported as cached prompt tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sim.tokenizer import filler_text


@dataclass(slots=True)
class ChatWorkload:
    """Shape of the conversations (token counts in the simulator tokenizer's tokens)."""

    conversations: int = 16
    concurrency: int = 8
    turns: int = 4
    system_tokens: int = 1000
    first_user_tokens: int = 2000
    user_tokens_per_turn: int = 500
    answer_tokens: int = 64
    think_time_mean_s: float = 0.5
    model: str = "kvroute-sim"
    seed: int = 0


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
    if not sorted_values:
        return float("nan")
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[max(0, min(98, round(q * 100) - 1))]


def _user_text(workload: ChatWorkload, conversation: int, turn: int) -> str:
    n = workload.first_user_tokens if turn == 0 else workload.user_tokens_per_turn
    # Distinct per conversation and turn; a leading tag keeps conversations apart from token 0 on.
    tag = f"[c{conversation}t{turn}] "
    return tag + filler_text(n, seed=workload.seed * 1_000_003 + conversation * 101 + turn + 1)


async def _one_turn(
    session: aiohttp.ClientSession,
    url: str,
    workload: ChatWorkload,
    conversation: int,
    turn: int,
    messages: list[dict[str, Any]],
) -> tuple[TurnResult, str]:
    body = {
        "model": workload.model,
        "messages": messages,
        "max_tokens": workload.answer_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-session-id": f"conv-{workload.seed}-{conversation}"}
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
                return TurnResult(conversation, turn, False, resp.status, elapsed, elapsed,
                                  engine=engine, arm=arm, error=text[:200]), ""
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
    workload: ChatWorkload,
    *,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 120.0,
) -> LoadResult:
    """Run ``workload.conversations`` conversations, ``workload.concurrency`` at a time."""
    rng = random.Random(workload.seed)
    system = {"role": "system", "content": filler_text(workload.system_tokens, seed=workload.seed)}
    total_turns = workload.conversations * workload.turns
    result = LoadResult()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for c in range(workload.conversations):
        queue.put_nowait(c)
    think = [rng.expovariate(1.0 / workload.think_time_mean_s) if workload.think_time_mean_s > 0 else 0.0
             for _ in range(total_turns)]

    async def worker(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                conversation = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            messages: list[dict[str, Any]] = [system]
            for turn in range(workload.turns):
                messages.append({"role": "user", "content": _user_text(workload, conversation, turn)})
                turn_result, answer = await _one_turn(session, url, workload, conversation, turn, messages)
                result.turns.append(turn_result)
                if progress:
                    progress(len(result.turns), total_turns)
                if not turn_result.ok:
                    break
                messages.append({"role": "assistant", "content": answer})
                await asyncio.sleep(think[conversation * workload.turns + turn])

    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=workload.concurrency * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(workload.concurrency)))
    result.wall_s = time.perf_counter() - start
    return result


def print_progress(done: int, total: int) -> None:
    """A one-line progress bar on stderr."""
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r  turns [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()
