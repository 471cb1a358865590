"""The engine simulator against real vLLM, request by request: the same prompts, one at a time, into
a real vLLM engine with a CPU offload tier (its own offloading manager, sim/vllm_host_offload.py's
host-copy worker) and into ``sim.engine.EngineCore`` with the same pools. Each request's cached
tokens by tier must be the same on both: what the GPU prefix cache and the CPU tier hold after every
request (their eviction orders, which writes the CPU tier admits, what a GPU hit writes back) is
then vLLM's. Everything the DES says about hit rates rests on this.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from loadtest.bench_quality_live import EventCounter, cached_by_tier_delta, scrape_engines
from sim.cache import StoragePool
from sim.engine import EngineCore, EngineProfile, SimRequest
from sim.fleet import FleetEngine
from sim.vllm_cpu import VllmCpuFleet, VllmCpuProfile
from sim.vllm_model import MODEL_NAME, VOCAB_SIZE
from tests.vllm.conftest import metric_total, scheduled_ahead_of_other_sessions, until

BLOCK = 32
#: vLLM's pool, its null block included (64 usable blocks, one 2,048-token request).
GPU_BLOCKS = 65
CPU_BLOCKS = 40
MAX_MODEL_LEN = 2048
#: The test model's KV bytes a token (sim/vllm_model.py: K and V x 2 layers x 2 heads x 64 x
#: bfloat16): what a transfer moves, so that the simulated reads and loads take as long, in steps,
#: as vLLM's do on this model (well within a step).
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2


def _workload(seed: int, n: int) -> list[list[int]]:
    """``n`` prompts of token ids: six conversations whose prompts grow turn by turn, in a random
    order. Their lengths (6-63 blocks, partial tails) make the GPU pool evict, the CPU tier evict,
    and some CPU writes larger than the tier."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, VOCAB_SIZE) for _ in range(MAX_MODEL_LEN)] for _ in range(6)]
    start = [rng.randrange(6, 30) * BLOCK for _ in docs]
    grow = [rng.randrange(3, 9) * BLOCK for _ in docs]
    turns = [0] * len(docs)
    prompts = []
    for _ in range(n):
        c = rng.randrange(len(docs))
        length = min(start[c] + turns[c] * grow[c], 63 * BLOCK) + rng.randrange(0, BLOCK)
        turns[c] += 1
        prompts.append(docs[c][:length])
    return prompts


def _sim_engine(
    budget: int, *, policy: str = "fcfs", cpu_blocks: int = 0, storage: StoragePool | None = None
) -> EngineCore:
    """A simulated engine with this file's GPU pool (and ``cpu_blocks``, ``storage`` behind it), a
    ``budget``-token step."""
    return EngineCore(
        "sim",
        EngineProfile(
            block_size=BLOCK,
            num_gpu_blocks=GPU_BLOCKS - 1,  # vLLM's override counts its null block
            num_cpu_blocks=cpu_blocks,
            max_num_batched_tokens=budget,
            max_model_len=MAX_MODEL_LEN,
            scheduling_policy=policy,
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        ),
        storage=storage,
    )


def _simulated(
    prompts: list[list[int]],
    cpu_blocks: int = CPU_BLOCKS,
    storage: StoragePool | None = None,
    tiers: int = 2,
) -> list[tuple[int, ...]]:
    """Each prompt's cached tokens by tier on the simulated engine, as ``_live`` reads them."""
    engine = _sim_engine(MAX_MODEL_LEN, cpu_blocks=cpu_blocks, storage=storage)
    out = []
    for i, prompt in enumerate(prompts):
        engine.add_request(SimRequest(f"r{i}", prompt, max_tokens=1))
        done = []
        while engine.has_unfinished():
            done += engine.step().finished
        (finished,) = done
        out.append(finished.cached_tokens_by_tier[:tiers])
    return out


def _live(engine: FleetEngine, prompts: list[list[int]], tiers: int = 2) -> list[tuple[int, ...]]:
    """Each prompt's cached tokens by tier on the engine: (GPU, CPU), or with ``tiers`` 3 (GPU, CPU,
    STORAGE)."""
    out = []
    before = scrape_engines([engine]).cached_by_tier
    for prompt in prompts:
        answer = httpx.post(
            f"{engine.url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1},
            timeout=120,
        )
        answer.raise_for_status()
        cached = (answer.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        # The counters by source may trail the answer: wait until they hold this request's hits.
        deadline = time.monotonic() + 30
        while True:
            after = scrape_engines([engine]).cached_by_tier
            delta = cached_by_tier_delta(before, after)
            if sum(delta.values()) >= cached or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert sum(delta.values()) == cached, (delta, cached)
        out.append((int(delta["GPU"]), int(delta["CPU"]), int(delta["STORAGE"]))[:tiers])
        before = after
    return out


def _on_vllm(
    model_dir: Path, workdir: Path, prompts: list[list[int]], cpu_blocks: int, storage_dir: Path | None = None
) -> list[tuple[int, ...]]:
    """``_live`` on one real engine of this file's pools (``cpu_blocks`` CPU tier, vLLM's fs tier
    on ``storage_dir`` behind it when given: then by tier GPU, CPU, STORAGE), started and stopped."""
    folder = "" if storage_dir is None else str(storage_dir)
    with _one_engine(workdir, model_dir, MAX_MODEL_LEN, cpu_blocks=cpu_blocks, storage_dir=folder) as engine:
        return _live(engine, prompts, tiers=2 if storage_dir is None else 3)


@contextlib.contextmanager
def _one_engine(
    workdir: Path, model_dir: Path, budget: int, *extra: str, **profile: Any
) -> Iterator[FleetEngine]:
    """One real engine of this file's pools (a ``budget``-token step, eager mode, ``profile``'s
    other VllmCpuProfile fields, ``extra`` arguments), stopped after."""
    fleet = VllmCpuFleet(workdir, model_dir=model_dir)
    try:
        (engine,) = fleet.start(
            1,
            VllmCpuProfile(
                gpu_blocks=GPU_BLOCKS,
                max_model_len=MAX_MODEL_LEN,
                enforce_eager=True,
                startup_timeout_s=900,
                extra_args=("--max-num-batched-tokens", str(budget), *extra),
                **profile,
            ),
        )
        yield engine
    finally:
        fleet.stop()


def _rows(prompts: list[list[int]], live: list[tuple[int, ...]], simulated: list[tuple[int, ...]]) -> str:
    """One line per request, the differing ones marked: the assertion's message."""
    return "\n".join(
        f"{i:3d} prompt {len(p):5d}  vllm {lv}  sim {sm}{'' if lv == sm else '  <-'}"
        for i, (p, lv, sm) in enumerate(zip(prompts, live, simulated, strict=True))
    )


def test_the_simulated_engine_caches_and_offloads_request_by_request_as_real_vllm(
    model_dir: Path, tmp_path: Path
) -> None:
    """Catches any difference in what the two engines hold after a request: the GPU pool's
    eviction order, the CPU tier's (vLLM ranks a request's blocks when it finishes, head last, and
    not when it loads them), a CPU write vLLM refuses (larger than the tier) or makes (a GPU hit's
    blocks the tier had lost), the hit cap on a fully cached prompt. Each of the first four,
    undone in the simulator, fails it (15-19 of the 150 requests differ; a second workload, seed
    2027, agreed on all 150 too)."""
    prompts = _workload(2026, 150)
    simulated = _simulated(prompts)
    live = _on_vllm(model_dir, tmp_path / "parity", prompts, CPU_BLOCKS)
    rows = _rows(prompts, live, simulated)
    # The workload does what it is for: GPU hits, CPU hits, and turns that found less than before.
    assert any(g for g, _c in live) and any(c for _g, c in live), rows
    assert live == simulated, rows


#: The CPU tier in front of the fs tier: it must hold the largest prompt (63 blocks), since every
#: STORAGE hit is promoted through it (with 40 blocks vLLM's lookup never settles and the engine
#: waits forever; the simulator loads what the tier holds: test_sim_engine.py).
STORAGE_CPU_BLOCKS = 80


def test_the_simulated_engine_promotes_storage_hits_through_the_cpu_tier_as_real_vllm(
    model_dir: Path, tmp_path: Path
) -> None:
    """The same 150 prompts with vLLM's ``fs`` tier behind an 80-block CPU tier (its tiering
    manager), against the simulator with an unbounded STORAGE pool: every request's cached tokens
    by tier (GPU, CPU, STORAGE) must be the same. Catches the promotion rules: vLLM promotes a
    STORAGE hit into the CPU tier one block at a time, evicting the least recently used block not
    in flight (a CPU hit of the same request too, which a later pass promotes again), labels every
    promoted block STORAGE for the request, and serves a whole prompt from the offload tiers (the
    last token recomputed). The previous model (each block at the first tier holding it, promoted
    blocks written as one batch, the offload hit capped one block short) differed on 31 requests
    (CPU 20,000 tokens against vLLM's 3,552) and on 4 totals."""
    prompts = _workload(2026, 150)
    simulated = _simulated(prompts, STORAGE_CPU_BLOCKS, StoragePool("fs", 10**7), tiers=3)
    live = _on_vllm(model_dir, tmp_path / "parity-storage", prompts, STORAGE_CPU_BLOCKS, tmp_path / "pool")
    rows = _rows(prompts, live, simulated)
    # The workload reaches every tier (vLLM: 41,248 GPU, 3,552 CPU, 206,944 STORAGE tokens).
    assert all(any(r[k] for r in live) for k in range(3)), rows
    assert live == simulated, rows


# ----------------------------------------------------------------------- requests in flight together

#: The concurrent check's step budget: long prompts are prefilled in chunks over several steps while
#: others wait for the budget or for blocks, hit blocks scheduled in the same step, and are preempted.
WAVE_BUDGET = 512
#: The concurrent check's cases: (scheduling policy, CPU tier blocks, requests a wave, seeds).
#: Without a CPU tier; with one twice the GPU pool, where 2-8 requests of a 16-request wave load a
#: prefix the GPU pool lost, some while others' loads are in flight; with this file's 40-block
#: tier, whose evictions under concurrency turn on the order in which it ranks blocks.
WAVE_CASES = [
    ("fcfs", 0, 8, (3, 4, 5)),
    ("priority", 0, 8, (3, 4, 5)),
    ("fcfs", 128, 16, (3, 4, 5)),
    ("priority", 128, 16, (3, 4, 5)),
    ("fcfs", CPU_BLOCKS, 8, (3, 4, 5, 6)),
    ("priority", CPU_BLOCKS, 8, (3, 4, 5, 6, 7, 8)),
]
#: One wave: (priority, max_tokens, prompt) per request, in the order they are sent.
Wave = list[tuple[int, int, list[int]]]
#: vLLM's side of every wave, labelled (``_labelled``), by "policy-cpu_blocks/seed": replayed in
#: ``make test`` by tests/test_sim_recorded_waves.py. Rewritten by this file's in-flight test when
#: RECORD_ENV is 1 (data/fixtures/vllm-waves/README.md).
RECORDED_WAVES = Path(__file__).resolve().parents[2] / "data" / "fixtures" / "vllm-waves" / "waves.json.gz"
RECORD_ENV = "KVROUTE_RECORD_WAVES"


def wave_key(policy: str, cpu_blocks: int, n: int, seed: int) -> str:
    return f"{policy}-{cpu_blocks}x{n}/{seed}"


def _record(path: Path, key: str, recorded: Any) -> None:
    """vLLM's side of one wave (or wave pair) into the recording at ``path``, under ``key``."""
    data: dict[str, Any] = {"waves": {}}
    if path.exists():
        data = json.loads(gzip.decompress(path.read_bytes()))
    data["waves"][key] = recorded
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(data, sort_keys=True).encode(), mtime=0))


def _wave(seed: int, n: int = 8) -> Wave:
    """``n`` requests: prefixes of four documents (8-29 blocks and a partial block), so some share
    a prefix with requests before them, with priorities 0-2 (an fcfs engine ignores them) and
    40-199 output tokens."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, VOCAB_SIZE) for _ in range(MAX_MODEL_LEN)] for _ in range(4)]
    return [
        (
            rng.randrange(3),
            rng.randrange(40, 200),
            rng.choice(docs)[: rng.randrange(8, 30) * BLOCK + rng.randrange(0, BLOCK)],
        )
        for _ in range(n)
    ]


def _block_name(
    tokens: list[int], index: int, parent: tuple[Any, ...] | None, prompts: list[list[int]]
) -> tuple[Any, ...]:
    """A block by what it holds, the same on both engines (their hashes and generated tokens
    differ): ("prompt", k, i) for block i of prompt k (the first prompt holding it), ("output", k,
    i) for an output block of prompt k (its first holds the end of the prompt)."""
    start = index * BLOCK
    tokens = list(tokens)
    for k, prompt in enumerate(prompts):
        if prompt[start : start + BLOCK] == tokens:
            return ("prompt", k, index)
    for k, prompt in enumerate(prompts):
        if start < len(prompt) < start + BLOCK and tokens[: len(prompt) - start] == prompt[start:]:
            return ("output", k, index)
    assert parent is not None and parent[0] == "output", (index, parent)
    return ("output", parent[1], index)


def _labelled(steps: list[list[Any]], prompts: list[list[int]]) -> list[list[tuple[Any, ...]]]:
    """Each step's events, each block by ``_block_name``, a CPU tier's tagged with its medium. A
    step's CPU stores come last and sorted: vLLM's connector reports the blocks of a landed write
    from a set, in no order."""
    names: dict[Any, tuple[Any, ...]] = {}
    out = []
    for events in steps:
        row: list[tuple[Any, ...]] = []
        offloaded: list[tuple[Any, ...]] = []
        for event in events:
            # The simulator's are dicts, vLLM's decoded structs (kvcore.wire).
            fields = event if isinstance(event, dict) else msgspec.structs.asdict(event)
            kind = fields.get("type") or type(event).__name__
            medium = fields.get("medium") or "GPU"
            if medium != "GPU":
                tag = ("stored " if "Stored" in kind else "removed ") + medium
                named = [(tag, *names.get(h, ("unknown", h))) for h in fields["block_hashes"]]
                if "Stored" in kind:
                    offloaded += named
                else:
                    row += named
            elif "Stored" in kind:
                parent = fields["parent_block_hash"]
                name = None if parent is None else names[parent]
                index = -1 if name is None else name[2]
                tokens = fields["token_ids"]
                for i, h in enumerate(fields["block_hashes"]):
                    index += 1
                    name = names[h] = _block_name(tokens[i * BLOCK : (i + 1) * BLOCK], index, name, prompts)
                    row.append(("stored", *name))
            elif "Removed" in kind:
                row += [("removed", *names.get(h, ("unknown", h))) for h in fields["block_hashes"]]
            else:
                row.append(("cleared",))
        out.append(row + sorted(offloaded))
    return out


def _simulated_wave(
    wave: Wave, policy: str, cpu_blocks: int = 0
) -> tuple[list[list[dict[str, Any]]], list[int], int, int]:
    """The wave on a fresh simulated engine, every request queued before the first step: each
    step's events, each request's cached tokens, the preemptions, and the requests that loaded
    from the CPU tier."""
    engine = _sim_engine(WAVE_BUDGET, policy=policy, cpu_blocks=cpu_blocks)
    for r, (priority, max_tokens, prompt) in enumerate(wave):
        engine.add_request(SimRequest(str(r), prompt, max_tokens=max_tokens, priority=priority))
    steps, cached, loaded = [], [0] * len(wave), 0
    while engine.has_unfinished():
        out = engine.step()
        if out.events:
            steps.append(out.events)
        for finished in out.finished:
            cached[int(finished.request_id)] = sum(finished.cached_tokens_by_tier)
            loaded += finished.cached_tokens_by_tier[1] > 0
    return steps, cached, engine.stats().num_preemptions, loaded


def _added(engine: FleetEngine) -> int:
    """Requests the engine's API server has handed to its engine core (its log)."""
    return Path(engine.log_path).read_text(errors="replace").count("Added request ")


@contextlib.contextmanager
def _wave_engine(
    workdir: Path, model_dir: Path, policy: str, cpu_blocks: int, storage_dir: str = ""
) -> Iterator[tuple[FleetEngine, list[Any]]]:
    """One real engine for the waves (this file's pools, a WAVE_BUDGET step, ``policy``,
    ``cpu_blocks`` CPU tier and the fs tier on ``storage_dir`` when given; dev mode for /pause and
    /resume) and the list its KV event batches arrive in, once a warm-up request's have arrived (a
    SUB socket misses what is published before it has joined); stopped after."""
    profile = {"cpu_blocks": cpu_blocks, "storage_dir": storage_dir, "scheduling_policy": policy}
    with (
        _one_engine(
            workdir, model_dir, WAVE_BUDGET, "--enable-log-requests", dev_mode=True, **profile
        ) as engine,
        EventCounter([engine], keep_batches=True) as tap,
    ):
        batches = tap.batches
        assert batches is not None

        def warmed_up() -> bool:
            if not batches:
                body = {"model": MODEL_NAME, "prompt": [1] * BLOCK * 2, "max_tokens": 1}
                httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120).raise_for_status()
            return bool(batches)

        until(warmed_up, 60)
        assert batches, "no KV events from the engine"
        yield engine, batches


def _live_wave(
    engine: FleetEngine,
    batches: list[Any],
    wave: Wave,
    expected_steps: int | None,
    expected_preemptions: int = 0,
) -> tuple[list[list[Any]], list[int], int]:
    """The wave on the real engine: its scheduler paused (which also empties its prefix cache, so
    the wave starts as the simulator's fresh engine does), the requests sent one by one, each once
    vLLM has handed the one before to its engine core (--enable-log-requests logs each after the
    send: the arrival order is the wave's; a request of several prompts would give them one arrival
    time, which vLLM's priority scheduler breaks by the running order), then resumed (the resume
    reaches the core on the same socket, after them). Each step's events, each request's cached
    tokens and the preemptions, once every answer is in, ``expected_steps`` event batches and
    ``expected_preemptions`` have arrived (the simulator's figures; a shortfall shows in the
    comparison) and no batch has come for two seconds."""
    httpx.post(f"{engine.url}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
    first = len(batches)
    before = metric_total(engine.url, "vllm:num_preemptions_total")
    answers: list[Any] = [None] * len(wave)

    def post(r: int, body: dict[str, Any]) -> None:
        answers[r] = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=600)

    senders = []
    for r, (priority, max_tokens, prompt) in enumerate(wave):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        senders.append(threading.Thread(target=post, args=(r, {**body, "priority": priority})))
        added = _added(engine) + 1
        senders[-1].start()
        until(lambda: _added(engine) >= added, 60)  # noqa: B023 (called before ``added`` changes)
    httpx.post(f"{engine.url}/resume", timeout=60).raise_for_status()
    for sender in senders:
        sender.join()
    for answer in answers:
        answer.raise_for_status()

    def preempted() -> int:
        return int(metric_total(engine.url, "vllm:num_preemptions_total") - before)

    if expected_steps is not None:
        # The KV events trail the answers; on a loaded machine by a lot (a CI run beside a full
        # `make test` once compared a wave cut off four batches short after 30 s).
        until(lambda: len(batches) - first >= expected_steps, 120)
        until(lambda: preempted() >= expected_preemptions, 120)
    # Then until they stop: with the fs tier vLLM announces some STORAGE writes in batches of their
    # own, so the count can be reached while the wave's last batches are still on their way (a CI
    # run compared two cold passes cut one and two batches short).
    _until_quiet(batches)
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0 for a in answers]
    return _since_reset(batches, first), cached, preempted()


def _until_quiet(batches: list[Any]) -> None:
    """Until no event batch has come for two seconds (when the count to wait for is not known)."""

    def settled() -> bool:
        seen = len(batches)
        time.sleep(2.0)
        return len(batches) == seen

    until(settled, 60)


def _since_reset(batches: list[Any], first: int) -> list[list[Any]]:
    """The non-empty event batches from ``first`` on, starting after the pause's cache reset: it
    comes first, in the first step after the resume; a batch before it is the wave before's, late."""
    start = next(
        (
            i
            for i in range(first, len(batches))
            if batches[i].events and type(batches[i].events[0]).__name__.endswith("AllBlocksCleared")
        ),
        None,
    )
    assert start is not None, [list(b.events) for b in batches[first : first + 1]]
    steps = [list(batch.events) for batch in batches[start:]]
    steps[0] = steps[0][1:]
    return [s for s in steps if s]


def _compare(
    tmp_path: Path,
    name: str,
    wave: Wave,
    live: tuple[list[list[Any]], list[int], int],
    simulated: tuple[list[list[Any]], list[int], int, int],
    record_key: str,
) -> list[list[tuple[Any, ...]]]:
    prompts = [prompt for _priority, _max_tokens, prompt in wave]
    live_steps, sim_steps = _labelled(live[0], prompts), _labelled(simulated[0], prompts)
    if os.environ.get(RECORD_ENV) == "1":  # vLLM's side, whatever the simulator does
        _record(RECORDED_WAVES, record_key, live_steps)
    (tmp_path / f"{name}.json").write_text(json.dumps({"vllm": live_steps, "sim": sim_steps}))
    n = min(len(live_steps), len(sim_steps))
    diff = next((i for i in range(n) if live_steps[i] != sim_steps[i]), n)
    assert live_steps == sim_steps, (
        f"{name}: {len(live_steps)} steps with events on vLLM, {len(sim_steps)} simulated; "
        f"first difference at step {diff}:\n"
        f"vllm {live_steps[diff - 4 : diff + 2]}\nsim  {sim_steps[diff - 4 : diff + 2]}"
    )
    assert live[1:] == simulated[1:3], (name, "cached tokens, preemptions", live[1:], simulated[1:3])
    return live_steps


@pytest.mark.parametrize(
    ("policy", "cpu_blocks", "n", "seeds"),
    WAVE_CASES,
    ids=[
        "fcfs",
        "priority",
        "fcfs-cpu-tier",
        "priority-cpu-tier",
        "fcfs-small-cpu-tier",
        "priority-small-cpu-tier",
    ],
)
def test_the_simulated_engine_admits_caches_and_preempts_requests_in_flight_together_as_real_vllm(
    model_dir: Path, tmp_path: Path, policy: str, cpu_blocks: int, n: int, seeds: tuple[int, ...]
) -> None:
    """Waves of requests in flight together on one real engine (64 blocks, a 512-token budget;
    WAVE_CASES), each queued whole behind a paused scheduler and then released, against the
    simulator with every request queued before its first step. Every step's events (which block
    of which prompt is stored or evicted, in which tier, in order), each request's cached tokens
    and the preemptions must be the same (each wave's labelled events are left in tmp_path for a
    failure's diagnosis). Catches the admission rules
    under contention: the token budget and chunked prefill, the whole-sequence gate, a block
    cached when scheduled, the queue order, re-entry after preemption, the eviction order. Tried:
    the model before 2026-12-06 (blocks cached after the step) and admission on the first chunk
    each fail on the first fcfs wave. The victim when a request arrives while another decodes is
    the late-arrival check's (below).

    With a CPU tier it also catches the offloading connector's rules (docs/simulator.md): a write
    lands a step after it is made (its blocks not evictable, a lookup reaching them deferred), a
    scheduled request offers its unstored prompt blocks every step (its GPU hits too), a finished
    request is offered again and ranked the step after (the blocks it recorded, over all its
    admissions), a load's blocks are cached only when it lands (the request waits among the
    waiting, and a lookup reaching blocks being loaded is deferred), a load is admitted only into
    blocks the prefills in flight do not still need. The model before these rules first differed
    within 9-36 event batches of every 40-block wave. With RECORD_ENV=1 vLLM's side of every wave is
    written to RECORDED_WAVES (replayed in ``make test``)."""
    with _wave_engine(tmp_path / f"{policy}-{cpu_blocks}", model_dir, policy, cpu_blocks) as (
        engine,
        batches,
    ):
        preempted = loaded = evicted = 0
        for seed in seeds:
            wave = _wave(seed, n)
            simulated = _simulated_wave(wave, policy, cpu_blocks)
            live = _live_wave(engine, batches, wave, len(simulated[0]), simulated[2])
            key = wave_key(policy, cpu_blocks, n, seed)
            steps = _compare(tmp_path, f"wave-{seed}", wave, live, simulated, key)
            preempted += live[2]
            loaded += simulated[3]
            evicted += sum(1 for row in steps for event in row if event[0] == "removed CPU")
        # The waves do what they are for: requests hit each other's blocks and are preempted;
        # with the large CPU tier some requests load what the GPU pool lost (it never fills),
        # and the small one evicts.
        assert preempted >= 2 and any(live[1]), preempted
        assert loaded >= (3 if cpu_blocks > CPU_BLOCKS else 0), loaded
        assert evicted > 0 if cpu_blocks == CPU_BLOCKS else evicted == 0, evicted


# ------------------------------------------------------- requests in flight together, with STORAGE

#: The STORAGE check's cases: (scheduling policy, CPU tier blocks, requests a wave, seeds). vLLM's
#: ``fs`` tier behind the CPU tier (STORAGE_CPU_BLOCKS: every promotion passes through it).
STORAGE_WAVE_CASES = [
    ("fcfs", STORAGE_CPU_BLOCKS, 8, (3, 4, 5, 6, 7, 8)),
    ("priority", STORAGE_CPU_BLOCKS, 8, (3, 4, 5, 6, 7, 8)),
]
#: vLLM's side of every STORAGE wave pair (``storage_wave_key``): replayed in ``make test`` by
#: tests/test_sim_recorded_waves.py, rewritten by the STORAGE check when RECORD_ENV is 1.
RECORDED_STORAGE_WAVES = RECORDED_WAVES.with_name("storage-waves.json.gz")


def storage_wave_key(policy: str, cpu_blocks: int, n: int, seed: int) -> str:
    return f"fs-{policy}-{cpu_blocks}x{n}/{seed}"


#: One pass of a wave: each step's events, each request's cached tokens, the preemptions, and the
#: cached tokens by tier (GPU, CPU, STORAGE) summed over the wave.
Pass = tuple[list[list[Any]], list[int], int, list[int]]


def simulated_storage_passes(wave: Wave, policy: str, cpu_blocks: int) -> tuple[Pass, Pass]:
    """The wave twice on one simulated engine with an unbounded STORAGE pool behind its CPU tier:
    cold, then again after a reset of its GPU pool and CPU tier (vLLM's pause), so that the second
    pass finds its prefixes in STORAGE only."""
    engine = _sim_engine(WAVE_BUDGET, policy=policy, cpu_blocks=cpu_blocks, storage=StoragePool("fs", 10**7))
    cold = _simulated_pass(engine, wave)
    engine.reset_prefix_cache(reset_connector=True)
    return cold, _simulated_pass(engine, wave)


def _simulated_pass(engine: EngineCore, wave: Wave) -> Pass:
    before = engine.stats().num_preemptions
    tag = str(engine.stats().num_steps)  # request ids unique across passes
    for r, (priority, max_tokens, prompt) in enumerate(wave):
        engine.add_request(SimRequest(f"{tag}:{r}", prompt, max_tokens=max_tokens, priority=priority))
    steps, cached, tiers = [], [0] * len(wave), [0, 0, 0]
    while engine.has_unfinished():
        out = engine.step()
        events = [e for e in out.events if e["type"] != "AllBlocksCleared"]
        if events:
            steps.append(events)
        for finished in out.finished:
            cached[int(finished.request_id.split(":")[1])] = sum(finished.cached_tokens_by_tier)
            tiers = [t + c for t, c in zip(tiers, finished.cached_tokens_by_tier, strict=True)]
    return steps, cached, engine.stats().num_preemptions - before, tiers


def _live_pass(engine: FleetEngine, batches: list[Any], wave: Wave, simulated: Pass | None) -> Pass:
    """``_live_wave`` and the wave's cached tokens by tier (the engine's counters by source, once
    they hold every answer's hits); ``simulated`` None for a pass whose events are not compared."""
    before = scrape_engines([engine]).cached_by_tier
    expected = (None, 0) if simulated is None else (len(simulated[0]), simulated[2])
    steps, cached, preempted = _live_wave(engine, batches, wave, *expected)

    def tiers() -> list[int]:
        delta = cached_by_tier_delta(before, scrape_engines([engine]).cached_by_tier)
        return [int(delta["GPU"]), int(delta["CPU"]), int(delta["STORAGE"])]

    until(lambda: sum(tiers()) >= sum(cached), 30)
    return steps, cached, preempted, tiers()


def storage_wave_compared(
    prompts: list[list[int]], cold: tuple[list[list[Any]], list[int], int, list[int]], warm_cached: list[int]
) -> dict[str, Any]:
    """What the STORAGE check compares of a wave pair, given the cold pass's labelled events (both
    passes labelled together, as recorded), cached tokens, preemptions and cached tokens by tier,
    and the second pass's cached tokens: the cold pass's events step by step without the STORAGE
    stores, those as one multiset (vLLM writes to its fs tier on threads and announces a write
    when a later step finds it done), its figures; the second pass's cached tokens per request."""
    steps = cold[0]
    return {
        "cold events": [row for row in ([e for e in r if "STORAGE" not in e[0]] for r in steps) if row],
        "cold STORAGE stores": sorted(e for r in steps for e in r if "STORAGE" in e[0]),
        "cold cached, preemptions, tiers": list(cold[1:]),
        "second pass cached": warm_cached,
    }


def simulated_storage_compared(wave: Wave, policy: str, cpu_blocks: int) -> dict[str, Any]:
    """``storage_wave_compared`` of the simulated pair, through JSON as the recording is."""
    cold, warm = simulated_storage_passes(wave, policy, cpu_blocks)
    prompts = [prompt for _priority, _max_tokens, prompt in wave]
    labelled = _labelled(cold[0] + warm[0], prompts)[: len(cold[0])]
    compared = storage_wave_compared(prompts, (labelled, *cold[1:]), warm[1])
    return dict(json.loads(json.dumps(compared)))


def recorded_storage_compared(wave: Wave, recorded: dict[str, Any]) -> dict[str, Any]:
    """``storage_wave_compared`` of a recorded pair (``_record_storage``)."""
    prompts = [prompt for _priority, _max_tokens, prompt in wave]
    cold = (recorded["steps"][0], recorded["cached"][0], recorded["preemptions"][0], recorded["tiers"][0])
    return dict(json.loads(json.dumps(storage_wave_compared(prompts, cold, recorded["cached"][1]))))


def _record_storage(key: str, prompts: list[list[int]], cold: Pass, warm: Pass) -> dict[str, Any]:
    """vLLM's side of one wave pair into RECORDED_STORAGE_WAVES (when RECORD_ENV is 1); returns it."""
    labelled = _labelled(cold[0] + warm[0], prompts)
    recorded = {
        "steps": [labelled[: len(cold[0])], labelled[len(cold[0]) :]],
        "cached": [cold[1], warm[1]],
        "preemptions": [cold[2], warm[2]],
        "tiers": [cold[3], warm[3]],
    }
    if os.environ.get(RECORD_ENV) == "1":
        _record(RECORDED_STORAGE_WAVES, key, recorded)
    return recorded


@pytest.mark.parametrize(
    ("policy", "cpu_blocks", "n", "seeds"), STORAGE_WAVE_CASES, ids=["fcfs-storage", "priority-storage"]
)
def test_the_simulated_engine_serves_storage_hits_to_requests_in_flight_together_as_real_vllm(
    model_dir: Path, tmp_path: Path, policy: str, cpu_blocks: int, n: int, seeds: tuple[int, ...]
) -> None:
    """The in-flight waves on a real engine with vLLM's ``fs`` tier behind an 80-block CPU tier, each
    wave twice: cold, then after the pause that empties the GPU pool and the CPU tier but not the
    fs tier, so every prefix of the second pass is in STORAGE only and is promoted through the CPU
    tier while other requests run. Compared (``storage_wave_compared``): the cold pass's events
    step by step (its STORAGE stores as one multiset), cached tokens, preemptions and cached tokens
    by tier; the second pass's cached tokens per request. Catches the fs tier's rules under
    concurrency (docs/simulator.md): a block the fs tier was never asked about makes its request
    wait a step, its answer stands while a request that asked lives, a promotion is read into
    a pinned CPU slot and found a step later, a write through to the fs tier announced for every
    block the CPU tier newly stored; and a reset that keeps the CPU tier (the second pass would
    hit CPU). The model before these rules differed on 5 of the 12 cold passes (4 first at event
    batch 9-15). Not compared: the second pass's events, preemptions and split by tier, which
    turn on when vLLM's read threads finish (one wave's preemptions were 3 and 4 in two runs; the
    simulator matches all its events in 4 of the 12 waves in each of two recordings, different
    waves each time, and its cached tokens by tier in 9-10). With
    RECORD_ENV=1 vLLM's side is written to RECORDED_STORAGE_WAVES (replayed in ``make test``)."""
    storage_dir = str(tmp_path / "pool")
    with _wave_engine(tmp_path / f"{policy}-storage", model_dir, policy, cpu_blocks, storage_dir) as (
        engine,
        batches,
    ):
        differ = []
        for seed in seeds:
            wave = _wave(seed, n)
            simulated = simulated_storage_passes(wave, policy, cpu_blocks)
            # Each seed's documents are its own: the fs tier's blocks of earlier waves never hit.
            live = (
                _live_pass(engine, batches, wave, simulated[0]),
                _live_pass(engine, batches, wave, None),  # its events are not compared
            )
            prompts = [prompt for _priority, _max_tokens, prompt in wave]
            key = storage_wave_key(policy, cpu_blocks, n, seed)
            recorded = _record_storage(key, prompts, *live)
            vllm_side = recorded_storage_compared(wave, recorded)
            sim_side = simulated_storage_compared(wave, policy, cpu_blocks)
            (tmp_path / f"wave-{seed}.json").write_text(json.dumps({"vllm": vllm_side, "sim": sim_side}))
            differ += [(seed, name) for name in vllm_side if vllm_side[name] != sim_side[name]]
            # The wave does what it is for: its second pass is served from STORAGE.
            assert live[1][3][2] > 0, (seed, live[1][3])
        assert not differ, differ


# ------------------------------------------------------------ a request arriving while another decodes

#: The late-arrival check's first request: (priority, max_tokens, prompt). Alone it never fills the
#: pool (8 blocks of prompt and a partial one, 1,700 output tokens: 62 of 64 blocks).
#: The late one shares its first 4 blocks, has a higher priority (0 < 2) and 1,200 output tokens:
#: together they outgrow the pool whenever the late one arrives, so a victim is chosen while both run,
#: the older request first in the running list.
LATE_CASES = ["fcfs", "priority"]
#: vLLM's side of each late-arrival case (``late_arrival_key``): replayed in ``make test`` by
#: tests/test_sim_recorded_waves.py, rewritten by the live check when RECORD_ENV is 1.
RECORDED_LATE_ARRIVALS = RECORDED_WAVES.with_name("late-arrival.json.gz")
#: The first request's output tokens the client has received when the late one is sent (at least).
LATE_SENT_AFTER = 40


def late_arrival() -> tuple[tuple[int, int, list[int]], tuple[int, int, list[int]]]:
    """The first request and the late one, as (priority, max_tokens, prompt)."""
    rng = random.Random(11)
    docs = [[rng.randrange(3, VOCAB_SIZE) for _ in range(MAX_MODEL_LEN)] for _ in range(2)]
    return (2, 1700, docs[0][: 8 * BLOCK + 5]), (0, 1200, docs[0][: 4 * BLOCK + 10])


def late_arrival_key(policy: str) -> str:
    return f"{policy}/late"


def simulated_late_arrival(policy: str, arrives_after: int) -> dict[str, Any]:
    """The late-arrival case on a fresh simulated engine: the first request alone until it has
    produced ``arrives_after`` tokens, then the late one added. Labelled events (through JSON, as
    recorded), the late request's cached tokens, the preemptions."""
    (p1, m1, first), (p2, m2, late) = late_arrival()
    engine = _sim_engine(WAVE_BUDGET, policy=policy)
    engine.add_request(SimRequest("first", first, max_tokens=m1, priority=p1))
    steps: list[list[dict[str, Any]]] = []
    produced = 0
    while produced < arrives_after:
        out = engine.step()
        produced += len(out.new_token_ids.get("first", ()))
        if out.events:
            steps.append(out.events)
    engine.add_request(SimRequest("late", late, max_tokens=m2, priority=p2))
    cached = 0
    while engine.has_unfinished():
        out = engine.step()
        if out.events:
            steps.append(out.events)
        cached += sum(sum(f.cached_tokens_by_tier) for f in out.finished if f.request_id == "late")
    labelled = json.loads(json.dumps(_labelled(steps, [first, late])))
    return {"steps": labelled, "cached": cached, "preemptions": engine.stats().num_preemptions}


def arrivals_reproducing(policy: str, live: dict[str, Any]) -> list[int]:
    """The arrival points (the first request's tokens produced before the late one is added) at
    which the simulated engine announces vLLM's events, cached tokens and preemptions exactly.
    vLLM adds the late request at a step nobody outside it sees; the client sent it after
    ``sent_after`` tokens had reached it, so every point from a block before that is tried, up to
    the first one past a run of matches. Points within one block of output give the same events."""
    want = {name: live[name] for name in ("steps", "cached", "preemptions")}
    found: list[int] = []
    for k in range(max(1, live["sent_after"] - BLOCK), late_arrival()[0][1]):
        if simulated_late_arrival(policy, k) == want:
            found.append(k)
        elif found:
            break
    return found


def _live_late_arrival(engine: FleetEngine, batches: list[Any], policy: str) -> dict[str, Any]:
    """The late-arrival case on the real engine: the first request queued behind the paused
    scheduler (which empties the prefix cache) and streamed once resumed; the late one sent as soon
    as LATE_SENT_AFTER of its tokens have reached the client, on a connection opened beforehand, from
    a thread started beforehand, this process's session ahead of the engine's while they run
    (``scheduled_ahead_of_other_sessions``): on two cores shared with a decoding engine, a late
    request on a new connection from a new thread reached vLLM only as the first one ended. Its
    labelled events, the late request's cached tokens, the preemptions."""
    (p1, m1, first), (p2, m2, late) = late_arrival()

    def body(prompt: list[int], max_tokens: int, priority: int, **extra: Any) -> dict[str, Any]:
        sent = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        # An fcfs engine is sent no priority.
        return sent | extra | ({"priority": priority} if policy == "priority" else {})

    httpx.post(f"{engine.url}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
    start = len(batches)
    before = metric_total(engine.url, "vllm:num_preemptions_total")
    received = 0
    go = threading.Event()
    answer: list[Any] = []
    with httpx.Client(timeout=600) as client:
        client.get(f"{engine.url}/health").raise_for_status()

        def send_late() -> None:
            go.wait()
            answer.append(client.post(f"{engine.url}/v1/completions", json=body(late, m2, p2)))

        def stream_first() -> None:
            nonlocal received
            # Every chunk carries the tokens so far: a slow reader gets several tokens a chunk.
            usage = {"include_usage": True, "continuous_usage_stats": True}
            sent = body(first, m1, p1, stream=True, stream_options=usage)
            with httpx.stream("POST", f"{engine.url}/v1/completions", json=sent, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        so_far = json.loads(line[6:]).get("usage") or {}
                        received = so_far.get("completion_tokens", received)
                        if received >= LATE_SENT_AFTER:
                            go.set()
            go.set()  # a failure above still ends the sender

        threads = [threading.Thread(target=send_late), threading.Thread(target=stream_first)]
        added = _added(engine) + 1
        for thread in threads:
            thread.start()
        assert until(lambda: _added(engine) >= added, 60), "the first request never reached the engine core"
        with scheduled_ahead_of_other_sessions():
            httpx.post(f"{engine.url}/resume", timeout=60).raise_for_status()
            for thread in threads:
                thread.join()
    assert received == m1 and answer, (received, answer)
    answer[0].raise_for_status()
    _until_quiet(batches)
    return {
        "sent_after": LATE_SENT_AFTER,
        "steps": json.loads(json.dumps(_labelled(_since_reset(batches, start), [first, late]))),
        "cached": answer[0].json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0,
        "preemptions": int(metric_total(engine.url, "vllm:num_preemptions_total") - before),
    }


@pytest.mark.parametrize("policy", LATE_CASES)
def test_the_simulated_engine_chooses_the_preemption_victim_of_a_late_arrival_as_real_vllm(
    model_dir: Path, tmp_path: Path, policy: str
) -> None:
    """A request arriving while another decodes, on a real engine (64 blocks, a 512-token budget):
    the first (priority 2) streams alone, the late one (priority 0, sharing its first 4 blocks) is
    sent once 40 of the first's tokens have arrived, and the two outgrow the pool together. The
    simulator, given the late request at some point of the first's output, must announce every
    step's events, the late request's cached tokens and the preemptions exactly as vLLM did
    (``arrivals_reproducing``). Catches the preemption victim when the running requests are out of
    (priority, arrival) order: vLLM's priority scheduler preempts the largest (priority, arrival),
    here the older request ahead of the one that needs a block; fcfs the newest. The waves (all
    queued at once) reach that order only when a request joins the running ones behind some that
    rank after it (re-admitted after a preemption, or its load landed). Checked on the recordings:
    the newest as victim on a priority engine reproduces the priority case at no arrival point (two
    recorded priority waves with a CPU tier fail with it too), the oldest on an fcfs engine the
    fcfs case. Not caught: undoing a victim's share of the step it was
    already scheduled in (that mutant still matches). With RECORD_ENV=1 vLLM's side is written to
    RECORDED_LATE_ARRIVALS (replayed in ``make test``)."""
    with _wave_engine(tmp_path / f"late-{policy}", model_dir, policy, 0) as (engine, batches):
        live = _live_late_arrival(engine, batches, policy)
    if os.environ.get(RECORD_ENV) == "1":
        _record(RECORDED_LATE_ARRIVALS, late_arrival_key(policy), live)
    (tmp_path / "late.json").write_text(json.dumps(live))
    # The case does what it is for: a victim was chosen while both ran (the first alone fits).
    assert live["preemptions"] >= 1, live["preemptions"]
    found = arrivals_reproducing(policy, live)
    assert found, (
        f"no arrival point reproduces vLLM's {len(live['steps'])} event batches; at the send point: "
        f"{_first_difference(live, simulated_late_arrival(policy, LATE_SENT_AFTER))}"
    )


def _first_difference(live: dict[str, Any], simulated: dict[str, Any]) -> str:
    a, b = live["steps"], simulated["steps"]
    n = min(len(a), len(b))
    d = next((i for i in range(n) if a[i] != b[i]), n)
    return (
        f"{len(a)} batches on vLLM, {len(b)} simulated, first difference at {d}: vllm {a[d : d + 2]} "
        f"sim {b[d : d + 2]}; cached {live['cached']} / {simulated['cached']}, preemptions "
        f"{live['preemptions']} / {simulated['preemptions']}"
    )
