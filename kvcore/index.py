"""The global prefix index: router block key -> which engines hold it, in which tier.

Pure data structure, no I/O: ``router.events`` feeds it decoded KV events, policies read it through
``match``. One dict maps each key to an int bitmask over (holder slot, tier); engine hashes are
only looked up in a per-engine map engine hash -> key (GPU/CPU) and a per-pool one (STORAGE).
STORAGE lives in LRU pools with a capacity: removals are applied when the tier sends them (vLLM's
kvcr tier and its disk offload manager do), the LRU covers tiers that never do (a shared fs tier).
The index also keeps the evidence that restores trust in an engine's picture: how often the cached
tokens the engine reported agreed with what the index predicted at routing (``watch_delivery``).
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore.keys import DEFAULT_NAMESPACE, block_keys
from policies.base import NO_MATCH, PrefixMatch, Tier

#: Capacity (blocks) of the private STORAGE pool an engine gets when it sends STORAGE events but
#: mounts no configured pool. About 1 TiB of Llama-3-8B KV at 16-token blocks.
DEFAULT_PRIVATE_POOL_BLOCKS = 500_000

_BITS_PER_SLOT = 3  # one bit per tier: GPU, CPU, STORAGE (bit = 3 * slot + tier)

#: Routing-time predictions kept per watched engine until the request's delivery is reported.
_PREDICTIONS_KEPT = 4096

#: Distinct mask values shared as one int object each; cleared (not evicted) beyond this.
_MASK_INTERN_LIMIT = 1 << 16

EngineHash = int | bytes

#: Default 0 for ``map(dict.get, keys, _ZEROS)``: a missing key reads as an empty mask.
_ZEROS = itertools.repeat(0)
#: Default expiry of a key with no speculative entry: never due.
_INF = float("inf")
_NEVER = itertools.repeat(_INF)
#: Default of ``map(dict.pop, keys, _NONES)``: a key already gone is no error.
_NONES = itertools.repeat(None)

#: A kept match result's name: (block count, last key, the engine ids asked for or None).
_MatchName = tuple[int, int, tuple[str, ...] | None]
#: Match results kept for repeated prompts (all dropped by any change to what the index holds).
_MATCHES_KEPT = 64

_STORED, _REMOVED, _CLEARED, _UNKNOWN = range(4)


@dataclass(slots=True)
class _LastSpeculation:
    """An engine slot's latest speculated chain: every key of ``keys`` is speculative on the slot
    with expiry ``expiry``. ``written``: the slot's expiry table says so too; while False the
    table may hold an earlier expiry for them (a re-sent prompt's refresh, written only when
    something reads the table: ``PrefixIndex._settle``)."""

    keys: list[int]
    expiry: float
    written: bool = True


#: Medium names (upper-cased) of the publishers the router knows, and their tier: vLLM's GPU pool
#: (None or "GPU"), its offloading connector's ``Medium`` enum ("CPU", "STORAGE") and the older
#: ``DiskLoadStoreSpec.medium()`` ("Disk"); LMCache's CPU backend ("cpu") and CXL memory ("CXL",
#: host-attached memory, priced like CPU). Any other name is counted per engine and skipped.
MEDIUM_TIERS: dict[str, Tier] = {
    "GPU": Tier.GPU,
    "CPU": Tier.CPU,
    "CXL": Tier.CPU,
    "STORAGE": Tier.STORAGE,
    "DISK": Tier.STORAGE,
}
#: Exact spellings, so the common case is one dict lookup.
_TIER_OF_MEDIUM: dict[str | None, Tier] = {
    None: Tier.GPU,
    **{
        spelled: tier for name, tier in MEDIUM_TIERS.items() for spelled in (name, name.lower(), name.title())
    },
}


def _tier(medium: str | None) -> Tier | None:
    """The tier of an event's ``medium``; None for a name no known publisher uses."""
    tier = _TIER_OF_MEDIUM.get(medium)
    if tier is None and isinstance(medium, str):
        tier = MEDIUM_TIERS.get(medium.upper())
    return tier


def _fold_hash(engine_hash: EngineHash) -> int:
    """An engine hash as a 64-bit int: raw digests (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) are
    read like vLLM's int form (last 8 bytes, big-endian), so the map never keeps 48-65 B bytes
    objects and both forms of one hash agree."""
    if type(engine_hash) is bytes:
        return int.from_bytes(engine_hash[-8:], "big")
    return engine_hash  # type: ignore[return-value]


def _fold_hashes(hashes: Sequence[EngineHash]) -> Sequence[EngineHash]:
    if hashes and type(hashes[0]) is bytes:
        return [_fold_hash(h) for h in hashes]
    return hashes


def _event_kind(cls: type) -> int:
    """Which event a decoded struct class is, by its fields (router.events imports this module,
    so the classes cannot be imported here)."""
    fields = set(getattr(cls, "__struct_fields__", ())) or set(dir(cls))
    if "token_ids" in fields:
        return _STORED
    if "block_hashes" in fields:
        return _REMOVED
    if cls.__name__.endswith("AllBlocksCleared"):
        return _CLEARED
    return _UNKNOWN


@dataclass(slots=True)
class _StoragePool:
    """STORAGE blocks of one pool: LRU order, a capacity, and the engines that mount it.

    The pool itself evicts its least recently *used* block (written or read) and never announces
    reads; some tiers announce removals (vLLM's kvcr tier, its disk offload manager), others never
    do (a shared fs directory). So the index applies announced removals, refreshes a block on its
    stores and on the reads the router's own routing causes (``refresh_pool_reads``), and drops a
    block the engine proved absent (``learn_delivered``). ``lru`` maps key -> index clock of its
    last announced store."""

    pool_id: str
    slot: int
    capacity_blocks: int
    #: Presence positions (bit 3 * engine slot) of every engine mounting the pool.
    mount_positions: int = 0
    #: Ids of the mounting engines, in mount order: match fills pool-only hits from this list.
    member_ids: list[str] = field(default_factory=list)
    lru: OrderedDict[int, float] = field(default_factory=OrderedDict)
    #: engine hash -> key of blocks stored in the pool, so a STORAGE BlockRemoved finds its key (the
    #: engines mounting one pool serve one model: equal hashes are equal blocks). Entries of blocks
    #: the LRU dropped are pruned when the map outgrows the pool (``_prune_pool_hashes``).
    key_of_hash: dict[EngineHash, int] = field(default_factory=dict)
    evicted_blocks: int = 0
    #: Blocks removed because the tier announced their removal.
    removed_blocks: int = 0
    #: Blocks refreshed because routing sent a request that reads them from the pool.
    refreshed_blocks: int = 0
    #: Blocks dropped because an engine delivered fewer cached tokens than the pool promised.
    shortfall_drops: int = 0

    @property
    def bit(self) -> int:
        return 1 << (_BITS_PER_SLOT * self.slot + Tier.STORAGE)


@dataclass(slots=True)
class _EngineState:
    engine_id: str
    slot: int
    pool: _StoragePool | None = None
    #: engine hash -> router key, kept while the engine holds the key in GPU or CPU. The key
    #: int is the very object the global mask dict holds, so the map adds no key objects.
    hash_to_key: dict[EngineHash, int] = field(default_factory=dict)
    #: (tier, key) -> announcements beyond the first (the first one is the bit in the mask).
    #: Only offload tiers repeat announcements, so this stays small.
    extra_refs: dict[tuple[int, int], int] = field(default_factory=dict)
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    # Per-event problems: counted, never raised.
    orphan_stores: int = 0
    unresolved_placeholders: int = 0
    unknown_removals: int = 0
    malformed_events: int = 0
    #: Events skipped because their medium is no tier the router knows: name -> events.
    unknown_media: dict[str, int] = field(default_factory=dict)
    #: The engine's block size (tokens) as configured; None: not checked.
    block_size: int | None = None
    #: Self-describing stores whose block_size is not ``block_size``: tier -> events.
    block_size_mismatches: dict[str, int] = field(default_factory=dict)
    gpu_block_size_mismatches: int = 0
    #: Evidence for trust: None = not collecting; else the last predictions' agreement with what
    #: the engine delivered (True = agreed), and the raw predictions of requests in flight.
    delivery: deque[bool] | None = None
    predictions: OrderedDict[tuple[float, int, int], int] = field(default_factory=OrderedDict)
    # Bits of this engine in a key's mask, made once so every fresh mask can share the object.
    gpu_bit: int = 0
    cpu_bit: int = 0

    def __post_init__(self) -> None:
        self.gpu_bit = 1 << (_BITS_PER_SLOT * self.slot + Tier.GPU)
        self.cpu_bit = 1 << (_BITS_PER_SLOT * self.slot + Tier.CPU)

    @property
    def position(self) -> int:
        return self.gpu_bit


class PrefixIndex:
    """Key -> engines x tiers, fed by KV events, queried by prefix.

    ``storage_pools``: pool id -> capacity in blocks (shared pools). STORAGE removals are applied
    when the tier announces them; beyond the capacity the index evicts in LRU order (for tiers
    that never announce, like a shared fs directory). ``engine_storage_pool``: engine id -> the
    pool it mounts; its STORAGE events go there and every mounting engine sees the pool as its STORAGE tier.
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
        #: (block count, last key, engine ids) -> (keys, result) of recent ``match`` calls: a prompt
        #: sent again finds its answer without a pass over its blocks' masks. Emptied by every
        #: change a match could see (``_forget_matches``); on a hit the keys are the very list
        #: matched before (kept by reference: a caller's keys are not changed after the call, as
        #: the router's key cache hands the same list to every repeat of a prompt) or compared in
        #: full.
        self._matches: dict[_MatchName, tuple[list[int], dict[str, PrefixMatch]]] = {}
        self._masks: dict[int, int] = {}
        self._engines: dict[str, _EngineState] = {}
        self._all_ids: list[str] = []  # engine ids in slot order, for filling many matches at once
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
        #: Per engine slot: speculative key -> expiry (one dict per engine, so a prompt's keys are
        #: written, refreshed and checked in C, with no per-key tuple).
        self._spec_expiry: dict[int, dict[int, float]] = {}
        #: Per engine slot: speculative key -> the heap entry (its counter) that expires or re-arms it.
        self._spec_armed: dict[int, dict[int, int]] = {}
        #: (expiry, entry, slot, keys): due entries expire the keys they are responsible for.
        self._spec_heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._spec_counter = itertools.count()
        #: Per engine slot: its latest speculated chain, so the same chain sent again refreshes one
        #: expiry, not one per block (``speculate``'s shortcut; ``_settle`` writes it through).
        self._spec_last: dict[int, _LastSpeculation] = {}
        self._now = 0.0
        self._mask_intern: dict[int, int] = {}
        self._event_kinds: dict[type, int] = {}

    # ----------------------------------------------------------------------------- engines

    def _forget_matches(self) -> None:
        """What the index holds changed (an event, an engine, a speculative entry added or due):
        no kept match result may answer again."""
        if self._matches:
            self._matches.clear()

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
        self._forget_matches()
        state = _EngineState(engine_id, self._take_slot())
        pool_id = self._engine_pool_ids.get(engine_id)
        if pool_id is not None:
            state.pool = self._shared_pools[pool_id]
            state.pool.mount_positions |= state.position
            state.pool.member_ids.append(engine_id)
        self._engines[engine_id] = state
        self._all_ids.append(engine_id)
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
        self._forget_matches()
        state = self._engine(engine_id)
        kinds = self._event_kinds
        for event in events:
            cls = type(event)
            kind = kinds.get(cls)
            if kind is None:
                kind = kinds[cls] = _event_kind(cls)
            try:
                if kind == _STORED:
                    self._apply_stored(state, event)
                elif kind == _REMOVED:
                    self._apply_removed(state, event)
                elif kind == _CLEARED:
                    self.clear_engine(engine_id, (Tier.GPU,))
                else:
                    state.malformed_events += 1
            except (ValueError, TypeError, OverflowError):
                state.malformed_events += 1

    def _intern(self, mask: int) -> int:
        """One shared int object per distinct mask value: a fleet has few holder combinations,
        and a mask above 256 would otherwise cost an int object (28-60 B) per key."""
        interned = self._mask_intern.get(mask)
        if interned is not None:
            return interned
        if len(self._mask_intern) >= _MASK_INTERN_LIMIT:
            self._mask_intern.clear()  # only sharing of future masks is lost
        self._mask_intern[mask] = mask
        return mask

    def _unknown_medium(self, state: _EngineState, event: Any) -> None:
        name = str(event.medium)[:64]
        state.unknown_media[name] = state.unknown_media.get(name, 0) + 1

    def _key_of_hash(self, state: _EngineState, engine_hash: EngineHash) -> int | None:
        """The key of one of the engine's hashes, wherever it holds the block (GPU/CPU, then pool)."""
        key = state.hash_to_key.get(engine_hash)
        if key is None and state.pool is not None:
            key = state.pool.key_of_hash.get(engine_hash)
            if key is not None and key not in state.pool.lru:
                return None  # the pool dropped it: a map entry not yet pruned
        return key

    def _apply_stored(self, state: _EngineState, event: Any) -> None:
        tier = _tier(event.medium)
        if tier is None:
            self._unknown_medium(state, event)
            return
        hashes = _fold_hashes(event.block_hashes)
        tokens = event.token_ids
        block_size = event.block_size
        keys: list[int]
        resolved = False  # True: every hash already maps to its key in this engine's map
        if tokens and block_size > 0:
            if state.block_size is not None and block_size != state.block_size:
                # Counted, still applied: the router's keys follow the configured block size, so
                # these blocks match only requests keyed by the engine's reported one (scraping).
                name = tier.name
                state.block_size_mismatches[name] = state.block_size_mismatches.get(name, 0) + 1
                if tier is Tier.GPU:
                    state.gpu_block_size_mismatches += 1
            parent_hash = event.parent_block_hash
            if parent_hash is None:
                parent = self._namespace
            else:
                found = self._key_of_hash(state, _fold_hash(parent_hash))
                if found is None:
                    state.orphan_stores += len(hashes)
                    return
                parent = found
            n_blocks = len(tokens) // block_size
            extra = event.extra_keys
            if extra is None and event.lora_name:
                extra = [[event.lora_name]] * n_blocks
            # One call per event: the key chain of all its blocks.
            keys = block_keys(tokens, block_size, parent=parent, extra_keys=extra)
            if n_blocks != len(hashes):
                state.malformed_events += 1
                n = min(n_blocks, len(hashes))
                keys, hashes = keys[:n], hashes[:n]
        else:
            # Offload placeholder: hashes only, resolved through this engine's map.
            found_keys = list(map(state.hash_to_key.get, hashes))
            resolved = True
            if None in found_keys and state.pool is not None:
                # Blocks this engine holds only in its pool: their GPU/CPU entries need the map too.
                found_keys = [
                    k if k is not None else self._key_of_hash(state, h)
                    for h, k in zip(hashes, found_keys, strict=True)
                ]
                resolved = False
            if None in found_keys:
                pairs = [(h, k) for h, k in zip(hashes, found_keys, strict=True) if k is not None]
                state.unresolved_placeholders += len(hashes) - len(pairs)
                hashes = [h for h, _ in pairs]
                keys = [k for _, k in pairs]
            else:
                keys = found_keys  # type: ignore[assignment]
        if tier is Tier.STORAGE:
            pool = self._storage_pool(state)
            for key in keys:
                self._pool_add(pool, key)
            pool.key_of_hash.update(zip(hashes, keys, strict=True))
            if len(pool.key_of_hash) > 2 * len(pool.lru) + 1024:
                self._prune_pool_hashes(pool)
            return
        if not keys:
            return
        bit = state.gpu_bit if tier is Tier.GPU else state.cpu_bit
        masks = self._masks
        fresh = dict.fromkeys(keys, bit)
        if masks.keys().isdisjoint(fresh):
            # Common case: blocks nobody indexes yet. Every new entry shares the one ``bit`` int.
            masks.update(fresh)
            added = len(fresh)
            if added != len(keys):  # the same block twice in one event: count the repeats
                self._count_repeats(state, tier, keys)
        else:
            existing = list(map(masks.get, keys))
            if len(fresh) == len(keys) and not any([m & bit for m in existing if m]):
                # Blocks other engines (or this engine's other tier) index: one more bit each.
                get_interned = self._mask_intern.get
                intern = self._intern
                new_masks = [(m | bit) if m else bit for m in existing]
                masks.update(zip(keys, [get_interned(m) or intern(m) for m in new_masks], strict=True))
                added = len(keys)
            else:
                added = self._add_bit_one_by_one(state, tier, bit, keys, existing)
        if not resolved:
            state.hash_to_key.update(zip(hashes, keys, strict=True))
        if tier is Tier.GPU:
            state.gpu_blocks += added
            expiries = self._spec_expiry.get(state.slot)
            if expiries:  # the store confirms this engine's speculative entries of these keys
                self._drop_specs(
                    state.slot, expiries, list(itertools.compress(keys, map(expiries.__contains__, keys)))
                )
        else:
            state.cpu_blocks += added

    def _add_bit_one_by_one(
        self, state: _EngineState, tier: Tier, bit: int, keys: Sequence[int], existing: list[int | None]
    ) -> int:
        """Slow path: some blocks are already held in this tier (or repeat within the event);
        each repeat is one more reference. Returns how many blocks gained the bit."""
        masks = self._masks
        extra_refs = state.extra_refs
        intern = self._intern
        added = 0
        seen: set[int] = set()
        for key, mask in zip(keys, existing, strict=True):
            if key in seen or (mask is not None and mask & bit):
                ref = (tier, key)
                extra_refs[ref] = extra_refs.get(ref, 0) + 1
                continue
            seen.add(key)
            masks[key] = intern(mask | bit) if mask else bit
            added += 1
        return added

    @staticmethod
    def _count_repeats(state: _EngineState, tier: Tier, keys: Sequence[int]) -> None:
        seen: set[int] = set()
        for key in keys:
            if key in seen:
                ref = (tier, key)
                state.extra_refs[ref] = state.extra_refs.get(ref, 0) + 1
            seen.add(key)

    @staticmethod
    def _prune_pool_hashes(pool: _StoragePool) -> None:
        """Forget the hashes of blocks the pool's LRU dropped (amortised: runs when the map has
        grown to twice the pool)."""
        lru = pool.lru
        pool.key_of_hash = {h: k for h, k in pool.key_of_hash.items() if k in lru}

    def _apply_removed(self, state: _EngineState, event: Any) -> None:
        tier = _tier(event.medium)
        if tier is None:
            self._unknown_medium(state, event)
            return
        hash_to_key = state.hash_to_key
        hashes = _fold_hashes(event.block_hashes)
        if tier is Tier.STORAGE:
            pool = state.pool
            for engine_hash in hashes:
                key = None if pool is None else pool.key_of_hash.pop(engine_hash, None)
                if key is None or pool is None or key not in pool.lru:
                    state.unknown_removals += 1
                else:
                    self._pool_remove(pool, key)
                    pool.removed_blocks += 1
            return
        bit = state.gpu_bit if tier is Tier.GPU else state.cpu_bit
        both = state.gpu_bit | state.cpu_bit
        masks = self._masks
        extra_refs = state.extra_refs
        intern = self._intern
        removed = 0
        unknown = 0
        for engine_hash in hashes:
            key = hash_to_key.get(engine_hash)
            if key is None:
                unknown += 1
                continue
            mask = masks.get(key, 0)
            if not mask & bit:
                unknown += 1
                continue
            if extra_refs:
                ref = (tier, key)
                extra = extra_refs.get(ref)
                if extra:
                    if extra == 1:
                        del extra_refs[ref]
                    else:
                        extra_refs[ref] = extra - 1
                    continue
            mask ^= bit
            if mask:
                masks[key] = intern(mask)
            else:
                del masks[key]
            removed += 1
            if not mask & both:
                del hash_to_key[engine_hash]
        state.unknown_removals += unknown
        if tier is Tier.GPU:
            state.gpu_blocks -= removed
        else:
            state.cpu_blocks -= removed

    def _pool_add(self, pool: _StoragePool, key: int) -> None:
        lru = pool.lru
        if key in lru:
            lru.move_to_end(key)
            lru[key] = self._now
            return
        lru[key] = self._now
        self._masks[key] = self._intern(self._masks.get(key, 0) | pool.bit)
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
            self._masks[key] = self._intern(mask)
        else:
            self._masks.pop(key, None)

    def clear_engine(self, engine_id: str, tiers: Iterable[Tier] | None = None) -> None:
        """Drop what ``engine_id`` announced in ``tiers`` (default: all tiers).

        STORAGE is dropped only for a private pool: a shared pool outlives one engine's restart.
        """
        state = self._engines.get(engine_id)
        if state is None:
            return
        self._forget_matches()
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
                        masks[key] = self._intern(mask)
                    else:
                        del masks[key]
                if not mask & both:
                    del state.hash_to_key[engine_hash]
            tier_ints = {int(t) for t in tier_set}
            state.extra_refs = {r: n for r, n in state.extra_refs.items() if r[0] not in tier_ints}
        if Tier.GPU in tier_set:
            expiries = self._spec_expiry.get(state.slot)
            if expiries:
                self._drop_specs(state.slot, expiries, list(expiries))
        pool = state.pool
        if Tier.STORAGE in tier_set and pool is not None and pool.slot == state.slot:
            for key in pool.lru:
                self._clear_bits(key, pool.bit)
            pool.lru.clear()
            pool.key_of_hash.clear()

    # ----------------------------------------------------------------------------- pool recency

    def refresh_pool_reads(self, engine_id: str, keys: Sequence[int], now: float | None = None) -> int:
        """``engine_id`` was just sent a request with prompt ``keys``: the blocks of its prefix that
        the engine holds only in its STORAGE pool (not on its GPU or CPU, as the events say) will be
        read from the pool, which makes them the pool's most recently used. Mirror that in the
        index's LRU, as the pool does, since the pool never says so. Returns blocks refreshed."""
        if now is not None:
            self._advance(now)
        state = self._engines.get(engine_id)
        if state is None:
            return 0
        if state.delivery is not None and keys:
            self._note_prediction(state, keys, self._now if now is None else now)
        if state.pool is None:
            return 0
        pool = state.pool
        lru = pool.lru
        masks = self._masks
        local = state.gpu_bit | state.cpu_bit
        refreshed = 0
        for key in keys:  # the engine's own walk: GPU, then CPU, then the pool, stop at a miss
            mask = masks.get(key)
            if mask is None:
                break
            if mask & local:
                continue
            if key not in lru:
                break
            lru.move_to_end(key)  # the stamp stays: a read proves nothing about a later store
            refreshed += 1
        pool.refreshed_blocks += refreshed
        return refreshed

    def learn_delivered(
        self,
        engine_id: str,
        keys: Sequence[int],
        delivered_blocks: int,
        predicted_blocks: int,
        routed_s: float,
    ) -> bool:
        """An engine reported ``delivered_blocks`` cached blocks of ``keys`` where the index had
        predicted ``predicted_blocks`` at ``routed_s``. A shortfall means block ``delivered_blocks``
        was in none of the engine's tiers, its pool included: drop it from the pool (the pool evicted
        it silently) unless a store announced it again since the routing. True when dropped."""
        state = self._engines.get(engine_id)
        if state is not None and state.delivery is not None and keys:
            self._note_delivery(state, keys, delivered_blocks, routed_s)
        if not 0 <= delivered_blocks < min(predicted_blocks, len(keys)):
            return False
        if state is None or state.pool is None:
            return False
        pool = state.pool
        key = keys[delivered_blocks]
        stamp = pool.lru.get(key)
        if stamp is None or stamp >= routed_s:
            return False
        self._forget_matches()
        self._pool_remove(pool, key)
        pool.shortfall_drops += 1
        return True

    # ----------------------------------------------------------------------------- evidence

    def watch_delivery(self, engine_id: str, window: int, *, keep: bool = False) -> None:
        """Start (or restart) collecting evidence for ``engine_id``'s picture: for each request
        routed to it from now on, whether the cached blocks the engine reports equal the prefix the
        index held for it at routing (its own events only: no speculative entries). ``window``: how
        many of the latest requests are kept. ``keep``: an engine already watched keeps what was
        collected (nothing new was lost since)."""
        if window < 1:
            raise ValueError(f"evidence window must be >= 1, got {window}")
        state = self._engine(engine_id)
        if keep and state.delivery is not None:
            return
        state.delivery = deque(maxlen=window)
        state.predictions.clear()

    def unwatch_delivery(self, engine_id: str) -> None:
        state = self._engines.get(engine_id)
        if state is not None:
            state.delivery = None
            state.predictions.clear()

    def delivery_evidence(self, engine_id: str) -> tuple[int, int]:
        """(requests compared, requests that agreed) in the window; (0, 0) when not collecting."""
        state = self._engines.get(engine_id)
        if state is None or state.delivery is None:
            return 0, 0
        return len(state.delivery), sum(state.delivery)

    def held_prefix_blocks(self, engine_id: str, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` the engine holds in any tier per its events (no speculation)."""
        state = self._engines.get(engine_id)
        return 0 if state is None else self._held_prefix(state, keys)

    def _held_prefix(self, state: _EngineState, keys: Sequence[int]) -> int:
        local = state.gpu_bit | state.cpu_bit
        pool_bit = state.pool.bit if state.pool is not None else 0
        held = 0
        masks = self._masks
        for key in keys:
            mask = masks.get(key, 0)
            if not mask & local and not (pool_bit and mask & pool_bit):
                break
            held += 1
        return held

    def _note_prediction(self, state: _EngineState, keys: Sequence[int], routed_s: float) -> None:
        predictions = state.predictions
        predictions[(routed_s, len(keys), keys[0])] = self._held_prefix(state, keys)
        while len(predictions) > _PREDICTIONS_KEPT:
            predictions.popitem(last=False)

    def _note_delivery(
        self, state: _EngineState, keys: Sequence[int], delivered: int, routed_s: float
    ) -> None:
        predicted = state.predictions.pop((routed_s, len(keys), keys[0]), None)
        if predicted is None or state.delivery is None:
            return  # routed before the watch began (or by a path that predicts nothing)
        # vLLM computes at least the last prompt token: a fully held prompt whose length is a
        # multiple of the block size delivers one block less.
        agreed = delivered == predicted or (predicted == len(keys) and delivered == predicted - 1)
        state.delivery.append(agreed)

    def set_block_size(self, engine_id: str, block_size: int | None) -> None:
        """The engine's configured block size: self-describing stores of another size are counted
        (``block_size_mismatches``). None stops checking."""
        if block_size is not None and block_size < 1:
            raise ValueError(f"engine {engine_id!r}: block_size must be >= 1, got {block_size}")
        self._engine(engine_id).block_size = block_size

    def gpu_block_size_mismatches(self, engine_id: str) -> int:
        """GPU stores of ``engine_id`` with a block size other than its configured one."""
        state = self._engines.get(engine_id)
        return 0 if state is None else state.gpu_block_size_mismatches

    def event_problems(self, engine_id: str) -> tuple[dict[str, int], dict[str, int]]:
        """(unknown medium name -> events, tier -> stores of the wrong block size) of an engine."""
        state = self._engines.get(engine_id)
        if state is None:
            return {}, {}
        return dict(state.unknown_media), dict(state.block_size_mismatches)

    # ----------------------------------------------------------------------------- speculation

    def speculate(self, engine_id: str, keys: Sequence[int], ttl_s: float, now: float) -> None:
        """Record ``keys`` as provisional GPU entries on ``engine_id`` until ``now + ttl_s``.

        Used right after routing, so a burst sharing a prefix sees the hit before the engine's
        BlockStored events arrive. A GPU BlockStored of the key confirms (replaces) the entry, and
        keys the engine's events already hold on its GPU get none (if the engine evicts one before
        the request reads it, the request stores it again and the event says so). A list of
        ``keys`` is kept by reference (a re-sent chain is then known by identity, not compared
        key by key): the caller does not change it after the call."""
        self._advance(now)
        state = self._engine(engine_id)
        expiry = now + ttl_s
        bit = state.gpu_bit
        spec_masks = self._spec_masks
        slot = state.slot
        spec_expiry = self._spec_expiry.setdefault(slot, {})
        # Blocks the engine's own events already put on its GPU need no provisional entry: a turn
        # resending its history speculates only the blocks that are new to that engine.
        # (An engine whose events put nothing on its GPU, or that sends none, skips the check.)
        if state.gpu_blocks:
            held = map(operator.and_, map(self._masks.get, keys, _ZEROS), itertools.repeat(bit))
            keys = list(itertools.compress(keys, map(operator.not_, held)))
        if not keys:
            return
        last = self._spec_last.get(slot)
        if last is not None:
            # The same chain again, due no earlier (a prompt re-sent to the engine that holds it):
            # its keys are all speculative here already and each has a heap entry due at or
            # before its new expiry, which re-arms it (``_advance`` settles first), so one
            # expiry for the chain is refreshed instead of one per block.
            if expiry >= last.expiry and (last.keys is keys or last.keys == keys):
                if expiry != last.expiry:
                    last.expiry = expiry
                    last.written = False
                if type(keys) is list:
                    # An equal chain in another list (requests tokenised at once, each hashing
                    # its own keys): keep the caller's, which the key cache hands out again, so
                    # the next call is known by identity, not by a compare of every key.
                    last.keys = keys
                return
            self._settle(slot)
        # Every key gets the new expiry; a heap entry is pushed only for keys no entry covers yet:
        # new keys, and keys whose expiry moves earlier (a replica's record of an older routing has
        # a shorter ttl). A key refreshed to a later expiry keeps the entry it has, which re-arms it
        # when it comes due (``_advance``): a prompt re-sent every few milliseconds costs a heap
        # entry per ttl, not one per request.
        if expiry == _INF:  # never due: no heap entry
            arm = []
            new = list(itertools.compress(keys, map(operator.not_, map(spec_expiry.__contains__, keys))))
        else:  # a new key reads as due at _INF, later than any finite expiry: it is armed
            ends = map(spec_expiry.get, keys, _NEVER)
            arm = list(itertools.compress(keys, map(operator.gt, ends, itertools.repeat(expiry))))
            new = list(itertools.compress(arm, map(operator.not_, map(spec_expiry.__contains__, arm))))
        spec_expiry.update(dict.fromkeys(keys, expiry))
        if new:
            self._forget_matches()
            spec_masks.update(
                zip(
                    new,
                    map(operator.or_, map(spec_masks.get, new, _ZEROS), itertools.repeat(bit)),
                    strict=True,
                )
            )
        if arm:
            # New keys' first entry is their own; keys moved earlier are taken over from the
            # entry that covered them (it must not re-arm them as well).
            self._arm(slot, expiry, arm, taking_over=len(new) < len(arm))
        self._spec_last[slot] = _LastSpeculation(keys if type(keys) is list else list(keys), expiry)

    def _settle(self, slot: int) -> None:
        """Write the slot's latest chain's expiry into its expiry table (before anything reads it)."""
        last = self._spec_last.get(slot)
        if last is not None and not last.written:
            self._spec_expiry[slot].update(dict.fromkeys(last.keys, last.expiry))
            last.written = True

    def _arm(self, slot: int, expiry: float, keys: list[int], *, taking_over: bool = True) -> None:
        """Push a heap entry due at ``expiry`` for ``keys``. ``taking_over``: it replaces the entry
        that covered them (recorded in ``_spec_armed``); a new key's first entry is its own."""
        entry = next(self._spec_counter)
        if taking_over:
            self._spec_armed.setdefault(slot, {}).update(dict.fromkeys(keys, entry))
        heapq.heappush(self._spec_heap, (expiry, entry, slot, tuple(keys)))

    def _drop_specs(self, slot: int, expiries: dict[int, float], keys: Sequence[int]) -> None:
        """Drop the speculative entries of ``keys`` on ``slot`` (``expiries`` is its expiry table):
        in bulk, each step one C-level map over the keys, not a Python call per key."""
        if not keys:
            return
        self._forget_matches()
        # Keys of the latest chain leave: the rest get its expiry, and the chain is no longer whole.
        self._settle(slot)
        self._spec_last.pop(slot, None)
        deque(map(expiries.pop, keys, _NONES), 0)
        armed = self._spec_armed.get(slot)
        if armed:
            deque(map(armed.pop, keys, _NONES), 0)
        spec_masks = self._spec_masks
        others = itertools.repeat(~(1 << (_BITS_PER_SLOT * slot)))
        masks = list(map(operator.and_, map(spec_masks.get, keys, _ZEROS), others))
        spec_masks.update(zip(keys, masks, strict=True))
        # Keys no other engine speculates leave the table (a zero mask is never kept).
        deque(map(spec_masks.pop, itertools.compress(keys, map(operator.not_, masks)), _NONES), 0)

    def _advance(self, now: float) -> None:
        if now > self._now:
            self._now = now
        heap = self._spec_heap
        if not heap or heap[0][0] > self._now:
            return
        now = self._now
        while heap and heap[0][0] <= now:
            _, entry, slot, keys = heapq.heappop(heap)
            expiries = self._spec_expiry.get(slot)
            if not expiries:
                continue
            self._settle(slot)
            # Due keys go (a key gone already reads as never due); a key still live was refreshed
            # to a later expiry and is re-armed there, by this entry only if no later entry took it
            # over (``_spec_armed``; a key's first entry is recorded nowhere), so a key is never
            # re-armed twice.
            ends = list(map(expiries.get, keys, _NEVER))
            due = list(itertools.compress(keys, map(operator.le, ends, itertools.repeat(now))))
            self._drop_specs(slot, expiries, due)
            if len(due) == len(keys):
                continue
            armed = self._spec_armed.get(slot, {})
            later: dict[float, list[int]] = {}
            for key, end in zip(keys, ends, strict=True):
                if now < end < _INF and armed.get(key, entry) == entry:
                    later.setdefault(end, []).append(key)
            for end, group in later.items():
                self._arm(slot, end, group)

    # ----------------------------------------------------------------------------- queries

    def match(
        self, keys: Sequence[int], engine_ids: Iterable[str] | None = None, now: float | None = None
    ) -> dict[str, PrefixMatch]:
        """Per engine: the contiguous prefix of ``keys`` it holds in any tier, split by best tier.

        With ``engine_ids`` every listed engine is in the result (NO_MATCH when it holds
        nothing); without, only engines holding at least block 0 are. A prompt matched again
        while nothing in the index changed gets the kept result (a new dict). A list of ``keys``
        is kept by reference: the caller does not change it after the call."""
        if now is not None:
            self._advance(now)
        wanted = None if engine_ids is None else tuple(engine_ids)
        name = (len(keys), keys[-1], wanted) if keys else None
        kept = self._matches.get(name) if name is not None else None
        if kept is not None and (kept[0] is keys or kept[0] == keys):
            if kept[0] is not keys and type(keys) is list and name is not None:
                self._matches[name] = (keys, kept[1])  # known by identity next time (as speculate)
            return dict(kept[1])
        if wanted is None:
            candidates = self._engine_positions
        else:
            candidates = 0
            for engine_id in wanted:
                state = self._engines.get(engine_id)
                if state is not None:
                    candidates |= state.position
        result: dict[str, PrefixMatch] = {}
        if candidates and keys:
            self._match_into(keys, candidates, result)
        if wanted is not None:
            result = {engine_id: result.get(engine_id, NO_MATCH) for engine_id in wanted}
        if name is not None:
            if len(self._matches) >= _MATCHES_KEPT:
                self._matches.clear()
            self._matches[name] = (keys if type(keys) is list else list(keys), dict(result))
        return result

    def _match_into(self, keys: Sequence[int], candidates: int, result: dict[str, PrefixMatch]) -> None:
        # Lookups dominate (cache misses in a big dict): stop at the first block nobody holds.
        held_masks: Iterable[int | None] = map(self._masks.get, keys)
        if self._spec_masks:  # OR in the provisional bits, all in C (no Python step per key)
            held_masks = map(
                operator.or_, map(self._masks.get, keys, _ZEROS), map(self._spec_masks.get, keys, _ZEROS)
            )
        positions = self._engine_positions
        shared_bits = self._shared_pool_bits
        shared_pools = self._shared_pools.values()
        # Engines that had the same best tier in every run so far form one class and share one
        # count, so 1,000 engines seeing a block only through their shared pool (or all holding the
        # system prompt on GPU) cost a few big-int operations per run, not 1,000 loop steps.
        # A class: (presence positions of its engines, gpu blocks, cpu blocks, storage blocks).
        classes: list[tuple[int, int, int, int]] = [(candidates, 0, 0, 0)]
        held_prefix: Iterable[int] = itertools.takewhile(bool, held_masks)  # type: ignore[arg-type]
        for mask, run in itertools.groupby(held_prefix):
            run_blocks = len(list(run))
            gpu = mask & positions
            cpu = (mask >> 1) & positions & ~gpu
            storage = (mask >> 2) & positions  # private pools sit on the engine's own slot
            if mask & shared_bits:
                for pool in shared_pools:
                    if mask & pool.bit:
                        storage |= pool.mount_positions
            storage &= ~(gpu | cpu)
            held = gpu | cpu | storage
            refined: list[tuple[int, int, int, int]] = []
            for members, g, c, s in classes:
                dead = members & ~held
                if dead:
                    self._emit(dead, g, c, s, result)
                    members ^= dead
                    if not members:
                        continue
                part = members & gpu
                if part:
                    refined.append((part, g + run_blocks, c, s))
                    members ^= part
                    if not members:
                        continue
                part = members & cpu
                if part:
                    refined.append((part, g, c + run_blocks, s))
                    members ^= part
                    if not members:
                        continue
                refined.append((members, g, c, s + run_blocks))  # the rest: storage
            classes = refined
            if not classes:
                return
        for members, g, c, s in classes:
            self._emit(members, g, c, s, result)

    def _emit(self, members: int, gpu: int, cpu: int, storage: int, result: dict[str, PrefixMatch]) -> None:
        """One PrefixMatch for every engine whose presence position is in ``members``."""
        blocks = gpu + cpu + storage
        if not blocks:
            return
        match = PrefixMatch(blocks, (gpu, cpu, storage))
        count = members.bit_count()
        if count < 8:
            for engine_id in self._ids_at(members):
                result[engine_id] = match
            return
        # Many engines: fill a whole id list with one C-level call, then undo the few that do not
        # belong (keeping what they already had).
        ids, id_positions = self._all_ids, self._engine_positions
        for pool in self._shared_pools.values():
            if not members & ~pool.mount_positions and len(pool.member_ids) < len(ids):
                ids, id_positions = pool.member_ids, pool.mount_positions
        excluded = id_positions & ~members
        if excluded.bit_count() > count:
            for engine_id in self._ids_at(members):
                result[engine_id] = match
            return
        excluded_ids = self._ids_at(excluded)
        kept = {engine_id: result[engine_id] for engine_id in excluded_ids if engine_id in result}
        result.update(dict.fromkeys(ids, match))
        for engine_id in excluded_ids:
            del result[engine_id]
        result.update(kept)

    def _ids_at(self, positions: int) -> list[str]:
        by_slot = self._engine_by_slot
        ids = []
        while positions:
            low = positions & -positions
            positions ^= low
            ids.append(by_slot[low.bit_length() // _BITS_PER_SLOT].engine_id)
        return ids

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

    def engine_hashes(self, engine_id: str) -> set[EngineHash]:
        """Engine hashes the engine holds in GPU or CPU per its events (checks against its cache)."""
        return set(self._engine(engine_id).hash_to_key)

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
                "unknown_media": dict(state.unknown_media),
                "block_size_mismatches": dict(state.block_size_mismatches),
            }
        pools = {
            pool.pool_id: {
                "blocks": len(pool.lru),
                "capacity_blocks": pool.capacity_blocks,
                "evicted_blocks": pool.evicted_blocks,
                "removed_blocks": pool.removed_blocks,
                "refreshed_blocks": pool.refreshed_blocks,
                "shortfall_drops": pool.shortfall_drops,
            }
            for pool in self._all_pools()
        }
        return {
            "keys": len(self._masks),
            "speculative_entries": sum(map(len, self._spec_expiry.values())),
            "engines": engines,
            "storage_pools": pools,
        }

    def _all_pools(self) -> list[_StoragePool]:
        pools = list(self._shared_pools.values())
        pools += [s.pool for s in self._engines.values() if s.pool is not None and s.pool.slot == s.slot]
        return pools


TIERS_ALL: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.STORAGE)
