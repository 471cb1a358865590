"""The index's model of a shared STORAGE pool against the real pool (sim/cache.StoragePool driven by
real engines): the pool evicts its least recently *used* blocks and announces neither reads nor
removals (a shared fs tier: ``announce_removals=False``), so the index must refresh on the reads
its routing causes and learn from shortfalls."""

from __future__ import annotations

from kvcore.index import PrefixIndex
from kvcore.keys import block_keys
from router.events import decode_events
from sim.cache import StoragePool
from sim.engine import EngineCore, EngineProfile, SimRequest

BS = 16


def prompt(n: int) -> list[int]:
    """Two full blocks of their own plus one token."""
    return list(range(n * 100, n * 100 + 2 * BS + 1))


class Fleet:
    """Engines on one pool, an index fed their events, routing mirrored into the index."""

    def __init__(self, refresh: bool) -> None:
        self.pool = StoragePool("fs", capacity_blocks=6, announce_removals=False)
        profile = EngineProfile(num_gpu_blocks=8, block_size=BS)
        self.engines = {e: EngineCore(e, profile, storage=self.pool) for e in ("e0", "e1", "e2")}
        self.index = PrefixIndex(
            storage_pools={"fs": 6}, engine_storage_pool=dict.fromkeys(self.engines, "fs")
        )
        self.refresh = refresh
        self.hashes: dict[int, list[int]] = {}
        self.now = 0.0

    def run(self, engine_id: str, n: int) -> int:
        """Route prompt n to engine_id, run it, deliver its events; returns cached tokens."""
        self.now += 1.0
        keys = block_keys(prompt(n), BS)
        if self.refresh:
            self.index.refresh_pool_reads(engine_id, keys, self.now)
        engine = self.engines[engine_id]
        engine.add_request(SimRequest(f"{engine_id}-{n}-{self.now}", prompt(n), max_tokens=1))
        cached = 0
        while engine.has_unfinished():
            out = engine.step(self.now)
            for event in out.events:
                if event["type"] == "BlockStored" and event["medium"] == "STORAGE":
                    self.hashes.setdefault(n, []).extend(event["block_hashes"])
            self.index.apply_batch(engine_id, decode_events(out.events), self.now)
            cached += sum(f.cached_tokens for f in out.finished)
        engine.reset_prefix_cache()  # keep GPUs out of the way: only the pool can hit
        self.index.apply_batch(engine_id, decode_events(engine.step(self.now).events), self.now)
        return cached

    def pool_has(self, n: int) -> bool:
        return all(h in self.pool for h in self.hashes[n])

    def index_has(self, n: int) -> bool:
        return self.index.match(block_keys(prompt(n), BS), ["e2"])["e2"].blocks_by_tier == (0, 0, 2)


def test_reads_routed_by_the_router_keep_the_index_in_the_pools_lru_order() -> None:
    for refresh in (True, False):
        fleet = Fleet(refresh)
        for n in (1, 2, 3):
            fleet.run("e0", n)  # the pool is full: 1a 1b 2a 2b 3a 3b
        assert fleet.run("e1", 1) == 2 * BS  # e1 reads prompt 1 from the pool: it is young again
        fleet.run("e0", 4)  # two new blocks evict the two least recently used: prompt 2's
        truth = [fleet.pool_has(n) for n in (1, 2, 3, 4)]
        assert truth == [True, False, True, True]
        seen = [fleet.index_has(n) for n in (1, 2, 3, 4)]
        if refresh:
            assert seen == truth
        else:  # write order: the index drops prompt 1 and promises prompt 2
            assert seen == [False, True, True, True]


def test_a_shortfall_drops_the_block_the_pool_no_longer_has() -> None:
    fleet = Fleet(refresh=False)  # the write-order index promises prompt 2 (see above)
    for n in (1, 2, 3):
        fleet.run("e0", n)
    fleet.run("e1", 1)
    fleet.run("e0", 4)
    keys = block_keys(prompt(2), BS)
    routed_s = fleet.now
    assert fleet.index_has(2)
    cached = fleet.run("e1", 2)  # the engine finds nothing: it recomputes and stores prompt 2 again
    assert cached == 0
    # Prompt 2's blocks were stored again after the routing: the pool has them, keep them.
    assert fleet.pool_has(2) and not fleet.index.learn_delivered("e1", keys, 0, 2, routed_s)
    assert fleet.index_has(2)
    # A promise made after the last store, then broken: dropped.
    stats = fleet.index.stats()["storage_pools"]["fs"]
    assert fleet.index.learn_delivered("e1", keys, 0, 2, fleet.now + 1.0)
    assert not fleet.index_has(2)
    assert fleet.index.stats()["storage_pools"]["fs"]["shortfall_drops"] == stats["shortfall_drops"] + 1
    # No shortfall, or an engine without a pool: nothing to learn.
    assert not fleet.index.learn_delivered("e1", keys, 2, 2, fleet.now + 1.0)
    assert not PrefixIndex().learn_delivered("e9", keys, 0, 2, 0.0)
