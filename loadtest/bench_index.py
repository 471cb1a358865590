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

from router.events import BlockStored, decode_payload
from router.index import PrefixIndex
from router.keys import block_keys

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
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 0,
                    "lora_id": None,
                    "medium": "CPU",
                    "lora_name": None,
                    "group_idx": 0,
                }
            )
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
    frames, stored = build_frames(total_blocks)
    index = PrefixIndex()
    gc.collect()
    start = time.perf_counter()
    for payload in frames:
        index.apply_batch("e0", decode_payload(payload).events)
    elapsed = time.perf_counter() - start
    rate = stored / elapsed
    print(
        f"ingest: {stored:,} GPU blocks in {len(frames):,} frames (+CPU placeholders, ~10% removals): "
        f"{elapsed:.2f} s -> {rate:,.0f} blocks/s on one core"
    )
    decode_only = time.perf_counter()
    for payload in frames:
        decode_payload(payload)
    print(f"  of which msgpack decode alone: {time.perf_counter() - decode_only:.2f} s")
    return rate


def populate(
    index: PrefixIndex, engines: int, total_keys: int, prompt_blocks: int, seed: int = 1
) -> list[list[int]]:
    """total_keys distinct keys in chains of prompt_blocks; each chain on 1-3 engines, a prefix of
    it in GPU, the rest of that engine's share in CPU. Returns the chains' keys."""
    rng = random.Random(seed)
    chains: list[list[int]] = []
    base = 0
    while len(chains) * prompt_blocks < total_keys:
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
                [BlockStored(hashes[:held], None, tokens[: held * BLOCK_TOKENS], BLOCK_TOKENS, medium="CPU")],
            )
            if gpu:
                index.apply_batch(f"e{engine}", [BlockStored(hashes[:gpu], None, [], 0, medium="GPU")])
    return chains


def bench_match(engines: int, total_keys: int, prompt_blocks: int, queries: int) -> tuple[float, float]:
    index = PrefixIndex()
    for e in range(engines):
        index.add_engine(f"e{e}")
    t0 = time.perf_counter()
    chains = populate(index, engines, total_keys, prompt_blocks)
    build_s = time.perf_counter() - t0
    rng = random.Random(2)
    samples = []
    for _ in range(queries):
        keys = rng.choice(chains)
        start = time.perf_counter()
        index.match(keys)
        samples.append(time.perf_counter() - start)
    samples.sort()
    p50 = statistics.median(samples) * 1e3
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3
    print(
        f"match: {prompt_blocks}-block prompt, {engines} engines, {len(index):,} keys "
        f"(built in {build_s:.1f} s): p50 {p50:.3f} ms, p99 {p99:.3f} ms over {queries} queries"
    )
    return p50, p99


def bench_memory(keys_count: int) -> None:
    tokens = list(range(keys_count * BLOCK_TOKENS))
    first_hash = 1 << 63
    for holders in (1, 2):
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex()
        for e in range(holders):
            for start in range(0, keys_count, 512):
                # Fresh hash ints per batch, as decoding allocates them: the index keeps them.
                hashes: list[int | bytes] = list(
                    range(first_hash + start, first_hash + min(start + 512, keys_count))
                )
                parent = first_hash + start - 1 if start else None
                index.apply_batch(
                    f"e{e}",
                    [
                        BlockStored(
                            hashes,
                            parent,
                            tokens[start * BLOCK_TOKENS : (start + 512) * BLOCK_TOKENS],
                            BLOCK_TOKENS,
                            medium="GPU",
                        )
                    ],
                )
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        entries = keys_count * holders
        print(
            f"memory: {keys_count:,} keys on {holders} engine(s) (GPU): "
            f"{used / keys_count:.0f} bytes per key, "
            f"{used / entries:.0f} bytes per (engine, key) entry"
        )
        del index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    args = parser.parse_args()
    quick = args.quick
    bench_ingest(20_000 if quick else 300_000)
    total_keys = 50_000 if quick else 1_000_000
    for engines in (16, 64, 256):
        bench_match(engines, total_keys, 2048, 50 if quick else 300)
    bench_memory(20_000 if quick else 200_000)


if __name__ == "__main__":
    main()
