"""The global prefix index: router block key -> which engines hold it, in which tier.

Pure data structure, no I/O: ``router.events`` feeds it decoded KV events, policies read it through
``match``. One dict maps each key to an int bitmask over (holder slot, tier); engine hashes are
only looked up in a per-engine map engine hash -> key. STORAGE lives in LRU pools with a capacity.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.base import NO_MATCH, PrefixMatch, Tier
from router.keys import DEFAULT_NAMESPACE, block_keys

#: Capacity (blocks) of the private STORAGE pool an engine gets when it sends STORAGE events but
#: mounts no configured pool. About 1 TiB of Llama-3-8B KV at 16-token blocks.
DEFAULT_PRIVATE_POOL_BLOCKS = 500_000

_BITS_PER_SLOT = 3  # one bit per tier: GPU, CPU, STORAGE (bit = 3 * slot + tier)

EngineHash = int | bytes


@dataclass(slots=True)
class _StoragePool:
    """STORAGE blocks of one pool: LRU order, a capacity, and the engines that mount it."""

    pool_id: str
    slot: int
    capacity_blocks: int
    #: Presence positions (bit 3 * engine slot) of every engine mounting the pool.
    mount_positions: int = 0
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    evicted_blocks: int = 0

    @property
    def bit(self) -> int:
        return 1 << (_BITS_PER_SLOT * self.slot + Tier.STORAGE)


@dataclass(slots=True)
class _EngineState:
    engine_id: str
    slot: int
    pool: _StoragePool | None = None
    #: engine hash -> router key, kept while the engine holds the key in GPU or CPU.
    hash_to_key: dict[EngineHash, int] = field(default_factory=dict)
    #: (tier, key) -> announcements beyond the first (the first one is the bit in the mask).
    extra_refs: dict[tuple[int, int], int] = field(default_factory=dict)
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    # Per-event problems: counted, never raised.
    orphan_stores: int = 0
    unresolved_placeholders: int = 0
    unknown_removals: int = 0
    malformed_events: int = 0

    @property
    def gpu_bit(self) -> int:
        return 1 << (_BITS_PER_SLOT * self.slot)

    @property
    def cpu_bit(self) -> int:
        return 1 << (_BITS_PER_SLOT * self.slot + Tier.CPU)

    @property
    def position(self) -> int:
        return 1 << (_BITS_PER_SLOT * self.slot)


class PrefixIndex:
    """Key -> engines x tiers, fed by KV events, queried by prefix.

    ``storage_pools``: pool id -> capacity in blocks (shared pools; STORAGE never sends removals,
    so the index evicts in LRU order). ``engine_storage_pool``: engine id -> the pool it mounts;
    its STORAGE events go there and every mounting engine sees the pool as its STORAGE tier.
    An engine that sends STORAGE events without a configured pool gets a private pool of
    ``default_private_pool_blocks``. ``namespace``: chain seed for blocks with no parent.
    """

    def __init__(
        self,
        *,
        storage_pools: Mapping[str, int] | None = None,
        engine_storage_pool: Mapping[str, str] | None = None,
        default_private_pool_blocks: int = DEFAULT_PRIVATE_POOL_BLOCKS,
        namespace: int = DEFAULT_NAMESPACE,
    ) -> None:
        self._namespace = namespace
        self._default_private_pool_blocks = default_private_pool_blocks
        self._masks: dict[int, int] = {}
        self._engines: dict[str, _EngineState] = {}
        self._engine_by_slot: dict[int, _EngineState] = {}
        self._next_slot = 0
        #: Presence positions (bit 3 * slot) of all engine slots.
        self._engine_positions = 0
        self._shared_pools: dict[str, _StoragePool] = {}
        self._shared_pool_bits = 0
        self._engine_pool_ids = dict(engine_storage_pool or {})
        for pool_id, capacity in (storage_pools or {}).items():
            if capacity <= 0:
                raise ValueError(f"storage pool {pool_id!r}: capacity must be a positive block count")
            pool = _StoragePool(pool_id, self._take_slot(), capacity)
            self._shared_pools[pool_id] = pool
            self._shared_pool_bits |= pool.bit
        for engine_id, pool_id in self._engine_pool_ids.items():
            if pool_id not in self._shared_pools:
                raise ValueError(
                    f"engine {engine_id!r} mounts storage pool {pool_id!r}, which is not configured; "
                    f"configured pools: {sorted(self._shared_pools) or 'none'}"
                )
        for engine_id in self._engine_pool_ids:
            self._engine(engine_id)  # mounting engines see the pool before their first event
        # Speculative GPU entries: key -> GPU bits, (slot, key) -> expiry, heap of expiries.
        self._spec_masks: dict[int, int] = {}
        self._spec_expiry: dict[tuple[int, int], float] = {}
        self._spec_heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._spec_counter = itertools.count()
        self._now = 0.0

    # ----------------------------------------------------------------------------- engines

    def _take_slot(self) -> int:
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def add_engine(self, engine_id: str) -> None:
        """Give ``engine_id`` a slot (done lazily by the first event too)."""
        self._engine(engine_id)

    def _engine(self, engine_id: str) -> _EngineState:
        state = self._engines.get(engine_id)
        if state is not None:
            return state
        state = _EngineState(engine_id, self._take_slot())
        pool_id = self._engine_pool_ids.get(engine_id)
        if pool_id is not None:
            state.pool = self._shared_pools[pool_id]
            state.pool.mount_positions |= state.position
        self._engines[engine_id] = state
        self._engine_by_slot[state.slot] = state
        self._engine_positions |= state.position
        return state

    def _storage_pool(self, state: _EngineState) -> _StoragePool:
        if state.pool is None:
            # Private pool on the engine's own STORAGE bit: match reads it as (mask >> 2).
            state.pool = _StoragePool(
                f"private:{state.engine_id}",
                state.slot,
                self._default_private_pool_blocks,
                mount_positions=state.position,
            )
        return state.pool

    @property
    def engine_ids(self) -> list[str]:
        return list(self._engines)

    # ----------------------------------------------------------------------------- events

    def apply_batch(self, engine_id: str, events: Sequence[Any], now: float | None = None) -> None:
        """Apply one batch of decoded events (``router.events`` structs) from ``engine_id``.

        Problems of single events (unknown medium, unresolvable hashes) are counted per engine
        and skipped, so one bad event never loses the rest of the batch."""
        if now is not None:
            self._advance(now)
        state = self._engine(engine_id)
        for event in events:
            kind = type(event).__name__
            try:
                if hasattr(event, "token_ids"):
                    self._apply_stored(state, event)
                elif hasattr(event, "block_hashes"):
                    self._apply_removed(state, event)
                elif kind.endswith("AllBlocksCleared"):
                    self.clear_engine(engine_id, (Tier.GPU,))
                else:
                    state.malformed_events += 1
            except (ValueError, TypeError, OverflowError):
                state.malformed_events += 1

    def _apply_stored(self, state: _EngineState, event: Any) -> None:
        tier = Tier.parse(event.medium)
        hashes = event.block_hashes
        tokens = event.token_ids
        block_size = event.block_size
        keys: list[int | None]
        if tokens and block_size > 0:
            parent_hash = event.parent_block_hash
            if parent_hash is None:
                parent = self._namespace
            else:
                found = state.hash_to_key.get(parent_hash)
                if found is None:
                    state.orphan_stores += len(hashes)
                    return
                parent = found
            n_blocks = len(tokens) // block_size
            extra = event.extra_keys
            if extra is None and event.lora_name:
                extra = [[event.lora_name]] * n_blocks
            keys = list(block_keys(tokens, block_size, parent=parent, extra_keys=extra))
            if n_blocks != len(hashes):
                state.malformed_events += 1
        else:
            get = state.hash_to_key.get
            keys = [get(h) for h in hashes]
        if tier is Tier.STORAGE:
            pool = self._storage_pool(state)
            for key in keys:
                if key is None:
                    state.unresolved_placeholders += 1
                else:
                    self._pool_add(pool, key)
            return
        bit = state.gpu_bit if tier is Tier.GPU else state.cpu_bit
        masks = self._masks
        hash_to_key = state.hash_to_key
        spec = self._spec_masks if tier is Tier.GPU and self._spec_masks else None
        added = 0
        for engine_hash, key in zip(hashes, keys, strict=False):
            if key is None:
                state.unresolved_placeholders += 1
                continue
            mask = masks.get(key, 0)
            if mask & bit:
                ref = (tier, key)
                state.extra_refs[ref] = state.extra_refs.get(ref, 0) + 1
            else:
                masks[key] = mask | bit
                added += 1
            hash_to_key[engine_hash] = key
            if spec is not None and key in spec:
                self._drop_spec(state.slot, key)
        if tier is Tier.GPU:
            state.gpu_blocks += added
        else:
            state.cpu_blocks += added

    def _apply_removed(self, state: _EngineState, event: Any) -> None:
        tier = Tier.parse(event.medium)
        hash_to_key = state.hash_to_key
        if tier is Tier.STORAGE:
            pool = state.pool
            for engine_hash in event.block_hashes:
                key = hash_to_key.get(engine_hash)
                if key is None or pool is None or key not in pool.lru:
                    state.unknown_removals += 1
                else:
                    self._pool_remove(pool, key)
            return
        bit = state.gpu_bit if tier is Tier.GPU else state.cpu_bit
        both = state.gpu_bit | state.cpu_bit
        masks = self._masks
        removed = 0
        for engine_hash in event.block_hashes:
            key = hash_to_key.get(engine_hash)
            mask = masks.get(key, 0) if key is not None else 0
            if key is None or not mask & bit:
                state.unknown_removals += 1
                continue
            ref = (tier, key)
            extra = state.extra_refs.get(ref)
            if extra:
                if extra == 1:
                    del state.extra_refs[ref]
                else:
                    state.extra_refs[ref] = extra - 1
                continue
            mask &= ~bit
            if mask:
                masks[key] = mask
            else:
                del masks[key]
            removed += 1
            if not mask & both:
                del hash_to_key[engine_hash]
        if tier is Tier.GPU:
            state.gpu_blocks -= removed
        else:
            state.cpu_blocks -= removed

    def _pool_add(self, pool: _StoragePool, key: int) -> None:
        lru = pool.lru
        if key in lru:
            lru.move_to_end(key)
            return
        lru[key] = None
        self._masks[key] = self._masks.get(key, 0) | pool.bit
        while len(lru) > pool.capacity_blocks:
            old, _ = lru.popitem(last=False)
            self._clear_bits(old, pool.bit)
            pool.evicted_blocks += 1

    def _pool_remove(self, pool: _StoragePool, key: int) -> None:
        del pool.lru[key]
        self._clear_bits(key, pool.bit)

    def _clear_bits(self, key: int, bits: int) -> None:
        mask = self._masks.get(key, 0) & ~bits
        if mask:
            self._masks[key] = mask
        else:
            self._masks.pop(key, None)

    def clear_engine(self, engine_id: str, tiers: Iterable[Tier] | None = None) -> None:
        """Drop what ``engine_id`` announced in ``tiers`` (default: all tiers).

        STORAGE is dropped only for a private pool: a shared pool outlives one engine's restart.
        """
        state = self._engines.get(engine_id)
        if state is None:
            return
        tier_set = set(TIERS_ALL if tiers is None else tiers)
        bits = 0
        if Tier.GPU in tier_set:
            bits |= state.gpu_bit
            state.gpu_blocks = 0
        if Tier.CPU in tier_set:
            bits |= state.cpu_bit
            state.cpu_blocks = 0
        if bits:
            both = state.gpu_bit | state.cpu_bit
            masks = self._masks
            for engine_hash, key in list(state.hash_to_key.items()):
                mask = masks.get(key, 0)
                if mask & bits:
                    mask &= ~bits
                    if mask:
                        masks[key] = mask
                    else:
                        del masks[key]
                if not mask & both:
                    del state.hash_to_key[engine_hash]
            tier_ints = {int(t) for t in tier_set}
            state.extra_refs = {r: n for r, n in state.extra_refs.items() if r[0] not in tier_ints}
        if Tier.GPU in tier_set:
            for slot, key in [sk for sk in self._spec_expiry if sk[0] == state.slot]:
                self._drop_spec(slot, key)
        pool = state.pool
        if Tier.STORAGE in tier_set and pool is not None and pool.slot == state.slot:
            for key in pool.lru:
                self._clear_bits(key, pool.bit)
            pool.lru.clear()

    # ----------------------------------------------------------------------------- speculation

    def speculate(self, engine_id: str, keys: Sequence[int], ttl_s: float, now: float) -> None:
        """Record ``keys`` as provisional GPU entries on ``engine_id`` until ``now + ttl_s``.

        Used right after routing, so a burst sharing a prefix sees the hit before the engine's
        BlockStored events arrive. A GPU BlockStored of the key confirms (replaces) the entry."""
        self._advance(now)
        state = self._engine(engine_id)
        expiry = now + ttl_s
        bit = state.gpu_bit
        spec_masks = self._spec_masks
        spec_expiry = self._spec_expiry
        slot = state.slot
        for key in keys:
            spec_masks[key] = spec_masks.get(key, 0) | bit
            spec_expiry[(slot, key)] = expiry
        heapq.heappush(self._spec_heap, (expiry, next(self._spec_counter), slot, tuple(keys)))

    def _drop_spec(self, slot: int, key: int) -> None:
        if self._spec_expiry.pop((slot, key), None) is None:
            return
        mask = self._spec_masks.get(key, 0) & ~(1 << (_BITS_PER_SLOT * slot))
        if mask:
            self._spec_masks[key] = mask
        else:
            self._spec_masks.pop(key, None)

    def _advance(self, now: float) -> None:
        self._now = max(self._now, now)
        heap = self._spec_heap
        while heap and heap[0][0] <= self._now:
            _, _, slot, keys = heapq.heappop(heap)
            for key in keys:
                expiry = self._spec_expiry.get((slot, key))
                if expiry is not None and expiry <= self._now:
                    self._drop_spec(slot, key)

    # ----------------------------------------------------------------------------- queries

    def match(
        self, keys: Sequence[int], engine_ids: Iterable[str] | None = None, now: float | None = None
    ) -> dict[str, PrefixMatch]:
        """Per engine: the contiguous prefix of ``keys`` it holds in any tier, split by best tier.

        With ``engine_ids`` every listed engine is in the result (NO_MATCH when it holds
        nothing); without, only engines holding at least block 0 are."""
        if now is not None:
            self._advance(now)
        if engine_ids is None:
            wanted: list[str] | None = None
            candidates = self._engine_positions
        else:
            wanted = list(engine_ids)
            candidates = 0
            for engine_id in wanted:
                state = self._engines.get(engine_id)
                if state is not None:
                    candidates |= state.position
        result: dict[str, PrefixMatch] = {}
        if candidates and keys:
            self._match_into(keys, candidates, result)
        if wanted is not None:
            return {engine_id: result.get(engine_id, NO_MATCH) for engine_id in wanted}
        return result

    def _match_into(self, keys: Sequence[int], candidates: int, result: dict[str, PrefixMatch]) -> None:
        masks: list[int | None] = list(map(self._masks.get, keys))
        if self._spec_masks:
            spec = list(map(self._spec_masks.get, keys))
            masks = [(m or 0) | (s or 0) or None for m, s in zip(masks, spec, strict=True)]
        positions = self._engine_positions
        shared_bits = self._shared_pool_bits
        shared_pools = self._shared_pools.values()
        # Per slot: [gpu, cpu, storage] best-tier block counts over its contiguous prefix.
        counts: dict[int, list[int]] = {}
        alive = candidates
        for mask, run in itertools.groupby(masks):
            if not mask:
                break
            run_blocks = len(list(run))
            gpu = mask & positions
            cpu = (mask >> 1) & positions
            storage = (mask >> 2) & positions
            if mask & shared_bits:
                for pool in shared_pools:
                    if mask & pool.bit:
                        storage |= pool.mount_positions
            alive &= gpu | cpu | storage
            if not alive:
                break
            for tier_index, tier_positions in enumerate((gpu, cpu & ~gpu, storage & ~gpu & ~cpu)):
                bits = alive & tier_positions
                while bits:
                    low = bits & -bits
                    bits ^= low
                    slot = low.bit_length() // _BITS_PER_SLOT
                    row = counts.get(slot)
                    if row is None:
                        row = counts[slot] = [0, 0, 0]
                    row[tier_index] += run_blocks
        by_slot = self._engine_by_slot
        for slot, (g, c, s) in counts.items():
            result[by_slot[slot].engine_id] = PrefixMatch(g + c + s, (g, c, s))

    def holders(self, key: int) -> dict[str, set[Tier]]:
        """Which engines hold ``key`` in which tiers (pools count for every mounting engine)."""
        mask = self._masks.get(key, 0)
        out: dict[str, set[Tier]] = {}
        for state in self._engines.values():
            tiers: set[Tier] = set()
            if mask & state.gpu_bit:
                tiers.add(Tier.GPU)
            if mask & state.cpu_bit:
                tiers.add(Tier.CPU)
            if state.pool is not None and mask & state.pool.bit:
                tiers.add(Tier.STORAGE)
            if tiers:
                out[state.engine_id] = tiers
        return out

    def __len__(self) -> int:
        """Number of distinct keys held anywhere (not counting speculative entries)."""
        return len(self._masks)

    def stats(self) -> dict[str, Any]:
        """Counts per engine and tier, pool fill, and the per-engine event problem counters."""
        engines: dict[str, Any] = {}
        for state in self._engines.values():
            pool = state.pool
            engines[state.engine_id] = {
                "gpu_blocks": state.gpu_blocks,
                "cpu_blocks": state.cpu_blocks,
                "storage_blocks": len(pool.lru) if pool is not None else 0,
                "storage_pool": pool.pool_id if pool is not None else None,
                "mapped_hashes": len(state.hash_to_key),
                "orphan_stores": state.orphan_stores,
                "unresolved_placeholders": state.unresolved_placeholders,
                "unknown_removals": state.unknown_removals,
                "malformed_events": state.malformed_events,
            }
        pools = {
            pool.pool_id: {
                "blocks": len(pool.lru),
                "capacity_blocks": pool.capacity_blocks,
                "evicted_blocks": pool.evicted_blocks,
            }
            for pool in self._all_pools()
        }
        return {
            "keys": len(self._masks),
            "speculative_entries": len(self._spec_expiry),
            "engines": engines,
            "storage_pools": pools,
        }

    def _all_pools(self) -> list[_StoragePool]:
        pools = list(self._shared_pools.values())
        pools += [s.pool for s in self._engines.values() if s.pool is not None and s.pool.slot == s.slot]
        return pools


TIERS_ALL: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.STORAGE)
