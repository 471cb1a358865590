"""Block stores of the simulated engine: the GPU pool with pinning and an LRU free list, and the
LRU offload tiers (CPU, and STORAGE pools that several engines may share). Pure data structures
keyed by the engine's 64-bit block hash; events and timing are the engine's job (sim/engine.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class GpuBlockPool:
    """The GPU KV pool, counted in blocks.

    A block is in one of three states: empty (free, no content), cached (holds a full block with a
    hash; pinned while ``ref[h] > 0``, otherwise on the LRU free list ``evictable``), or anonymous
    (held by a request without a hash: a partial block, or a duplicate of a cached block). Only
    counts are kept for empty and anonymous blocks; block identities do not matter to the model.
    """

    __slots__ = ("_evictable", "_ref", "num_blocks", "num_empty")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_empty = num_blocks
        #: hash -> number of requests holding it (pinned blocks only).
        self._ref: dict[int, int] = {}
        #: Cached, unpinned blocks, least recently freed first (eviction order).
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones plus evictable cached ones."""
        return self.num_empty + len(self._evictable)

    def num_used(self) -> int:
        """Blocks held by requests (pinned cached + anonymous)."""
        return self.num_blocks - self.num_free()

    def num_cached(self) -> int:
        return len(self._ref) + len(self._evictable)

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._ref or block_hash in self._evictable

    def is_evictable(self, block_hash: int) -> bool:
        return block_hash in self._evictable

    def is_pinned(self, block_hash: int) -> bool:
        return block_hash in self._ref

    def evictable_hashes(self) -> list[int]:
        """Unpinned cached hashes, next to be evicted first (for tests and introspection)."""
        return list(self._evictable)

    def cached_hashes(self) -> set[int]:
        """Every hash cached on GPU, pinned or not (what the engine's events have announced)."""
        return set(self._ref).union(self._evictable)

    def pin(self, block_hash: int) -> None:
        """Take a reference on a cached block (a prefix hit); it leaves the free list."""
        ref = self._ref.get(block_hash)
        if ref is not None:
            self._ref[block_hash] = ref + 1
            return
        try:
            del self._evictable[block_hash]
        except KeyError:
            raise KeyError(f"block {block_hash} is not cached on GPU") from None
        self._ref[block_hash] = 1

    def allocate(self, num_blocks: int, evicted: list[int]) -> None:
        """Take ``num_blocks`` anonymous blocks: empty ones first, then evict oldest cached ones
        (their hashes are appended to ``evicted``). The caller checks ``num_free()`` first."""
        if num_blocks > self.num_free():
            raise RuntimeError(f"GPU pool cannot allocate {num_blocks} blocks, {self.num_free()} free")
        from_empty = min(num_blocks, self.num_empty)
        self.num_empty -= from_empty
        for _ in range(num_blocks - from_empty):
            block_hash, _unused = self._evictable.popitem(last=False)
            evicted.append(block_hash)

    def commit(self, block_hash: int) -> bool:
        """Turn one anonymous block held by a request into cached block ``block_hash`` (pinned).

        False when that hash is already cached: the request's copy then stays anonymous, so the
        pool never holds two cached blocks with one hash (and announces each hash once)."""
        if block_hash in self._ref or block_hash in self._evictable:
            return False
        self._ref[block_hash] = 1
        return True

    def release(self, block_hash: int) -> None:
        """Drop a reference; the last one puts the block at the young end of the free list."""
        ref = self._ref[block_hash]
        if ref > 1:
            self._ref[block_hash] = ref - 1
        else:
            del self._ref[block_hash]
            self._evictable[block_hash] = None

    def release_anonymous(self, num_blocks: int) -> None:
        self.num_empty += num_blocks

    def clear_cached(self) -> None:
        """Forget every unpinned cached block (prefix-cache reset). Pinned blocks must be released
        first: the engine preempts running requests before a reset."""
        if self._ref:
            raise RuntimeError("clear_cached with pinned blocks; release them first")
        self.num_empty += len(self._evictable)
        self._evictable.clear()


class LruBlockTier:
    """An offload tier: a set of block hashes with a capacity and LRU eviction (CPU, STORAGE)."""

    __slots__ = ("_blocks", "_pinned", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"tier capacity must be positive, got {capacity_blocks} blocks")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        #: Held blocks that cannot be evicted, with a count of holders: a write not landed yet,
        #: or a load in flight (vLLM's offloading manager: a chunk not ready or with ref_cnt > 0).
        self._pinned: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def hashes(self) -> list[int]:
        """Held hashes, least recently used first."""
        return list(self._blocks)

    def touch(self, block_hash: int) -> None:
        """Mark as most recently used (a hit)."""
        self._blocks.move_to_end(block_hash)

    def pin(self, block_hash: int) -> None:
        """``block_hash`` (held) cannot be evicted until as many ``unpin`` calls."""
        self._pinned[block_hash] = self._pinned.get(block_hash, 0) + 1

    def unpin(self, block_hash: int) -> None:
        pinned = self._pinned
        n = pinned[block_hash] - 1
        if n:
            pinned[block_hash] = n
        else:
            del pinned[block_hash]

    def write(self, block_hashes: Sequence[int], evicted: list[int]) -> list[int] | None:
        """One offload write, admitted as vLLM's offloading manager admits it (``prepare_store``):
        the blocks not yet held are stored as the most recent, evicting the least recently used
        blocks outside the write that are not pinned; a write that cannot fit whole is refused
        whole (None: nothing stored, nothing evicted), also when pinned blocks leave too few to
        evict. Held blocks of the write keep their rank (vLLM re-ranks a request's blocks when it
        finishes: ``rank_used``). Returns the newly stored hashes; evicted hashes are appended to
        ``evicted``, never one of the write's."""
        if len(block_hashes) > self.capacity_blocks:
            return None
        blocks = self._blocks
        new = [h for h in block_hashes if h not in blocks]
        excess = len(blocks) + len(new) - self.capacity_blocks
        if excess > 0:
            written = set(block_hashes)
            pinned = self._pinned
            victims = []
            for h in blocks:
                if h not in written and h not in pinned:
                    victims.append(h)
                    if len(victims) == excess:
                        break
            if len(victims) < excess:
                return None
            for h in victims:
                del blocks[h]
            evicted.extend(victims)
        for h in new:
            blocks[h] = None
        return new

    def promote(self, block_hash: int, in_flight: set[int], evicted: list[int]) -> bool:
        """One block read into this tier from the tier behind it (vLLM's tiering manager promotes a
        STORAGE hit into the CPU tier one block at a time: ``_initiate_promotion``). It becomes the
        most recent, evicting the least recently used block that is neither ``in_flight`` (a
        promotion not landed yet cannot be evicted) nor pinned; False, nothing changed, when
        every held block is. Appends the evicted hash to ``evicted``."""
        blocks = self._blocks
        if block_hash in blocks:
            return True
        if len(blocks) >= self.capacity_blocks:
            pinned = self._pinned
            victim = next((h for h in blocks if h not in in_flight and h not in pinned), None)
            if victim is None:
                return False
            del blocks[victim]
            evicted.append(victim)
        blocks[block_hash] = None
        return True

    def rank_used(self, block_hashes: Sequence[int]) -> None:
        """The held ones of ``block_hashes`` become most recent, the last one most of all (vLLM's
        LRU policy re-ranks a finished request's blocks); the others are ignored."""
        blocks = self._blocks
        for h in block_hashes:
            if h in blocks:
                blocks.move_to_end(h)

    def clear(self) -> None:
        self._blocks.clear()
        self._pinned.clear()


class StoragePool(LruBlockTier):
    """A STORAGE tier, content-addressed by engine block hash, LRU, capacity in blocks.

    ``announce_removals``: the engine writing a block that evicts another announces the removal
    (``BlockRemoved(medium="STORAGE")``), as vLLM 0.33's kvcr tier and its disk offload manager
    do; False models a tier that never does (llm-d's shared fs directory leaves cleanup to the
    storage system). Several EngineCore objects may share one instance (a shared directory mounted
    by several engines): a block written by one is a hit for all. ``load_bytes_per_s`` /
    ``latency_s`` override the engine profile's storage figures (one engine's read rate).
    ``shared_bytes_per_s``: the pool's aggregate bandwidth, which every read and write of every
    mounting engine books (``reserve``); None = no shared limit.
    """

    __slots__ = (
        "announce_removals",
        "busy_until_s",
        "latency_s",
        "load_bytes_per_s",
        "pool_id",
        "shared_bytes_per_s",
    )

    def __init__(
        self,
        pool_id: str,
        capacity_blocks: int,
        load_bytes_per_s: float | None = None,
        latency_s: float | None = None,
        shared_bytes_per_s: float | None = None,
        announce_removals: bool = True,
    ) -> None:
        super().__init__(capacity_blocks)
        if load_bytes_per_s is not None and not load_bytes_per_s > 0:
            raise ValueError(f"storage pool {pool_id!r}: load_bytes_per_s must be positive")
        if latency_s is not None and latency_s < 0:
            raise ValueError(f"storage pool {pool_id!r}: latency_s must be >= 0")
        if shared_bytes_per_s is not None and not shared_bytes_per_s > 0:
            raise ValueError(f"storage pool {pool_id!r}: shared_bytes_per_s must be positive or None")
        self.pool_id = pool_id
        self.load_bytes_per_s = load_bytes_per_s
        self.latency_s = latency_s
        self.shared_bytes_per_s = shared_bytes_per_s
        self.announce_removals = announce_removals
        #: When the pool's aggregate bandwidth is free again (FIFO over all mounting engines).
        self.busy_until_s = 0.0

    def reserve(self, start_s: float, nbytes: float) -> float:
        """Book ``nbytes`` of the pool's shared bandwidth from ``start_s`` on (after what is already
        booked); returns when that share is done. Without a shared limit: ``start_s``."""
        if not self.shared_bytes_per_s:
            return start_s
        begin_s = max(start_s, self.busy_until_s)
        self.busy_until_s = begin_s + nbytes / self.shared_bytes_per_s
        return self.busy_until_s
