"""Locust multi-turn chat users for any OpenAI-compatible endpoint (kvroute, one vLLM, a peer router).

Each user runs conversations from sim/workloads.py (the B1 ladder, Mooncake or agentic-session
trace replay): it resends the whole history every turn (ladder: with the model's real answers),
streams, waits its think time and sends a session header. Per turn number it reports TTFT, mean
inter-token latency and end-to-end latency as Locust request stats, and cached prompt tokens (from
``usage.prompt_tokens_details``) as the "size" of a USAGE entry and in ``<csv>_turns.csv``.

The end of a run: with Locust's ``--stop-timeout S`` (loadtest/load.py passes 30) a user stopping
at ``--run-time`` finishes the turn it has in flight (up to S s) and sends no other, not even the
rest of its conversation; one thinking stops at once. Without it Locust cuts the turns in flight,
whose TTFTs never reach the percentiles, and the longest waits are the likeliest to be in flight.
``<csv>_turns.csv`` counts per turn number the turns sent (``sent``) and those that neither answered
nor failed (``unfinished``: cut at the end). ``--measure-after S`` leaves the turns sent in the
run's first S s (the ramp-up) out of that table.

    locust -f loadtest/locustfile.py --host http://ROUTER:PORT                      # web UI
    locust -f loadtest/locustfile.py --host http://ROUTER:PORT --headless -u 16 -r 4 -t 2m --csv out/run
    python -m loadtest.locustfile --help     # Locust's options and this file's (workload, trace, ...)
"""

from __future__ import annotations

import csv
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import locust  # noqa: F401  (first: gevent patches ssl before requests imports it)
import requests
from locust import User, events, task
from locust.env import Environment
from locust.user.task import LOCUST_STATE_STOPPING

from kvcore.sim_tokenizer import NAME as SIM_MODEL
from kvcore.stats import percentile
from loadtest.trace_prompts import trace_messages
from sim.workloads import (
    Conversation,
    LadderConfig,
    agentic_workload,
    ladder_conversations,
    mooncake_workload,
    read_agentic_sessions,
    read_mooncake_records,
)

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("ladder", "mooncake", "agentic")


# -- options (also in the web UI's "custom parameters") ----------------------------------------------


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    group = parser.add_argument_group("kvroute multi-turn chat")
    group.add_argument("--workload", choices=WORKLOADS, default="ladder", help="conversation source")
    group.add_argument("--model", default=SIM_MODEL, help="model name sent in each request")
    group.add_argument("--session-header", default="X-Session-ID", help="header carrying the conversation id")
    group.add_argument("--first-prompt-tokens", type=int, default=2400, help="ladder: first prompt")
    group.add_argument("--system-prefix-tokens", type=int, default=600, help="ladder: shared system prompt")
    group.add_argument("--tokens-per-turn", type=int, default=448, help="ladder: prompt growth per turn")
    group.add_argument("--turns", type=int, default=5, help="ladder: turns per conversation")
    group.add_argument("--answer-tokens", type=int, default=48, help="ladder: max_tokens of each answer")
    group.add_argument("--think-time-mean", type=float, default=1.0, help="ladder: mean think time s")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--trace",
        default="",
        help="mooncake: a JSONL trace (default data/traces/mooncake/conversation_trace.jsonl); "
        "agentic: a session file or directory (default data/traces/agentic-sessions)",
    )
    group.add_argument("--trace-limit", type=int, default=0, help="use only the first N records/sessions")
    group.add_argument(
        "--trace-token-scale",
        type=int,
        default=1,
        help="trace replay: divide every token count by N (a trace block becomes block_size/N tokens)",
    )
    group.add_argument("--think-scale", type=float, default=1.0, help="multiply every think time")
    group.add_argument(
        "--max-prompt-tokens", type=int, default=0, help="skip trace turns whose prompt is longer (0 = all)"
    )
    group.add_argument("--max-output-tokens", type=int, default=0, help="cap max_tokens (0 = as given)")
    group.add_argument("--no-stream", action="store_true", help="ask for whole answers (no TTFT, no ITL)")
    group.add_argument(
        "--measure-after",
        type=float,
        default=0.0,
        help="seconds from the test's start: the turns sent before are warm-up, not in <csv>_turns.csv",
    )


# -- conversations -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Source:
    """Where users take their next conversation (one per Locust process)."""

    kind: str
    conversations: Iterator[Conversation]
    block_size: int = 16
    started_at: float = field(default_factory=time.monotonic)
    open_loop: bool = False


def make_source(options: Any) -> Source:
    kind = options.workload
    if kind == "ladder":
        cfg = LadderConfig(
            first_prompt_tokens=options.first_prompt_tokens,
            system_prefix_tokens=options.system_prefix_tokens,
            tokens_per_turn=options.tokens_per_turn,
            turns=options.turns,
            answer_min_tokens=options.answer_tokens,
            answer_max_tokens=options.answer_tokens,
            think_time_mean_s=options.think_time_mean,
            seed=options.seed,
        )
        return Source(kind, ladder_conversations(cfg), cfg.block_size)
    limit = options.trace_limit or None
    if kind == "mooncake":
        path = options.trace or str(REPO / "data/traces/mooncake/conversation_trace.jsonl")
        workload = mooncake_workload(read_mooncake_records(path, limit=limit))
        # One-turn conversations at recorded times: wait for each one's timestamp (open loop, bounded
        # by the number of users).
        return Source(kind, iter(workload.conversations), workload.block_size, open_loop=True)
    path = options.trace or str(REPO / "data/traces/agentic-sessions")
    workload = agentic_workload(read_agentic_sessions(path, limit=limit), stagger_s=0.0)
    # Sessions' agents run one after another per user, repeating the list when it runs out.
    return Source(kind, itertools.cycle(workload.conversations), workload.block_size)


# -- per-turn token accounting (the part Locust's stats have no column for) ---------------------------


@dataclass(slots=True)
class TurnTokens:
    #: measured turns sent, and of them the ones that failed; ``requests``: the ones answered.
    sent: int = 0
    failed: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts_ms: list[float] = field(default_factory=list)


TURN_TOKENS: dict[int, TurnTokens] = {}
_SOURCE: list[Source] = []
#: time.monotonic() when the test started (the start of ``--measure-after``).
_STARTED_AT: list[float] = []


def _quantile(values: list[float], q: float) -> float:
    """The project's one percentile definition (kvcore.stats), q in [0, 1]."""
    return percentile(values, q * 100)


def turn_rows() -> list[dict[str, Any]]:
    """One row per turn number, then an "all" row over every turn."""
    rows = []
    overall = TurnTokens()
    for t in TURN_TOKENS.values():
        overall.sent += t.sent
        overall.failed += t.failed
        overall.requests += t.requests
        overall.prompt_tokens += t.prompt_tokens
        overall.cached_tokens += t.cached_tokens
        overall.ttfts_ms.extend(t.ttfts_ms)
    keys: list[int | str] = [*sorted(TURN_TOKENS), "all"] if TURN_TOKENS else []
    for turn in keys:
        t = overall if turn == "all" else TURN_TOKENS[int(turn)]
        rows.append(
            {
                "turn": turn,
                "requests": t.requests,
                "sent": t.sent,
                "unfinished": t.sent - t.requests - t.failed,
                "ttft_p50_ms": _quantile(t.ttfts_ms, 0.5),
                "ttft_p90_ms": _quantile(t.ttfts_ms, 0.9),
                "ttft_p99_ms": _quantile(t.ttfts_ms, 0.99),
                "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens,
                "cached_fraction": t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0,
            }
        )
    return rows


def format_turn_rows(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'turn':>4} {'reqs':>6} {'TTFT p50 ms':>12} {'p90 ms':>9} {'p99 ms':>9} "
        f"{'prompt tok':>11} {'cached':>10} {'frac':>6}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['turn']:>4} {r['requests']:>6} {r['ttft_p50_ms']:>12.1f} {r['ttft_p90_ms']:>9.1f} "
            f"{r['ttft_p99_ms']:>9.1f} {r['prompt_tokens']:>11} {r['cached_tokens']:>10} "
            f"{r['cached_fraction']:>6.3f}"
        )
    return "\n".join(lines)


@events.test_start.add_listener
def _on_start(environment: Environment, **_: Any) -> None:
    TURN_TOKENS.clear()
    _STARTED_AT[:] = [time.monotonic()]
    _SOURCE[:] = [make_source(environment.parsed_options)]


@events.quitting.add_listener
def _on_quit(environment: Environment, **_: Any) -> None:
    rows = turn_rows()
    if not rows:
        return
    print("\nper turn (client TTFT, engine-reported cached prompt tokens):")
    print(format_turn_rows(rows))
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        with open(f"{prefix}_turns.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


# -- the user ------------------------------------------------------------------------------------------


class ChatUser(User):
    """Runs one conversation after another; every turn is one streamed chat completion."""

    # Think times come from the workload, not from Locust's wait_time.
    def wait_time(self) -> float:
        return 0.0

    def on_start(self) -> None:
        self.http = requests.Session()
        self.options = self.environment.parsed_options

    def on_stop(self) -> None:
        self.http.close()

    def _fire(self, kind: str, name: str, ms: float, size: int = 0, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=name, response_time=ms, response_length=size, exception=exc, context={}
        )

    @task
    def conversation(self) -> None:
        source = _SOURCE[0] if _SOURCE else make_source(self.options)
        try:
            conv = next(source.conversations)
        except StopIteration:
            self.environment.runner.quit() if self.environment.runner else None
            return
        if source.open_loop:
            wait_s = conv.start_s - (time.monotonic() - source.started_at)
            if wait_s > 0:
                self._sleep(wait_s)
        answers: list[str] = []
        for k, turn in enumerate(conv.turns):
            if k > 0 and turn.think_time_s > 0:
                self._sleep(turn.think_time_s * self.options.think_scale)
            if self._state == LOCUST_STATE_STOPPING:
                return  # the run is over (--stop-timeout): no new turn
            if conv.messages_fn is not None:
                messages = conv.messages(k, answers)
            else:
                scale = max(1, self.options.trace_token_scale)
                prompt_tokens = turn.prompt_tokens // scale
                if self.options.max_prompt_tokens and prompt_tokens > self.options.max_prompt_tokens:
                    continue
                messages = trace_messages(turn.block_ids, max(1, source.block_size // scale), prompt_tokens)
            max_tokens = turn.output_tokens
            if conv.messages_fn is not None:
                max_tokens = self.options.answer_tokens
            if self.options.max_output_tokens:
                max_tokens = min(max_tokens, self.options.max_output_tokens)
            answer = self._turn(conv.conversation_id, k, messages, max_tokens)
            if answer is None:
                return  # the error is in the stats; start a new conversation
            answers.append(answer)

    def _sleep(self, seconds: float) -> None:
        """Think (or wait for an open-loop start) in slices, so that a user the run's end asks to
        stop (--stop-timeout) ends now rather than after its think time."""
        import gevent

        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0 and self._state != LOCUST_STATE_STOPPING:
            gevent.sleep(min(left, 0.1))

    def _turn(self, session_id: str, k: int, messages: list[dict[str, str]], max_tokens: int) -> str | None:
        stream = not self.options.no_stream
        body: dict[str, Any] = {"model": self.options.model, "messages": messages, "max_tokens": max_tokens}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        name = f"turn {k}"
        url = self.environment.host.rstrip("/") + "/v1/chat/completions"
        sent_at = time.monotonic() - (_STARTED_AT[0] if _STARTED_AT else time.monotonic())
        measured = sent_at >= self.options.measure_after
        stats = TURN_TOKENS.setdefault(k, TurnTokens()) if measured else TurnTokens()  # (warm-up: unread)
        stats.sent += 1
        start = time.perf_counter()
        first_s: float | None = None
        last_s = start
        gaps_s: list[float] = []
        pieces: list[str] = []
        usage: dict[str, Any] = {}
        size = 0
        try:
            with self.http.post(
                url, json=body, headers={self.options.session_header: session_id}, stream=stream, timeout=600
            ) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                if not stream:
                    data = resp.json()
                    size = len(resp.content)
                    pieces.append(data["choices"][0]["message"].get("content") or "")
                    usage = data.get("usage") or {}
                else:
                    for raw in resp.iter_lines():
                        size += len(raw)
                        if not raw.startswith(b"data:"):
                            continue
                        payload = raw[5:].strip()
                        if payload == b"[DONE]":
                            break
                        chunk = json.loads(payload)
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for choice in chunk.get("choices") or []:
                            piece = (choice.get("delta") or {}).get("content")
                            if piece:
                                now = time.perf_counter()
                                if first_s is None:
                                    first_s = now
                                else:
                                    gaps_s.append(now - last_s)
                                last_s = now
                                pieces.append(piece)
        except Exception as exc:  # any failure is one failed request in the stats, then a new conversation
            self._fire("POST", name, (time.perf_counter() - start) * 1000, size, exc)
            stats.failed += 1
            return None
        end = time.perf_counter()
        self._fire("POST", name, (end - start) * 1000, size)
        ttft_ms = ((first_s if first_s is not None else end) - start) * 1000
        if stream:
            self._fire("TTFT", name, ttft_ms)
            if gaps_s:
                self._fire("ITL", name, sum(gaps_s) / len(gaps_s) * 1000)
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        # Locust has no token column: the cached tokens ride as this entry's "content size".
        self._fire("USAGE", f"cached tokens {name}", 0.0, cached)
        stats.requests += 1
        stats.prompt_tokens += prompt
        stats.cached_tokens += cached
        stats.ttfts_ms.append(ttft_ms)
        return "".join(pieces)


# -- help ----------------------------------------------------------------------------------------------


def options_help() -> str:
    """Locust's full --help with this file's options. ``locust -f loadtest/locustfile.py --help``
    cannot show them: Locust 2.x answers --help before it imports the locustfile, so the
    init_command_line_parser listener above never runs (locustio/locust#2917). Importing this
    module registers it, and Locust's own parser then carries the "kvroute multi-turn chat" group."""
    from locust.argument_parser import get_parser

    return get_parser().format_help()


if __name__ == "__main__":
    print(options_help())
