"""Speed of the engine model (sim/engine.py) on one core: scheduler steps and KV events per second
for a busy engine under a closed-loop multi-turn chat workload, in token mode and trace mode.

    .venv/bin/python -m loadtest.bench_engine [--conversations 64] [--steps 3000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass

from sim.cache import StoragePool
from sim.engine import EngineCore, EngineProfile, SimRequest


@dataclass
class BenchResult:
    steps: int
    wall_s: float
    events: int
    finished: int
    generated_tokens: int
    virtual_s: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s


def run_once(
    mode: str,
    conversations: int,
    steps: int,
    emit_events: bool,
    block_size: int = 16,
    system_tokens: int = 1000,
    first_user_tokens: int = 2000,
    turn_user_tokens: int = 500,
    answer_tokens: int = 100,
    turns: int = 8,
) -> BenchResult:
    """Closed loop: each conversation sends its next turn (whole history resent) as soon as the
    previous one finishes; after ``turns`` turns it starts over as a new conversation."""
    profile = EngineProfile(
        block_size=block_size,
        num_cpu_blocks=2 * 27852,
        emit_events=emit_events,
    )
    storage = StoragePool("bench-fs", capacity_blocks=10 * 27852)
    engine = EngineCore("bench", profile, storage=storage, seed=1)
    system = list(range(10, 10 + system_tokens))
    history: dict[int, list[int]] = {}
    turn_of: dict[int, int] = {}
    generation: dict[int, int] = {}
    next_id = [0]

    def new_user_text(conv: int, turn: int, n: int) -> list[int]:
        base = 100_000 + (generation[conv] * 10_007 + conv * 1009 + turn * 101) * 4096
        return list(range(base, base + n))

    def submit(conv: int) -> None:
        turn = turn_of[conv]
        n_user = first_user_tokens if turn == 0 else turn_user_tokens
        prompt = history[conv] + new_user_text(conv, turn, n_user)
        history[conv] = prompt
        rid = f"c{conv}-g{generation[conv]}-t{turn}-{next_id[0]}"
        next_id[0] += 1
        if mode == "trace":
            n_full = len(prompt) // block_size
            # One id per block of the prompt (prefix-unique ids, as in Mooncake traces).
            ids = [prompt[i * block_size] * 31 + prompt[(i + 1) * block_size - 1] for i in range(n_full)]
            req = SimRequest(rid, [], answer_tokens, block_ids=ids, prompt_len=n_full * block_size)
            engine.add_request(req)
        else:
            engine.add_request(SimRequest(rid, prompt, answer_tokens))
        owner[rid] = conv

    owner: dict[str, int] = {}
    for conv in range(conversations):
        history[conv] = list(system)
        turn_of[conv] = 0
        generation[conv] = 0
        submit(conv)

    n_events = n_finished = n_tokens = 0
    virtual_s = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        out = engine.step()
        virtual_s += out.duration_s
        n_events += len(out.events)
        n_tokens += len(out.new_token_ids)
        for fin in out.finished:
            n_finished += 1
            conv = owner.pop(fin.request_id)
            history[conv] = history[conv] + fin.output_token_ids
            turn_of[conv] += 1
            if turn_of[conv] >= turns:
                turn_of[conv] = 0
                generation[conv] += 1
                history[conv] = list(system)
            submit(conv)
    wall_s = time.perf_counter() - start
    return BenchResult(steps, wall_s, n_events, n_finished, n_tokens, virtual_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{args.conversations} concurrent conversations, {args.steps} steps per run, {args.repeats} runs")
    print(
        f"{'mode':<8}{'events':<8}{'steps/s (min-max)':<26}{'events/s':<12}{'gen tok/s':<12}"
        f"{'turns done':<12}{'virtual s':<10}"
    )
    for mode in ("token", "trace"):
        for emit in (True, False):
            runs = [run_once(mode, args.conversations, args.steps, emit) for _ in range(args.repeats)]
            sps = [r.steps_per_s for r in runs]
            eps = statistics.median(r.events_per_s for r in runs)
            tps = statistics.median(r.generated_tokens / r.wall_s for r in runs)
            print(
                f"{mode:<8}{'on' if emit else 'off':<8}"
                f"{statistics.median(sps):>8.0f} ({min(sps):.0f}-{max(sps):.0f}){'':<8}"
                f"{eps:<12.0f}{tps:<12.0f}{runs[0].finished:<12}{runs[0].virtual_s:<10.1f}"
            )


if __name__ == "__main__":
    main()
