"""The simulated fleets the DES runs: engine specs, the B1 fleets (homogeneous and the
heterogeneous B1b), storage-pool sizing, and engine profiles read from a file (a calibration fit)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.engine import EngineProfile
from sim.frontend import ServerStage
from sim.workloads import (
    LadderConfig,
    Workload,
)

# ------------------------------------------------------------------------------------ fleet


#: The engine models b1_fleet builds (sim/engine.py's, and the one before its realism round).
ENGINE_MODELS = ("vllm", "legacy")
ROUTER_PRIORS = ("defaults", "nominal")


@dataclass(slots=True)
class EngineSpec:
    engine_id: str
    profile: EngineProfile


#: Capacity that never fills (an "unbounded" pool): far above any workload's distinct blocks.
UNBOUNDED_STORAGE_BLOCKS = 1 << 40

#: Aggregate bandwidth of the shared pool per mounting engine, as a fraction of one engine's own
#: storage read rate: the pool (a shared filesystem of a few servers) moves half of what all its
#: clients' links could. An assumption, not a published figure: ``--storage-bandwidth`` sets it.
SHARED_POOL_BANDWIDTH_PER_ENGINE = 0.5


@dataclass(slots=True)
class FleetSpec:
    """The simulated engines and their shared STORAGE pool."""

    engines: list[EngineSpec]
    storage_pool_blocks: int = 0  # 0 = no shared storage tier
    storage_load_bytes_per_s: float | None = None  # None = each engine's profile figure
    storage_latency_s: float | None = None
    #: The pool's aggregate bandwidth (reads and writes of all engines); None = no shared limit.
    storage_shared_bytes_per_s: float | None = None
    #: The pool's writers publish BlockRemoved(STORAGE) for what it evicts, as vLLM's offloading
    #: connectors do; False models a shared fs directory nobody announces removals for (llm-d's).
    storage_announces_removals: bool = True
    #: Heterogeneous fleet: at this fraction of the workload's requests, divide this engine's
    #: storage bandwidth by ``slowdown_factor`` (a noisy neighbour). None = never.
    slowdown_engine: str | None = None
    slowdown_at_fraction: float = 0.5
    slowdown_factor: float = 4.0
    #: vLLM's API server in front of each engine core (sim/frontend.py): a single-server queue every
    #: request and every output token passes through. None = requests reach the core when sent.
    api_server: ServerStage | None = None
    #: The router process in front of the fleet: one single-server queue for all requests and
    #: streamed tokens. None = no router cost.
    router_stage: ServerStage | None = None

    @property
    def block_size(self) -> int:
        return self.engines[0].profile.block_size


def b1_fleet(
    num_engines: int = 4,
    *,
    block_size: int = 16,
    conversations_in_hbm: float = 64,
    mean_conversation_tokens: float = LadderConfig().mean_prompt_tokens(),
    cpu_ratio: float = 2.0,
    storage_blocks: int | None = None,
    storage_shared_bytes_per_s: float | str | None = "default",
    hetero: bool = False,
    base: EngineProfile | None = None,
    engine_model: str = "vllm",
    engine_variation: float = 0.0,
    variation_seed: int = 0,
    gpu_blocks: int | None = None,
    api_server: ServerStage | None = None,
    router_stage: ServerStage | None = None,
) -> FleetSpec:
    """The B1 fleet: GPU pools sized so the fleet's HBM holds ``conversations_in_hbm`` average
    conversations, CPU tier ``cpu_ratio`` x GPU per engine (0 = none), one shared STORAGE pool.
    ``gpu_blocks``: each engine's GPU pool in blocks exactly (a real fleet's pool, e.g. vLLM's
    ``--num-gpu-blocks-override``), instead of the size from ``conversations_in_hbm``.
    ``api_server``, ``router_stage``: the fleet's server stages (sim/frontend.py; none by default).

    ``storage_blocks``: None = unbounded (never fills), 0 = no storage tier, N = N blocks
    (``storage_blocks_for`` turns "1/4" of a workload's working set into blocks).
    ``storage_shared_bytes_per_s``: the pool's aggregate bandwidth; "default" =
    SHARED_POOL_BANDWIDTH_PER_ENGINE x engines x one engine's read rate, None = no shared limit.
    ``engine_model``: "vllm" (asynchronous loads, context-dependent costs) or "legacy" (the model
    before issue 16: loads stall the step, context-free costs, no shared pool bandwidth).
    ``engine_variation``: each engine's prefill rate and load bandwidths are scaled by a factor drawn
    uniformly in [1 - v, 1 + v] (seeded by ``variation_seed``); the router is not told.
    ``hetero`` (B1b): engines 2 and 3 load CPU at 1/4 PCIe 5 speed, engine 1 reads storage 4x
    slower, and halfway through engine 0's storage slows down 4x (noisy neighbour)."""
    if num_engines < 1:
        raise ValueError("--engines must be >= 1")
    if storage_blocks is not None and storage_blocks < 0:
        raise ValueError(f"storage_blocks must be >= 0 (0 = no storage tier), got {storage_blocks}")
    if engine_model not in ENGINE_MODELS:
        raise ValueError(f"engine_model {engine_model!r} is unknown; accepted: {', '.join(ENGINE_MODELS)}")
    if not 0 <= engine_variation < 1:
        raise ValueError(f"engine_variation must be in [0, 1), got {engine_variation}")
    if gpu_blocks is not None and gpu_blocks < 1:
        raise ValueError(f"gpu_blocks must be >= 1, got {gpu_blocks}")
    if not cpu_ratio >= 0:
        raise ValueError(f"cpu_ratio must be >= 0 (0 = no CPU tier), got {cpu_ratio}")
    base = base or EngineProfile()
    if engine_model == "legacy":
        base = base.legacy_model()
    if gpu_blocks is None:
        gpu_blocks = max(
            8, math.ceil(conversations_in_hbm * mean_conversation_tokens / num_engines / block_size)
        )
    cpu_blocks = int(gpu_blocks * cpu_ratio)
    profile = dataclasses.replace(
        base, block_size=block_size, num_gpu_blocks=gpu_blocks, num_cpu_blocks=cpu_blocks
    )
    specs = [EngineSpec(f"e{i}", dataclasses.replace(profile)) for i in range(num_engines)]
    if storage_shared_bytes_per_s == "default":
        shared: float | None = (
            None
            if engine_model == "legacy"
            else SHARED_POOL_BANDWIDTH_PER_ENGINE * num_engines * base.storage_load_bytes_per_s
        )
    elif storage_shared_bytes_per_s is None or isinstance(storage_shared_bytes_per_s, float | int):
        shared = storage_shared_bytes_per_s
        if shared is not None and not shared > 0:
            raise ValueError(f"storage_shared_bytes_per_s must be positive or None, got {shared}")
    else:
        raise ValueError(
            f"storage_shared_bytes_per_s {storage_shared_bytes_per_s!r}: a number, None or 'default'"
        )
    fleet = FleetSpec(
        specs,
        storage_pool_blocks=UNBOUNDED_STORAGE_BLOCKS if storage_blocks is None else storage_blocks,
        storage_shared_bytes_per_s=shared,
        api_server=api_server,
        router_stage=router_stage,
    )
    if engine_variation:
        rng = random.Random(f"variation:{variation_seed}")
        for spec in specs:
            p = spec.profile
            p.prefill_tokens_per_s *= rng.uniform(1 - engine_variation, 1 + engine_variation)
            p.cpu_load_bytes_per_s *= rng.uniform(1 - engine_variation, 1 + engine_variation)
            p.storage_load_bytes_per_s *= rng.uniform(1 - engine_variation, 1 + engine_variation)
    if hetero:
        for i, spec in enumerate(specs):
            if i % 4 in (2, 3):
                spec.profile.cpu_load_bytes_per_s = spec.profile.cpu_load_bytes_per_s / 4
            if i % 4 == 1:
                spec.profile.storage_load_bytes_per_s = spec.profile.storage_load_bytes_per_s / 4
        fleet.slowdown_engine = specs[0].engine_id
    return fleet


def working_set_blocks(workload: Workload) -> int:
    """Distinct blocks the workload's prompts hold: what a pool must keep to miss nothing."""
    seen: set[int] = set()
    for conv in workload.conversations:
        for turn in conv.turns:
            seen.update(turn.block_ids)
    return len(seen)


def parse_storage(text: str) -> str:
    """Validate one ``--storage`` value: "none", "unbounded", a block count, or a fraction of the
    working set ("1/4", "0.25"). Returns it normalised; ValueError says what is accepted."""
    value = text.strip().lower()
    if value in ("none", "unbounded"):
        return value
    try:
        if "/" in value:
            num, _, den = value.partition("/")
            fraction = float(num) / float(den)
        elif "." in value or "e" in value:
            fraction = float(value)
        else:
            blocks = int(value)
            if blocks < 1:
                raise ValueError
            return str(blocks)
    except (ValueError, ZeroDivisionError):
        raise ValueError(
            f"--storage {text!r}: accepted values are none, unbounded, a block count (e.g. 500000) "
            "or a fraction of the working set (e.g. 1/4 or 0.25)"
        ) from None
    if not 0 < fraction <= 1:
        raise ValueError(f"--storage {text!r}: a fraction of the working set must be in (0, 1]")
    return value


def storage_blocks_for(spec: str, working_set: int) -> int | None:
    """Pool capacity for a ``parse_storage`` value: None = unbounded, 0 = no storage tier."""
    value = parse_storage(spec)
    if value == "none":
        return 0
    if value == "unbounded":
        return None
    if "/" in value or "." in value or "e" in value:
        num, _, den = value.partition("/")
        fraction = float(num) / float(den) if den else float(num)
        return max(1, round(fraction * working_set))
    return int(value)


#: EngineProfile fields a profile file may not set: the fleet options set them.
_FLEET_SET_FIELDS = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "scheduling_policy", "counter_noise")


def load_engine_profile(path: str | Path) -> dict[str, Any]:
    """EngineProfile fields from a JSON file: an object of fields, or one under "engine_profile"
    (what loadtest/calibrate_vllm.py writes). Unknown fields and the fleet-set ones are refused."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--engine-profile {path}: {exc}") from exc
    fields = doc.get("engine_profile", doc) if isinstance(doc, dict) else None
    if not isinstance(fields, dict):
        raise ValueError(f"--engine-profile {path}: a JSON object of EngineProfile fields expected")
    known = {f.name for f in dataclasses.fields(EngineProfile)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"--engine-profile {path}: unknown EngineProfile fields {', '.join(unknown)}")
    fleet_set = sorted(set(fields) & set(_FLEET_SET_FIELDS))
    if fleet_set:
        raise ValueError(f"--engine-profile {path}: {', '.join(fleet_set)} are set by the fleet options")
    EngineProfile(**fields)  # the profile's own validation, with its messages
    return fields


def load_server_stages(path: str | Path) -> tuple[ServerStage | None, ServerStage | None]:
    """The API-server and router stages (sim/frontend.py) a calibration file holds under
    "api_server" and "router_stage" (loadtest/calibrate_vllm.py writes them); None where absent."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--engine-profile {path}: {exc}") from exc
    if not isinstance(doc, dict):
        return None, None
    return tuple(  # type: ignore[return-value]
        ServerStage.from_dict(doc[key], f"{path}: {key}") if key in doc else None
        for key in ("api_server", "router_stage")
    )
