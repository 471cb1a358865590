"""Router CPU per request before the policy: tokenise (simulator tokenizer), block keys, index match
(`router.service.IndexAnnotator.annotate`), with the conversation caches on and off, in one run.

Two prompt shapes, ``--sessions`` conversations interleaved, ``--calls`` calls each, every call
``--tokens-per-call`` longer than the last: ``chat`` (a new user message per turn, the answer
appended to the history) and ``growing`` (one user message that grows by appending, as trace
replays and some agent frameworks send). After each call the prompt is speculated on one of 4
engines, as the routing core does. Prints the median and p90 over the second half of the calls,
and the caches' speed-up.

    python -m loadtest.bench_annotate                      # 8 sessions x 22 calls, ~7K tokens at the end
    python -m loadtest.bench_annotate --tokens-per-call 700 --calls 23   # ~16K tokens at the end
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

from kvcore import sim_tokenizer
from kvcore.index import PrefixIndex
from kvcore.stats import percentile
from policies.base import RouteRequest
from router.config import RouterConfig, TokenizerConfig
from router.routing import CHAT, RouteContext
from router.service import IndexAnnotator
from router.tokenize import SimChatTokenizer

ENGINES = ("e0", "e1", "e2", "e3")


def _messages(shape: str, session: int, call: int, history: list[dict[str, str]], tokens: int) -> list[Any]:
    text = sim_tokenizer.filler_text(tokens, seed=call * 1009 + session) + f" <{session}:{call}>"
    if shape == "growing":
        body = (history[0]["content"] if history else "") + text
        history[:] = [{"role": "user", "content": body}]
    else:
        history.append({"role": "user", "content": text})
    return [{"role": "system", "content": f"agent {session}"}, *history]


async def measure(
    shape: str, cache_bytes: int, sessions: int, calls: int, tokens: int
) -> tuple[list[float], int]:
    """(seconds per annotate call over the second half of the calls, prompt tokens at the end)."""
    config = RouterConfig(tokenizer=TokenizerConfig(backend="sim", cache_max_bytes=cache_bytes))
    index = PrefixIndex()
    for engine in ENGINES:
        index.add_engine(engine)
    annotator = IndexAnnotator(config, SimChatTokenizer(cache_max_bytes=cache_bytes), index, namespace=0)
    histories: list[list[dict[str, str]]] = [[] for _ in range(sessions)]
    times: list[float] = []
    prompt_tokens = 0
    for call in range(calls):
        for session in range(sessions):
            messages = _messages(shape, session, call, histories[session], tokens)
            ctx = RouteContext(
                request_id="r",
                endpoint=CHAT,
                raw_body=b"",
                body={"model": "m", "messages": messages},
                stream=False,
                route_request=RouteRequest(request_id="r", model="m"),
                started_s=0.0,
            )
            start = time.perf_counter()
            await annotator.annotate(ctx)
            times.append(time.perf_counter() - start)
            prompt_tokens = ctx.route_request.prompt_tokens
            index.speculate(
                ENGINES[session % len(ENGINES)], ctx.route_request.block_keys, 2.0, time.monotonic()
            )
            if shape == "chat":
                histories[session].append(
                    {"role": "assistant", "content": sim_tokenizer.filler_text(40, seed=call)}
                )
    return times[len(times) // 2 :], prompt_tokens


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_annotate", description=__doc__)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--calls", type=int, default=22)
    parser.add_argument("--tokens-per-call", type=int, default=300)
    args = parser.parse_args(argv)
    print(
        f"annotate (tokenise + keys + match), {args.sessions} sessions x {args.calls} calls, "
        f"+{args.tokens_per_call} tokens per call; second half of the calls"
    )
    print(
        "| prompt shape | tokens at the end | caches off: median / p90 us | on: median / p90 us | speed-up |"
    )
    print("|---|---|---|---|---|")
    for shape in ("chat", "growing"):
        cells = []
        for cache_bytes in (0, 64 << 20):
            times, tokens = asyncio.run(
                measure(shape, cache_bytes, args.sessions, args.calls, args.tokens_per_call)
            )
            cells.append((percentile(times, 50) * 1e6, percentile(times, 90) * 1e6))
        (off, off90), (on, on90) = cells
        print(f"| {shape} | {tokens} | {off:.0f} / {off90:.0f} | {on:.0f} / {on90:.0f} | {off / on:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
