"""The simulated vLLM engine core: continuous batching in scheduler steps, a tiered prefix cache
(GPU / CPU / STORAGE) and a time model. A pure, deterministic state machine with no I/O: its clock
``now_s`` advances by the ``duration_s`` each ``step()`` returns, or jumps to the ``now_s`` a driver
passes (sim/server.py, sim/des.py).

Step time model, in seconds (docs/simulator.md gives the source of every default figure):
    duration_s = step_overhead_s
               + prefill_tokens_computed / prefill_tokens_per_s
               + prefill_attention_s_per_token_ctx * sum over prefill tokens of their context length
               + decoding_requests * decode_s_per_seq
               + decode context tokens * kv_bytes_per_token / hbm_bytes_per_s   (KV read per decode)
KV loads from CPU / STORAGE are asynchronous (``async_loads``, vLLM's offloading connector): they
queue on one host->GPU link per engine (``latency + bytes / bandwidth``; a shared STORAGE pool also
books its aggregate ``shared_bytes_per_s``, writes included) and only the loading request waits for
its blocks; the batch goes on, and the loaded blocks join the prefix cache when the load lands. CPU
tier writes land at the end of the step after the one that made them. ``async_loads=False`` is the
old model: the step stalls for the loads, and writes land at once.
bytes = blocks * block_size * kv_bytes_per_token (trace mode too: block_size tokens per id).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore.core import SCHEDULING_POLICIES
from kvcore.sim_tokenizer import filler_tokens
from sim.cache import GpuBlockPool, LruBlockTier, StoragePool
from sim.hashing import HASH_ALGOS, BlockHashCache, HashChain

# Tier indices, in policies.base.Tier order (sim/ does not import the routing library).
_GPU, _CPU, _STORAGE = 0, 1, 2
_MEDIUM = ("GPU", "CPU", "STORAGE")

#: Length of the deterministic output-token cycle each engine draws answers from.
_OUTPUT_CYCLE_TOKENS = 4096

#: Why a step admitted no further waiting request (``EngineCore.wait_records``): the step's token
#: budget was spent (prefill queued ahead), the head's whole sequence did not fit the free KV
#: blocks, ``max_num_seqs`` requests were running, or a preemption stopped admission.
WAIT_REASONS = ("budget", "kv", "seqs", "preempt")
_BUDGET, _KV, _SEQS, _PREEMPT = 0, 1, 2, 3

#: ``_try_admit``'s answer for a request vLLM's scheduler skips this step (its connector cannot say
#: yet what it will load): the next waiting request is tried.
_DEFER = (-1, -1.0)


@dataclass
class EngineProfile:
    """Every parameter of the engine model. Defaults: Llama-3-8B bf16 on one H100 (see
    docs/architecture.md reference numbers); ``scaled_down`` shrinks the pools for small machines."""

    #: Tokens per KV block: the hashing and caching unit.
    block_size: int = 16
    #: GPU KV pool in blocks (27,852 x 16 = 445,632 token slots at 0.92 memory utilisation).
    num_gpu_blocks: int = 27852
    #: CPU tier in blocks (0 = no CPU tier). Prompt blocks are written through when computed.
    num_cpu_blocks: int = 0
    #: Token budget of one step: chunked prefill tokens + one per decoding request (vLLM's API-server
    #: default on an H100).
    max_num_batched_tokens: int = 8192
    #: Most requests running at once. vLLM's API-server default on a GPU of 70 GiB or more other
    #: than an A100 (``EngineArgs.get_batch_defaults``: 1,024 for ``vllm serve`` on an H100).
    max_num_seqs: int = 1024
    #: Longest sequence (prompt + output) accepted.
    max_model_len: int = 131072
    #: KV-cache bytes of one token (Llama-3-8B bf16: 32 layers x 8 KV heads x 128 dims x 2 x 2 bytes).
    kv_bytes_per_token: int = 131072
    #: Prefill rate of the context-free part (weights' FLOPs). 22,000 tok/s makes recompute ~22x
    #: slower than a host reload at 64 GB/s (131,072 B / 64e9 B/s = 2.05 us per token reloaded vs
    #: 45 us per token computed); 2 x 8.03e9 FLOPs x 22,000 = 353 TFLOP/s, 36% of H100 bf16 peak.
    prefill_tokens_per_s: float = 22_000.0
    #: Attention of one prefill token over one token of context before it, in seconds:
    #: 4 x 32 layers x 4,096 (QK^T and AV, 2 FLOPs per multiply-add) = 524,288 FLOPs at the same
    #: 353 TFLOP/s as the rest of the prefill = 1.48 ns. A 40K-token prompt from scratch then costs
    #: 1.82 s linear + 1.19 s attention. 0 = the old context-free model.
    prefill_attention_s_per_token_ctx: float = 1.48e-9
    #: Fixed cost of every step: one read of the 16 GB of bf16 weights (4.8 ms at 3.35 TB/s;
    #: kernels overlap part of it), scheduling, sampling.
    step_overhead_s: float = 0.004
    #: Added per decoding request in a step: its 16 GFLOPs of matmuls at the H100's 989 TFLOP/s.
    decode_s_per_seq: float = 0.000016
    #: HBM bandwidth a decode reads its KV cache at (H100 SXM: 3.35 TB/s): a 40K-token KV of
    #: 5.2 GB takes 1.57 ms per step. inf = the old model (decode cost independent of context).
    hbm_bytes_per_s: float = 3.35e12
    #: KV loads overlap compute (vLLM's asynchronous offloading connector); False = the step stalls.
    async_loads: bool = True
    #: Log-normal sigma of the noise on the reported offload load/store times (the router's
    #: measured bandwidths); 0 = exact counters.
    counter_noise: float = 0.0
    #: Host -> GPU bandwidth (PCIe 5.0 x16, one direction).
    cpu_load_bytes_per_s: float = 64e9
    #: Fixed cost of one CPU -> GPU load operation.
    cpu_latency_s: float = 0.0002
    #: STORAGE -> GPU bandwidth (NVMe class); a StoragePool may override it.
    storage_load_bytes_per_s: float = 6e9
    #: Fixed cost of one STORAGE -> GPU load operation; a StoragePool may override it.
    storage_latency_s: float = 0.001
    #: "sha256" (own: sha256 over parent/tokens/extra keys, folded to 64 bits) or "sha256_cbor"
    #: (vLLM's exact values).
    hash_algo: str = "sha256"
    #: CPU BlockStored carry token ids and parent (else hash-only placeholders, vLLM's default).
    self_describing_cpu_events: bool = False
    #: Announce STORAGE stores (vLLM: ``"enable_kv_events": true`` in the tier config).
    emit_storage_events: bool = True
    #: Build KV event dicts at all; the offline simulator turns this off for speed.
    emit_events: bool = True
    #: vLLM's ``--scheduling-policy``: "fcfs" or "priority" (waiting ordered by (priority,
    #: arrival); the preemption victim is the running request with the largest (priority, arrival)).
    scheduling_policy: str = "fcfs"
    #: vLLM's ``scheduler_reserve_full_isl`` (on by default): a waiting request is admitted only if
    #: the blocks of its whole sequence (prompt and output so far, less its GPU prefix hits) are
    #: free, not just those of its first chunk. False = admit on the first chunk (the old model).
    reserve_full_isl: bool = True

    def __post_init__(self) -> None:
        positive_ints = (
            "block_size",
            "num_gpu_blocks",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "kv_bytes_per_token",
        )
        for name in positive_ints:
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineProfile.{name} must be positive, got {getattr(self, name)}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"EngineProfile.num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        for name in (
            "prefill_tokens_per_s",
            "cpu_load_bytes_per_s",
            "storage_load_bytes_per_s",
            "hbm_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"EngineProfile.{name} must be positive, got {getattr(self, name)}")
        for name in (
            "step_overhead_s",
            "decode_s_per_seq",
            "cpu_latency_s",
            "storage_latency_s",
            "prefill_attention_s_per_token_ctx",
            "counter_noise",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineProfile.{name} must be >= 0, got {getattr(self, name)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"EngineProfile.scheduling_policy {self.scheduling_policy!r} is unknown; accepted: "
                f"{', '.join(SCHEDULING_POLICIES)} (vLLM's --scheduling-policy)"
            )
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"EngineProfile.hash_algo {self.hash_algo!r} is unknown; accepted: {', '.join(HASH_ALGOS)}"
            )

    def legacy_model(self) -> EngineProfile:
        """The model before issue 16, for before/after comparisons: loads stall the step, no
        context-dependent costs, a flat 60 us per decoding request, exact counters."""
        return dataclasses.replace(
            self,
            async_loads=False,
            prefill_attention_s_per_token_ctx=0.0,
            decode_s_per_seq=0.00006,
            hbm_bytes_per_s=math.inf,
            counter_noise=0.0,
        )

    def scaled_down(self, factor: float) -> EngineProfile:
        """The same engine with GPU and CPU pools ``factor`` times smaller (at least one block of
        GPU pool; a CPU tier stays present). Rates and block size are unchanged."""
        if factor < 1:
            raise ValueError(f"scaled_down factor must be >= 1, got {factor}")
        cpu_blocks = max(1, int(self.num_cpu_blocks / factor)) if self.num_cpu_blocks else 0
        return dataclasses.replace(
            self, num_gpu_blocks=max(1, int(self.num_gpu_blocks / factor)), num_cpu_blocks=cpu_blocks
        )


@dataclass
class SimRequest:
    """A request as the engine receives it: token ids (token mode) or trace block ids (trace mode)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None
    lora_name: str | None = None
    #: The sim always generates max_tokens (capped by max_model_len); False is accepted, same effect.
    ignore_eos: bool = True
    #: Trace mode: one opaque id per block of ``block_size`` tokens (Mooncake / agent hash ids).
    #: Only ids of full blocks are hashed and cached; a trailing id for a partial block is allowed.
    block_ids: list[int] | None = None
    #: Trace mode: prompt length in tokens (default: len(block_ids) * block_size).
    prompt_len: int | None = None
    #: vLLM's ``priority`` (lower is served first); an "fcfs" engine ignores it, as vLLM does.
    priority: int = 0


@dataclass
class FinishedRequest:
    request_id: str
    prompt_tokens: int
    output_token_ids: list[int]
    #: Prompt tokens served from cache (any tier), counted when the request was first scheduled.
    cached_tokens: int
    #: GPU, CPU, STORAGE (policies.base.Tier order).
    cached_tokens_by_tier: tuple[int, int, int]
    #: "length" | "abort"
    finish_reason: str


@dataclass
class StepOutput:
    #: Virtual seconds this step took (module docstring).
    duration_s: float
    #: request_id -> output tokens produced this step (the first non-empty one is the first token).
    new_token_ids: dict[str, list[int]]
    finished: list[FinishedRequest]
    #: KV events of this step in vLLM 0.33's map form (empty when profile.emit_events is False).
    events: list[dict[str, Any]]
    #: Requests that ran in this step (prefill chunk or decode), and prefill tokens computed.
    num_scheduled: int = 0
    num_prefill_tokens: int = 0


@dataclass
class EngineStats:
    """Counters (monotonic) and gauges for the engine's /metrics (vLLM names in comments)."""

    num_running: int = 0  # vllm:num_requests_running
    num_waiting: int = 0  # vllm:num_requests_waiting
    kv_cache_usage: float = 0.0  # vllm:kv_cache_usage_perc (0..1)
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    block_size: int = 16
    hash_algo: str = "sha256"
    prefix_cache_queries_tokens: int = 0  # vllm:prefix_cache_queries_total
    prefix_cache_hits_tokens: int = 0  # vllm:prefix_cache_hits_total (GPU)
    external_prefix_cache_queries_tokens: int = 0  # vllm:external_prefix_cache_queries_total
    external_prefix_cache_hits_tokens: int = 0  # vllm:external_prefix_cache_hits_total (CPU+STORAGE)
    #: vllm:prompt_tokens_cached_by_source_total, GPU / CPU / STORAGE.
    cached_tokens_by_tier: tuple[int, int, int] = (0, 0, 0)
    #: vllm:kv_offload_load_bytes_total / load_time_total per tier name ("CPU", "STORAGE").
    load_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    load_time_s_by_tier: dict[str, float] = field(default_factory=dict)
    #: vllm:kv_offload_store_bytes_total / store_time_total per tier name.
    store_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    store_time_s_by_tier: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0  # vllm:prompt_tokens_total (admitted requests)
    generation_tokens: int = 0  # vllm:generation_tokens_total
    num_preemptions: int = 0  # vllm:num_preemptions_total
    num_finished: int = 0
    num_aborted: int = 0
    num_steps: int = 0
    num_events: int = 0
    busy_time_s: float = 0.0


@dataclass(frozen=True, slots=True)
class WaitRecord:
    """Where one request's time before its first token went, on the engine clock
    (``EngineCore.wait_records``)."""

    #: Seconds it waited while each step stopped admitting for a reason, in WAIT_REASONS order,
    #: until its first admission.
    waits_s: tuple[float, float, float, float]
    #: When it was first admitted (the start of that step).
    admitted_s: float
    #: When it was first preempted before its first token (-1 = never).
    preempted_s: float
    #: When its first token was produced (the end of that step).
    first_token_s: float


class _Request:
    """Engine-side state of one request."""

    __slots__ = (
        "admitted_s",
        "block_ids",
        "blocks",
        "cached_by_tier",
        "chain",
        "cpu_pins",
        "extra_every_block",
        "extra_first_block",
        "loading_blocks",
        "max_output",
        "num_committed_blocks",
        "num_computed",
        "num_prompt_blocks",
        "offered_to",
        "output_offset",
        "output_token_ids",
        "preempted_s",
        "prio_key",
        "promoted",
        "promotion_s",
        "promotion_walks",
        "prompt_len",
        "ready_at_s",
        "request",
        "seen_from",
        "store_from",
        "stores_pending",
        "tier_keys",
        "tokens",
        "unranked",
        "wait_snapshot",
        "waits_s",
    )

    def __init__(
        self,
        request: SimRequest,
        prompt_len: int,
        max_output: int,
        block_size: int,
        chain: HashChain,
        output_offset: int,
    ) -> None:
        self.request = request
        self.prompt_len = prompt_len
        self.max_output = max_output
        self.block_ids = request.block_ids
        #: Token mode: prompt + output token ids (output blocks get cached too, as in vLLM).
        self.tokens: list[int] | None = (
            None if request.block_ids is not None else list(request.prompt_token_ids)
        )
        #: Full prompt blocks: the ones that may be hashed, cached and offloaded.
        self.num_prompt_blocks = prompt_len // block_size
        self.chain = chain
        lora = request.lora_name
        salt = request.cache_salt
        # vLLM's per-block extra keys: LoRA name on every block, cache_salt on block 0 only.
        self.extra_every_block: tuple[Any, ...] | None = (lora,) if lora else None
        first = tuple(x for x in (lora, salt) if x)
        self.extra_first_block: tuple[Any, ...] | None = first or None
        #: GPU blocks held, in order: the block's hash when cached, -1 when anonymous.
        self.blocks: list[int] = []
        self.num_committed_blocks = 0
        self.num_computed = 0
        self.output_token_ids: list[int] = []
        self.output_offset = output_offset
        self.cached_by_tier: tuple[int, int, int] | None = None
        #: vLLM's offloading scheduler: the first prompt block the request's next offload write
        #: offers (it offers every block from here to its last full prompt block; a refused write
        #: leaves it, so the next write offers those blocks again). 0 at admission, or past the
        #: hits when some came from CPU or STORAGE.
        self.store_from = 0
        #: The first block of the request the CPU tier ranks as used when it finishes: the first it
        #: loaded or offered, over all its admissions (vLLM's manager keeps what a request used
        #: through preemptions); none yet.
        self.seen_from = self.num_prompt_blocks
        #: Hashes it offered first while another request's write of them had not landed, and not
        #: again since once it had: vLLM's manager does not record them for the request, so its
        #: finish does not rank them. ``offered_to``: the end of the blocks it has offered.
        self.unranked: set[int] | None = None
        self.offered_to = 0
        #: Hashes promoted from STORAGE into the CPU tier for this request: their hits count as
        #: STORAGE hits (vLLM's tiering manager keeps each promoted block's source per request).
        self.promoted: set[int] = set()
        #: Engine time its loaded blocks are on the GPU (0 = nothing in flight): it waits till then.
        self.ready_at_s = 0.0
        #: Indices of the blocks this request is loading: GPU blocks it holds, cached (hashed) only
        #: when the load lands.
        self.loading_blocks: list[int] | None = None
        #: CPU tier blocks this request's loads in flight read (pinned there until they land).
        self.cpu_pins: list[int] | None = None
        #: Its CPU tier writes not landed yet (vLLM delays a request with transfers in flight).
        self.stores_pending = 0
        #: Hashes this request asked the STORAGE tier about (``EngineCore._tier_lookups``).
        self.tier_keys: list[int] | None = None
        #: Seconds its STORAGE reads into the CPU tier took (``EngineCore._promotions``): its
        #: STORAGE load's reported time includes them.
        self.promotion_s = 0.0
        #: Walks that started promotions for it (``EngineCore._walk_tiers`` gives up past a cap).
        self.promotion_walks = 0
        #: (priority, arrival order): the priority scheduler's sort key.
        self.prio_key: tuple[int, int] = (request.priority, 0)
        #: Wait accounting (EngineCore.wait_records): the engine's per-reason wait totals when it
        #: was queued, its own waits at its first admission, and the clock of each milestone.
        self.wait_snapshot: tuple[float, ...] = ()
        self.waits_s: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
        self.admitted_s = -1.0
        self.preempted_s = -1.0

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV must exist before the next token can be sampled."""
        return self.prompt_len + len(self.output_token_ids)

    def extra_keys(self, block_index: int) -> tuple[Any, ...] | None:
        return self.extra_first_block if block_index == 0 else self.extra_every_block


def placeholder_stored_event(block_hashes: list[int], medium: str = "CPU") -> dict[str, Any]:
    """A hash-only BlockStored as vLLM's offloading connector sends it (no tokens, block_size 0)."""
    return {
        "type": "BlockStored",
        "block_hashes": block_hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": 0,
    }


class EngineCore:
    """One simulated engine. Drive it with add_request / abort_request / step.

    ``storage`` may be shared by several engines (a shared fs tier); ``seed`` picks the output
    tokens (the same seed and inputs give the same steps, tokens, events and durations).
    ``hash_cache`` memoises block hashes across requests; pass one instance to many engines of
    the same hash algorithm to hash each shared prefix once (default: one per engine).
    """

    def __init__(
        self,
        engine_id: str,
        profile: EngineProfile,
        storage: StoragePool | None = None,
        seed: int = 0,
        hash_cache: BlockHashCache | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.profile = profile
        self.storage = storage
        self.seed = seed
        self.hash_cache = hash_cache if hash_cache is not None else BlockHashCache()
        self.gpu = GpuBlockPool(profile.num_gpu_blocks)
        self.cpu: LruBlockTier | None = (
            LruBlockTier(profile.num_cpu_blocks) if profile.num_cpu_blocks else None
        )
        self._block_size = profile.block_size
        self._bytes_per_block = profile.block_size * profile.kv_bytes_per_token
        self._emit = profile.emit_events
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._priority = profile.scheduling_policy == "priority"
        self._arrivals = 0
        self._running: list[_Request] = []
        #: Requests admitted with loads in flight (vLLM's WAITING_FOR_REMOTE_KVS, in its queue of
        #: waiting requests that hold KV blocks): not running, never preempted; once their loads
        #: land they are scheduled before the waiting queue, in admission order.
        self._loading: list[_Request] = []
        #: Hash -> when the load reading it lands, for blocks a request in ``_loading`` loads: a
        #: lookup that reaches one waits for it (vLLM's connector delays a request whose hits are
        #: being loaded, ``_chunks_being_loaded``), then hits the GPU copy.
        self._being_loaded: dict[int, float] = {}
        self._pending_events: list[dict[str, Any]] = []
        self._pending_finished: list[FinishedRequest] = []
        self._output_cycle = filler_tokens(_OUTPUT_CYCLE_TOKENS, seed)
        self._stats = EngineStats(
            num_gpu_blocks=profile.num_gpu_blocks,
            num_cpu_blocks=profile.num_cpu_blocks,
            block_size=profile.block_size,
            hash_algo=profile.hash_algo,
        )
        self._cached_by_tier = [0, 0, 0]
        self._load_bytes = [0, 0, 0]
        self._load_time_s = [0.0, 0.0, 0.0]
        self._store_bytes = [0, 0, 0]
        self._store_time_s = [0.0, 0.0, 0.0]
        #: Engine clock (seconds): advanced by each step, or set forward by the driver.
        self.now_s = 0.0
        #: When the host->GPU link is free again (loads from CPU and STORAGE queue on it).
        self._link_free_s = 0.0
        #: CPU tier writes (request, block indices stored) made in this step and in the step
        #: before: a write lands at the end of the step after the one that made it (vLLM's
        #: offloading worker reports it then); till then its blocks are pinned and not ready.
        self._stores_issued: list[tuple[_Request, list[int]]] = []
        self._stores_landing: list[tuple[_Request, list[int]]] = []
        #: Requests finished or aborted since the last step: the CPU tier ranks their blocks in
        #: the next step, after that step's writes (vLLM signals a finished request to its
        #: offloading manager when it builds the next step's connector metadata).
        self._to_rank: list[_Request] = []
        #: Hashes of CPU tier blocks written but not landed: a lookup that reaches one is deferred.
        self._cpu_unready: set[int] = set()
        #: vLLM's fs tier behind a CPU tier answers a lookup on a thread (its AsyncLookupManager):
        #: hash -> [the answer, None till the end of the step that asked; the ids of the requests
        #: that asked and have not finished]. A request whose lookup reaches a block not answered
        #: yet waits a step; an answer stands while a request that asked is alive, even if the block
        #: is written to the tier meanwhile.
        self._tier_lookups: dict[int, list[Any]] = {}
        self._tier_lookups_asked: list[int] = []
        self._async_tier_lookups = storage is not None and self.cpu is not None and profile.async_loads
        #: Promotions in flight there (vLLM's tiering manager reads a STORAGE hit into a CPU tier
        #: slot on a thread, a job per request and step): (request, block indices, when the read
        #: is done). Their slots are pinned and not ready; they land at the start of the first
        #: step at or after the read (vLLM polls its threads as a step schedules).
        self._promotions: list[tuple[_Request, list[int], float]] = []
        #: When the STORAGE tier's reader is free again (promotion jobs are read one after another).
        self._read_free_s = 0.0
        #: Per WAIT_REASONS: seconds of steps that ended with requests waiting for that reason.
        self._wait_totals_s = [0.0, 0.0, 0.0, 0.0]
        #: Request id -> WaitRecord of each request at its first token, when not None (set it to
        #: {} to measure; the driver pops the records it reads).
        self.wait_records: dict[str, WaitRecord] | None = None
        self._noise_rng = random.Random(f"counters:{engine_id}:{seed}") if profile.counter_noise else None
        if storage is not None:
            self._storage_bw = storage.load_bytes_per_s or profile.storage_load_bytes_per_s
            self._storage_latency_s = (
                storage.latency_s if storage.latency_s is not None else profile.storage_latency_s
            )
        else:
            self._storage_bw = profile.storage_load_bytes_per_s
            self._storage_latency_s = profile.storage_latency_s

    # ------------------------------------------------------------------ requests

    def add_request(self, req: SimRequest) -> None:
        """Queue a request. ValueError (saying what to change) when it is invalid or cannot fit."""
        p = self.profile
        rid = req.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in this engine; use a unique request_id")
        if req.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {req.max_tokens}")
        if req.block_ids is not None:
            n_ids = len(req.block_ids)
            prompt_len = req.prompt_len if req.prompt_len is not None else n_ids * p.block_size
            full_blocks = prompt_len // p.block_size
            if not full_blocks <= n_ids <= -(-prompt_len // p.block_size):
                raise ValueError(
                    f"request {rid!r}: {n_ids} block_ids do not fit prompt_len {prompt_len} at block_size "
                    f"{p.block_size}; give one id per block ({full_blocks} full blocks, optionally one more "
                    "for a partial last block)"
                )
        else:
            prompt_len = len(req.prompt_token_ids)
        if prompt_len < 1:
            raise ValueError(f"request {rid!r}: the prompt is empty; send at least one token")
        if prompt_len >= p.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {prompt_len} tokens leaves no room for output within "
                f"max_model_len {p.max_model_len}; shorten the prompt or raise max_model_len"
            )
        max_output = min(req.max_tokens, p.max_model_len - prompt_len)
        blocks_needed = -(-(prompt_len + max_output) // p.block_size)
        if blocks_needed > p.num_gpu_blocks:
            raise ValueError(
                f"request {rid!r}: needs {blocks_needed} KV blocks (prompt {prompt_len} + output "
                f"{max_output} tokens) but the GPU pool has {p.num_gpu_blocks}; shorten it or raise "
                "num_gpu_blocks"
            )
        offset = (zlib.crc32(rid.encode()) ^ self.seed) % _OUTPUT_CYCLE_TOKENS
        chain = HashChain(p.hash_algo, self.hash_cache)
        state = _Request(req, prompt_len, max_output, p.block_size, chain, offset)
        self._arrivals += 1
        # vLLM's V1 input processor no longer refuses a priority on an fcfs engine: its fcfs queue
        # and victim choice simply never read it.
        state.prio_key = (req.priority if self._priority else 0, self._arrivals)
        state.wait_snapshot = tuple(self._wait_totals_s)
        self._requests[rid] = state
        self._enqueue(state)

    def _enqueue(self, state: _Request) -> None:
        if self._priority:
            bisect.insort(self._waiting, state, key=_prio_key)
        else:
            self._waiting.append(state)

    def abort_request(self, request_id: str) -> None:
        """Drop a request (unknown ids are ignored, as vLLM does); it is reported finished with
        reason "abort" in the next step's output."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        holder = (
            self._running if state in self._running else self._loading if state in self._loading else None
        )
        if holder is not None:
            holder.remove(state)
            self._end_load(state)
            self._signal_finished(state)
            self._free_blocks(state)
        else:
            self._waiting.remove(state)
            # vLLM's connector finishes an aborted waiting request the next step like any other:
            # the STORAGE tier's answers it asked for go with it (``_forget_tier_lookups``).
            self._signal_finished(state)
        self._stats.num_aborted += 1
        self._pending_finished.append(self._finished(state, "abort"))

    def has_unfinished(self) -> bool:
        """Requests to serve or report, finished requests whose end the next step signals, or CPU
        tier writes to land (vLLM's engine keeps stepping while its scheduler has finished
        requests to signal or its offloading connector has transfers in flight)."""
        return bool(
            self._requests
            or self._pending_finished
            or self._to_rank
            or self._stores_issued
            or self._stores_landing
            or self._promotions
        )

    def reset_prefix_cache(self, reset_connector: bool = False) -> None:
        """Forget the GPU prefix cache. Running requests are preempted (they recompute later, like
        vLLM's reset with running requests); the next step's events start with AllBlocksCleared.
        With ``reset_connector`` (vLLM's ``reset_external``, and what its pause does) the CPU tier
        is emptied too, its writes in flight dropped, and the requests left offer their prompts
        again from the first block; the STORAGE pool stays (vLLM's tiering manager resets only its
        primary tier: persistent stores keep their data)."""
        while self._running:
            self._preempt(self._running.pop())
        while self._loading:
            self._preempt(self._loading.pop())
        self.gpu.clear_cached()
        if reset_connector and self.cpu is not None:
            self.cpu.clear()
            self._cpu_unready.clear()
            self._stores_issued.clear()
            self._stores_landing.clear()
            self._promotions.clear()
            self._to_rank.clear()
            for req in self._requests.values():
                req.stores_pending = 0
                req.store_from = 0
                req.seen_from = req.num_prompt_blocks
                req.unranked = None
                req.offered_to = 0
        if self._emit:
            self._pending_events.append({"type": "AllBlocksCleared"})

    def stats(self) -> EngineStats:
        s = self._stats
        s.num_running = len(self._running)
        s.num_waiting = len(self._waiting) + len(self._loading)
        s.kv_cache_usage = self.gpu.num_used() / self.gpu.num_blocks
        s.cached_tokens_by_tier = (self._cached_by_tier[0], self._cached_by_tier[1], self._cached_by_tier[2])
        s.load_bytes_by_tier = {_MEDIUM[t]: self._load_bytes[t] for t in (_CPU, _STORAGE)}
        s.load_time_s_by_tier = {_MEDIUM[t]: self._load_time_s[t] for t in (_CPU, _STORAGE)}
        s.store_bytes_by_tier = {_MEDIUM[t]: self._store_bytes[t] for t in (_CPU, _STORAGE)}
        s.store_time_s_by_tier = {_MEDIUM[t]: self._store_time_s[t] for t in (_CPU, _STORAGE)}
        return dataclasses.replace(s)

    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._loading)

    def num_running(self) -> int:
        return len(self._running)

    def cached_prefix_tokens(self, hashes: Sequence[int], prompt_len: int) -> tuple[int, int, int]:
        """Tokens of a prompt (``prompt_len`` tokens, its full blocks' ``hashes``) this engine would
        serve from each tier (GPU, CPU, STORAGE) if it admitted it now, in ``_try_admit``'s order:
        the GPU prefix (one block short of a full hit), then the offload tiers from there (a full
        hit allowed with asynchronous loads). Where the blocks are now: the promotions admission
        makes may evict CPU hits and serve them from STORAGE (``_offload_lookup``). Reads only
        (nothing pinned, touched or loaded): the DES's placement trace."""
        bs = self._block_size
        gpu, cpu, storage = self.gpu, self.cpu, self.storage
        by_tier = [0, 0, 0]
        limit, _, end = self._hit_ends(prompt_len, len(hashes))
        b = 0
        while b < limit and (gpu.is_pinned(hashes[b]) or gpu.is_evictable(hashes[b])):
            by_tier[_GPU] += bs
            b += 1
        while b < end:
            h = hashes[b]
            if cpu is not None and h in cpu:
                by_tier[_CPU] += bs
            elif storage is not None and h in storage:
                by_tier[_STORAGE] += bs
            else:
                break
            b += 1
        return by_tier[0], by_tier[1], by_tier[2]

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens this engine has still to compute over its waiting and running requests,
        a waiting one's cached prefix (``cached_prefix_tokens`` now) left out: the true prefill
        queue a new request finds, where ``queued_prefill_tokens`` is an upper bound. Reads only."""
        total = 0
        for r in (*self._running, *self._loading):
            total += max(0, r.prompt_len - r.num_computed)
        for r in self._waiting:
            hashes = self._ensure_hashes(r, self._num_hashable_blocks(r))
            total += max(
                0, r.prompt_len - r.num_computed - sum(self.cached_prefix_tokens(hashes, r.prompt_len))
            )
        return total

    def free_gpu_blocks(self) -> int:
        """GPU blocks an admission may take now: empty ones plus unpinned cached ones (evictable)."""
        return self.gpu.num_free()

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed over waiting and running requests (an upper bound: hits
        are not known before admission)."""
        return sum(
            max(0, r.prompt_len - r.num_computed) for r in (*self._waiting, *self._running, *self._loading)
        )

    # ------------------------------------------------------------------ the scheduler step

    def step(self, now_s: float | None = None) -> StepOutput:
        """One scheduler step: schedule running requests (chunked prefill or one decode token each)
        whose KV is on the GPU, admit waiting ones while the token budget, max_num_seqs and free GPU
        blocks allow (a request with CPU/STORAGE hits starts its loads and waits for them), then
        advance them, cache newly full blocks and emit their events.

        ``now_s``: the driver's clock (virtual or scaled real time); the engine's clock moves
        forward to it when the engine was idle. Loads are booked on that clock."""
        if now_s is not None and now_s > self.now_s:
            self.now_s = now_s
        now = self.now_s
        p = self.profile
        bs = self._block_size
        gpu = self.gpu
        events = self._pending_events
        self._pending_events = []
        if self._promotions:
            self._land_promotions(now, events)
        finished = self._pending_finished
        self._pending_finished = []
        to_rank = self._to_rank
        self._to_rank = []
        budget = p.max_num_batched_tokens
        scheduled: list[tuple[_Request, int, bool]] = []
        prefill_tokens = 0
        #: Sum over prefill tokens computed of the context before them (attention cost).
        prefill_token_ctx = 0.0
        num_decoding = 0
        decode_ctx_tokens = 0
        load_s = 0.0
        preempted = False

        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            remaining = req.num_tokens - req.num_computed
            n_new = remaining if remaining < budget else budget
            need = -(-(req.num_computed + n_new) // bs) - len(req.blocks)
            if need > 0:
                victim = None
                while need > gpu.num_free() and running:
                    # A request whose KV is still loading is not in ``running`` (``_loading``), so
                    # it is never a victim; ``req`` itself always can be.
                    if self._priority:
                        # vLLM's priority scheduler preempts the running request with the largest
                        # (priority, arrival), which may sit before this one and be scheduled already.
                        j = max(range(len(running)), key=lambda k: running[k].prio_key)
                        victim = running.pop(j)
                        if j < i:
                            i -= 1
                            for k, (sreq, sn, sdec) in enumerate(scheduled):
                                if sreq is victim:  # undo its share of this step
                                    del scheduled[k]
                                    budget += sn
                                    if sdec:
                                        num_decoding -= 1
                                        decode_ctx_tokens -= sreq.num_computed
                                    else:
                                        prefill_tokens -= sn
                                        prefill_token_ctx -= sn * (sreq.num_computed + (sn - 1) / 2)
                                    break
                    else:
                        # The newest running request: at or after ``req``, which is one of them.
                        victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if i >= len(running):
                    break
                if victim is req:
                    continue
                self._allocate(need, events)
                req.blocks.extend([-1] * need)
            self._cache_blocks(req, (req.num_computed + n_new) // bs, events)
            is_decode = remaining == 1 and bool(req.output_token_ids)
            scheduled.append((req, n_new, is_decode))
            budget -= n_new
            if is_decode:
                num_decoding += 1
                decode_ctx_tokens += req.num_computed
            else:
                prefill_tokens += n_new
                prefill_token_ctx += n_new * (req.num_computed + (n_new - 1) / 2)
            i += 1

        # Admission stops for the step once anything was preempted (as vLLM does): the pool is full.
        waiting = self._waiting
        blocked = _PREEMPT
        if not preempted:
            # First the requests whose loads were started (vLLM drains the waiting requests that
            # hold KV blocks first): those whose loads have landed are cached and scheduled.
            loading = self._loading
            k = 0
            while k < len(loading) and budget > 0 and len(running) < p.max_num_seqs:
                req = loading[k]
                if req.ready_at_s > now:
                    k += 1
                    continue
                self._land_load(req, events)
                remaining = req.num_tokens - req.num_computed
                n_new = remaining if remaining < budget else budget
                need = -(-(req.num_computed + n_new) // bs) - len(req.blocks)
                if need > gpu.num_free():
                    blocked = _KV
                    break
                del loading[k]
                if need > 0:
                    self._allocate(need, events)
                    req.blocks.extend([-1] * need)
                running.append(req)
                self._cache_blocks(req, (req.num_computed + n_new) // bs, events)
                scheduled.append((req, n_new, False))
                budget -= n_new
                prefill_tokens += n_new
                prefill_token_ctx += n_new * (req.num_computed + (n_new - 1) / 2)
            j = 0  # requests before it were skipped (deferred) this step
            while blocked != _KV and j < len(waiting) and budget > 0 and len(running) < p.max_num_seqs:
                admitted = self._try_admit(waiting[j], budget, events, now)
                if admitted is None:
                    blocked = _KV
                    break
                if admitted is _DEFER:
                    j += 1
                    continue
                if j:
                    req = waiting[j]
                    del waiting[j]
                else:
                    req = waiting.popleft()
                if req.admitted_s < 0:
                    totals, snapshot = self._wait_totals_s, req.wait_snapshot
                    req.waits_s = (
                        totals[0] - snapshot[0],
                        totals[1] - snapshot[1],
                        totals[2] - snapshot[2],
                        totals[3] - snapshot[3],
                    )
                    req.admitted_s = now
                n_new, req_load_s = admitted
                (self._loading if req.ready_at_s else running).append(req)
                load_s += req_load_s
                if n_new:
                    self._cache_blocks(req, (req.num_computed + n_new) // bs, events)
                    scheduled.append((req, n_new, False))
                    budget -= n_new
                    prefill_tokens += n_new
                    prefill_token_ctx += n_new * (req.num_computed + (n_new - 1) / 2)
            if blocked != _KV:
                blocked = _SEQS if len(running) >= p.max_num_seqs else _BUDGET

        if not scheduled and not running and not self._loading and (self._stores_landing or to_rank):
            # Nothing to compute: the step only signals finished requests and lands writes.
            duration_s = 0.0
        elif scheduled or not (self._loading or (not running and self._promotions)):
            duration_s = (
                p.step_overhead_s
                + prefill_tokens / p.prefill_tokens_per_s
                + prefill_token_ctx * p.prefill_attention_s_per_token_ctx
                + num_decoding * p.decode_s_per_seq
                + decode_ctx_tokens * p.kv_bytes_per_token / p.hbm_bytes_per_s
                + load_s
            )
        else:
            # Every admitted request waits for its KV (or, none admitted, for STORAGE reads into the
            # CPU tier): the engine idles until the first lands, at least a step overhead.
            if self._loading:
                firsts = [r.ready_at_s for r in self._loading if r.ready_at_s > now]
            else:
                firsts = [done_s for _req, _blocks, done_s in self._promotions]
            duration_s = max(min(firsts, default=now) - now, p.step_overhead_s) + load_s

        if waiting:
            self._wait_totals_s[blocked] += duration_s
        records = self.wait_records
        new_token_ids: dict[str, list[int]] = {}
        cycle = self._output_cycle
        num_generated = 0
        offloads = self.cpu is not None or self.storage is not None
        for req, n_new, _ in scheduled:
            req.num_computed += n_new
            if offloads and req.store_from < req.num_prompt_blocks:
                # vLLM's connector offers a scheduled request's computed prompt blocks not stored
                # yet each step (also GPU hits, and what a refused write left).
                self._offload_computed(req, events, now)
            if req.num_computed == req.num_tokens:
                outputs = req.output_token_ids
                token = cycle[(req.output_offset + len(outputs)) % _OUTPUT_CYCLE_TOKENS]
                outputs.append(token)
                if req.tokens is not None:
                    req.tokens.append(token)
                new_token_ids[req.request.request_id] = [token]
                num_generated += 1
                if records is not None and len(outputs) == 1:
                    records[req.request.request_id] = WaitRecord(
                        req.waits_s, req.admitted_s, req.preempted_s, now + duration_s
                    )
                if len(outputs) >= req.max_output:
                    finished.append(self._finish(req))

        # vLLM's connector offers a request that finished since the last step what it has not
        # stored yet (a refused write's blocks), after the step's other writes, then ranks it.
        for done in to_rank:
            self._offload_computed(done, events, now)
        for done in to_rank:
            self._rank_used(done)
            if done.tier_keys is not None:
                self._forget_tier_lookups(done)
        if self._tier_lookups_asked:
            self._answer_tier_lookups()
        # The last step's CPU tier writes land; this step's land at the end of the next.
        if self._stores_landing:
            self._land_stores(self._stores_landing, events)
        self._stores_landing = self._stores_issued
        self._stores_issued = []

        s = self._stats
        s.num_steps += 1
        s.generation_tokens += num_generated
        s.busy_time_s += duration_s
        s.num_events += len(events)
        self.now_s = now + duration_s
        return StepOutput(
            duration_s=duration_s,
            new_token_ids=new_token_ids,
            finished=finished,
            events=events,
            num_scheduled=len(scheduled),
            num_prefill_tokens=prefill_tokens,
        )

    # ------------------------------------------------------------------ internals

    def _ensure_hashes(self, req: _Request, num_blocks: int) -> list[int]:
        """The request's hash chain extended to ``num_blocks`` blocks (computed once per request)."""
        chain = req.chain
        hashes = chain.hashes
        if len(hashes) < num_blocks:
            bs = self._block_size
            if req.block_ids is not None:
                ids = req.block_ids
                for b in range(len(hashes), num_blocks):
                    chain.append((ids[b],), req.extra_keys(b))
            else:
                tokens = req.tokens
                assert tokens is not None
                for b in range(len(hashes), num_blocks):
                    chain.append(tokens[b * bs : (b + 1) * bs], req.extra_keys(b))
        return hashes

    def _num_hashable_blocks(self, req: _Request) -> int:
        """Blocks that get a hash: full prompt blocks in trace mode; every full block (prompt and
        output tokens) in token mode, as vLLM caches decode blocks too."""
        if req.tokens is None:
            return req.num_prompt_blocks
        return len(req.tokens) // self._block_size

    def _hit_ends(self, num_tokens: int, num_hashable: int) -> tuple[int, int, int]:
        """In blocks, for a request of ``num_tokens`` tokens and ``num_hashable`` hashed blocks:
        where its GPU prefix hit ends at most (one block short of a full prompt: vLLM computes at
        least the last token), where vLLM's connector looks up the offload tiers to (the last full
        block), and where their hits count to (the same with asynchronous loads, which load a full
        hit whole and recompute the last token; else the GPU's end)."""
        bs = self._block_size
        gpu_end = min((num_tokens - 1) // bs, num_hashable)
        lookup_end = min(num_tokens // bs, num_hashable)
        return gpu_end, lookup_end, lookup_end if self.profile.async_loads else gpu_end

    def _try_admit(
        self, req: _Request, budget: int, events: list[dict[str, Any]], now: float
    ) -> tuple[int, float] | None:
        """Admit ``req`` if its prefix hits plus this step's new tokens fit the free GPU blocks.
        Returns (tokens to compute this step, seconds the step stalls for loads) or None (it stays
        queued). With asynchronous loads a request with CPU/STORAGE hits computes nothing this step:
        it starts its loads and waits for them (``_loading``). ``_DEFER`` when vLLM's offloading
        connector would not answer yet: the request has CPU tier writes in flight, or its lookup
        reaches a CPU block whose write has not landed or a block another request is loading."""
        if req.stores_pending:
            return _DEFER
        bs = self._block_size
        gpu = self.gpu
        cpu = self.cpu
        storage = self.storage
        num_tokens = req.num_tokens
        num_hashable = self._num_hashable_blocks(req)
        limit, lookup_end, offload_end = self._hit_ends(num_tokens, num_hashable)
        hashes = self._ensure_hashes(req, num_hashable)
        # vLLM's order: the GPU prefix cache's longest hit, then the offload tiers from there on
        # (the connector's lookup), so a block past a CPU or STORAGE hit loads from its tier even
        # when the GPU pool holds it too.
        tiers: list[int] = []
        pin_cost = 0
        gpu_pinned, gpu_evictable = gpu.is_pinned, gpu.is_evictable
        for b in range(limit):
            h = hashes[b]
            if gpu_pinned(h):
                tiers.append(_GPU)
            elif gpu_evictable(h):
                tiers.append(_GPU)
                pin_cost += 1
            else:
                break
        if cpu is not None or storage is not None:
            found = self._offload_lookup(req, hashes, len(tiers), lookup_end, events)
            if found is None:
                return _DEFER
            unready, being_loaded = self._cpu_unready, self._being_loaded
            if unready or being_loaded:
                for b in range(len(tiers), len(tiers) + len(found)):
                    h = hashes[b]
                    if h in unready or being_loaded.get(h, 0.0) > now:
                        return _DEFER
            tiers += found[: offload_end - len(tiers)]
        hit_blocks = len(tiers)
        hit_tokens = hit_blocks * bs
        num_loaded = hit_blocks - tiers.count(_GPU)
        asynchronous = self.profile.async_loads and num_loaded > 0
        n_new = 0 if asynchronous else min(num_tokens - hit_tokens, budget)
        new_blocks = -(-(hit_tokens + n_new) // bs) - hit_blocks
        # vLLM's admission gate (scheduler_reserve_full_isl): the whole sequence must fit, though
        # only this step's chunk is allocated now.
        must_fit = -(-num_tokens // bs) - hit_blocks if self.profile.reserve_full_isl else new_blocks
        if pin_cost + num_loaded + must_fit > gpu.num_free():
            return None
        if asynchronous and pin_cost + num_loaded + new_blocks > gpu.num_free() - self._inflight_reserved():
            # vLLM starts a load only in the free blocks the prefills in flight (loading requests
            # and running ones still prefilling) do not still need for their whole sequence
            # (``_inflight_prefill_reserved_blocks``): a load holds its blocks and cannot be
            # preempted.
            return None

        n_by_tier = [0, 0, 0]
        for b, tier in enumerate(tiers):
            n_by_tier[tier] += 1
            if tier == _GPU:
                gpu.pin(hashes[b])
        # Loaded blocks take fresh GPU blocks and become cached there (promotion).
        self._allocate(num_loaded + new_blocks, events)
        req.blocks = [-1] * (hit_blocks + new_blocks)
        load_s = 0.0
        stored_runs: list[tuple[int, int]] = []
        run_start = -1
        loading: list[int] = []
        for b, tier in enumerate(tiers):
            h = hashes[b]
            if tier == _GPU:
                req.blocks[b] = h
                if run_start >= 0:
                    stored_runs.append((run_start, b))
                    run_start = -1
                continue
            if asynchronous:
                # vLLM caches a loaded block only when its load lands (``_land_load``).
                loading.append(b)
                continue
            if not gpu.commit(h):
                # The GPU pool holds it past the prefix hit: the load fills a duplicate, anonymous.
                req.blocks[b] = -1
                if run_start >= 0:
                    stored_runs.append((run_start, b))
                    run_start = -1
                continue
            req.blocks[b] = h
            if run_start < 0:
                run_start = b
        if run_start >= 0:
            stored_runs.append((run_start, hit_blocks))
        ready_s = 0.0
        for tier in (_CPU, _STORAGE):
            if n_by_tier[tier]:
                nbytes = n_by_tier[tier] * self._bytes_per_block
                if asynchronous:
                    if tier == _STORAGE and self._async_tier_lookups:
                        # Promoted: read into the CPU tier already, loaded from there.
                        start_s, done_s = self._transfer(_CPU, nbytes, now)
                        start_s -= req.promotion_s
                        req.promotion_s = 0.0
                    else:
                        start_s, done_s = self._transfer(tier, nbytes, now)
                    ready_s = max(ready_s, done_s)
                    t_s = done_s - start_s
                else:
                    t_s = self._latency_s(tier) + nbytes / self._bandwidth(tier)
                    load_s += t_s
                self._load_bytes[tier] += nbytes
                self._load_time_s[tier] += self._noisy(t_s)
        if asynchronous:
            req.ready_at_s = ready_s
            req.loading_blocks = loading
            for b in loading:
                self._being_loaded[hashes[b]] = ready_s
            if cpu is not None:
                # The CPU blocks it reads cannot be evicted before the load lands (ref_cnt > 0).
                pins = [hashes[b] for b, tier in enumerate(tiers) if tier != _GPU and hashes[b] in cpu]
                for h in pins:
                    cpu.pin(h)
                req.cpu_pins = pins
        for start, end in stored_runs:
            self._emit_gpu_stored(req, start, end, events)
        req.num_committed_blocks = hit_blocks
        req.num_computed = min(hit_tokens, num_tokens - 1)
        if num_loaded:
            # vLLM (update_state_after_alloc): a request that loads from the offload tiers stores
            # only past its hits; one that hit only GPU blocks offers its whole prompt, so the
            # tier takes back what it had lost of it.
            req.seen_from = min(req.seen_from, hit_blocks - num_loaded)
            req.store_from = hit_blocks

        s = self._stats
        if req.cached_by_tier is None:
            # First scheduling: what the request's usage reports and the metrics count.
            req.cached_by_tier = (n_by_tier[0] * bs, n_by_tier[1] * bs, n_by_tier[2] * bs)
            for t in (_GPU, _CPU, _STORAGE):
                self._cached_by_tier[t] += n_by_tier[t] * bs
            s.prompt_tokens += req.prompt_len
        s.prefix_cache_queries_tokens += num_tokens
        s.prefix_cache_hits_tokens += n_by_tier[_GPU] * bs
        if cpu is not None or storage is not None:
            s.external_prefix_cache_queries_tokens += num_tokens - n_by_tier[_GPU] * bs
            s.external_prefix_cache_hits_tokens += (n_by_tier[_CPU] + n_by_tier[_STORAGE]) * bs
        return n_new, load_s

    def _offload_lookup(
        self, req: _Request, hashes: list[int], start: int, end: int, events: list[dict[str, Any]]
    ) -> list[int] | None:
        """vLLM's offloading connector looking up blocks ``start``..``end`` in the offload tiers,
        block by block until a miss: the tier of each hit (CPU, or STORAGE for a block promoted for
        this request; vLLM labels a promoted block by the tier it came from).

        With a CPU tier in front of the STORAGE pool (vLLM's tiering manager), a STORAGE hit is
        promoted into the CPU tier first, one block at a time, evicting the least recently used
        block that is not itself being promoted, so a promotion may evict a CPU hit of the same
        request found earlier in the pass. vLLM retries the lookup each step until a pass finds
        every block resident (the blocks it evicted are promoted again, as the most recent); here
        the passes run at once. A CPU tier smaller than the request's hits never settles: vLLM's
        engine then waits forever (seen with a 40-block tier, docs/results/cpu-tier.md); the
        simulator stops after as many passes as blocks and loads the resident prefix. A promotion
        the tier refuses (every block in flight) is a miss."""
        cpu, storage = self.cpu, self.storage
        if cpu is None:
            # STORAGE alone: it loads straight into the GPU pool.
            assert storage is not None
            found = 0
            for b in range(start, end):
                if hashes[b] not in storage:
                    break
                storage.touch(hashes[b])
                found += 1
            return [_STORAGE] * found
        if self._async_tier_lookups:
            return self._walk_tiers(req, hashes, start, end, events)
        promoted = req.promoted
        for _ in range(end - start + 1):
            in_flight: set[int] = set()
            found = 0
            for b in range(start, end):
                h = hashes[b]
                if h in cpu:
                    found += 1
                    continue
                if storage is None or h not in storage:
                    break
                storage.touch(h)
                if not self._promote(req, b, in_flight, events):
                    break
                in_flight.add(h)
                promoted.add(h)
                found += 1
            if not in_flight:
                break
        else:
            return self._resident_prefix(req, hashes, start, end)
        return _hit_tiers(req, hashes, start, found)

    def _resident_prefix(self, req: _Request, hashes: list[int], start: int, end: int) -> list[int]:
        """The tiers of the blocks from ``start`` the CPU tier holds in a row: what a request whose
        promotions never settle loads."""
        cpu = self.cpu
        assert cpu is not None
        found = 0
        while start + found < end and hashes[start + found] in cpu:
            found += 1
        return _hit_tiers(req, hashes, start, found)

    def _walk_tiers(
        self, req: _Request, hashes: list[int], start: int, end: int, events: list[dict[str, Any]]
    ) -> list[int] | None:
        """``_offload_lookup`` as vLLM's tiering manager runs it with the fs tier's asynchronous
        lookups: one walk a step. Every block the CPU tier lacks must have the STORAGE tier's
        answer (``_tier_answered``), else the request waits a step. Then, block by block until a
        miss, a CPU block counts (one not ready makes the caller defer the request), and a block
        the STORAGE tier said it holds is promoted (``_promote_slot``): its read takes at least
        a step, so a walk that started one defers the request (None), and the next walk finds the
        block in the CPU tier. A block counts as STORAGE for the request that promoted it, as CPU
        for another. A CPU tier smaller than the hit never holds it whole (each walk's promotions
        evict the request's own earlier blocks): vLLM's engine then waits forever; here a request
        stops promoting after as many walks as blocks, and loads the resident prefix."""
        if not self._tier_answered(req, hashes, start, end):
            return None
        cpu, storage, answers = self.cpu, self.storage, self._tier_lookups
        assert cpu is not None and storage is not None
        if req.promotion_walks > end - start:
            return self._resident_prefix(req, hashes, start, end)
        found, promoting = 0, []
        for b in range(start, end):
            h = hashes[b]
            if h in cpu:
                found += 1
                continue
            answer = answers.get(h)
            if answer is None or not answer[0] or h not in storage:
                break
            storage.touch(h)
            if not self._promote_slot(req, b, events):
                break
            promoting.append(b)
            found += 1
        if promoting:
            self._start_promotion(req, promoting)
            req.promotion_walks += 1
            return None
        return _hit_tiers(req, hashes, start, found)

    def _promote_slot(self, req: _Request, b: int, events: list[dict[str, Any]]) -> bool:
        """A CPU tier slot for block ``b`` of ``req``, read from STORAGE: the least recently used
        block not pinned is evicted (announced now); the slot is pinned and not ready till the read
        lands. False when every block is pinned (vLLM: the primary tier is full, a miss)."""
        cpu = self.cpu
        assert cpu is not None
        h = req.chain.hashes[b]
        evicted: list[int] = []
        if not cpu.promote(h, set(), evicted):
            return False
        cpu.pin(h)
        self._cpu_unready.add(h)
        req.promoted.add(h)
        if self._emit and evicted:
            self._announce_cpu(req, evicted, (), events)
        return True

    def _start_promotion(self, req: _Request, blocks: list[int]) -> None:
        """One read job of this step's promotions for ``req``, queued behind the jobs before it:
        done after the STORAGE tier's latency and the bytes at its read rate (a shared pool's
        aggregate bandwidth booked)."""
        now = self.now_s
        nbytes = len(blocks) * self._bytes_per_block
        start_s = max(now, self._read_free_s)
        done_s = start_s + nbytes / self._storage_bw
        storage = self.storage
        if storage is not None and storage.shared_bytes_per_s:
            done_s = max(done_s, storage.reserve(start_s, nbytes))
        self._read_free_s = done_s
        self._promotions.append((req, blocks, done_s + self._storage_latency_s))
        req.promotion_s += done_s + self._storage_latency_s - now

    def _land_promotions(self, now: float, events: list[dict[str, Any]]) -> None:
        """Promotions whose reads are done land: their blocks become ready and evictable in the
        CPU tier, and their stores are announced."""
        waiting = []
        for job in self._promotions:
            req, blocks, done_s = job
            if done_s > now:
                waiting.append(job)
                continue
            self._make_ready(req, blocks, events)
        self._promotions = waiting

    def _tier_answered(self, req: _Request, hashes: list[int], start: int, end: int) -> bool:
        """vLLM's connector walking blocks ``start``..``end``: each the CPU tier lacks is asked of
        the STORAGE tier, whose answer comes at the end of the step (``_answer_tier_lookups``). The
        walk goes on past a block not answered yet, so that the tier is asked about every block up
        to one it said it lacks, and False when any is unanswered: the request waits a step."""
        cpu = self.cpu
        assert cpu is not None
        answers = self._tier_lookups
        rid = req.request.request_id
        answered = True
        for b in range(start, end):
            h = hashes[b]
            if h in cpu:
                continue
            answer = answers.get(h)
            if answer is None:
                answers[h] = answer = [None, set()]
                self._tier_lookups_asked.append(h)
            if rid not in answer[1]:
                answer[1].add(rid)
                if req.tier_keys is None:
                    req.tier_keys = []
                req.tier_keys.append(h)
            if answer[0] is None:
                answered = False
            elif not answer[0]:
                break
        return answered

    def _answer_tier_lookups(self) -> None:
        """The STORAGE tier answers the lookups asked this step (whether it holds each block now);
        one no live request asked about any more is dropped."""
        storage, answers = self.storage, self._tier_lookups
        assert storage is not None
        for h in self._tier_lookups_asked:
            answer = answers.get(h)
            if answer is None:
                continue
            if answer[1]:
                answer[0] = h in storage
            else:
                del answers[h]
        self._tier_lookups_asked = []

    def _forget_tier_lookups(self, req: _Request) -> None:
        """``req`` has finished: its lookups' answers go once no other request holds them (one not
        answered yet stays until it is)."""
        keys, answers, rid = req.tier_keys, self._tier_lookups, req.request.request_id
        if keys is None:
            return
        for h in keys:
            answer = answers.get(h)
            if answer is None:
                continue
            answer[1].discard(rid)
            if not answer[1] and answer[0] is not None:
                del answers[h]
        req.tier_keys = None

    def _promote(self, req: _Request, b: int, in_flight: set[int], events: list[dict[str, Any]]) -> bool:
        """Block ``b`` of ``req`` read from the STORAGE pool into the CPU tier
        (``LruBlockTier.promote``); announces the eviction it makes and the store."""
        cpu = self.cpu
        assert cpu is not None
        evicted: list[int] = []
        h = req.chain.hashes[b]
        if not cpu.promote(h, in_flight, evicted):
            return False
        if self._emit:
            self._announce_cpu(req, evicted, [b], events)
        return True

    def _bandwidth(self, tier: int) -> float:
        return self.profile.cpu_load_bytes_per_s if tier == _CPU else self._storage_bw

    def _latency_s(self, tier: int) -> float:
        return self.profile.cpu_latency_s if tier == _CPU else self._storage_latency_s

    def _transfer(self, tier: int, nbytes: int, now: float) -> tuple[float, float]:
        """Queue one load on this engine's host->GPU link (FIFO); a STORAGE load also books the
        shared pool's aggregate bandwidth. Returns (start, done) on the engine clock."""
        start_s = max(now, self._link_free_s)
        done_s = start_s + nbytes / self._bandwidth(tier)
        self._link_free_s = done_s
        storage = self.storage
        if tier == _STORAGE and storage is not None and storage.shared_bytes_per_s:
            done_s = max(done_s, storage.reserve(start_s, nbytes))
        return start_s, done_s + self._latency_s(tier)

    def _noisy(self, seconds: float) -> float:
        """A measured duration as the engine's counters report it (log-normal noise, if set)."""
        rng = self._noise_rng
        if rng is None:
            return seconds
        return seconds * math.exp(rng.gauss(0.0, self.profile.counter_noise))

    def _land_load(self, req: _Request, events: list[dict[str, Any]]) -> None:
        """``req``'s loads have landed: vLLM caches the loaded blocks now
        (``_update_waiting_for_remote_kv``), so they are GPU prefix-cache blocks (BlockStored)
        from here on; one another request cached meanwhile stays an anonymous copy."""
        blocks = req.loading_blocks
        if blocks is None:
            return
        gpu, hashes = self.gpu, req.chain.hashes
        runs: list[tuple[int, int]] = []
        for b in blocks:
            if not gpu.commit(hashes[b]):
                continue
            req.blocks[b] = hashes[b]
            if runs and runs[-1][1] == b:
                runs[-1] = (runs[-1][0], b + 1)
            else:
                runs.append((b, b + 1))
        for start, end in runs:
            self._emit_gpu_stored(req, start, end, events)
        self._end_load(req)

    def _signal_finished(self, req: _Request) -> None:
        """The next step offers the offload tiers what ``req`` has not stored and ranks its CPU
        blocks (``_to_rank``). Without offload tiers there is nothing to signal, and no step."""
        if self.cpu is not None or self.storage is not None:
            self._to_rank.append(req)

    def _inflight_reserved(self) -> int:
        """Blocks the prefills in flight still need to hold their whole sequence: the requests
        loading, and the running ones with more than their next token to compute."""
        bs = self._block_size
        total = 0
        for r in self._loading:
            total += max(0, -(-r.num_tokens // bs) - len(r.blocks))
        for r in self._running:
            if r.num_tokens - r.num_computed > 1:
                total += max(0, -(-r.num_tokens // bs) - len(r.blocks))
        return total

    def _end_load(self, req: _Request) -> None:
        """``req``'s load is over (landed, or dropped by a reset or an abort): its blocks are no
        longer being loaded (``_being_loaded``) and the CPU blocks it read are unpinned."""
        being_loaded, hashes = self._being_loaded, req.chain.hashes
        for b in req.loading_blocks or ():
            if being_loaded.get(hashes[b]) == req.ready_at_s:
                del being_loaded[hashes[b]]
        req.ready_at_s = 0.0
        req.loading_blocks = None
        pins = req.cpu_pins
        if pins:
            cpu = self.cpu
            assert cpu is not None
            for h in pins:
                cpu.unpin(h)
            req.cpu_pins = None

    def _allocate(self, num_blocks: int, events: list[dict[str, Any]]) -> None:
        """Take anonymous GPU blocks, evicting the oldest free cached ones if needed; vLLM's GPU
        pool sends one BlockRemoved per evicted hash."""
        evicted: list[int] = []
        self.gpu.allocate(num_blocks, evicted)
        if evicted and self._emit:
            events.extend(
                {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
                for h in evicted
            )

    def _cache_blocks(self, req: _Request, full_blocks: int, events: list[dict[str, Any]]) -> None:
        """Cache the blocks this step's tokens of ``req`` fill, as it is scheduled: vLLM's
        ``allocate_slots`` gives them their hashes before the step computes them, so a request
        scheduled after it in the same step already hits them, and each request's BlockStored
        follows its own evictions. One GPU BlockStored per contiguous run of newly cached blocks;
        the offload tiers' write comes after the step (``_offload_computed``)."""
        start = req.num_committed_blocks
        if full_blocks <= start:
            return
        end = min(full_blocks, self._num_hashable_blocks(req))
        if end <= start:
            req.num_committed_blocks = full_blocks
            return
        hashes = self._ensure_hashes(req, end)
        gpu = self.gpu
        blocks = req.blocks
        run_start = -1
        for b in range(start, end):
            h = hashes[b]
            if gpu.commit(h):
                blocks[b] = h
                if run_start < 0:
                    run_start = b
            elif run_start >= 0:
                self._emit_gpu_stored(req, run_start, b, events)
                run_start = -1
        if run_start >= 0:
            self._emit_gpu_stored(req, run_start, end, events)
        req.num_committed_blocks = full_blocks

    def _offload_computed(self, req: _Request, events: list[dict[str, Any]], now: float) -> None:
        """After a step ``req`` was scheduled in, or the step after it finished: write its computed
        full prompt blocks not stored yet through to the offload tiers (the callers run it only
        when the engine has some)."""
        end = min(req.num_computed // self._block_size, self._num_hashable_blocks(req))
        prompt_end = min(end, req.num_prompt_blocks)
        if prompt_end > req.store_from:
            self._offload(req, prompt_end, events, now)

    def _offload(self, req: _Request, prompt_end: int, events: list[dict[str, Any]], now: float) -> None:
        """vLLM's offloading scheduler, one step of one request: one write offers every prompt
        block from ``req.store_from`` to ``prompt_end``. The CPU tier admits it whole or refuses it
        (then the pointer stays and the request's next scheduled step, or the step after it
        finishes, offers those blocks again); the STORAGE pool behind it takes the blocks the CPU
        tier newly stored (vLLM's tiering cascade), or the whole write when there is no CPU tier."""
        offered = range(req.store_from, prompt_end)
        if self.cpu is not None:
            stored = self._write_cpu(req, offered, events)
            if stored is None:
                return
            if self.storage is not None:
                self._write_storage(req, stored, events, now, rewrite=True)
        elif self._write_storage(req, offered, events, now) is None:
            return
        req.store_from = prompt_end

    def _event_tokens(self, req: _Request, start: int, end: int) -> tuple[list[int], int]:
        """Token ids and block_size of blocks [start, end) as events carry them: in trace mode the
        block ids themselves with block_size 1."""
        if req.block_ids is not None:
            return list(req.block_ids[start:end]), 1
        assert req.tokens is not None
        bs = self._block_size
        return req.tokens[start * bs : end * bs], bs

    def _stored_event(self, req: _Request, start: int, end: int, medium: str) -> dict[str, Any]:
        hashes = req.chain.hashes
        token_ids, block_size = self._event_tokens(req, start, end)
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes[start:end],
            "parent_block_hash": hashes[start - 1] if start > 0 else None,
            "token_ids": token_ids,
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": req.request.lora_name,
        }
        if req.extra_first_block is not None:
            extra = [req.extra_keys(b) for b in range(start, end)]
            event["extra_keys"] = [list(e) if e else None for e in extra]
        event["group_idx"] = 0
        return event

    def _emit_gpu_stored(self, req: _Request, start: int, end: int, events: list[dict[str, Any]]) -> None:
        if self._emit:
            events.append(self._stored_event(req, start, end, "GPU"))

    def _write_cpu(
        self, req: _Request, block_indices: Sequence[int], events: list[dict[str, Any]]
    ) -> list[int] | None:
        """One write of prompt blocks to the CPU tier (LRU, admitted whole or refused:
        ``LruBlockTier.write``); announces its evictions now and its stores when it lands
        (``_land_stores``; at once with ``async_loads`` off). Returns the blocks newly stored, None
        when refused."""
        cpu = self.cpu
        assert cpu is not None
        if block_indices and block_indices[0] < req.seen_from:
            req.seen_from = block_indices[0]
        unready = self._cpu_unready
        if unready or req.unranked:
            hashes = req.chain.hashes
            unranked = req.unranked if req.unranked is not None else set()
            for b in block_indices:
                if hashes[b] not in unready:
                    unranked.discard(hashes[b])
                elif b >= req.offered_to:  # offered before: recorded then
                    unranked.add(hashes[b])
            req.unranked = unranked or None
        if block_indices and block_indices[-1] >= req.offered_to:
            req.offered_to = block_indices[-1] + 1
        evicted: list[int] = []
        stored = _tier_write(cpu, req.chain.hashes, block_indices, evicted)
        if not stored:
            return stored
        nbytes = len(stored) * self._bytes_per_block
        self._store_bytes[_CPU] += nbytes
        # GPU->host copies use the other direction of the link: they cost time, block nobody.
        self._store_time_s[_CPU] += self._noisy(nbytes / self.profile.cpu_load_bytes_per_s)
        if self.profile.async_loads:
            # vLLM's offloading connector: the write lands at the end of the next step; till then
            # its blocks cannot be evicted and a lookup reaching them waits. Its evictions are
            # announced now, its stores when it lands.
            hashes, unready = req.chain.hashes, self._cpu_unready
            for b in stored:
                cpu.pin(hashes[b])
                unready.add(hashes[b])
            self._stores_issued.append((req, stored))
            req.stores_pending += 1
            if self._emit and evicted:
                self._announce_cpu(req, evicted, (), events)
        elif self._emit:
            self._announce_cpu(req, evicted, stored, events)
        return stored

    def _land_stores(self, writes: list[tuple[_Request, list[int]]], events: list[dict[str, Any]]) -> None:
        """CPU tier writes of the step before land: their blocks become ready and evictable, and
        their stores are announced (after this step's other events, as vLLM's connector adds
        the writes its worker finished)."""
        for req, stored in writes:
            self._make_ready(req, stored, events)
            req.stores_pending -= 1

    def _make_ready(self, req: _Request, blocks: Sequence[int], events: list[dict[str, Any]]) -> None:
        """Blocks of ``req`` written into the CPU tier (a write from the GPU or a read from STORAGE)
        have landed: unpinned, ready, their stores announced."""
        cpu, unready, hashes = self.cpu, self._cpu_unready, req.chain.hashes
        assert cpu is not None
        for b in blocks:
            cpu.unpin(hashes[b])
            unready.discard(hashes[b])
        if self._emit:
            self._announce_cpu(req, [], blocks, events)

    def _announce_cpu(
        self, req: _Request, evicted: list[int], stored: Sequence[int], events: list[dict[str, Any]]
    ) -> None:
        """One CPU tier write's events: its evictions, then the stores of blocks ``stored`` (indices
        of ``req``), self-describing or, as vLLM's offloading connector sends them, one hash-only
        placeholder per block."""
        if evicted:
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "CPU", "group_idx": 0})
        if self.profile.self_describing_cpu_events:
            for start, end in _runs(stored):
                events.append(self._stored_event(req, start, end, "CPU"))
        else:
            hashes = req.chain.hashes
            events.extend(placeholder_stored_event([hashes[b]]) for b in stored)

    def _write_storage(
        self,
        req: _Request,
        block_indices: Sequence[int],
        events: list[dict[str, Any]],
        now: float,
        rewrite: bool = False,
    ) -> list[int] | None:
        """One write to the STORAGE pool, admitted as the CPU tier's writes are: self-describing
        stores, and the removals the write causes when the pool announces them. A shared pool's
        writes take their share of its aggregate bandwidth (reads queue behind them). Returns the
        blocks newly stored, None when refused. ``rewrite``: the CPU tier's cascade (vLLM's
        tiering manager writes every block the CPU tier newly stored through to the fs tier and
        announces each, the pool holding it already or not)."""
        storage = self.storage
        assert storage is not None
        if not block_indices:
            return []
        evicted: list[int] = []
        stored = _tier_write(storage, req.chain.hashes, block_indices, evicted)
        if stored is None:
            return None
        if evicted and self._emit and self.profile.emit_storage_events and storage.announce_removals:
            events.append(
                {"type": "BlockRemoved", "block_hashes": evicted, "medium": "STORAGE", "group_idx": 0}
            )
        written = block_indices if rewrite else stored
        if not written:
            return stored
        nbytes = len(written) * self._bytes_per_block
        self._store_bytes[_STORAGE] += nbytes
        store_s = nbytes / self._storage_bw
        if storage.shared_bytes_per_s:
            store_s = max(store_s, storage.reserve(now, nbytes) - now)
        self._store_time_s[_STORAGE] += self._noisy(store_s)
        if self._emit and self.profile.emit_storage_events:
            for start, end in _runs(written):
                event = self._stored_event(req, start, end, "STORAGE")
                event["locality"] = "LOCAL"
                events.append(event)
        return stored

    def _rank_used(self, req: _Request) -> None:
        """vLLM's CPU LRU policy when a request finishes: every block of it the tier holds that
        the request loaded or offered becomes most recent, its head last (so the tier evicts a
        conversation's deepest blocks first, as the GPU pool does)."""
        cpu = self.cpu
        if cpu is None:
            return
        hashes = req.chain.hashes
        end = min(req.num_committed_blocks, req.num_prompt_blocks, len(hashes))
        used = [hashes[b] for b in range(end - 1, req.seen_from - 1, -1)]
        if req.unranked:
            used = [h for h in used if h not in req.unranked]
        cpu.rank_used(used)

    def _free_blocks(self, req: _Request) -> None:
        # Last block first, so that a request's deeper blocks are evicted before its prefix.
        gpu = self.gpu
        anonymous = 0
        for h in reversed(req.blocks):
            if h == -1:
                anonymous += 1
            else:
                gpu.release(h)
        gpu.release_anonymous(anonymous)
        req.blocks = []

    def _preempt(self, req: _Request) -> None:
        """Recompute-style preemption: free its blocks; it waits at the head of the queue (by its
        (priority, arrival) on a priority engine) and later recomputes prompt + output so far
        (prefix hits still apply)."""
        self._free_blocks(req)
        if req.preempted_s < 0 and not req.output_token_ids:
            req.preempted_s = self.now_s
        req.num_computed = 0
        req.num_committed_blocks = 0
        self._end_load(req)  # a reset preempts requests whose loads are in flight
        if self._priority:
            self._enqueue(req)
        else:
            self._waiting.appendleft(req)
        self._stats.num_preemptions += 1

    def _finish(self, req: _Request) -> FinishedRequest:
        self._running.remove(req)
        self._signal_finished(req)
        self._free_blocks(req)
        del self._requests[req.request.request_id]
        self._stats.num_finished += 1
        return self._finished(req, "length")

    def _finished(self, req: _Request, reason: str) -> FinishedRequest:
        by_tier = req.cached_by_tier or (0, 0, 0)
        return FinishedRequest(
            request_id=req.request.request_id,
            prompt_tokens=req.prompt_len,
            output_token_ids=list(req.output_token_ids),
            cached_tokens=sum(by_tier),
            cached_tokens_by_tier=by_tier,
            finish_reason=reason,
        )


def _prio_key(req: _Request) -> tuple[int, int]:
    return req.prio_key


def _hit_tiers(req: _Request, hashes: list[int], start: int, found: int) -> list[int]:
    """The tier of each of ``found`` offload hits from block ``start``: STORAGE for a block
    promoted for ``req`` (vLLM labels it by its source for the request), else CPU."""
    promoted = req.promoted
    return [_STORAGE if hashes[b] in promoted else _CPU for b in range(start, start + found)]


def _tier_write(
    tier: LruBlockTier, hashes: Sequence[int], block_indices: Sequence[int], evicted: list[int]
) -> list[int] | None:
    """``LruBlockTier.write`` of a request's blocks by index: the indices newly stored, None when
    the tier refused the write."""
    new = tier.write([hashes[b] for b in block_indices], evicted)
    if not new:
        return new
    new_set = set(new)
    return [b for b in block_indices if hashes[b] in new_set]


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous [start, end) runs of ascending block indices."""
    runs: list[tuple[int, int]] = []
    start = prev = indices[0]
    for b in indices[1:]:
        if b != prev + 1:
            runs.append((start, prev + 1))
            start = b
        prev = b
    runs.append((start, prev + 1))
    return runs
