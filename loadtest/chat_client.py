"""A small async multi-turn chat load generator for any OpenAI-compatible endpoint.

It drives a synthetic ``sim.workloads.Workload`` (the same conversations the offline simulator
replays): each conversation resends its whole history every turn (shared system prompt, growing user text and
the previous answers), streams the answer, measures TTFT at the client and records what the router
said in its response headers (engine, arm) and what the engine reported as cached prompt tokens.
``main`` is ``kvroute load``: the demo's conversations against any router or engine URL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvcore.sim_tokenizer import NAME as SIM_MODEL
from kvcore.stats import percentile
from sim.workloads import LadderConfig, Workload, ladder_workload


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


def chat_workload(
    *,
    conversations: int,
    concurrency: int,
    turns: int,
    think_time_s: float,
    seed: int = 0,
    block_size: int = 16,
) -> Workload:
    """The B1 ladder scaled down (the demo's load): 2,400-token first prompts sharing a 600-token
    system prompt, +448 tokens a turn (the previous 48-token answer and new user text)."""
    return ladder_workload(
        LadderConfig(
            first_prompt_tokens=2400,
            system_prefix_tokens=600,
            tokens_per_turn=448,
            turns=turns,
            answer_min_tokens=48,
            answer_max_tokens=48,
            think_time_mean_s=think_time_s,
            concurrency=concurrency,
            total_conversations=conversations,
            block_size=block_size,
            seed=seed,
        )
    )


#: How long "connection refused" (nothing listens) may last before ``kvroute load`` gives up, unless
#: --wait-s is given: a wrong port or a router that is not running must not look like a slow start.
REFUSED_WAIT_S = 3.0


def _wait_ready(url: str, wait_s: float, refused_wait_s: float | None = None) -> str:
    """Poll GET /health until it answers 200; "" when ready, else why not. Refused connections
    alone give up after ``refused_wait_s`` (default: ``wait_s``)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    started = time.monotonic()
    deadline = started + wait_s
    refused_deadline = started + (wait_s if refused_wait_s is None else min(wait_s, refused_wait_s))
    error = ""
    only_refused = True
    while True:
        try:
            with opener.open(f"{url}/health", timeout=2.0) as resp:
                if resp.status == 200:
                    return ""
        except OSError as exc:
            error = str(exc)
            refused = isinstance(getattr(exc, "reason", exc), ConnectionRefusedError)
            only_refused = only_refused and refused
        now = time.monotonic()
        if only_refused and error and now >= refused_deadline:
            return (
                f"connection refused: nothing listens at {url}; is the router running, and is this "
                "its port? (--wait-s waits longer for a router that is still starting)"
            )
        if now >= deadline:
            return error or "no answer"
        time.sleep(0.25)


def format_summary(result: LoadResult) -> str:
    s = result.summary()
    per_engine = Counter(t.engine or "-" for t in result.turns if t.ok)
    lines = [
        f"{s['ok']} turns ok, {s['errors']} errors in {result.wall_s:.1f} s ({s['turns_per_s']:.1f} turns/s)",
        f"TTFT p50 {s['ttft_p50_s'] * 1000:.1f} ms, p90 {s['ttft_p90_s'] * 1000:.1f} ms (at this client)",
        f"prompt tokens the engines reported as cached: {s['cached_fraction']:.1%}",
        "turns per engine: " + ", ".join(f"{e} {n}" for e, n in sorted(per_engine.items())),
    ]
    errors = [t.error for t in result.turns if not t.ok and t.error]
    if errors:
        lines.append(f"first error: {errors[0]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``kvroute load``: multi-turn streaming chats against an OpenAI-compatible URL, then a summary."""
    p = argparse.ArgumentParser(
        prog="kvroute load",
        description="Drive multi-turn streaming chat conversations (full history resent each turn) against "
        "a kvroute router or any OpenAI-compatible server, and print TTFT and cache figures.",
    )
    p.add_argument("--url", default="http://127.0.0.1:9000", help="server base URL, without /v1")
    p.add_argument("--model", default=SIM_MODEL, help=f"model name to send (default {SIM_MODEL})")
    p.add_argument("--conversations", type=int, default=24, help="conversations in total (default 24)")
    p.add_argument("--concurrency", type=int, default=6, help="conversations at a time (default 6)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--think-time-s", type=float, default=0.3, help="mean pause between turns (default 0.3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--wait-s",
        type=float,
        default=None,
        help=f"wait this long for GET /health first (default 60 s, but only {REFUSED_WAIT_S:g} s while "
        "connections are refused)",
    )
    args = p.parse_args(argv)
    url = args.url.rstrip("/").removesuffix("/v1")
    try:
        workload = chat_workload(
            conversations=args.conversations,
            concurrency=args.concurrency,
            turns=args.turns,
            think_time_s=args.think_time_s,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"kvroute load: {exc}", file=sys.stderr)
        return 2
    wait_s = 60.0 if args.wait_s is None else args.wait_s
    why = _wait_ready(url, wait_s, REFUSED_WAIT_S if args.wait_s is None else None)
    if why:
        print(f"kvroute load: {url}/health did not answer ({why})", file=sys.stderr)
        return 1
    print(
        f"{len(workload.conversations)} conversations x {args.turns} turns, "
        f"{workload.concurrency} at a time, against {url} ...",
        file=sys.stderr,
    )
    result = asyncio.run(run_load(url, workload, model=args.model, progress=print_progress))
    print(format_summary(result))
    return 0 if result.summary()["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
