"""The engine model: continuous batching, the time model against hand-computed values, tiered
prefix caching (hits, LRU, pinning, promotion, shared storage) and vLLM-shaped KV events."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.keys import block_keys
from sim.cache import StoragePool
from sim.engine import WAIT_REASONS, EngineCore, EngineProfile, FinishedRequest, SimRequest, StepOutput

DATA = Path(__file__).resolve().parents[1] / "data"
FIXTURE = DATA / "fixtures" / "vllm-kv-events" / "vllm-0.33.0-frames.jsonl"

# Round figures so that every expected duration below can be checked by hand:
# 1 block = 16 tokens x 1,000 bytes = 16,000 bytes.
OVERHEAD_S = 0.01
PREFILL_TOK_PER_S = 1000.0
DECODE_S = 0.001
CPU_BW, CPU_LAT_S = 1e6, 0.002
STO_BW, STO_LAT_S = 1e5, 0.005
BLOCK_BYTES = 16 * 1000


def profile(**overrides: Any) -> EngineProfile:
    fields: dict[str, Any] = dict(
        num_gpu_blocks=64,
        kv_bytes_per_token=1000,
        prefill_tokens_per_s=PREFILL_TOK_PER_S,
        step_overhead_s=OVERHEAD_S,
        decode_s_per_seq=DECODE_S,
        cpu_load_bytes_per_s=CPU_BW,
        cpu_latency_s=CPU_LAT_S,
        storage_load_bytes_per_s=STO_BW,
        storage_latency_s=STO_LAT_S,
        # Context-dependent costs off unless a test turns them on (their own hand-computed tests).
        prefill_attention_s_per_token_ctx=0.0,
        hbm_bytes_per_s=math.inf,
    )
    fields.update(overrides)
    return EngineProfile(**fields)


def run(engine: EngineCore, max_steps: int = 10_000) -> list[StepOutput]:
    outs = []
    while engine.has_unfinished():
        outs.append(engine.step())
        assert len(outs) < max_steps, "engine did not drain"
    return outs


def finished(outs: list[StepOutput]) -> dict[str, FinishedRequest]:
    return {f.request_id: f for o in outs for f in o.finished}


def events(outs: list[StepOutput]) -> list[dict[str, Any]]:
    return [e for o in outs for e in o.events]


def of(evs: list[dict[str, Any]], kind: str, medium: str | None = None) -> list[dict[str, Any]]:
    return [e for e in evs if e["type"] == kind and (medium is None or e.get("medium") == medium)]


class EventMirror:
    """What a router learns from the events: hash sets per tier."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}

    def apply(self, evs: list[dict[str, Any]]) -> None:
        for e in evs:
            if e["type"] == "BlockStored":
                self.tiers[e["medium"]].update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                self.tiers[e["medium"]].difference_update(e["block_hashes"])
            else:
                assert e == {"type": "AllBlocksCleared"}
                self.tiers["GPU"].clear()


T_TOKENS = list(range(1000, 1064)) + list(range(2000, 2040))  # the fixture's T: 6 full blocks + 8


# ---------------------------------------------------------------- time model and batching


def test_single_request_time_model_and_tokens() -> None:
    engine = EngineCore("e0", profile())
    engine.add_request(SimRequest("a", list(range(100)), max_tokens=3))
    outs = run(engine)
    assert [o.duration_s for o in outs] == pytest.approx(
        [OVERHEAD_S + 100 / PREFILL_TOK_PER_S, OVERHEAD_S + DECODE_S, OVERHEAD_S + DECODE_S]
    )
    assert all(len(o.new_token_ids["a"]) == 1 for o in outs)
    done = finished(outs)["a"]
    assert done.finish_reason == "length" and done.prompt_tokens == 100
    assert done.output_token_ids == [o.new_token_ids["a"][0] for o in outs]
    assert done.cached_tokens == 0 and done.cached_tokens_by_tier == (0, 0, 0)


def test_chunked_prefill_respects_the_token_budget() -> None:
    engine = EngineCore("e0", profile(num_gpu_blocks=2000))
    engine.add_request(SimRequest("long", list(range(20_000)), max_tokens=1))
    outs = run(engine)
    assert [o.num_prefill_tokens for o in outs] == [8192, 8192, 3616]
    assert [o.duration_s for o in outs] == pytest.approx(
        [OVERHEAD_S + 8.192, OVERHEAD_S + 8.192, OVERHEAD_S + 3.616]
    )
    assert [bool(o.new_token_ids) for o in outs] == [False, False, True]


def test_continuous_batching_mixes_decode_and_prefill() -> None:
    engine = EngineCore("e0", profile())
    engine.add_request(SimRequest("a", list(range(100)), max_tokens=5))
    first = engine.step()
    engine.add_request(SimRequest("b", list(range(500, 550)), max_tokens=2))
    second = engine.step()
    third = engine.step()
    assert first.duration_s == pytest.approx(OVERHEAD_S + 0.1)
    # a decodes while b prefills 50 tokens in the same step.
    assert second.duration_s == pytest.approx(OVERHEAD_S + 0.05 + DECODE_S)
    assert set(second.new_token_ids) == {"a", "b"}
    assert third.duration_s == pytest.approx(OVERHEAD_S + 2 * DECODE_S)
    assert [f.request_id for f in third.finished] == ["b"]


def test_max_num_seqs_queues_the_rest() -> None:
    engine = EngineCore("e0", profile(max_num_seqs=2))
    for i in range(3):
        engine.add_request(SimRequest(f"r{i}", list(range(i * 100, i * 100 + 20)), max_tokens=2))
    out = engine.step()
    assert set(out.new_token_ids) == {"r0", "r1"}
    assert engine.stats().num_waiting == 1 and engine.stats().num_running == 2
    out = engine.step()  # r0 and r1 finish; r2 is admitted next step
    assert {f.request_id for f in out.finished} == {"r0", "r1"}
    assert set(finished(run(engine))) == {"r2"}


def test_output_is_capped_by_max_model_len_and_long_prompts_are_rejected() -> None:
    engine = EngineCore("e0", profile(max_model_len=40))
    engine.add_request(SimRequest("a", list(range(30)), max_tokens=100))
    assert len(finished(run(engine))["a"].output_token_ids) == 10
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(SimRequest("b", list(range(40)), max_tokens=1))


def test_invalid_requests_say_what_to_change() -> None:
    engine = EngineCore("e0", profile(num_gpu_blocks=4))
    engine.add_request(SimRequest("a", [1, 2, 3], max_tokens=1))
    with pytest.raises(ValueError, match="unique request_id"):
        engine.add_request(SimRequest("a", [1, 2, 3], max_tokens=1))
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        engine.add_request(SimRequest("big", list(range(16)), max_tokens=49))  # 65 tokens = 5 blocks
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(SimRequest("z", [1], max_tokens=0))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(SimRequest("e", [], max_tokens=1))
    with pytest.raises(ValueError, match="block_ids"):
        engine.add_request(SimRequest("t", [], max_tokens=1, block_ids=[1, 2, 3], prompt_len=16))
    with pytest.raises(ValueError, match="num_gpu_blocks must be positive"):
        EngineProfile(num_gpu_blocks=0)


# ---------------------------------------------------------------- prefix cache semantics


def test_prefix_hit_counts_full_blocks_and_keeps_one_token_to_compute() -> None:
    engine = EngineCore("e0", profile())
    engine.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    run(engine)
    engine.add_request(SimRequest("b", [*T_TOKENS, 7, 7, 7], max_tokens=1))
    outs = run(engine)
    assert finished(outs)["b"].cached_tokens_by_tier == (96, 0, 0)
    assert outs[0].duration_s == pytest.approx(OVERHEAD_S + (107 - 96) / PREFILL_TOK_PER_S)
    # A prompt of exactly 2 full blocks hits only 1: vLLM always computes the last token.
    engine.add_request(SimRequest("c", T_TOKENS[:32], max_tokens=1))
    assert finished(run(engine))["c"].cached_tokens == 16
    # Only contiguous prefixes from block 0 hit: same blocks 1.. after a different block 0 miss.
    engine.add_request(SimRequest("d", [5] * 16 + T_TOKENS[16:], max_tokens=1))
    assert finished(run(engine))["d"].cached_tokens == 0
    stats = engine.stats()
    assert stats.prefix_cache_hits_tokens == 96 + 16
    assert stats.prefix_cache_queries_tokens == 104 + 107 + 32 + 104


def test_gpu_lru_evicts_oldest_freed_and_announces_each_removal() -> None:
    engine = EngineCore("e0", profile(num_gpu_blocks=10))
    engine.add_request(SimRequest("a", T_TOKENS[:65], max_tokens=1))  # 4 full blocks cached
    a_hashes = of(events(run(engine)), "BlockStored", "GPU")[0]["block_hashes"]
    assert len(a_hashes) == 4
    engine.add_request(SimRequest("c", list(range(5000, 5145)), max_tokens=1))  # needs all 10 blocks
    evs = events(run(engine))
    removed = of(evs, "BlockRemoved", "GPU")
    # One event per hash; a request's deepest block is evicted first so its prefix survives longest.
    assert [e["block_hashes"] for e in removed] == [[h] for h in reversed(a_hashes)]
    assert all(set(e) == {"type", "block_hashes", "medium", "group_idx"} for e in removed)


def test_running_requests_pin_their_blocks_and_others_wait() -> None:
    engine = EngineCore("e0", profile(num_gpu_blocks=8))
    engine.add_request(SimRequest("a", list(range(100)), max_tokens=10))  # 7 blocks -> 8 while decoding
    engine.add_request(SimRequest("b", list(range(200, 240)), max_tokens=1))  # 3 blocks
    out = engine.step()
    assert set(out.new_token_ids) == {"a"}
    assert engine.stats().num_waiting == 1
    assert not of(out.events, "BlockRemoved")
    outs = run(engine)
    done = finished(outs)
    assert list(done) == ["a", "b"]
    assert engine.stats().kv_cache_usage == 0.0


def test_preemption_recomputes_and_both_requests_complete() -> None:
    engine = EngineCore("e0", profile(num_gpu_blocks=4))
    engine.add_request(SimRequest("a", list(range(16)), max_tokens=40))
    engine.add_request(SimRequest("b", list(range(100, 116)), max_tokens=40))
    mirror = EventMirror()
    outs = []
    while engine.has_unfinished():
        out = engine.step()
        outs.append(out)
        mirror.apply(out.events)
        assert mirror.tiers["GPU"] == engine.gpu.cached_hashes()
    done = finished(outs)
    assert len(done["a"].output_token_ids) == 40 and len(done["b"].output_token_ids) == 40
    assert engine.stats().num_preemptions >= 1
    assert engine.gpu.num_used() == 0


def test_abort_frees_blocks_and_reports_abort() -> None:
    engine = EngineCore("e0", profile())
    engine.add_request(SimRequest("a", list(range(64)), max_tokens=100))
    engine.add_request(SimRequest("w", list(range(64)), max_tokens=1))
    engine.step()
    assert engine.gpu.num_used() > 0
    engine.abort_request("a")
    engine.abort_request("missing")  # ignored
    out = engine.step()
    aborted = [f for f in out.finished if f.request_id == "a"]
    assert aborted and aborted[0].finish_reason == "abort"
    run(engine)
    assert engine.gpu.num_used() == 0 and not engine.has_unfinished()


# ---------------------------------------------------------------- tiers


def test_cpu_write_through_hit_load_time_and_promotion() -> None:
    engine = EngineCore("e0", profile(num_gpu_blocks=10, num_cpu_blocks=32))
    engine.add_request(SimRequest("a", T_TOKENS[:65], max_tokens=1))
    evs = events(run(engine))
    a_hashes = of(evs, "BlockStored", "GPU")[0]["block_hashes"]
    placeholders = of(evs, "BlockStored", "CPU")
    assert [e["block_hashes"] for e in placeholders] == [[h] for h in a_hashes]
    assert all(
        e["token_ids"] == [] and e["block_size"] == 0 and e["parent_block_hash"] is None for e in placeholders
    )
    engine.add_request(SimRequest("c", list(range(5000, 5145)), max_tokens=1))  # evicts a from GPU
    run(engine)
    assert not engine.gpu.cached_hashes() & set(a_hashes)

    engine.add_request(SimRequest("a2", T_TOKENS[:65], max_tokens=1))
    outs = run(engine)
    assert finished(outs)["a2"].cached_tokens_by_tier == (0, 64, 0)
    load_s = CPU_LAT_S + 4 * BLOCK_BYTES / CPU_BW
    # Asynchronous load: the engine idles until the blocks land, then computes the last token;
    # one more step, with nothing to compute, signals the finish to the offload tiers.
    assert [o.duration_s for o in outs] == pytest.approx([load_s, OVERHEAD_S + 1 / PREFILL_TOK_PER_S, 0.0])
    assert outs[1].new_token_ids and not outs[0].new_token_ids
    promoted = of(events(outs), "BlockStored", "GPU")
    assert promoted[0]["block_hashes"] == a_hashes and promoted[0]["token_ids"] == T_TOKENS[:64]

    engine.add_request(SimRequest("a3", T_TOKENS[:65], max_tokens=1))
    assert finished(run(engine))["a3"].cached_tokens_by_tier == (64, 0, 0)
    stats = engine.stats()
    assert stats.load_bytes_by_tier["CPU"] == 4 * BLOCK_BYTES
    assert stats.load_time_s_by_tier["CPU"] == pytest.approx(load_s)
    assert stats.external_prefix_cache_hits_tokens == 64
    assert stats.cached_tokens_by_tier == (64, 64, 0)


def test_cpu_lru_eviction_is_announced() -> None:
    """A write that fits evicts the tier's least recently used blocks, never its own, and announces
    them before its stores. vLLM's LRU policy re-ranks a finished request's blocks head last, so a
    finished conversation loses its deepest blocks first. Catches eviction in the wrong order
    (a prefix evicted makes the whole conversation miss) or a removal left unannounced."""
    engine = EngineCore("e0", profile(num_cpu_blocks=8))
    engine.add_request(SimRequest("a", T_TOKENS, max_tokens=1))  # 6 prompt blocks
    a_hashes = of(events(run(engine)), "BlockStored", "GPU")[0]["block_hashes"]
    engine.add_request(SimRequest("b", list(range(5000, 5064)), max_tokens=1))  # 4 more: 2 go
    evs = events(run(engine))
    removed = of(evs, "BlockRemoved", "CPU")
    assert [h for e in removed for h in e["block_hashes"]] == [a_hashes[5], a_hashes[4]]
    assert evs.index(removed[0]) < evs.index(of(evs, "BlockStored", "CPU")[0])
    b_hashes = of(evs, "BlockStored", "GPU")[0]["block_hashes"]
    assert engine.cpu is not None
    assert engine.cpu.hashes() == a_hashes[3::-1] + b_hashes[::-1]


def test_a_write_larger_than_the_cpu_tier_is_refused_whole_and_offered_again() -> None:
    """vLLM's offloading manager refuses a store it cannot hold whole (prepare_store returns None)
    and its scheduler offers the refused blocks again with the request's next write (after the
    request finishes too). A 6-block prompt into a 4-block tier:
    - prefilled 3 blocks a step: the second write is refused (the first has not landed, so its
      blocks cannot be evicted) and offered again the step after the finish, when it evicts the
      first's oldest two;
    - prefilled 5 blocks, then 1: the first write is refused, and the second offers all 6, so it
      is refused too: nothing is stored (a model without the retry stores the sixth block).
    Catches a write that evicts its own blocks (a reader's index would keep them), a partial store
    vLLM never makes, and a refused write forgotten."""
    fits = EngineCore("e0", profile(num_cpu_blocks=4, max_num_batched_tokens=48))
    fits.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    mirror = EventMirror()
    outs = []
    while fits.has_unfinished():
        outs.append(fits.step())
        mirror.apply(outs[-1].events)
        # The events announce what has landed.
        assert fits.cpu is not None and mirror.tiers["CPU"] == set(fits.cpu.hashes()) - fits._cpu_unready
    a_hashes = [h for e in of(events(outs), "BlockStored", "GPU") for h in e["block_hashes"]]
    # The second write evicted the first's two oldest; at the finish the head ranks last.
    assert fits.cpu is not None and fits.cpu.hashes() == a_hashes[5:1:-1]

    refused = EngineCore("e1", profile(num_cpu_blocks=4, max_num_batched_tokens=80))
    refused.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    outs = run(refused)
    assert len(outs) >= 2 and of(events(outs[:1]), "BlockStored", "GPU")  # two prefill steps
    assert not of(events(outs), "BlockStored", "CPU") and not of(events(outs), "BlockRemoved", "CPU")
    assert refused.cpu is not None and len(refused.cpu) == 0
    assert refused.stats().store_bytes_by_tier["CPU"] == 0


def test_self_describing_cpu_events_carry_tokens_and_parent() -> None:
    engine = EngineCore("e0", profile(num_cpu_blocks=16, self_describing_cpu_events=True))
    engine.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    evs = events(run(engine))
    gpu, cpu = of(evs, "BlockStored", "GPU")[0], of(evs, "BlockStored", "CPU")
    assert len(cpu) == 1
    assert cpu[0]["token_ids"] == gpu["token_ids"] and cpu[0]["block_size"] == 16
    assert cpu[0]["block_hashes"] == gpu["block_hashes"] and cpu[0]["parent_block_hash"] is None


def test_shared_storage_pool_is_visible_to_a_second_engine() -> None:
    pool = StoragePool("fs", capacity_blocks=100, load_bytes_per_s=2e5, latency_s=0.004)
    e1 = EngineCore("e1", profile(), storage=pool)
    e2 = EngineCore("e2", profile(), storage=pool)
    e1.add_request(SimRequest("a", T_TOKENS[:65], max_tokens=1))
    evs1 = events(run(e1))
    stored = of(evs1, "BlockStored", "STORAGE")
    assert len(stored) == 1
    assert stored[0]["locality"] == "LOCAL" and stored[0]["token_ids"] == T_TOKENS[:64]
    assert stored[0]["block_hashes"] == of(evs1, "BlockStored", "GPU")[0]["block_hashes"]

    e2.add_request(SimRequest("a", T_TOKENS[:65], max_tokens=1))
    outs = run(e2)
    assert finished(outs)["a"].cached_tokens_by_tier == (0, 0, 64)
    # The pool's own figures override the profile's storage figures.
    load_s = 0.004 + 4 * BLOCK_BYTES / 2e5
    assert [o.duration_s for o in outs] == pytest.approx([load_s, OVERHEAD_S + 1 / PREFILL_TOK_PER_S, 0.0])
    # Already in the pool: e2 does not announce it again; it announces the promotion to its GPU.
    assert not of(events(outs), "BlockStored", "STORAGE")
    assert of(events(outs), "BlockStored", "GPU")[0]["block_hashes"] == stored[0]["block_hashes"]
    assert e2.stats().load_bytes_by_tier["STORAGE"] == 4 * BLOCK_BYTES


def test_storage_announces_its_removals_like_vllm() -> None:
    """vLLM 0.33's kvcr tier and disk offload manager send BlockRemoved(medium="STORAGE").
    Prefilled 2 blocks a step, each write fits the 2-block pool and evicts the one before."""
    pool = StoragePool("disk", capacity_blocks=2)
    engine = EngineCore("e0", profile(max_num_batched_tokens=32), storage=pool)
    engine.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    evs = events(run(engine))
    removed = [h for e in of(evs, "BlockRemoved", "STORAGE") for h in e["block_hashes"]]
    stored = [h for e in of(evs, "BlockStored", "STORAGE") for h in e["block_hashes"]]
    assert len(stored) == 6 and removed == stored[:4] and set(pool.hashes()) == set(stored[4:])


def test_storage_evicts_silently() -> None:
    pool = StoragePool("fs", capacity_blocks=2, announce_removals=False)
    engine = EngineCore("e0", profile(max_num_batched_tokens=32), storage=pool)
    engine.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    evs = events(run(engine))
    assert len(pool) == 2
    assert not [e for e in evs if e["type"] == "BlockRemoved" and e["medium"] == "STORAGE"]
    # The pool kept the two youngest blocks, so block 0 misses and nothing of T hits.
    engine.reset_prefix_cache()
    engine.add_request(SimRequest("b", T_TOKENS, max_tokens=1))
    assert finished(run(engine))["b"].cached_tokens == 0


def test_a_connector_reset_empties_the_cpu_tier_and_keeps_the_storage_pool() -> None:
    """vLLM's reset with ``reset_external`` (and its pause) resets the offloading connector: its
    primary (CPU) tier empties, a secondary tier (fs) keeps its data. Catches a reset that keeps the
    CPU tier (the next turn would hit CPU where vLLM promotes from STORAGE), or that empties the
    pool too (no hit at all)."""
    pool = StoragePool("fs", capacity_blocks=100)
    engine = EngineCore("e", profile(num_cpu_blocks=16), storage=pool)
    engine.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    run(engine)
    engine.reset_prefix_cache()
    engine.add_request(SimRequest("b", T_TOKENS, max_tokens=1))
    assert finished(run(engine))["b"].cached_tokens_by_tier == (0, 96, 0)
    engine.reset_prefix_cache(reset_connector=True)
    assert len(engine.cpu or ()) == 0 and len(pool) == 6
    engine.add_request(SimRequest("c", T_TOKENS, max_tokens=1))
    assert finished(run(engine))["c"].cached_tokens_by_tier == (0, 0, 96)


def test_a_connector_reset_makes_a_request_in_flight_offer_its_prompt_again_from_the_first_block() -> None:
    """vLLM's connector reset sets every live request's store progress back to chunk 0: the
    request, preempted by the reset, writes its whole prompt to the emptied CPU tier again. Catches
    a reset that keeps the progress (the blocks offered before it would never reach the tier)."""
    engine = EngineCore("e", profile(num_cpu_blocks=16, max_num_batched_tokens=48))
    engine.add_request(SimRequest("a", T_TOKENS, max_tokens=4))
    for _ in range(4):  # three 48-token chunks: the prompt's six blocks offered, written, landed
        engine.step()
    engine.reset_prefix_cache(reset_connector=True)
    assert engine.has_unfinished() and len(engine.cpu or ()) == 0
    run(engine)
    assert len(engine.cpu or ()) == 6


def _waiting_behind_big(pool: StoragePool) -> EngineCore:
    """An engine whose 10-block GPU pool ``big`` (4 -> 8 blocks, 60 tokens to decode) holds while
    w, sent for T (7 blocks), asks the fs tier about T's blocks (not there: answered no) and waits
    for KV memory."""
    engine = EngineCore("e", profile(num_gpu_blocks=10, num_cpu_blocks=16), storage=pool)
    engine.add_request(SimRequest("big", list(range(5000, 5064)), max_tokens=60))
    engine.step()
    engine.add_request(SimRequest("w", T_TOKENS, max_tokens=1))
    for _ in range(3):  # w asks, is answered, and is refused memory
        assert not finished([engine.step()])
    assert engine.num_waiting() == 1 and len(pool) == 4  # big's prompt, not T
    return engine


def _write_t(pool: StoragePool) -> None:
    """Another engine writes T to the shared pool."""
    writer = EngineCore("e1", profile(num_cpu_blocks=16), storage=pool)
    writer.add_request(SimRequest("t", T_TOKENS, max_tokens=1))
    run(writer)
    assert len(pool) == 10


def test_a_storage_answer_stands_while_a_request_that_asked_for_it_lives() -> None:
    """vLLM's fs tier keeps a lookup's verdict while a request that asked for it is alive
    (AsyncLookupManager: cleanup only on request_finished). w was told T is not there; T reaches
    the pool while w waits; w still recomputes it. Catches a lookup asked again each step (w would
    load T from STORAGE)."""
    pool = StoragePool("fs", capacity_blocks=100)
    engine = _waiting_behind_big(pool)
    _write_t(pool)
    assert finished(run(engine))["w"].cached_tokens_by_tier == (0, 0, 0)


def test_an_aborted_waiting_request_takes_its_storage_answers_with_it() -> None:
    """vLLM's scheduler finishes an aborted waiting request through its connector like any other
    (``finish_requests`` -> ``request_finished``; the tiering manager drops its lookups the next
    step). w asks the fs tier about T's blocks (not there: answered no) and waits for KV memory
    while ``big`` decodes; w is aborted; another engine then writes T to the shared pool. x, sent
    for T, must ask again and load it from STORAGE. Catches an aborted waiting request whose
    answers stand (a stale "no" stops x's walk: x recomputes T)."""
    pool = StoragePool("fs", capacity_blocks=100)
    engine = _waiting_behind_big(pool)
    engine.abort_request("w")
    assert [f.finish_reason for f in engine.step().finished] == ["abort"]  # the step that finishes it
    _write_t(pool)
    engine.add_request(SimRequest("x", T_TOKENS, max_tokens=1))
    assert finished(run(engine))["x"].cached_tokens_by_tier == (0, 0, 96)


def test_storage_loads_are_promoted_through_cpu() -> None:
    pool = StoragePool("fs", capacity_blocks=100)
    e1 = EngineCore("e1", profile(), storage=pool)
    e2 = EngineCore("e2", profile(num_cpu_blocks=16), storage=pool)
    e1.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    run(e1)
    e2.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    run(e2)
    e2.reset_prefix_cache()
    e2.add_request(SimRequest("b", T_TOKENS, max_tokens=1))
    assert finished(run(e2))["b"].cached_tokens_by_tier == (0, 96, 0)


def test_a_promotion_from_storage_may_evict_the_requests_own_cpu_hits_which_then_count_as_storage() -> None:
    """vLLM's tiering manager promotes a STORAGE hit into the CPU tier one block at a time, evicting
    the least recently used block not itself in flight, and its lookup only counts what is resident
    in one pass. Blocks 0-1 of P in a 4-block CPU tier (least recent), blocks 2-3 only in STORAGE:
    promoting 2 and 3 evicts 0 and 1, the next pass promotes those again (evicting Q's blocks), and
    every block of P is served from STORAGE (vLLM labels a promoted block by its source for the
    request). Catches a lookup that counts CPU hits found before the evictions (0, 32, 32), a
    promotion written as one batch that spares the request's blocks, events that stop describing
    the tier. Live: real vLLM with an fs tier gives the same split on all 150 requests
    (tests/vllm/test_sim_parity.py)."""
    pool = StoragePool("fs", capacity_blocks=100)
    engine = EngineCore("e0", profile(num_cpu_blocks=4), storage=pool)
    mirror = EventMirror()
    p_tokens, q_tokens = T_TOKENS[:72], list(range(7000, 7040))  # 4 blocks + 8, 2 blocks + 8
    for rid, tokens in (("p", p_tokens), ("q", q_tokens)):
        engine.add_request(SimRequest(rid, tokens, max_tokens=1))
        mirror.apply(events(run(engine)))
    assert engine.cpu is not None
    held = engine.cpu.hashes()
    assert len(held) == 4 and len(pool) == 6  # P's blocks 0-1 (least recent) and Q's two
    engine.reset_prefix_cache()
    mirror.apply([{"type": "AllBlocksCleared"}])
    engine.add_request(SimRequest("p2", p_tokens, max_tokens=1))
    outs = []
    while engine.has_unfinished():
        outs.append(engine.step())
        mirror.apply(outs[-1].events)
        # A promoted block is announced when its read lands (vLLM: ``complete_write``).
        assert mirror.tiers["CPU"] == set(engine.cpu.hashes()) - engine._cpu_unready
    assert finished(outs)["p2"].cached_tokens_by_tier == (0, 0, 64)
    assert len(of(events(outs), "BlockStored", "CPU")) == 4  # 2, 3, then 0 and 1 again
    assert not set(held[2:]) & set(engine.cpu.hashes())  # Q's blocks went in the second pass


def test_the_offload_tiers_serve_a_whole_prompt_past_the_gpu_prefix() -> None:
    """vLLM looks up the GPU prefix cache first (one block short of a full hit: the last token is
    computed), then the offload tiers from there to the last full block; a full hit from them is
    loaded whole, the last token recomputed, and the whole prompt reported cached. Catches the
    offload hit capped as the GPU's (vLLM with an fs tier served 4 of 150 prompts whole that the
    old model served one block short) and a block counted at the first tier holding it rather
    than in vLLM's order."""
    engine = EngineCore("e0", profile(num_cpu_blocks=32))
    prompt = T_TOKENS[:64]  # exactly 4 blocks
    engine.add_request(SimRequest("a", prompt, max_tokens=1))
    run(engine)
    engine.add_request(SimRequest("b", prompt, max_tokens=2))
    outs = run(engine)
    # GPU holds all four; its prefix stops at three and the CPU tier serves the fourth.
    assert finished(outs)["b"].cached_tokens_by_tier == (48, 16, 0)
    assert len(finished(outs)["b"].output_token_ids) == 2
    engine.reset_prefix_cache()
    engine.add_request(SimRequest("c", prompt, max_tokens=1))
    outs = run(engine)
    assert finished(outs)["c"].cached_tokens_by_tier == (0, 64, 0)
    # The load, then one step computing the last token (and one signalling the finish).
    assert [o.duration_s for o in outs][1:] == pytest.approx([OVERHEAD_S + 1 / PREFILL_TOK_PER_S, 0.0])


def test_a_block_past_the_gpu_prefix_loads_from_its_tier_even_when_the_gpu_pool_holds_it() -> None:
    """vLLM looks up the offload tiers from the end of the GPU prefix, so a later block the GPU pool
    also holds is loaded from the CPU tier into a block of its own, and counted as a CPU hit; the
    pool keeps one cached copy (the load's stays anonymous). Catches a block counted as a GPU hit
    out of order, and a request that would release a cached block it never held (KeyError)."""
    engine = EngineCore("e0", profile(num_cpu_blocks=32))
    prompt = T_TOKENS[:72]  # 4 blocks + 8 tokens
    engine.add_request(SimRequest("a", prompt, max_tokens=1))
    outs = run(engine)
    hashes = of(events(outs), "BlockStored", "GPU")[0]["block_hashes"]
    engine.reset_prefix_cache()
    # The GPU pool holds block 2 alone (cached, unpinned), as after an out-of-order eviction.
    engine.gpu.allocate(1, [])
    assert engine.gpu.commit(hashes[2])
    engine.gpu.release(hashes[2])
    engine.add_request(SimRequest("b", prompt, max_tokens=1))
    outs = run(engine)
    assert finished(outs)["b"].cached_tokens_by_tier == (0, 64, 0)
    assert engine.gpu.num_used() == 0 and engine.gpu.cached_hashes() == set(hashes)


def test_a_cpu_tier_smaller_than_the_storage_hit_loads_what_it_holds() -> None:
    """Promoting a 6-block STORAGE hit through a 4-block CPU tier never leaves all six resident:
    vLLM's lookup retries forever (its engine stalled so, docs/results/cpu-tier.md). The simulator
    stops promoting after as many walks as blocks and loads the resident prefix (here none: the
    last walk's promotions evicted block 0), so the run finishes. Catches a lookup that loops
    forever or counts blocks the tier no longer holds."""
    pool = StoragePool("fs", capacity_blocks=100)
    writer = EngineCore("w", profile(), storage=pool)
    writer.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    run(writer)
    engine = EngineCore("e0", profile(num_cpu_blocks=4), storage=pool)
    engine.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    gpu, cpu, storage = finished(run(engine))["a"].cached_tokens_by_tier
    assert gpu == cpu == 0 and storage <= 4 * 16
    assert engine.cpu is not None and len(engine.cpu) == 4


def test_reset_prefix_cache_clears_gpu_only_and_preempts_running() -> None:
    engine = EngineCore("e0", profile(num_cpu_blocks=16))
    engine.add_request(SimRequest("a", T_TOKENS, max_tokens=1))
    run(engine)
    engine.add_request(SimRequest("r", list(range(3000, 3040)), max_tokens=5))
    engine.step()
    engine.reset_prefix_cache()
    out = engine.step()
    assert out.events[0] == {"type": "AllBlocksCleared"}
    assert engine.stats().num_preemptions == 1
    done = finished([out, *run(engine)])
    assert len(done["r"].output_token_ids) == 5
    engine.add_request(SimRequest("b", T_TOKENS, max_tokens=1))
    assert finished(run(engine))["b"].cached_tokens_by_tier == (0, 96, 0)


# ---------------------------------------------------------------- events as vLLM sends them


def _fixture_events() -> list[dict[str, Any]]:
    out = []
    for line in FIXTURE.read_text().splitlines():
        frame = json.loads(line)
        if frame["kind"] == "pub":
            out.extend(frame["decoded"][1])
    return out


def test_event_shapes_match_recorded_vllm_frames() -> None:
    golden = _fixture_events()

    def golden_keys(kind: str, medium: str | None, salted: bool = False) -> list[str]:
        for e in golden:
            if e["type"] == kind and e.get("medium") == medium and ("extra_keys" in e) == salted:
                return list(e)
        raise AssertionError(f"no {kind}/{medium} in fixture")

    pool = StoragePool("fs", capacity_blocks=100)
    engine = EngineCore("e0", profile(num_gpu_blocks=10, num_cpu_blocks=32), storage=pool)
    engine.add_request(SimRequest("t", T_TOKENS, max_tokens=1))
    engine.add_request(SimRequest("s", T_TOKENS[:32], max_tokens=1, cache_salt="tenant-b"))
    engine.add_request(SimRequest("x", list(range(5000, 5100)), max_tokens=1))
    outs = run(engine)
    engine.reset_prefix_cache()
    outs.append(engine.step())
    evs = events(outs)

    gpu_stored = of(evs, "BlockStored", "GPU")
    plain = [e for e in gpu_stored if "extra_keys" not in e]
    salted = [e for e in gpu_stored if "extra_keys" in e]
    assert plain and all(list(e) == golden_keys("BlockStored", "GPU") for e in plain)
    assert [list(e) for e in salted] == [golden_keys("BlockStored", "GPU", salted=True)]
    assert salted[0]["extra_keys"] == [["tenant-b"], None]
    assert salted[0]["token_ids"] == T_TOKENS[:32]
    # Same tokens, different salt: different engine hashes (never a hit across tenants).
    assert set(salted[0]["block_hashes"]).isdisjoint(plain[0]["block_hashes"])
    cpu_stored = of(evs, "BlockStored", "CPU")
    assert cpu_stored and all(list(e) == golden_keys("BlockStored", "CPU") for e in cpu_stored)
    storage = of(evs, "BlockStored", "STORAGE")
    assert storage and all(e["locality"] == "LOCAL" for e in storage)
    assert all(list(e) == golden_keys("BlockStored", "STORAGE") for e in storage if "extra_keys" not in e)
    salted_storage = [e for e in storage if "extra_keys" in e]
    assert [e["extra_keys"] for e in salted_storage] == [[["tenant-b"], None]]
    removed = of(evs, "BlockRemoved", "GPU")
    assert removed and all(list(e) == golden_keys("BlockRemoved", "GPU") for e in removed)
    assert evs[-1] == {"type": "AllBlocksCleared"}
    # Event hashes are unsigned 64-bit ints, as vLLM's default int block hashes.
    assert all(0 <= h < 2**64 for e in evs for h in e.get("block_hashes", []))


def test_lora_is_folded_into_every_block() -> None:
    engine = EngineCore("e0", profile())
    engine.add_request(SimRequest("l", T_TOKENS[:33], max_tokens=1, lora_name="sql", cache_salt="t"))
    stored = of(events(run(engine)), "BlockStored", "GPU")[0]
    assert stored["lora_name"] == "sql"
    assert stored["extra_keys"] == [["sql", "t"], ["sql"]]
    # The router's key function fed the same extra keys gives one key per stored block.
    keys = block_keys(stored["token_ids"], 16, extra_keys=stored["extra_keys"])
    assert len(keys) == len(stored["block_hashes"]) == 2


def test_emit_events_off_changes_nothing_but_the_events() -> None:
    def workload(emit: bool) -> tuple[list[float], list[dict[str, list[int]]], list[int]]:
        engine = EngineCore(
            "e0",
            profile(num_gpu_blocks=12, num_cpu_blocks=8, emit_events=emit),
            storage=StoragePool("fs", 50),
        )
        for i in range(6):
            engine.add_request(SimRequest(f"r{i}", T_TOKENS[: 40 + 10 * i], max_tokens=3))
        outs = run(engine)
        assert emit or not events(outs)
        return [o.duration_s for o in outs], [o.new_token_ids for o in outs], [engine.stats().num_steps]

    assert workload(True) == workload(False)


# ---------------------------------------------------------------- trace mode and determinism


def test_trace_mode_uses_block_ids_with_block_size_tokens_each() -> None:
    engine = EngineCore("e0", profile())
    engine.add_request(SimRequest("t1", [], max_tokens=2, block_ids=[11, 12, 13, 14], prompt_len=60))
    outs = run(engine)
    assert outs[0].duration_s == pytest.approx(OVERHEAD_S + 60 / PREFILL_TOK_PER_S)
    stored = of(events(outs), "BlockStored", "GPU")
    assert len(stored) == 1
    # 60 tokens = 3 full blocks; the 4th id names a partial block and is never cached.
    assert stored[0]["token_ids"] == [11, 12, 13] and stored[0]["block_size"] == 1
    # Keys the router derives from the request's ids equal those from the event.
    assert block_keys([11, 12, 13], 1) == block_keys(stored[0]["token_ids"], 1)

    engine.add_request(SimRequest("t2", [], max_tokens=1, block_ids=[11, 12, 99]))  # 48 tokens
    outs = run(engine)
    assert finished(outs)["t2"].cached_tokens == 32
    assert outs[0].duration_s == pytest.approx(OVERHEAD_S + 16 / PREFILL_TOK_PER_S)
    extension = of(events(outs), "BlockStored", "GPU")[0]
    assert extension["token_ids"] == [99] and extension["parent_block_hash"] == stored[0]["block_hashes"][1]


def test_same_seed_same_run_other_seed_other_tokens() -> None:
    def trace(seed: int) -> list[tuple[float, dict[str, list[int]], list[dict[str, Any]]]]:
        engine = EngineCore("e0", profile(num_gpu_blocks=20, num_cpu_blocks=10), seed=seed)
        for i in range(8):
            engine.add_request(SimRequest(f"r{i}", T_TOKENS[: 20 + 11 * i], max_tokens=4 + i))
        return [(o.duration_s, o.new_token_ids, o.events) for o in run(engine)]

    assert trace(1) == trace(1)
    assert [t[1] for t in trace(1)] != [t[1] for t in trace(2)]


def test_scaled_down_profile() -> None:
    base = EngineProfile(num_cpu_blocks=1000)
    small = base.scaled_down(100)
    assert (small.num_gpu_blocks, small.num_cpu_blocks) == (278, 10)
    assert small.prefill_tokens_per_s == base.prefill_tokens_per_s
    assert EngineProfile().scaled_down(10).num_cpu_blocks == 0
    with pytest.raises(ValueError, match="factor"):
        base.scaled_down(0.5)


def test_default_profile_matches_reference_numbers() -> None:
    p = EngineProfile()
    host_reload_s_per_token = p.kv_bytes_per_token / p.cpu_load_bytes_per_s
    recompute_s_per_token = 1 / p.prefill_tokens_per_s
    assert 20 <= recompute_s_per_token / host_reload_s_per_token <= 24
    assert p.num_gpu_blocks * p.block_size == 445_632


# ---------------------------------------------------------------- asynchronous loads, context costs

CPU_LOAD_4_BLOCKS_S = CPU_LAT_S + 4 * BLOCK_BYTES / CPU_BW  # 0.066 s


def engine_with_a_in_cpu_only(**overrides: Any) -> EngineCore:
    """An engine whose CPU tier holds T's first 4 blocks and whose GPU holds nothing."""
    engine = EngineCore("e0", profile(num_cpu_blocks=32, **overrides))
    engine.add_request(SimRequest("a", T_TOKENS[:65], max_tokens=1))
    run(engine)
    engine.reset_prefix_cache()
    return engine


def test_async_cpu_load_overlaps_the_running_decode() -> None:
    engine = engine_with_a_in_cpu_only()
    engine.add_request(SimRequest("d", list(range(5000, 5017)), max_tokens=50))
    engine.step()  # d's prefill
    t0 = engine.now_s
    engine.add_request(SimRequest("a2", T_TOKENS[:49], max_tokens=2))  # 3 blocks in CPU
    outs = [engine.step() for _ in range(7)]
    load_s = CPU_LAT_S + 3 * BLOCK_BYTES / CPU_BW  # 0.050 s
    # d decodes every step while a2's blocks cross the link: no step stalls.
    decode_step_s = OVERHEAD_S + DECODE_S  # 0.011 s
    assert [o.duration_s for o in outs[:5]] == pytest.approx([decode_step_s] * 5)
    assert all("d" in o.new_token_ids for o in outs)
    # The first step starting after the load lands (t0 + 5 x 0.011 = 0.055 >= 0.050) computes a2's
    # last prompt token next to d's decode.
    assert [("a2" in o.new_token_ids) for o in outs] == [False] * 5 + [True, True]
    assert outs[5].duration_s == pytest.approx(OVERHEAD_S + 1 / PREFILL_TOK_PER_S + DECODE_S)
    assert 4 * decode_step_s < load_s <= 5 * decode_step_s
    first_token_s = t0 + 5 * decode_step_s + outs[5].duration_s
    assert first_token_s - t0 == pytest.approx(0.067)
    assert finished(outs + run(engine))["a2"].cached_tokens_by_tier == (0, 48, 0)


def test_legacy_model_stalls_the_whole_step_for_the_load() -> None:
    engine = engine_with_a_in_cpu_only()
    engine.profile = engine.profile.legacy_model()
    # legacy_model restores the 60 us decode; use the test's own figure to compare by hand.
    engine.profile.decode_s_per_seq = DECODE_S
    engine.add_request(SimRequest("d", list(range(5000, 5017)), max_tokens=50))
    engine.step()
    engine.add_request(SimRequest("a2", T_TOKENS[:65], max_tokens=2))
    out = engine.step()
    assert out.duration_s == pytest.approx(
        OVERHEAD_S + DECODE_S + 1 / PREFILL_TOK_PER_S + CPU_LOAD_4_BLOCKS_S
    )
    assert {"d", "a2"} <= set(out.new_token_ids)


def test_loads_queue_on_one_link_per_engine() -> None:
    engine = EngineCore("e0", profile(num_cpu_blocks=32))
    b_tokens = list(range(7000, 7033))  # 2 full blocks + 1
    for rid, toks in (("a", T_TOKENS[:65]), ("b", b_tokens)):
        engine.add_request(SimRequest(rid, toks, max_tokens=1))
    run(engine)
    engine.reset_prefix_cache()
    t0 = engine.now_s
    engine.add_request(SimRequest("a2", T_TOKENS[:65], max_tokens=1))
    engine.add_request(SimRequest("b2", b_tokens, max_tokens=1))
    outs = run(engine)
    done = {}
    t = t0
    for o in outs:
        t += o.duration_s
        for rid in o.new_token_ids:
            done.setdefault(rid, t - t0)
    a_ready = CPU_LOAD_4_BLOCKS_S  # 0.066
    b_ready = 4 * BLOCK_BYTES / CPU_BW + CPU_LAT_S + 2 * BLOCK_BYTES / CPU_BW  # queued behind a2: 0.098
    assert outs[0].duration_s == pytest.approx(a_ready)  # idle until the first load lands
    assert done["a2"] == pytest.approx(a_ready + OVERHEAD_S + 1 / PREFILL_TOK_PER_S)
    # b2 lands at 0.098: after a2's step (0.066-0.077) the engine idles until then.
    assert done["b2"] == pytest.approx(b_ready + OVERHEAD_S + 1 / PREFILL_TOK_PER_S)
    assert engine.stats().load_time_s_by_tier["CPU"] == pytest.approx(a_ready + (b_ready - 0.064))


def test_shared_pool_bandwidth_is_shared_by_its_engines_reads_and_writes() -> None:
    # Each engine reads at 1e5 B/s; the pool as a whole moves 1e5 B/s too, so two engines'
    # loads at the same instant take turns.
    pool = StoragePool("fs", capacity_blocks=100, shared_bytes_per_s=STO_BW)
    writer = EngineCore("w", profile(), storage=pool)
    writer.add_request(SimRequest("a", T_TOKENS[:65], max_tokens=1))
    run(writer)
    # The write of 4 blocks booked 0.64 s of the pool's bandwidth from the write's step start (0).
    assert pool.busy_until_s == pytest.approx(4 * BLOCK_BYTES / STO_BW)
    readers = [EngineCore(f"r{i}", profile(), storage=pool) for i in range(2)]
    start_s = 1.0  # after the write
    ready = []
    for r in readers:
        r.add_request(SimRequest("a", T_TOKENS[:65], max_tokens=1))
        out = r.step(start_s)
        ready.append(start_s + out.duration_s)
    transfer_s = 4 * BLOCK_BYTES / STO_BW  # 0.64 s on either the engine's link or the pool
    assert ready[0] == pytest.approx(start_s + transfer_s + STO_LAT_S)
    assert ready[1] == pytest.approx(start_s + 2 * transfer_s + STO_LAT_S)
    # Without a shared limit a booking costs nothing.
    assert StoragePool("fs2", capacity_blocks=100).reserve(5.0, 1e9) == 5.0


def test_writes_to_a_shared_pool_delay_its_reads() -> None:
    pool = StoragePool("fs", capacity_blocks=100, shared_bytes_per_s=STO_BW)
    e1 = EngineCore("e1", profile(), storage=pool)
    e1.add_request(SimRequest("a", T_TOKENS[:65], max_tokens=1))
    run(e1)
    e2 = EngineCore("e2", profile(), storage=pool)
    e2.add_request(SimRequest("a", T_TOKENS[:65], max_tokens=1))
    out = e2.step(0.0)  # at 0 the pool is still busy with e1's write until 0.64 s
    assert out.duration_s == pytest.approx(2 * 4 * BLOCK_BYTES / STO_BW + STO_LAT_S)


def test_prefill_attention_grows_with_context_and_decode_reads_the_kv() -> None:
    attn_s = 1e-6  # per prefill token per token of context before it
    hbm = 16e6  # bytes/s: a 1,000-byte token of KV costs 62.5 us to read per decode step
    engine = EngineCore(
        "e0", profile(prefill_attention_s_per_token_ctx=attn_s, hbm_bytes_per_s=hbm, num_gpu_blocks=64)
    )
    engine.add_request(SimRequest("a", list(range(100)), max_tokens=3))
    outs = run(engine)
    # Prefill of 100 tokens from scratch: token j attends to j tokens before it: 0+1+...+99 = 4,950.
    assert outs[0].duration_s == pytest.approx(OVERHEAD_S + 100 / PREFILL_TOK_PER_S + 4950 * attn_s)
    # Decodes read the KV of the 100 and 101 tokens before the new one.
    assert outs[1].duration_s == pytest.approx(OVERHEAD_S + DECODE_S + 100 * 1000 / hbm)
    assert outs[2].duration_s == pytest.approx(OVERHEAD_S + DECODE_S + 101 * 1000 / hbm)

    # With a GPU prefix hit of 96 tokens only the last 4 are computed, each over 96+ tokens.
    engine.add_request(SimRequest("b", list(range(100)), max_tokens=1))
    out = run(engine)[0]
    assert out.duration_s == pytest.approx(OVERHEAD_S + 4 / PREFILL_TOK_PER_S + (96 + 97 + 98 + 99) * attn_s)


def test_chunked_prefill_attention_counts_the_chunks_before() -> None:
    attn_s = 1e-6
    engine = EngineCore(
        "e0", profile(prefill_attention_s_per_token_ctx=attn_s, max_num_batched_tokens=60, num_gpu_blocks=64)
    )
    engine.add_request(SimRequest("a", list(range(100)), max_tokens=1))
    outs = run(engine)
    first = sum(range(60))  # tokens 0..59
    second = sum(range(60, 100))  # tokens 60..99 over everything before them
    assert [o.duration_s for o in outs] == pytest.approx(
        [
            OVERHEAD_S + 60 / PREFILL_TOK_PER_S + first * attn_s,
            OVERHEAD_S + 40 / PREFILL_TOK_PER_S + second * attn_s,
        ]
    )


def test_counter_noise_blurs_measured_times_not_bytes_and_is_seeded() -> None:
    def measured() -> tuple[int, float]:
        engine = engine_with_a_in_cpu_only(counter_noise=0.3)
        engine.add_request(SimRequest("a2", T_TOKENS[:65], max_tokens=1))
        run(engine)
        st_ = engine.stats()
        return st_.load_bytes_by_tier["CPU"], st_.load_time_s_by_tier["CPU"]

    nbytes, noisy_s = measured()
    assert nbytes == 4 * BLOCK_BYTES
    assert noisy_s != pytest.approx(CPU_LOAD_4_BLOCKS_S, rel=1e-3)
    assert 0.2 * CPU_LOAD_4_BLOCKS_S < noisy_s < 5 * CPU_LOAD_4_BLOCKS_S
    assert measured() == (nbytes, noisy_s)


def test_default_profile_context_costs_match_published_figures() -> None:
    p = EngineProfile()
    # Reading a 40K-token KV cache on an H100 (3.35 TB/s) takes ~1.6 ms per decode step.
    assert 40_000 * p.kv_bytes_per_token / p.hbm_bytes_per_s == pytest.approx(1.565e-3, rel=0.01)
    # Attention FLOPs of Llama-3-8B (4 x 32 layers x 4096) at the prefill's own FLOP rate
    # (2 x 8.03e9 FLOPs per token at 22,000 tokens/s).
    flops_per_s = 2 * 8.03e9 * p.prefill_tokens_per_s
    assert p.prefill_attention_s_per_token_ctx == pytest.approx(4 * 32 * 4096 / flops_per_s, rel=0.01)
    assert p.async_loads and p.legacy_model().async_loads is False


# ---------------------------------------------------------------- invariants under random workloads


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    prefixes = [list(range(k * 1000, k * 1000 + 80)) for k in range(3)]
    requests = []
    for i in range(draw(st.integers(1, 10))):
        base = prefixes[draw(st.integers(0, 2))]
        cut = draw(st.integers(1, 80))
        tail = [9000 + i] * draw(st.integers(0, 20))
        requests.append(
            SimRequest(
                f"r{i}",
                base[:cut] + tail,
                max_tokens=draw(st.integers(1, 12)),
                cache_salt=draw(st.sampled_from([None, None, "s"])),
            )
        )
    return {
        "profile": profile(
            num_gpu_blocks=draw(st.integers(8, 30)),
            num_cpu_blocks=draw(st.sampled_from([0, 4, 12])),
            max_num_batched_tokens=draw(st.integers(8, 64)),
            max_num_seqs=draw(st.integers(1, 4)),
        ),
        "storage": draw(st.sampled_from([None, 6, 40])),
        "requests": requests,
        "ops": draw(st.lists(st.sampled_from(["step", "step", "step", "abort", "reset"]), max_size=30)),
    }


# derandomize: the examples are fixed, so `make test` is deterministic. Run it with fresh draws
# after changing the engine (KVROUTE_HYPOTHESIS_DRAWS=N): it found the CPU-tier write bug below.
@settings(
    max_examples=int(os.environ.get("KVROUTE_HYPOTHESIS_DRAWS", 60)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize="KVROUTE_HYPOTHESIS_DRAWS" not in os.environ,
)
@given(workloads())
def test_events_always_describe_the_cache_and_everything_finishes(w: dict[str, Any]) -> None:
    pool = StoragePool("fs", w["storage"]) if w["storage"] else None
    engine = EngineCore("e0", w["profile"], storage=pool)
    for req in w["requests"]:
        engine.add_request(req)
    mirror = EventMirror()
    done: dict[str, FinishedRequest] = {}
    aborted = 0
    ops = list(w["ops"])
    while engine.has_unfinished():
        op = ops.pop(0) if ops else "step"
        if op == "abort":
            live = [r.request_id for r in w["requests"] if r.request_id not in done]
            if live:
                engine.abort_request(live[-1])
                aborted += 1
            continue
        if op == "reset":
            engine.reset_prefix_cache()
            continue
        out = engine.step()
        for f in out.finished:
            done[f.request_id] = f
        mirror.apply(out.events)
        gpu = engine.gpu
        assert 0 <= gpu.num_used() <= gpu.num_blocks
        assert mirror.tiers["GPU"] == gpu.cached_hashes()
        if engine.cpu is not None:  # the events announce the writes that have landed
            assert mirror.tiers["CPU"] == set(engine.cpu.hashes()) - engine._cpu_unready
        if pool is not None:
            assert set(pool.hashes()) == mirror.tiers["STORAGE"]
    assert set(done) == {r.request_id for r in w["requests"]}
    for req in w["requests"]:
        f = done[req.request_id]
        if f.finish_reason == "length":
            assert len(f.output_token_ids) == req.max_tokens
        assert f.cached_tokens <= len(req.prompt_token_ids) - 1
    assert engine.gpu.num_used() == 0


# ------------------------------------------------------------------ admission and preemption as vLLM


def test_a_waiting_request_is_admitted_only_if_its_whole_sequence_fits() -> None:
    """vLLM's scheduler_reserve_full_isl (on by default). Pool of 16 blocks, 100-token budget,
    two 160-token prompts (10 blocks each). a's last 60 tokens leave 40 of budget in step 2: b's
    first chunk (3 blocks) fits the 6 free blocks, its whole prompt does not. Admitted on its first
    chunk (the old model) b grows into a's blocks and somebody is preempted; with vLLM's gate b
    waits for a and nothing is."""
    for full_isl, preemptions in ((True, 0), (False, 1)):
        engine = EngineCore(
            "e0", profile(num_gpu_blocks=16, max_num_batched_tokens=100, reserve_full_isl=full_isl)
        )
        engine.add_request(SimRequest("a", list(range(160)), max_tokens=20))
        engine.add_request(SimRequest("b", list(range(1000, 1160)), max_tokens=20))
        engine.step()
        engine.step()
        assert engine.stats().num_running == (1 if full_isl else 2)
        outs = run(engine)
        assert engine.stats().num_preemptions >= preemptions
        if full_isl:
            assert engine.stats().num_preemptions == 0
        assert {f.request_id: len(f.output_token_ids) for o in outs for f in o.finished} == {"a": 20, "b": 20}
        assert engine.gpu.num_used() == 0


def test_wait_records_say_a_request_waited_for_kv_blocks_not_for_prefill() -> None:
    """The same pool: b waits one step for budget (a's first chunk takes all 100 tokens), then for
    KV blocks while a finishes its prefill and its 19 decodes (b's whole prompt does not fit), then
    is served. Catches: the KV wait booked as prefill queue (the step's reason taken from the
    budget), the step that admits b counted as its wait, or a wait after admission counted."""
    engine = EngineCore("e0", profile(num_gpu_blocks=16, max_num_batched_tokens=100))
    engine.wait_records = {}
    engine.add_request(SimRequest("a", list(range(160)), max_tokens=20))
    engine.add_request(SimRequest("b", list(range(1000, 1160)), max_tokens=20))
    run(engine)
    a, b = engine.wait_records["a"], engine.wait_records["b"]
    first_chunk_s, second_chunk_s, decode_s = OVERHEAD_S + 0.1, OVERHEAD_S + 0.06, OVERHEAD_S + DECODE_S
    assert a.waits_s == (0.0, 0.0, 0.0, 0.0) and a.admitted_s == 0.0 and a.preempted_s == -1.0
    assert a.first_token_s == pytest.approx(first_chunk_s + second_chunk_s)
    waits = dict(zip(WAIT_REASONS, b.waits_s, strict=True))
    assert waits["budget"] == pytest.approx(first_chunk_s)
    assert waits["kv"] == pytest.approx(second_chunk_s + 19 * decode_s)
    assert waits["seqs"] == waits["preempt"] == 0.0
    assert b.admitted_s == pytest.approx(first_chunk_s + second_chunk_s + 19 * decode_s)
    assert b.first_token_s == pytest.approx(b.admitted_s + first_chunk_s + second_chunk_s)
    assert b.preempted_s == -1.0


def test_a_request_whose_kv_is_still_loading_is_never_preempted() -> None:
    """In vLLM a request loading its KV waits in WAITING_FOR_REMOTE_KVS, not in ``running``, so the
    scheduler cannot choose it as a victim. Here l (priority 9, the largest) loads 4 blocks from a
    slow CPU tier (0.64 s) while r (priority 0) decodes into a full pool of 7 blocks: r must preempt
    itself, not l, and l finishes first. (Taking l as the victim throws its load away.)"""
    engine = EngineCore(
        "e0",
        profile(num_gpu_blocks=7, num_cpu_blocks=32, cpu_load_bytes_per_s=1e5, scheduling_policy="priority"),
    )
    shared = list(range(500, 564))  # 4 blocks, written through to the CPU tier
    engine.add_request(SimRequest("w", shared, max_tokens=1))
    run(engine)
    engine.reset_prefix_cache()  # only the CPU copy is left
    engine.add_request(SimRequest("r", list(range(32)), max_tokens=40, priority=0))
    engine.add_request(SimRequest("l", [*shared, 9], max_tokens=2, priority=9))
    outs = run(engine)
    order = [f.request_id for o in outs for f in o.finished]
    assert order == ["l", "r"]
    assert engine.stats().num_preemptions >= 1
    fin = finished(outs)
    assert fin["l"].cached_tokens_by_tier == (0, 64, 0)
    assert len(fin["r"].output_token_ids) == 40
    assert engine.gpu.num_used() == 0


def test_a_victim_scheduled_earlier_in_the_step_gives_its_share_back() -> None:
    """vLLM's priority scheduler preempts the running request with the largest (priority, arrival),
    which may come before the one that needs a block and be scheduled in this step already; it then
    drops that request from the step and returns its tokens to the budget (scheduler.py: "if
    preempted_req in scheduled_running_reqs": ``token_budget += num_scheduled_tokens.pop(...)``).
    Here A (priority 2, admitted first) decodes, B (priority 0) decodes into a full 7-block pool and
    preempts A, and C (priority 1, behind them) is prefilling with an 8-token budget. Catches a
    victim left in the step (3 requests scheduled, A's decode timed) and a share not given back
    (C's chunk 6 tokens, not 7). The live late-arrival check cannot tell these apart: a decode's one
    token never binds its 512-token budget."""
    engine = EngineCore(
        "e0", profile(num_gpu_blocks=7, max_num_batched_tokens=8, scheduling_policy="priority")
    )
    engine.add_request(SimRequest("A", list(range(100, 115)), max_tokens=60, priority=2))
    for step in range(23):
        if step == 3:
            engine.add_request(SimRequest("B", list(range(200, 215)), max_tokens=60, priority=0))
        if step == 18:
            engine.add_request(SimRequest("C", list(range(300, 340)), max_tokens=4, priority=1))
        assert engine.stats().num_preemptions == 0
        engine.step()
    assert [r.request.request_id for r in engine._running] == ["A", "B", "C"]
    b = engine._running[1]
    assert -(-b.num_tokens // 16) > len(b.blocks)  # B's next token needs a block: none is free
    assert engine.gpu.num_free() == 0
    out = engine.step()
    assert engine.stats().num_preemptions == 1
    assert [r.request.request_id for r in engine._running] == ["B", "C"]
    assert (out.num_scheduled, list(out.new_token_ids), out.num_prefill_tokens) == (2, ["B"], 7)
    assert out.duration_s == pytest.approx(OVERHEAD_S + DECODE_S + 7 / PREFILL_TOK_PER_S)
    fin = finished(run(engine))
    assert {rid: len(f.output_token_ids) for rid, f in fin.items()} == {"A": 60, "B": 60, "C": 4}


def test_max_num_seqs_and_token_budget_default_to_vllm_serve_on_an_h100() -> None:
    """vLLM's EngineArgs.get_batch_defaults for the API server on a GPU of >= 70 GiB (not A100):
    max_num_seqs 1,024 (256 was the LLM-class / smaller-GPU figure), max_num_batched_tokens 8,192."""
    default = EngineProfile()
    assert (default.max_num_seqs, default.max_num_batched_tokens) == (1024, 8192)
    engine = EngineCore("e0", profile(num_gpu_blocks=2000, max_num_batched_tokens=8192))
    for i in range(600):
        engine.add_request(SimRequest(f"r{i}", [i, i + 1], max_tokens=2))
    engine.step()
    assert engine.stats().num_running == 600


def test_cpu_tier_events_after_a_reset_describe_the_tier() -> None:
    """The draw the property above found (2026-12-05): after a prefix-cache reset, recomputed
    requests write more blocks to a 4-block CPU tier in one step than it holds. The engine stored
    them all, evicting some of the write's own blocks and announcing their removal before their
    store, so a reader kept blocks the tier no longer had. vLLM refuses such a write whole."""
    engine = EngineCore(
        "e0",
        profile(num_gpu_blocks=10, num_cpu_blocks=4, max_num_batched_tokens=37, max_num_seqs=2),
        storage=StoragePool("fs", 40),
    )
    prompts = [list(range(1000, 1044)) + [9000] * 20, list(range(60)) + [9001] * 20, *[[0]] * 4]
    for i, (prompt, max_tokens) in enumerate(zip(prompts, [4, 2, 1, 1, 1, 1], strict=True)):
        engine.add_request(SimRequest(f"r{i}", prompt, max_tokens=max_tokens, ignore_eos=True))
    mirror = EventMirror()
    ops = ["step", "step", "step", "step", "reset"]
    while engine.has_unfinished():
        if (ops.pop(0) if ops else "step") == "reset":
            engine.reset_prefix_cache()
            continue
        mirror.apply(engine.step().events)
        assert engine.cpu is not None
        assert mirror.tiers["CPU"] == set(engine.cpu.hashes()) - engine._cpu_unready


def test_blocks_are_cached_when_scheduled_so_a_request_later_in_the_same_step_hits_them() -> None:
    """vLLM's ``allocate_slots`` gives a request's blocks their hashes as it is scheduled, before
    the step computes them. 16-token blocks, budget 200, a = 240 tokens, b = a's 240 and 20 of its
    own, both waiting. Step 1 computes a's first 200 tokens (blocks 0-11; b gets no budget). Step
    2 schedules a's last 40 (blocks 12-14), then b, which hits all 15 blocks, 3 of them scheduled in
    this very step, and computes 20 tokens (its block 15). Caught on real vLLM
    (tests/vllm/test_sim_parity.py): the previous model cached blocks after the step, so b hit 12
    blocks (192 tokens) and computed 3 of a's again."""
    engine = EngineCore("e0", profile(num_gpu_blocks=64, max_num_batched_tokens=200))
    prompt_a = list(range(240))
    engine.add_request(SimRequest("a", prompt_a, max_tokens=4))
    engine.add_request(SimRequest("b", prompt_a + list(range(5000, 5020)), max_tokens=4))
    first = engine.step()
    assert first.num_prefill_tokens == 200
    second = engine.step()
    assert second.num_prefill_tokens == 40 + 20
    stored = [
        (len(e["block_hashes"]), e["parent_block_hash"]) for e in second.events if e["type"] == "BlockStored"
    ]
    a_block_14 = second.events[0]["block_hashes"][-1]
    assert stored == [(3, first.events[-1]["block_hashes"][-1]), (1, a_block_14)]
    done = finished([first, second, *run(engine)])
    assert done["b"].cached_tokens_by_tier == (240, 0, 0)


def test_a_cpu_write_lands_a_step_later_and_a_lookup_reaching_it_waits() -> None:
    """vLLM's offloading worker reports a write at the end of the step after the one that made it
    (checked against real vLLM: the CPU BlockStored events come one batch after their GPU ones).
    Till then a lookup that reaches one of its blocks is deferred (HIT_PENDING): the scheduler
    skips that request and admits the next. Catches a write announced at once, a lookup that
    loads blocks not written yet, and a deferred request that blocks the queue behind it."""
    engine = EngineCore("e0", profile(num_cpu_blocks=16))
    a = list(range(64))  # 4 blocks
    engine.add_request(SimRequest("a", a, max_tokens=1))
    first = engine.step()
    assert "a" in finished([first]) and not of(first.events, "BlockStored", "CPU")
    engine.reset_prefix_cache()  # the GPU copies go: b's lookup reaches the CPU tier
    engine.add_request(SimRequest("b", a + list(range(500, 516)), max_tokens=1))
    engine.add_request(SimRequest("c", list(range(900, 932)), max_tokens=1))
    second = engine.step()
    assert len([h for e in of(second.events, "BlockStored", "CPU") for h in e["block_hashes"]]) == 4
    assert "c" in finished([second]) and engine.num_waiting() == 1  # b waited, c went ahead
    done = finished(run(engine))
    assert done["b"].cached_tokens_by_tier == (0, 64, 0)


def test_cpu_blocks_a_load_reads_cannot_be_evicted_until_it_lands() -> None:
    """vLLM's offloading manager counts the loads reading a block (ref_cnt): such a block is not
    evictable, so a write that would need it is refused. A 4-block tier holds a's 4 blocks; b
    loads them (66 ms on this profile's link) while c, admitted in the same step, writes 2 blocks.
    Catches a write evicting blocks a load in flight reads."""
    engine = EngineCore("e0", profile(num_cpu_blocks=4))
    a = list(range(64))
    engine.add_request(SimRequest("a", a, max_tokens=1))
    run(engine)
    assert engine.cpu is not None and len(engine.cpu) == 4
    held = set(engine.cpu.hashes())
    engine.reset_prefix_cache()
    engine.add_request(SimRequest("b", a + [7] * 8, max_tokens=1))
    engine.add_request(SimRequest("c", list(range(900, 932)), max_tokens=1))
    out = engine.step()
    assert "c" in finished([out])  # c computed and offered its write in this step
    assert set(engine.cpu.hashes()) == held and not of(out.events, "BlockRemoved", "CPU")
    assert finished(run(engine))["b"].cached_tokens_by_tier == (0, 64, 0)


def test_loaded_blocks_are_cached_when_the_load_lands_and_a_lookup_reaching_them_waits() -> None:
    """vLLM caches a request's loaded blocks only when its load lands (the request waits among
    the waiting meanwhile), and its connector delays a request whose hits are being loaded. b loads
    a's 4 blocks from the CPU tier (66 ms on this profile's link); c, queued behind it with the same
    prefix, waits and then hits b's GPU copies. Catches loaded blocks announced (and hit) at
    admission, and c loading the same blocks again."""
    engine = EngineCore("e0", profile(num_cpu_blocks=16))
    a = list(range(64))
    engine.add_request(SimRequest("a", a, max_tokens=1))
    run(engine)
    engine.reset_prefix_cache()
    engine.add_request(SimRequest("b", a + [7] * 8, max_tokens=1))
    engine.add_request(SimRequest("c", a + [8] * 8, max_tokens=1))
    first = engine.step()
    assert not of(first.events, "BlockStored", "GPU") and engine.num_running() == 0
    assert engine.num_waiting() == 2  # b loading, c deferred
    outs = [first, *run(engine)]
    landed = next(i for i, o in enumerate(outs) if of(o.events, "BlockStored", "GPU"))
    assert landed == 1 and first.duration_s == pytest.approx(CPU_LAT_S + 4 * BLOCK_BYTES / CPU_BW)
    done = finished(outs)
    assert done["b"].cached_tokens_by_tier == (0, 64, 0)
    assert done["c"].cached_tokens_by_tier == (64, 0, 0)


def test_a_scheduled_request_offers_its_unstored_prompt_blocks_in_every_step() -> None:
    """vLLM's connector offers a scheduled request's computed prompt blocks it has not stored each
    step, also when no block fills in that step: a request that hit a's 4 blocks on the GPU (and
    computes 8 more tokens, then decodes 3 without filling a block) writes them back to the CPU
    tier, which had lost them, in its first step. Catches an offer made only when a block fills."""
    engine = EngineCore("e0", profile(num_cpu_blocks=4))
    a = list(range(64))
    engine.add_request(SimRequest("a", a, max_tokens=1))
    a_hashes = of(events(run(engine)), "BlockStored", "GPU")[0]["block_hashes"]
    engine.add_request(SimRequest("d", list(range(900, 964)), max_tokens=1))  # takes the CPU tier
    run(engine)
    assert engine.cpu is not None and not set(a_hashes) & set(engine.cpu.hashes())
    engine.add_request(SimRequest("b", a + [7] * 8, max_tokens=3))
    first = engine.step()
    assert finished([first]) == {} and len(of(first.events, "BlockRemoved", "CPU")) == 1
    assert set(engine.cpu.hashes()) == set(a_hashes)  # written (not landed yet)


def test_a_load_starts_only_in_blocks_the_prefills_in_flight_do_not_still_need() -> None:
    """vLLM admits a request that must load its hits only if its blocks fit in the free blocks
    less what the prefills in flight still need for their whole sequence (a load holds its blocks
    and cannot be preempted). In a 16-block pool b1 loads a's 4 blocks for a 14-block prompt, so
    10 blocks are spoken for; b2 (4 blocks of c to load, 5 in all) waits until b1 has its blocks,
    though 12 are free. Catches a load admitted on the free count alone (live: two loads started
    together where vLLM started one)."""
    engine = EngineCore("e0", profile(num_gpu_blocks=16, num_cpu_blocks=32))
    a, c = list(range(64)), list(range(500, 564))
    for rid, prompt in (("a", a), ("c", c)):
        engine.add_request(SimRequest(rid, prompt, max_tokens=1))
        run(engine)
    engine.reset_prefix_cache()
    engine.add_request(SimRequest("b1", a + list(range(1000, 1160)), max_tokens=1))
    engine.add_request(SimRequest("b2", c + [7] * 8, max_tokens=1))
    engine.step()
    assert engine.stats().load_bytes_by_tier["CPU"] == 4 * BLOCK_BYTES  # b1's load only
    done = finished(run(engine))
    assert done["b1"].cached_tokens_by_tier == done["b2"].cached_tokens_by_tier == (0, 64, 0)
