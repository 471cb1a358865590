"""Block stores of the simulated engine: GPU pinning and LRU free list, LRU offload tiers."""

from __future__ import annotations

import pytest

from sim.cache import GpuBlockPool, LruBlockTier, StoragePool


def test_gpu_allocation_prefers_empty_blocks_then_evicts_oldest_freed() -> None:
    pool = GpuBlockPool(4)
    evicted: list[int] = []
    pool.allocate(3, evicted)
    for h in (11, 12, 13):
        assert pool.commit(h)
    assert pool.num_free() == 1
    # Freed in the order 13, 11, 12: that is the eviction order.
    for h in (13, 11, 12):
        pool.release(h)
    assert pool.evictable_hashes() == [13, 11, 12]
    assert pool.num_free() == 4
    pool.allocate(1, evicted)  # the one empty block, nothing evicted
    assert evicted == []
    pool.allocate(2, evicted)
    assert evicted == [13, 11]
    assert pool.contains(12) and not pool.contains(13)
    assert pool.num_used() == 3


def test_pinned_blocks_are_never_evicted() -> None:
    pool = GpuBlockPool(2)
    evicted: list[int] = []
    pool.allocate(2, evicted)
    pool.commit(1)
    pool.commit(2)
    pool.release(1)
    pool.pin(2)  # a second request shares block 2
    pool.release(2)
    assert pool.is_pinned(2)
    assert pool.num_free() == 1
    with pytest.raises(RuntimeError, match="cannot allocate 2"):
        pool.allocate(2, evicted)
    pool.allocate(1, evicted)
    assert evicted == [1]
    assert pool.contains(2)


def test_pin_moves_block_off_the_free_list_and_release_puts_it_at_the_young_end() -> None:
    pool = GpuBlockPool(3)
    pool.allocate(3, [])
    for h in (1, 2, 3):
        pool.commit(h)
        pool.release(h)
    assert pool.evictable_hashes() == [1, 2, 3]
    pool.pin(1)
    assert pool.evictable_hashes() == [2, 3]
    pool.release(1)
    assert pool.evictable_hashes() == [2, 3, 1]
    with pytest.raises(KeyError):
        pool.pin(99)


def test_commit_of_an_already_cached_hash_keeps_the_copy_anonymous() -> None:
    pool = GpuBlockPool(2)
    pool.allocate(2, [])
    assert pool.commit(7)
    assert not pool.commit(7)
    assert pool.num_cached() == 1
    pool.release(7)
    pool.release_anonymous(1)
    assert pool.num_free() == 2 and pool.num_empty == 1


def test_clear_cached_requires_no_pinned_blocks() -> None:
    pool = GpuBlockPool(2)
    pool.allocate(1, [])
    pool.commit(5)
    with pytest.raises(RuntimeError):
        pool.clear_cached()
    pool.release(5)
    pool.clear_cached()
    assert not pool.contains(5) and pool.num_empty == 2


def test_lru_tier_evicts_least_recently_used() -> None:
    """Catches a write that refreshes the blocks it already holds (vLLM's prepare_store does not:
    they are re-ranked when the request finishes, ``rank_used``) and a re-rank in the wrong order."""
    tier = LruBlockTier(3)
    evicted: list[int] = []
    assert tier.write([1, 2, 3], evicted) == [1, 2, 3]
    tier.touch(1)
    assert tier.write([2], evicted) == []  # held: not new, not refreshed
    assert tier.hashes() == [2, 3, 1]
    assert tier.write([4], evicted) == [4]
    assert evicted == [2]
    assert 2 not in tier and 4 in tier and len(tier) == 3
    tier.rank_used([4, 9, 3])  # a finished request's blocks, head last; 9 is not held
    assert tier.hashes() == [1, 4, 3]


def test_a_tier_write_is_admitted_whole_or_refused_as_vllm_admits_it() -> None:
    """vLLM's prepare_store: a write evicts only blocks outside it, and one the tier cannot hold
    whole is refused with nothing changed. Catches a write that evicts its own blocks (the engine
    would announce a removal before the store of the same block) and partial writes."""
    tier = LruBlockTier(3)
    evicted: list[int] = []
    tier.write([1, 2, 3], evicted)
    assert tier.write([3, 4, 5], evicted) == [4, 5]  # 3 is held: the oldest others go
    assert evicted == [1, 2] and tier.hashes() == [3, 4, 5]
    assert tier.write([6, 7, 8, 9], evicted) is None
    assert evicted == [1, 2] and tier.hashes() == [3, 4, 5]


def test_a_promotion_evicts_the_least_recent_block_not_in_flight_or_is_refused() -> None:
    """vLLM's tiering manager writes a promoted block into the CPU tier as the most recent; its
    eviction skips blocks still being promoted, and with every block in flight it is refused.
    Catches a promotion that evicts an in-flight block (the request would count a block the tier
    lost) or one that overfills the tier."""
    tier = LruBlockTier(3)
    evicted: list[int] = []
    assert tier.write([1, 2, 3], evicted) == [1, 2, 3]
    assert tier.promote(4, {1}, evicted) and evicted == [2]
    assert tier.hashes() == [1, 3, 4]
    assert tier.promote(3, set(), evicted) and tier.hashes() == [1, 3, 4]  # held: nothing moves
    assert not tier.promote(5, {1, 3, 4}, evicted) and tier.hashes() == [1, 3, 4] and evicted == [2]


def test_storage_pool_is_one_object_for_all_engines_and_validates() -> None:
    pool = StoragePool("shared-fs", capacity_blocks=2, load_bytes_per_s=1e9, latency_s=0.01)
    evicted: list[int] = []
    for h in (1, 2, 3):
        pool.write([h], evicted)
    assert evicted == [1] and pool.hashes() == [2, 3]
    with pytest.raises(ValueError, match="load_bytes_per_s"):
        StoragePool("x", 4, load_bytes_per_s=0)
    with pytest.raises(ValueError, match="capacity"):
        StoragePool("x", 0)


def test_a_directory_pool_admits_writes_as_the_in_process_tier(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The pool several engine processes share through a folder (sim/server.py): a block another
    engine wrote first is held, not new; a write larger than the pool is refused with nothing
    written; the trim never removes the blocks of the write that triggered it. Catches the folder
    pool drifting from LruBlockTier.write's rules."""
    from sim.server import DirectoryStoragePool

    one = DirectoryStoragePool("fs", 4, str(tmp_path))
    two = DirectoryStoragePool("fs", 4, str(tmp_path))
    evicted: list[int] = []
    assert one.write([1, 2], evicted) == [1, 2]
    assert two.write([2, 3], evicted) == [3]  # 2 is in the folder already
    assert two.write([5, 6, 7, 8, 9], evicted) is None and len(two) == 3
    assert two.write([6, 7, 8, 9], evicted) == [6, 7, 8, 9]  # the trim (every 1 + 4 // 16 new) runs
    assert set(two.hashes()) == {6, 7, 8, 9} and set(evicted) == {1, 2, 3}
