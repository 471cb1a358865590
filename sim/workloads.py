"""Workloads for the offline simulator and the live fleet: synthetic multi-turn conversations (the B1
"ladder"), readers for Mooncake and agentic-session traces, the ideal (infinite shared cache) hit
rate. (The recorder of the router's own traffic is kvcore.trace.TraceRecorder.)

Every workload is a list of Conversations; each Turn carries its prompt as a chain of block ids
(fast, for sim/des.py) and, for synthetic conversations, the chat messages / token ids the live
fleet sends (built with kvcore/sim_tokenizer.py so token counts are exact).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcore.sim_tokenizer import CHARS_PER_TOKEN, encode_chat, filler_text

#: Block ids of a shared prefix live below this; per-conversation / per-session ids above it.
#: Ids stay below 2**63 so they pack as int64 token ids in trace-mode KV events.
_NAMESPACE_STRIDE = 1 << 32


@dataclass(slots=True)
class Turn:
    """One request of a conversation."""

    prompt_tokens: int
    output_tokens: int
    #: One id per FULL block (``Workload.block_size`` tokens) of the prompt; equal ids <=> equal
    #: prefix content up to and including that block.
    block_ids: list[int]
    #: Closed loop: delay after the previous turn's answer finished before this turn is sent.
    think_time_s: float = 0.0
    #: Open loop (traces): arrival offset from the conversation's start; None = closed loop.
    at_s: float | None = None


@dataclass(slots=True)
class Conversation:
    """A sequence of turns sharing a session key (the router's sticky key)."""

    conversation_id: str
    turns: list[Turn]
    #: Open-loop start time (seconds from workload start); closed-loop workloads ignore it.
    start_s: float = 0.0
    #: Builds the chat messages of turn k (synthetic workloads only; None for traces).
    messages_fn: Callable[[int, Sequence[str] | None], list[dict[str, str]]] | None = field(
        default=None, repr=False
    )

    def messages(self, turn: int, answers: Sequence[str] | None = None) -> list[dict[str, str]]:
        """Chat messages of ``turn`` (history resent). ``answers`` = the real previous answers
        (live fleet); None uses the workload's assumed answers (exact token counts)."""
        if self.messages_fn is None:
            raise ValueError(f"conversation {self.conversation_id} comes from a trace: it has no text")
        return self.messages_fn(turn, answers)

    def prompt_token_ids(self, turn: int, answers: Sequence[str] | None = None) -> list[int]:
        """Token ids of ``turn``'s prompt through the simulator's chat template."""
        return encode_chat(self.messages(turn, answers), add_generation_prompt=True)


@dataclass(slots=True)
class Workload:
    """What the simulator (or a live load generator) replays."""

    name: str
    #: Tokens per block id in ``Turn.block_ids``.
    block_size: int
    conversations: list[Conversation]
    #: Closed loop: conversations active at a time (a finished one is replaced by the next in the
    #: list). None = open loop: every conversation starts at its ``start_s``.
    concurrency: int | None = None
    #: Closed loop only: stop starting new conversations after this many seconds (None = run all).
    duration_s: float | None = None
    #: Closed loop only: the first ``concurrency`` conversations start spread over this window.
    ramp_s: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def chains_in_nominal_order(self) -> list[list[int]]:
        """Block-id chains ordered by nominal arrival (open loop: by time; closed loop: turn by
        turn within each conversation, conversations in order)."""
        if self.concurrency is None:
            timed: list[tuple[float, int, int, list[int]]] = []
            for ci, conv in enumerate(self.conversations):
                t = conv.start_s
                for ti, turn in enumerate(conv.turns):
                    t = conv.start_s + turn.at_s if turn.at_s is not None else t + turn.think_time_s
                    timed.append((t, ci, ti, turn.block_ids))
            timed.sort(key=lambda x: (x[0], x[1], x[2]))
            return [x[3] for x in timed]
        return [turn.block_ids for conv in self.conversations for turn in conv.turns]


# --------------------------------------------------------------------------------------------
# Ideal hit rate


def ideal_hit_blocks(chains: Iterable[Sequence[Any]]) -> tuple[int, int]:
    """(hit blocks, total blocks) of one infinite shared cache fed in order: each request hits the
    contiguous prefix of its ids already seen (ids are prefix ids: an id implies its prefix)."""
    seen: set[Any] = set()
    hit = total = 0
    for ids in chains:
        n = 0
        for block_id in ids:
            if block_id not in seen:
                break
            n += 1
        hit += n
        total += len(ids)
        seen.update(ids)
    return hit, total


def ideal_hit_rate(chains: Iterable[Sequence[Any]]) -> float:
    """Fraction of blocks an infinite shared cache would serve (0.0 for an empty workload)."""
    hit, total = ideal_hit_blocks(chains)
    return hit / total if total else 0.0


# --------------------------------------------------------------------------------------------
# Synthetic multi-turn conversations (B1 ladder)


@dataclass(slots=True)
class LadderConfig:
    """Shape of the B1 ladder (token counts in the simulator tokenizer's tokens)."""

    #: Tokens of the first prompt, shared system prefix included.
    first_prompt_tokens: int = 12_000
    #: Tokens of the shared prefix (BOS + system message); identical in every conversation.
    system_prefix_tokens: int = 1_000
    #: Prompt growth per turn: the previous answer + the new user text (+ 4 template tokens).
    tokens_per_turn: int = 4_000
    turns: int = 8
    answer_min_tokens: int = 200
    answer_max_tokens: int = 500
    #: Mean of the exponential think time between an answer and the next turn.
    think_time_mean_s: float = 10.0
    #: Conversations active at a time (closed loop).
    concurrency: int = 16
    #: Total conversations to run (finished ones are replaced until this many have started).
    total_conversations: int | None = None
    #: Alternatively stop starting new conversations after this many seconds.
    duration_s: float | None = None
    #: Tokens per block id (use the engines' block size).
    block_size: int = 16
    seed: int = 0

    def validate(self) -> None:
        template_tokens = 4  # END + USER before the user text, END + ASSISTANT after it
        if self.system_prefix_tokens < 3:
            raise ValueError("system_prefix_tokens must be >= 3 (BOS, role and END tokens)")
        if self.first_prompt_tokens < self.system_prefix_tokens + 4:
            raise ValueError("first_prompt_tokens must exceed system_prefix_tokens by >= 4 tokens")
        if self.tokens_per_turn < self.answer_max_tokens + template_tokens + 1:
            raise ValueError(
                f"tokens_per_turn ({self.tokens_per_turn}) must exceed answer_max_tokens "
                f"({self.answer_max_tokens}) + {template_tokens + 1}: it includes the previous answer"
            )
        if not 1 <= self.answer_min_tokens <= self.answer_max_tokens:
            raise ValueError("need 1 <= answer_min_tokens <= answer_max_tokens")
        if self.turns < 1 or self.concurrency < 1 or self.block_size < 1:
            raise ValueError("turns, concurrency and block_size must be >= 1")
        if self.think_time_mean_s < 0:
            raise ValueError("think_time_mean_s must be >= 0")

    def mean_prompt_tokens(self) -> float:
        """Mean prompt length over a conversation's turns (its average working set)."""
        return self.first_prompt_tokens + self.tokens_per_turn * (self.turns - 1) / 2


def _exact_text(num_tokens: int, tag: str, seed: int) -> str:
    """ASCII text of exactly ``num_tokens`` simulator tokens that starts with ``tag`` (so texts of
    different conversations/turns never share a block's content)."""
    n_chars = num_tokens * CHARS_PER_TOKEN
    text = tag + filler_text(num_tokens + len(tag), seed)
    return text[:n_chars]


@dataclass(frozen=True, slots=True)
class _LadderText:
    """The chat messages of one ladder conversation (a picklable callable: runs may go to worker
    processes)."""

    cfg: LadderConfig
    index: int
    conv_id: str
    answers: list[int]

    def user_tokens(self, k: int) -> int:
        cfg = self.cfg
        if k == 0:
            return cfg.first_prompt_tokens - cfg.system_prefix_tokens - 3
        return cfg.tokens_per_turn - self.answers[k - 1] - 4

    def __call__(self, turn: int, real_answers: Sequence[str] | None = None) -> list[dict[str, str]]:
        cfg = self.cfg
        if not 0 <= turn < cfg.turns:
            raise ValueError(f"turn must be in [0, {cfg.turns}), got {turn}")
        system_text = _exact_text(cfg.system_prefix_tokens - 3, "", seed=cfg.seed)
        msgs = [{"role": "system", "content": system_text}]
        for k in range(turn + 1):
            if k > 0:
                if real_answers is not None and len(real_answers) >= k:
                    answer = real_answers[k - 1]
                else:
                    answer = filler_text(self.answers[k - 1], seed=self.index * 31 + k)
                msgs.append({"role": "assistant", "content": answer})
            tag = f"[{self.conv_id} turn {k}] "
            msgs.append(
                {"role": "user", "content": _exact_text(self.user_tokens(k), tag, seed=self.index + k)}
            )
        return msgs


def _ladder_conversation(cfg: LadderConfig, index: int) -> Conversation:
    rng = random.Random(f"ladder:{cfg.seed}:{index}")
    answers = [rng.randint(cfg.answer_min_tokens, cfg.answer_max_tokens) for _ in range(cfg.turns)]
    thinks = [0.0] + [
        rng.expovariate(1.0 / cfg.think_time_mean_s) if cfg.think_time_mean_s > 0 else 0.0
        for _ in range(cfg.turns - 1)
    ]
    conv_id = f"ladder-{cfg.seed}-{index}"
    bs = cfg.block_size
    shared_blocks = cfg.system_prefix_tokens // bs
    next_id = (index + 1) * _NAMESPACE_STRIDE
    ids: list[int] = list(range(shared_blocks))
    turns: list[Turn] = []
    prompt = cfg.first_prompt_tokens
    for k in range(cfg.turns):
        if k > 0:
            prompt += cfg.tokens_per_turn
        full = prompt // bs
        while len(ids) < full:
            ids.append(next_id)
            next_id += 1
        turns.append(Turn(prompt, answers[k], list(ids), think_time_s=thinks[k]))

    return Conversation(conv_id, turns, 0.0, _LadderText(cfg, index, conv_id, answers))


def ladder_conversations(cfg: LadderConfig) -> Iterator[Conversation]:
    """Endless deterministic stream of ladder conversations (conversation i depends on seed and i)."""
    cfg.validate()
    i = 0
    while True:
        yield _ladder_conversation(cfg, i)
        i += 1


def ladder_workload(cfg: LadderConfig) -> Workload:
    """The B1 closed-loop workload: ``concurrency`` conversations at a time, ``total_conversations``
    in all (default 2x concurrency), or as many as start within ``duration_s``."""
    cfg.validate()
    total = cfg.total_conversations
    if total is None:
        if cfg.duration_s is not None:
            # Upper bound on what can start in duration_s: a conversation lasts at least its think
            # times, turns x the mean on average; allow each slot twice as many starts as that
            # average, plus one (conversation i depends only on the seed and i: a longer list
            # only adds conversations that never start when the bound is not reached).
            per_slot = max(1, math.ceil(2 * cfg.duration_s / max(cfg.think_time_mean_s * cfg.turns, 1.0)))
            total = cfg.concurrency * (per_slot + 1)
        else:
            total = 2 * cfg.concurrency
    stream = ladder_conversations(cfg)
    convs = [next(stream) for _ in range(total)]
    return Workload(
        name=f"ladder-c{cfg.concurrency}",
        block_size=cfg.block_size,
        conversations=convs,
        concurrency=cfg.concurrency,
        duration_s=cfg.duration_s,
        ramp_s=cfg.think_time_mean_s,
    )


# --------------------------------------------------------------------------------------------
# Mooncake traces


@dataclass(slots=True)
class MooncakeRecord:
    """One line of a Mooncake-format trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    #: Prefix ids of ``block_size``-token blocks, ceil(input_length / block_size) of them (the last
    #: one may cover a partial block).
    hash_ids: list[int]


#: The public traces the repository carries (data/README.md): the readers' defaults.
DATA_TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
MOONCAKE_CONVERSATION_TRACE = DATA_TRACES / "mooncake" / "conversation_trace.jsonl"
AGENTIC_SESSIONS_DIR = DATA_TRACES / "agentic-sessions"
#: Short names ``kvroute sim --trace`` accepts for them.
NAMED_TRACES: dict[str, Path] = {
    "mooncake": MOONCAKE_CONVERSATION_TRACE,
    "mooncake-synthetic": DATA_TRACES / "mooncake" / "synthetic_trace.jsonl",
    "agentic": AGENTIC_SESSIONS_DIR,
}


def read_mooncake_records(
    path: str | Path = MOONCAKE_CONVERSATION_TRACE, *, limit: int | None = None
) -> list[MooncakeRecord]:
    """Parse a Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids); by
    default the Mooncake conversation trace in data/traces."""
    records: list[MooncakeRecord] = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rec = MooncakeRecord(
                    float(obj["timestamp"]),
                    int(obj["input_length"]),
                    int(obj["output_length"]),
                    [int(x) for x in obj["hash_ids"]],
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(
                    f"{path}:{line_no}: not a Mooncake trace line (need timestamp, input_length, "
                    f"output_length, hash_ids): {exc}"
                ) from None
            records.append(rec)
            if limit is not None and len(records) >= limit:
                break
    return records


def mooncake_workload(
    records: Sequence[MooncakeRecord], *, speed: float = 1.0, block_size: int = 512, name: str = "mooncake"
) -> Workload:
    """Open-loop workload: each record is a one-turn conversation arriving at timestamp / speed.
    Only full blocks become block ids (engines cache full blocks only)."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    convs = []
    for i, rec in enumerate(records):
        full = min(len(rec.hash_ids), rec.input_length // block_size)
        turn = Turn(max(rec.input_length, 1), max(rec.output_length, 1), rec.hash_ids[:full], at_s=0.0)
        convs.append(Conversation(f"mc-{i}", [turn], start_s=rec.timestamp_ms / 1000.0 / speed))
    return Workload(name=name, block_size=block_size, conversations=convs, concurrency=None)


# --------------------------------------------------------------------------------------------
# Agentic-session traces


@dataclass(slots=True)
class AgenticSession:
    """One session file: its requests flattened (subagents become their own request lists)."""

    session_id: str
    block_size: int
    shared_prefix_blocks: int
    #: (agent id, start offset s, requests) - the main agent first, then subagents.
    agents: list[tuple[str, float, list[dict[str, Any]]]]

    def chains(self) -> list[list[int]]:
        """Raw hash-id chains in time order (ids comparable within this session only)."""
        timed = [
            (start + float(r.get("t", 0.0)), r["hash_ids"]) for _, start, reqs in self.agents for r in reqs
        ]
        timed.sort(key=lambda x: x[0])
        return [ids for _, ids in timed]


def _flatten_agent_requests(
    reqs: Sequence[dict[str, Any]],
    agent: str,
    start_s: float,
    out: list[tuple[str, float, list[dict[str, Any]]]],
) -> None:
    own: list[dict[str, Any]] = []
    out.append((agent, start_s, own))
    for r in reqs:
        if r.get("type") == "subagent":
            sub_id = f"{agent}/{r.get('agent_id', len(out))}"
            _flatten_agent_requests(r.get("requests", []), sub_id, start_s + float(r.get("t", 0.0)), out)
        elif "hash_ids" in r:
            own.append(r)


def read_agentic_session(path: str | Path) -> AgenticSession:
    """Parse one agentic-session JSON file."""
    with open(path, encoding="utf-8") as fh:
        obj = json.load(fh)
    try:
        block_size = int(obj["block_size"])
        shared = (int(obj.get("system_tokens", 0)) + int(obj.get("tool_tokens", 0))) // block_size
        agents: list[tuple[str, float, list[dict[str, Any]]]] = []
        _flatten_agent_requests(obj["requests"], "main", 0.0, agents)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not an agentic-session trace (need block_size, requests): {exc}") from None
    return AgenticSession(str(obj.get("id", Path(path).stem)), block_size, shared, agents)


def read_agentic_sessions(
    path: str | Path = AGENTIC_SESSIONS_DIR, *, limit: int | None = None
) -> list[AgenticSession]:
    """All session files of a directory (sorted by name), or one file; by default the 48 sessions
    in data/traces/agentic-sessions."""
    p = Path(path)
    files = sorted(p.glob("*.json")) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"{path}: no *.json session files found")
    return [read_agentic_session(f) for f in files[:limit]]


def agentic_within_session_ideal(sessions: Sequence[AgenticSession]) -> float:
    """Ideal hit rate with one infinite cache per session (ids never shared across sessions)."""
    hit = total = 0
    for s in sessions:
        h, t = ideal_hit_blocks(s.chains())
        hit += h
        total += t
    return hit / total if total else 0.0


def agentic_workload(
    sessions: Sequence[AgenticSession],
    *,
    stagger_s: float = 30.0,
    speed: float = 1.0,
    share_prefix: bool = True,
    closed_loop: bool = True,
) -> Workload:
    """Merge sessions into one fleet workload: session i starts at i * stagger_s (/ speed).

    Ids are namespaced per session; with ``share_prefix`` each session's first
    (system_tokens + tool_tokens) / block_size blocks map onto one common prefix. ``closed_loop``
    sends each call think_time after the previous answer (agents wait for answers); otherwise at
    the recorded offsets ``t``.
    """
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    if not sessions:
        raise ValueError("no sessions given")
    block_size = sessions[0].block_size
    convs: list[Conversation] = []
    for si, s in enumerate(sessions):
        if s.block_size != block_size:
            raise ValueError(f"session {s.session_id}: block_size {s.block_size} != {block_size}")
        base = (si + 1) * _NAMESPACE_STRIDE
        for agent, agent_start, reqs in s.agents:
            if not reqs:
                continue
            turns: list[Turn] = []
            prev_t = float(reqs[0].get("t", 0.0))
            for r in reqs:
                ids = [
                    j if share_prefix and j < s.shared_prefix_blocks else base + int(h)
                    for j, h in enumerate(r["hash_ids"])
                ]
                t = float(r.get("t", 0.0))
                think = float(r.get("think_time", max(0.0, t - prev_t)) or 0.0)
                turns.append(
                    Turn(
                        max(int(r["in"]), 1),
                        max(int(r.get("out", 1)), 1),
                        ids,
                        think_time_s=0.0 if not turns else think / speed,
                        at_s=None if closed_loop else (t - float(reqs[0].get("t", 0.0))) / speed,
                    )
                )
                prev_t = t
            start = (si * stagger_s + agent_start + float(reqs[0].get("t", 0.0))) / speed
            convs.append(Conversation(f"{s.session_id}:{agent}", turns, start_s=start))
    convs.sort(key=lambda c: c.start_s)
    # Closed-loop turns inside open-loop starts: concurrency None, the DES chains turns itself.
    return Workload(name="agentic", block_size=block_size, conversations=convs, concurrency=None)
