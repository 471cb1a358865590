"""What a kvroute policy predicted against what the engine did, turn by turn: plays the quality bench's
ladder (loadtest/bench_quality_live.py LADDER, the same seed) through a running router, asking
``POST /v1/route/explain`` with each turn's body just before sending it, and records per turn the
explained choice and its cost parts on every engine, the engine that served it (``x-kvroute-engine``),
the client TTFT and the engine's ``cached_tokens``. Ends with the router's ``/debug/costs`` (what its
calibration learned) and a summary: how often a conversation's next turn left the engine holding
its history, and why (the parts of the chosen engine against those of the history's engine).

    python -m loadtest.explain_probe --url http://127.0.0.1:PORT --users 8 --conversations 2 \\
        --model kvroute-tiny-llama --out runs/probe.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench_quality_live import LADDER
from sim.workloads import LadderConfig, ladder_conversations

#: Parts of tier_cost's scores compared between the chosen engine and the history's engine.
PARTS = ("wait_s", "slot_s", "load_s", "prefill_s", "work_s", "decode_s", "pressure_s", "cost_s")


def play(
    url: str, model: str, users: int, conversations: int, think_mean_s: float, seed: int
) -> list[dict[str, Any]]:
    """``users`` threads, each playing ``conversations`` ladder conversations in turn."""
    cfg = LadderConfig(
        first_prompt_tokens=LADDER["first"], system_prefix_tokens=LADDER["system"],
        tokens_per_turn=LADDER["per_turn"], turns=LADDER["turns"], answer_min_tokens=LADDER["answer"],
        answer_max_tokens=LADDER["answer"], think_time_mean_s=think_mean_s, seed=seed,
    )  # fmt: skip
    source = ladder_conversations(cfg)
    lock = threading.Lock()
    records: list[dict[str, Any]] = []

    def user(u: int) -> None:
        rng = random.Random(seed * 1000 + u)
        with httpx.Client(timeout=600) as http:
            for _ in range(conversations):
                with lock:
                    conv = next(source)
                answers: list[str] = []
                for k in range(len(conv.turns)):
                    if k:
                        time.sleep(rng.expovariate(1.0 / think_mean_s) if think_mean_s > 0 else 0.0)
                    body = {
                        "model": model,
                        "messages": conv.messages(k, answers),
                        "max_tokens": LADDER["answer"],
                    }
                    headers = {"X-Session-ID": conv.conversation_id}
                    explained = http.post(url + "/v1/route/explain", json=body, headers=headers).json()
                    rec = one_turn(http, url, body, headers)
                    rec.update(conversation=conv.conversation_id, turn=k, explain=explained)
                    answers.append(rec.pop("text"))
                    with lock:
                        records.append(rec)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def one_turn(http: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    pieces: list[str] = []
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", url + "/v1/chat/completions", json=stream_body, headers=headers) as resp:
        resp.raise_for_status()
        engine = resp.headers.get("x-kvroute-engine", "")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    pieces.append(piece)
    end = time.perf_counter()
    return {
        "engine": engine,
        "ttft_s": (first or end) - start,
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        "text": "".join(pieces),
    }


def summarise(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stays and moves of later turns, and the median cost parts behind the moves."""
    by_conv: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_conv.setdefault(r["conversation"], []).append(r)
    stays, moves = 0, []
    for turns in by_conv.values():
        turns.sort(key=lambda r: r["turn"])
        for prev, cur in itertools.pairwise(turns):
            if cur["engine"] == prev["engine"]:
                stays += 1
                continue
            engines = {e["engine_id"]: e for e in cur["explain"]["engines"]}
            home, chosen = engines.get(prev["engine"]), engines.get(cur["engine"])
            if home is None or chosen is None:
                continue
            moves.append((home, chosen, cur))
    out: dict[str, Any] = {"later_turns": stays + len(moves), "stayed": stays, "moved": len(moves)}
    if moves:

        def med(side: int, key: str) -> float:
            vals = [float(_part(m[side], key)) for m in moves]
            return statistics.median(vals)

        out["moves_median"] = {
            key: {"history_engine": med(0, key), "chosen": med(1, key)}
            for key in (*PARTS, "prefix_tokens", "in_flight")
        }
    later = [r for r in records if r["turn"] > 0]
    out["cached_share"] = sum(r["cached_tokens"] for r in records) / max(
        1, sum(r["prompt_tokens"] for r in records)
    )
    out["ttft_p50_s"] = statistics.median(r["ttft_s"] for r in records) if records else float("nan")
    out["later_turn_ttft_p50_s"] = statistics.median(r["ttft_s"] for r in later) if later else float("nan")
    return out


def _part(engine: dict[str, Any], key: str) -> float:
    if key in ("prefix_tokens", "in_flight"):
        return float(engine.get(key) or 0)
    scores = engine.get("scores") or {}
    if key == "load_s":
        return sum(float(v) for k, v in scores.items() if k.startswith("load_s"))
    return float(scores.get(key, float("nan")))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.explain_probe", description=__doc__)
    p.add_argument("--url", required=True, help="a running kvroute router")
    p.add_argument("--model", required=True, help="the model name the engines serve")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--conversations", type=int, default=2, help="conversations per user")
    p.add_argument("--think-time-mean", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="JSONL of every turn; the summary goes to stdout")
    args = p.parse_args(argv)
    records = play(args.url, args.model, args.users, args.conversations, args.think_time_mean, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    costs = httpx.get(args.url + "/debug/costs", timeout=10).json()
    summary = summarise(records)
    summary["costs"] = {
        e: {k: s.get(k) for k in ("estimate", "overhead_s", "observations", "slot_observations")}
        for e, s in (costs.get("engines") or {}).items()
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
