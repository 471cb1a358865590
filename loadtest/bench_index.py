"""Benchmark of event ingestion and the prefix index: blocks ingested per second (decode + apply of
pre-encoded vLLM frames), match latency for a 2,048-block prompt at 10^6 keys, bytes per entry.

Run: ``python -m loadtest.bench_index`` (``--quick`` for a smoke run). Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from typing import Any

import msgspec

from kvcore.index import PrefixIndex
from kvcore.keys import block_keys
from kvcore.stats import percentile, percentiles
from router.events import BlockStored, decode_payload
from sim.engine import placeholder_stored_event

BLOCK_TOKENS = 16


def build_frames(total_blocks: int, seed: int = 0) -> tuple[list[bytes], int]:
    """vLLM map-layout payloads: GPU stores of 1-64 blocks extending conversations, CPU placeholders
    for some, ~10% of blocks removed again. Returns the payloads and the stored block count."""
    rng = random.Random(seed)
    encode = msgspec.msgpack.encode
    frames: list[bytes] = []
    next_hash = 1 << 63
    conversations: list[tuple[int, int]] = []  # (last hash, next token)
    live: list[int] = []
    stored = 0
    token = 0
    while stored < total_blocks:
        n = rng.randint(1, 64)
        if conversations and rng.random() < 0.7:
            i = rng.randrange(len(conversations))
            parent, _ = conversations[i]
        else:
            parent, i = None, -1  # type: ignore[assignment]
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        tokens = list(range(token, token + n * BLOCK_TOKENS))
        token += n * BLOCK_TOKENS
        events: list[dict[str, Any]] = [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": tokens,
                "block_size": BLOCK_TOKENS,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            }
        ]
        if rng.random() < 0.3:
            events.append(placeholder_stored_event(hashes))
        live.extend(hashes)
        n_remove = sum(1 for _ in range(n) if rng.random() < 0.1)
        if n_remove and len(live) > 1000:
            victims = [live.pop(rng.randrange(len(live) - 500)) for _ in range(n_remove)]
            events.append({"type": "BlockRemoved", "block_hashes": victims, "medium": "GPU", "group_idx": 0})
        frames.append(encode([time.time(), events, 0]))
        if i >= 0:
            conversations[i] = (hashes[-1], token)
        else:
            conversations.append((hashes[-1], token))
        stored += n
    return frames, stored


def bench_ingest(total_blocks: int) -> float:
    """Blocks/s of decode + apply on one core. CPU time of this process (``time.process_time``),
    not wall time: the benchmark machine is shared, and CPU time is what one core spends."""
    frames, stored = build_frames(total_blocks)
    index = PrefixIndex()
    gc.collect()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for payload in frames:
        index.apply_batch("e0", decode_payload(payload).events)
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    rate = stored / cpu_s
    decode0 = time.process_time()
    for payload in frames:
        decode_payload(payload)
    decode_s = time.process_time() - decode0
    print(
        f"ingest: {stored:,} GPU blocks in {len(frames):,} frames (+CPU placeholders, ~10% removals): "
        f"{cpu_s:.2f} s CPU ({wall_s:.2f} s wall) -> {rate:,.0f} blocks/s per core; "
        f"msgpack decode alone {decode_s / cpu_s:.0%} of it"
    )
    return rate


def populate(
    index: PrefixIndex, engines: int, total_keys: int, prompt_blocks: int, seed: int = 1
) -> list[list[int]]:
    """At least total_keys distinct keys in chains of prompt_blocks; each chain on 1-3 engines, a prefix of
    it in GPU, the rest of that engine's share in CPU. Returns the chains' keys."""
    rng = random.Random(seed)
    chains: list[list[int]] = []
    base = 0
    while len(index) < total_keys:
        tokens = list(range(base, base + prompt_blocks * BLOCK_TOKENS))
        base += prompt_blocks * BLOCK_TOKENS
        keys = block_keys(tokens, BLOCK_TOKENS)
        chains.append(keys)
        hashes: list[int | bytes] = list(range(base * 4, base * 4 + prompt_blocks))
        for engine in rng.sample(range(engines), min(engines, rng.randint(1, 3))):
            held = rng.randint(prompt_blocks // 4, prompt_blocks)
            gpu = rng.randint(0, held)
            index.apply_batch(
                f"e{engine}",
                [
                    BlockStored(
                        hashes[:held], None, tokens[: held * BLOCK_TOKENS], BLOCK_TOKENS, None, "CPU", None
                    )
                ],
            )
            if gpu:
                index.apply_batch(f"e{engine}", [BlockStored(hashes[:gpu], None, [], 0, None, "GPU", None)])
    return chains


def bench_match(
    engines: int, total_keys: int, prompt_blocks: int, queries: int
) -> tuple[float, float, float]:
    """Latency of ``match`` for a prompt_blocks-block prompt over ``total_keys`` indexed keys.
    Returns p50 and p99 wall ms, and p99 of the thread's CPU ms (what noise from other processes
    on the shared machine cannot inflate)."""
    index = PrefixIndex()
    for e in range(engines):
        index.add_engine(f"e{e}")
    t0 = time.perf_counter()
    chains = populate(index, engines, total_keys, prompt_blocks)
    build_s = time.perf_counter() - t0
    rng = random.Random(2)
    wall_samples, cpu_samples = [], []
    for _ in range(queries):
        keys = rng.choice(chains)
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        index.match(keys)
        cpu_samples.append(time.thread_time() - cpu0)
        wall_samples.append(time.perf_counter() - wall0)
    wall_samples.sort()
    cpu_samples.sort()
    p50, p99 = (v * 1e3 for v in percentiles(wall_samples, (50, 99)))
    cpu_p99 = percentile(cpu_samples, 99) * 1e3
    print(
        f"match: {prompt_blocks}-block prompt, {engines} engines, {len(index):,} keys "
        f"(built in {build_s:.1f} s): p50 {p50:.3f} ms, p99 {p99:.3f} ms (CPU p99 {cpu_p99:.3f} ms) "
        f"over {queries} queries"
    )
    return p50, p99, cpu_p99


def _chain_tokens(chain: int, blocks: int) -> list[int]:
    """Tokens of a distinct ``blocks``-block chain: its first token is the chain number."""
    return [chain, *range(1, blocks * BLOCK_TOKENS)]


def bench_memory(total_keys: int, engines: int, max_holders: int, cpu_copy: bool, seed: int = 3) -> float:
    """Bytes per (key, engine, tier) entry after indexing ``total_keys`` keys.

    Chains of 512 blocks; each chain on 1..max_holders of ``engines`` engines, stored on GPU (with
    tokens, as vLLM announces it) and, with ``cpu_copy``, written through to CPU (hash-only
    placeholders, as the offloading connector announces it). Counted: everything tracemalloc sees
    allocated and still alive after ingestion (the index's dicts, key ints, mask ints, per-engine
    engine-hash maps and the engine-hash ints it keeps); the decoded event structs and token lists
    are freed before the measurement."""
    rng = random.Random(seed)
    chain_blocks = 512
    index = PrefixIndex()
    for e in range(engines):
        index.add_engine(f"e{e}")
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    entries = 0
    next_hash = 1 << 63
    chain = 0
    while len(index) < total_keys:
        n = min(chain_blocks, total_keys - len(index))
        tokens = _chain_tokens(chain, n)
        chain += 1
        for engine in rng.sample(range(engines), rng.randint(1, max_holders)):
            # Fresh hash ints per event, as decoding allocates them: the index keeps them.
            hashes: list[int | bytes] = list(range(next_hash, next_hash + n))
            next_hash += n
            batch = [BlockStored(hashes, None, tokens, BLOCK_TOKENS, None, "GPU", None)]
            if cpu_copy:
                batch.append(BlockStored(list(hashes), None, [], 0, None, "CPU", None))
            index.apply_batch(f"e{engine}", batch)
            entries += n * len(batch)
        del tokens, batch, hashes
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    keys = len(index)
    per_entry = used / entries
    print(
        f"memory: {keys:,} keys, {engines} engine(s), 1-{max_holders} holders per key, "
        f"{'GPU+CPU' if cpu_copy else 'GPU only'}: {entries:,} (key, engine, tier) entries, "
        f"{used / 2**20:,.0f} MiB -> {used / keys:.0f} B per key, {per_entry:.0f} B per entry"
    )
    return per_entry


def _summary(name: str, values: list[float], fmt: str) -> None:
    values = sorted(values)
    print(
        f"  {name}: median {format(statistics.median(values), fmt)} "
        f"(min {format(values[0], fmt)}, max {format(values[-1], fmt)}) over {len(values)} runs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--repeats", type=int, default=1, help="runs of ingest and match (memory runs once)")
    parser.add_argument("--keys", type=int, default=None, help="indexed keys for match (default 10^6)")
    parser.add_argument("--no-memory", action="store_true", help="skip the (slow) tracemalloc runs")
    args = parser.parse_args()
    quick = args.quick
    total_keys = args.keys or (50_000 if quick else 1_000_000)
    figures: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        figures.setdefault("ingest blocks/s per core", []).append(bench_ingest(20_000 if quick else 300_000))
        for engines in (16, 64, 256):
            p50, p99, cpu_p99 = bench_match(engines, total_keys, 2048, 50 if quick else 300)
            figures.setdefault(f"match p50 ms, {engines} engines", []).append(p50)
            figures.setdefault(f"match p99 ms, {engines} engines", []).append(p99)
            figures.setdefault(f"match CPU p99 ms, {engines} engines", []).append(cpu_p99)
    if not args.no_memory:
        memory_keys = 20_000 if quick else 1_000_000
        bench_memory(memory_keys, engines=1, max_holders=1, cpu_copy=False)
        bench_memory(memory_keys, engines=64, max_holders=3, cpu_copy=True)
    if args.repeats > 1:
        print("summary:")
        for name, values in figures.items():
            _summary(name, values, ",.0f" if name.startswith("ingest") else ".3f")


if __name__ == "__main__":
    main()
