"""Routing-quality sweep: storage pool size x conversations x seeds x policies on the DES, with the
hindsight bound of every run (sim/oracle.py), written as a markdown table (median and range).

    python -m loadtest.bench_quality --concurrency 64,128,192 --storage none,1/4,1/2,unbounded \
        --seeds 1,2,3 --policies horizon_cost,kv_fixed_credit --out results.md --jobs 2

A storage fraction is of the working set: conversations x mean conversation tokens (what the
concurrent conversations hold on average). Traces (--trace) run on --engines engines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvcore.core import (
    ADMISSION_FORMS,
    ESCALATE_PICKS,
    HOLD_ORDERS,
    HOLD_PICKS,
    PRIORITY_FCFS_FACTOR,
    PRIORITY_MAX_OVERTAKE_S,
    PRIORITY_RECOMPUTE_BELOW,
    PRIORITY_RECOMPUTE_FCFS_FACTOR,
    PRIORITY_STRETCH,
    PRIORITY_WAITS,
    SCHEDULING_POLICIES,
    check_hold_wait,
    check_priority_fcfs_factor,
    check_priority_max_overtake,
    check_priority_stretch,
    check_recompute_below,
)
from kvcore.stats import median_span, percentiles
from policies.costs import RECOMPUTE_BELOW
from sim.des import (
    ESCALATE_ABORTS,
    SPLIT_CACHED_FRACTION_KEY,
    TTFT_SPLIT_KEYS,
    FleetSimulator,
    SimConfig,
    ttft_figures,
)
from sim.des_cli import parse_policy_spec, worker_pool
from sim.engine import EngineProfile
from sim.fleets import (
    UNBOUNDED_STORAGE_BLOCKS,
    FleetSpec,
    b1_fleet,
    parse_storage,
    storage_blocks_for,
    working_set_blocks,
)
from sim.oracle import ArrivalRecorder, capacity_bound, sticky_lru_hit
from sim.workloads import (
    LadderConfig,
    Workload,
    agentic_workload,
    ladder_workload,
    mooncake_workload,
    read_agentic_sessions,
    read_mooncake_records,
)


@dataclass(slots=True)
class Cell:
    """One run: a workload x fleet x storage size x policy spec x seed."""

    label: str
    storage: str
    policy: str
    seed: int
    concurrency: int = 0
    trace: str = ""
    trace_format: str = ""
    engines: int = 4
    hetero: bool = False
    block_size: int = 64
    conversations: float = 2.0
    stagger_s: float = 30.0
    limit: int | None = None
    #: The engines' vLLM ``--scheduling-policy``: "fcfs", or "priority" (the router then sends each
    #: request's ``shortest_first_priority``); "priority:S" with the priority stretch S,
    #: "priority:S:H" also with the bound H (``max_overtake_s``), "priority:S:H:K" also with the
    #: relative bound K (``fcfs_factor``), "priority:S:H:K:W" also with the router's priced wait W
    #: (``SimConfig.priority_wait``, one of ``kvcore.core.PRIORITY_WAITS``); any of them followed by
    #: ADMISSION_SUFFIX (optionally ":FORM", then optionally ":recompute[:X]"): the router also prices
    #: the admission wait (``SimConfig.admission_wait``, counted as ``SimConfig.admission_form``,
    #: gated by ``SimConfig.admission_recompute_below``; ``admission_of``). A priority spec may
    #: carry RECOMPUTE_BOUND_SUFFIX before that: ``+recompute-k:KR[:X]`` (``recompute_bound_of``).
    #: Any spec may end in HOLD_SUFFIX: ``+hold:W[:ORDER[:PICK[:recompute[:X]][:max:M][:aged]]]``,
    #: late binding (``hold_of``); any spec may carry READQ_SUFFIX, the shared pool's read queue
    #: booked and priced (``readq_of``).
    scheduling: str = "fcfs"
    #: The router's ``costs.priors.calibration.pool_observations`` (0 = off).
    pool_observations: float = 0.0
    #: The router's ``costs.priors.calibration.shared_storage`` (the shared pool's STORAGE bandwidth
    #: measured as one figure; ``SimConfig.calibration_shared_storage``).
    shared_storage_calibration: bool = False
    #: The router's ``costs.priors.calibration.storage_spread`` (``SimConfig
    #: .calibration_storage_spread``; inf = off).
    storage_spread: float = math.inf
    #: Split each turn's TTFT into where it went (``sim.des.ttft_split``) and summarise the split
    #: of the turns around the p50 and above the p99 (``split_summary``).
    split_ttft: bool = False
    #: Which turns the TTFT figures are read over (READS): every turn of the run, or "steady", the
    #: turns of the ladder's conversations numbered concurrency .. total - concurrency - 1 only
    #: (``steady_window``): none of them starts in the first wave, none in the last, so the reading
    #: has neither the synchronized cold start nor the drain (round q52).
    read: str = "all"


#: A scheduling spec ending in this prices the admission wait (``SimConfig.admission_wait``);
#: ``+admission:FORM`` also names how it counts the placed sequences' KV (``SimConfig
#: .admission_form``, one of ``kvcore.core.ADMISSION_FORMS``; plain ``+admission`` = "reserved");
#: ``+admission:FORM:recompute`` prices it only for turns no engine holds much of
#: (``SimConfig.admission_recompute_below`` = ``policies.costs.RECOMPUTE_BELOW``), and
#: ``+admission:FORM:recompute:X`` below the fraction X of the prompt.
ADMISSION_SUFFIX = "+admission"
ADMISSION_RECOMPUTE = "recompute"


#: Any scheduling spec may end in ``+hold:W[:ORDER[:PICK[:recompute[:X]][:max:M][:aged]]]``: late binding,
#: the router holds turns while no engine's predicted queue wait is below W seconds
#: (``SimConfig.hold_wait_s``), releases them in ORDER (``SimConfig.hold_order``, one of
#: ``kvcore.core.HOLD_ORDERS``, default fcfs) and routes each among PICK (``SimConfig.hold_pick``,
#: one of ``kvcore.core.HOLD_PICKS``, default all); ``:recompute[:X]`` holds only the turns every
#: engine holds less than X of (``SimConfig.hold_recompute_below``, default
#: ``PRIORITY_RECOMPUTE_BELOW``); ``:max:M`` routes a turn held M seconds then, room or not
#: (``SimConfig.hold_max_s``); ``:aged`` counts a held turn's shortest-first deadline from its
#: arrival, not from its release (``SimConfig.hold_aged``). It comes after every other suffix.
HOLD_SUFFIX = "+hold"
HOLD_MAX = "max"
HOLD_AGED = "aged"


class Hold(NamedTuple):
    """A scheduling spec's late binding (``hold_of``): W None = none."""

    spec: str
    wait_s: float | None = None
    order: str = HOLD_ORDERS[0]
    pick: str = HOLD_PICKS[0]
    recompute_below: float | None = None
    max_s: float | None = None
    aged: bool = False


#: A scheduling spec containing this (anywhere after the order) prices placement on priority engines
#: by the deadline sent (``SimConfig.deadline_floor``, round q12).
FLOOR_SUFFIX = "+floor"


#: A scheduling spec containing this (anywhere after the order) books the traffic the router places
#: on the shared pool, reads and the computed blocks the engines write through, and prices a
#: STORAGE read's wait behind it (``SimConfig.storage_read_queue``); ``+readq:reads`` books the
#: reads only (``SimConfig.storage_read_queue_writes`` False: round q54's first build).
READQ_SUFFIX = "+readq"
#: The forms ``READQ_SUFFIX`` takes after a ':' (none = "writes": reads and writes).
READQ_FORMS = ("writes", "reads")


#: A scheduling spec containing this (anywhere after the order) prices what a placement does to the
#: turns queued on each engine (``SimConfig.externality``, round q13); ``+extern:new`` prices only
#: the blocks the placement writes (``SimConfig.externality_new_blocks``, post hoc).
EXTERN_SUFFIX = "+extern"
#: The footprints ``EXTERN_SUFFIX`` takes after a ':' (none = "sequence").
EXTERN_FORMS = ("sequence", "new")


#: A scheduling spec containing ``+escalate:E`` (anywhere after the order) escalates turns on
#: priority engines (round q24): a turn with no first token E seconds after it arrived is cancelled
#: and sent again at priority 0 (``SimConfig.escalate_after_s``); ``+escalate:E:PICK`` also names
#: where it is sent (``SimConfig.escalate_pick``, one of ``kvcore.core.ESCALATE_PICKS``; default
#: same), ``+escalate:E:PICK:ABORT`` when the engine drops the first request
#: (``SimConfig.escalate_abort``, one of ``sim.des.ESCALATE_ABORTS``; default now, as vLLM 0.32 and
#: kvroute's sim server; first_token a sensitivity check).
ESCALATE_SUFFIX = "+escalate"


class Escalation(NamedTuple):
    """A scheduling spec's escalation (``escalate_of``): after_s None = none."""

    spec: str
    after_s: float | None = None
    pick: str = ESCALATE_PICKS[0]
    abort: str = ESCALATE_ABORTS[0]


def escalate_of(spec: str) -> Escalation:
    """The scheduling spec without its ESCALATE_SUFFIX part, and the escalation it names."""
    if ESCALATE_SUFFIX not in spec:
        return Escalation(spec)
    head, _, tail = spec.partition(ESCALATE_SUFFIX)
    usage = (
        f"--scheduling {spec!r}: write {ESCALATE_SUFFIX}:E[:PICK[:ABORT]] (E > 0 seconds, PICK one of"
        f" {', '.join(ESCALATE_PICKS)}, ABORT one of {', '.join(ESCALATE_ABORTS)}; priority engines only)"
    )
    body, plus, rest = tail.partition("+")
    fields = body[1:].split(":") if body.startswith(":") else []
    if not head.startswith("priority") or not 1 <= len(fields) <= 3:
        raise ValueError(usage)
    try:
        after_s = float(fields[0])
    except ValueError:
        raise ValueError(f"{usage}: E must be a number") from None
    pick = fields[1] if len(fields) > 1 else ESCALATE_PICKS[0]
    abort = fields[2] if len(fields) > 2 else ESCALATE_ABORTS[0]
    if not after_s > 0 or math.isinf(after_s) or pick not in ESCALATE_PICKS or abort not in ESCALATE_ABORTS:
        raise ValueError(usage)
    return Escalation(head + plus + rest, after_s, pick, abort)


def _switch_of(spec: str, suffix: str) -> tuple[str, bool]:
    """(the scheduling spec without ``suffix``, a switch with no value, whether it had it)."""
    if suffix not in spec:
        return spec, False
    head, _, tail = spec.partition(suffix)
    if tail and not tail.startswith("+"):
        raise ValueError(f"--scheduling {spec!r}: {suffix} takes no value")
    return head + tail, True


def floor_of(spec: str) -> tuple[str, bool]:
    """(the scheduling spec without FLOOR_SUFFIX, whether it had it)."""
    return _switch_of(spec, FLOOR_SUFFIX)


def _form_of(spec: str, suffix: str, forms: Sequence[str]) -> tuple[str, str | None]:
    """(the scheduling spec without its ``suffix`` part, the form that part names after a ':': one
    of ``forms``, the first without one; None without the suffix)."""
    if suffix not in spec:
        return spec, None
    head, _, tail = spec.partition(suffix)
    form = forms[0]
    if tail.startswith(":"):
        form, plus, rest = tail[1:].partition("+")
        tail = plus + rest
        if form not in forms:
            raise ValueError(f"--scheduling {spec!r}: {suffix}:FORM, FORM one of {', '.join(forms)}")
    elif tail and not tail.startswith("+"):
        raise ValueError(f"--scheduling {spec!r}: write {suffix} or {suffix}:FORM")
    return head + tail, form


def readq_of(spec: str) -> tuple[str, str | None]:
    """(the scheduling spec without its READQ_SUFFIX part, the form it names: one of READQ_FORMS,
    None without the suffix)."""
    return _form_of(spec, READQ_SUFFIX, READQ_FORMS)


def extern_of(spec: str) -> tuple[str, str | None]:
    """(the scheduling spec without its EXTERN_SUFFIX part, the footprint it names: one of
    EXTERN_FORMS, None without the suffix)."""
    return _form_of(spec, EXTERN_SUFFIX, EXTERN_FORMS)


def hold_of(spec: str) -> Hold:
    """The scheduling spec without its HOLD_SUFFIX part (and without READQ_SUFFIX, FLOOR_SUFFIX,
    EXTERN_SUFFIX and ESCALATE_SUFFIX), and the hold that part names."""
    spec = escalate_of(extern_of(floor_of(readq_of(spec)[0])[0])[0]).spec
    head, sep, tail = spec.partition(HOLD_SUFFIX)
    if not sep:
        return Hold(spec)
    usage = (
        f"--scheduling {spec!r}: end it in {HOLD_SUFFIX}:W[:ORDER[:PICK[:{ADMISSION_RECOMPUTE}[:X]]"
        f"[:{HOLD_MAX}:M][:{HOLD_AGED}]]] (W, M > 0 seconds, ORDER one of {', '.join(HOLD_ORDERS)},"
        f" PICK one of {', '.join(HOLD_PICKS)})"
    )
    fields = tail[1:].split(":") if tail.startswith(":") else []
    rest = fields[3:]
    aged = bool(rest) and rest[-1] == HOLD_AGED
    if aged:
        rest = rest[:-1]
    max_field: str | None = None
    if len(rest) >= 2 and rest[-2] == HOLD_MAX:
        max_field, rest = rest[-1], rest[:-2]
    if not 1 <= len(fields) or len(rest) > 2 or (rest and rest[0] != ADMISSION_RECOMPUTE):
        raise ValueError(usage)
    try:
        wait_s = float(fields[0])
        below = (float(rest[1]) if len(rest) > 1 else PRIORITY_RECOMPUTE_BELOW) if rest else None
        max_s = float(max_field) if max_field is not None else None
    except ValueError:
        raise ValueError(f"{usage}: W, X and M must be numbers") from None
    check_hold_wait(wait_s, f"--scheduling {spec!r}: the hold's W")
    if below is not None:
        check_recompute_below(below, f"--scheduling {spec!r}: the hold's recompute fraction X")
    if max_s is not None:
        check_hold_wait(max_s, f"--scheduling {spec!r}: the hold's bound M")
    order = fields[1] if len(fields) > 1 else HOLD_ORDERS[0]
    pick = fields[2] if len(fields) > 2 else HOLD_PICKS[0]
    if order not in HOLD_ORDERS or pick not in HOLD_PICKS:
        raise ValueError(usage)
    return Hold(head, wait_s, order, pick, below, max_s, aged)


def admission_of(spec: str) -> tuple[str, str | None, float | None]:
    """(the scheduling spec without its ADMISSION_SUFFIX part and HOLD_SUFFIX's, the admission form
    it names: None without the suffix, "reserved" for a plain ``+admission``; the ``:recompute``
    gate's fraction, None without it)."""
    spec_without_hold = hold_of(spec).spec
    head, sep, tail = spec_without_hold.partition(ADMISSION_SUFFIX)
    if not sep:
        return spec_without_hold, None, None
    if not tail:
        return head, ADMISSION_FORMS[0], None
    form, _, gate = tail[1:].partition(":") if tail.startswith(":") else ("", "", "")
    if form not in ADMISSION_FORMS:
        raise ValueError(
            f"--scheduling {spec!r}: end it in {ADMISSION_SUFFIX}, {ADMISSION_SUFFIX}:FORM or"
            f" {ADMISSION_SUFFIX}:FORM:{ADMISSION_RECOMPUTE}[:X], FORM one of {', '.join(ADMISSION_FORMS)}"
        )
    if not gate:
        if tail.endswith(":"):
            raise ValueError(f"--scheduling {spec!r}: nothing after the last ':'")
        return head, form, None
    word, colon, fraction = gate.partition(":")
    if word != ADMISSION_RECOMPUTE:
        raise ValueError(
            f"--scheduling {spec!r}: after {ADMISSION_SUFFIX}:FORM only :{ADMISSION_RECOMPUTE}[:X]"
        )
    below = RECOMPUTE_BELOW
    if colon:
        try:
            below = float(fraction)
        except ValueError:
            raise ValueError(
                f"--scheduling {spec!r}: the {ADMISSION_RECOMPUTE} fraction X must be a number"
            ) from None
    check_recompute_below(below, f"--scheduling {spec!r}: the {ADMISSION_RECOMPUTE} fraction")
    return head, form, below


#: A priority spec followed by ``+recompute-k:KR`` bounds the ordering for recomputes only
#: (``SimConfig.priority_recompute_fcfs_factor`` = KR, >= 1): a turn no engine holds
#: ``RECOMPUTE_BELOW`` of gets a deadline of at most min(K, KR) x its first-come TTFT, the other
#: turns keep K; ``+recompute-k:KR:X`` gates at the fraction X of the prompt
#: (``SimConfig.priority_recompute_below``). It comes before any ADMISSION_SUFFIX.
RECOMPUTE_BOUND_SUFFIX = "+recompute-k"


def recompute_bound_of(spec: str) -> tuple[str, float, float]:
    """(the scheduling spec without its RECOMPUTE_BOUND_SUFFIX part and without ADMISSION_SUFFIX's,
    the recompute bound KR: inf without the suffix, its gate's fraction X)."""
    head, sep, tail = admission_of(spec)[0].partition(RECOMPUTE_BOUND_SUFFIX)
    if not sep:
        return head, PRIORITY_RECOMPUTE_FCFS_FACTOR, PRIORITY_RECOMPUTE_BELOW
    usage = f"--scheduling {spec!r}: write priority[:...]{RECOMPUTE_BOUND_SUFFIX}:KR[:X]"
    if not head.startswith("priority") or not tail.startswith(":"):
        raise ValueError(f"{usage} (KR >= 1, X in (0, 1]; priority engines only)")
    fields = tail[1:].split(":")
    if len(fields) > 2:
        raise ValueError(f"{usage}: too many fields after {RECOMPUTE_BOUND_SUFFIX}")
    try:
        factor = float(fields[0])
        below = float(fields[1]) if len(fields) > 1 else PRIORITY_RECOMPUTE_BELOW
    except ValueError:
        raise ValueError(f"{usage}: KR and X must be numbers") from None
    check_priority_fcfs_factor(factor, f"--scheduling {spec!r}: the recompute bound KR")
    check_recompute_below(below, f"--scheduling {spec!r}: the recompute fraction X")
    return head, factor, below


def parse_scheduling(spec: str) -> tuple[str, float, float, float, str]:
    """ "fcfs", "priority", "priority:S", "priority:S:H", "priority:S:H:K" or "priority:S:H:K:W",
    each optionally followed by RECOMPUTE_BOUND_SUFFIX (``recompute_bound_of``), then by
    ADMISSION_SUFFIX (read with ``admission_of``) -> (vLLM scheduling
    policy, priority stretch, max overtake seconds, fcfs factor, priced wait)."""
    policy, *numbers = recompute_bound_of(spec)[0].split(":")
    if policy not in SCHEDULING_POLICIES or (numbers and policy != "priority") or len(numbers) > 4:
        raise ValueError(
            f"--scheduling {spec!r}: use fcfs, priority, priority:STRETCH, priority:STRETCH:MAX_OVERTAKE_S,"
            " priority:STRETCH:MAX_OVERTAKE_S:FCFS_FACTOR or priority:STRETCH:MAX_OVERTAKE_S:FCFS_FACTOR:WAIT"
        )
    wait = numbers.pop() if len(numbers) == 4 else PRIORITY_WAITS[0]
    if wait not in PRIORITY_WAITS:
        raise ValueError(
            f"--scheduling {spec!r}: the priced wait must be one of {', '.join(PRIORITY_WAITS)}"
            " (priority:STRETCH:MAX_OVERTAKE_S:FCFS_FACTOR:WAIT)"
        )
    try:
        values = [float(x) for x in numbers]
    except ValueError:
        raise ValueError(f"--scheduling {spec!r}: the stretch and the bounds must be numbers") from None
    stretch = values[0] if values else PRIORITY_STRETCH
    max_overtake_s = values[1] if len(values) > 1 else PRIORITY_MAX_OVERTAKE_S
    fcfs_factor = values[2] if len(values) > 2 else PRIORITY_FCFS_FACTOR
    check_priority_stretch(stretch, f"--scheduling {spec!r}: the stretch")
    check_priority_max_overtake(max_overtake_s, f"--scheduling {spec!r}: the bound")
    check_priority_fcfs_factor(fcfs_factor, f"--scheduling {spec!r}: the fcfs factor")
    return policy, stretch, max_overtake_s, fcfs_factor, wait


def policy_runs(policies: str, schedulings: str) -> list[tuple[str, str]]:
    """(policy spec, scheduling) pairs: every policy with every --scheduling value, except that a
    policy written ``SPEC@SCHEDULING`` runs with that scheduling only."""
    for sched in _list(schedulings):
        parse_scheduling(sched)
    runs: list[tuple[str, str]] = []
    for entry in _list(policies):
        spec, at, scheduling = entry.partition("@")
        parse_policy_spec(spec)  # fail early on a malformed spec
        for sched in [scheduling] if at else _list(schedulings):
            parse_scheduling(sched)
            runs.append((spec, sched))
    return runs


def storage_blocks(storage: str, workload: Workload) -> int:
    """Pool size in blocks (sim.fleets.parse_storage values: none, unbounded, N blocks, or a fraction
    of the workload's working set = its distinct blocks, as ``kvroute sim --storage``)."""
    blocks = storage_blocks_for(storage, working_set_blocks(workload))
    return UNBOUNDED_STORAGE_BLOCKS if blocks is None else blocks


def ladder_conversations(concurrency: int, conversations: float) -> int:
    """The conversations a ladder cell runs: ``conversations`` x the concurrency, at least one wave."""
    return max(concurrency, round(concurrency * conversations))


def build(cell: Cell) -> tuple[Workload, FleetSpec]:
    """The workload and fleet of a cell (storage pool sized as the cell says)."""
    if cell.trace:
        path = Path(cell.trace)
        if cell.trace_format == "mooncake":
            wl = mooncake_workload(read_mooncake_records(path, limit=cell.limit), name=path.stem)
        else:
            wl = agentic_workload(read_agentic_sessions(path, limit=cell.limit), stagger_s=cell.stagger_s)
        base = dataclasses.replace(EngineProfile(), max_model_len=1 << 22)
        gpu_blocks = max(8, 27_852 * 16 // wl.block_size)
        fleet = b1_fleet(
            cell.engines,
            block_size=wl.block_size,
            hetero=cell.hetero,
            base=base,
            conversations_in_hbm=gpu_blocks * cell.engines * wl.block_size,
            mean_conversation_tokens=1.0,
        )
    else:
        lcfg = LadderConfig(
            concurrency=cell.concurrency,
            total_conversations=ladder_conversations(cell.concurrency, cell.conversations),
            block_size=cell.block_size,
            seed=cell.seed,
        )
        wl = ladder_workload(lcfg)
        fleet = b1_fleet(
            cell.engines,
            block_size=cell.block_size,
            hetero=cell.hetero,
            mean_conversation_tokens=lcfg.mean_prompt_tokens(),
        )
    fleet.storage_pool_blocks = storage_blocks(cell.storage, wl)
    policy = parse_scheduling(cell.scheduling)[0]
    for spec in fleet.engines:
        spec.profile = dataclasses.replace(spec.profile, scheduling_policy=policy)
    return wl, fleet


def sim_config(cell: Cell, **extra: Any) -> SimConfig:
    """The DES configuration of a cell (its seed and scheduling spec), with ``extra`` fields set."""
    _, stretch, max_overtake_s, fcfs_factor, wait = parse_scheduling(cell.scheduling)
    _, admission_form, recompute_below = admission_of(cell.scheduling)
    _, recompute_fcfs_factor, priority_recompute_below = recompute_bound_of(cell.scheduling)
    hold = hold_of(cell.scheduling)
    escalation = escalate_of(cell.scheduling)
    readq = readq_of(cell.scheduling)[1]
    return SimConfig(
        seed=cell.seed,
        priority_stretch=stretch,
        priority_max_overtake_s=max_overtake_s,
        priority_fcfs_factor=fcfs_factor,
        priority_recompute_fcfs_factor=recompute_fcfs_factor,
        priority_recompute_below=priority_recompute_below,
        priority_wait=wait,
        admission_wait=admission_form is not None,
        admission_form=admission_form or ADMISSION_FORMS[0],
        admission_recompute_below=recompute_below,
        hold_wait_s=hold.wait_s,
        hold_order=hold.order,
        hold_pick=hold.pick,
        hold_recompute_below=hold.recompute_below,
        hold_max_s=hold.max_s,
        hold_aged=hold.aged,
        calibration_pool_observations=cell.pool_observations,
        calibration_shared_storage=cell.shared_storage_calibration,
        calibration_storage_spread=cell.storage_spread,
        split_ttft=cell.split_ttft,
        deadline_floor=floor_of(cell.scheduling)[1],
        storage_read_queue=readq is not None,
        storage_read_queue_writes=readq != "reads",
        externality=extern_of(cell.scheduling)[1] is not None,
        externality_new_blocks=extern_of(cell.scheduling)[1] == "new",
        escalate_after_s=escalation.after_s,
        escalate_pick=escalation.pick,
        escalate_abort=escalation.abort,
        **extra,
    )


#: ``Cell.read``'s values.
READS = ("all", "steady")


def ladder_index(request_id: str) -> int:
    """The ladder conversation's number in a request id ("ladder-SEED-INDEX#TURN")."""
    conversation = request_id.split("#", 1)[0]
    prefix, _, index = conversation.rpartition("-")
    if not prefix.startswith("ladder-") or not index.isdigit():
        raise ValueError(f"{request_id!r} is not a ladder request id")
    return int(index)


def steady_window(concurrency: int, conversations: int) -> tuple[int, int]:
    """The conversations a "steady" reading keeps, [lo, hi): those started after the first wave
    and before the last one, in a ladder run of ``conversations`` at ``concurrency`` at a time."""
    lo, hi = concurrency, conversations - concurrency
    if hi <= lo:
        raise ValueError(
            f"a steady reading needs at least 3x the concurrency in conversations ({conversations} at"
            f" {concurrency}): use --conversations 3 or more"
        )
    return lo, hi


def read_steady(row: dict[str, Any], concurrency: int, conversations: int) -> None:
    """Replace ``row``'s TTFT figures (p50, p90, p99, mean, max and the per-turn map) by those of
    the steady window's turns; the run's other figures (hit rate, turns/s, ...) stay the whole
    run's. ``read_turns`` counts the turns kept."""
    lo, hi = steady_window(concurrency, conversations)
    kept = {k: t for k, t in row["ttft_by_request_s"].items() if lo <= ladder_index(k) < hi}
    ttfts = list(kept.values())
    row["ttft_p50_s"], row["ttft_p90_s"], row["ttft_p99_s"], row["ttft_mean_s"] = ttft_figures(ttfts)
    row["ttft_max_s"] = max(ttfts, default=0.0)
    row["ttft_by_request_s"] = kept
    row["read_turns"] = len(kept)


def run_cell(cell: Cell) -> dict[str, Any]:
    """Run one cell; the result row (figures of the run and of its hindsight bound). With
    ``cell.read`` "steady" the TTFT figures are the steady window's (``read_steady``)."""
    wl, fleet = build(cell)
    name, params = parse_policy_spec(cell.policy)
    config = sim_config(cell)
    sim = FleetSimulator(wl, name, fleet, config, policy_params=params)
    # Tier capacities reach the policy through sim.views[i].extra (FleetSimulator fills them).
    recorder = ArrivalRecorder(sim.policy)
    sim.policy = recorder  # type: ignore[assignment]
    result = sim.run()
    capacity = sum(s.profile.num_gpu_blocks + s.profile.num_cpu_blocks for s in fleet.engines)
    capacity += fleet.storage_pool_blocks
    rate = max(s.profile.prefill_tokens_per_s for s in fleet.engines)
    bound = capacity_bound(recorder.arrivals, min(capacity, UNBOUNDED_STORAGE_BLOCKS), rate)
    local_blocks = max(max(s.profile.num_gpu_blocks, s.profile.num_cpu_blocks) for s in fleet.engines)
    sticky = sticky_lru_hit(recorder.arrivals, len(fleet.engines), local_blocks, fleet.storage_pool_blocks)
    row = result.as_dict()
    row.update(
        label=cell.label,
        storage=cell.storage,
        policy=cell.policy,
        scheduling=cell.scheduling,
        seed=cell.seed,
        bound_hit=bound.bound_hit,
        bound_ideal_hit=bound.ideal_hit,
        sticky_lru_hit=sticky,
        ttft_floor_p50_s=bound.ttft_floor_p50_s,
        ttft_floor_p99_s=bound.ttft_floor_p99_s,
        capacity_blocks=capacity,
        ttft_max_s=max(result.ttfts_s, default=0.0),
        ttft_by_request_s=result.ttft_by_request_s,
    )
    row["read"] = cell.read
    if cell.read == "steady":
        read_steady(row, cell.concurrency, len(wl.conversations))
    if cell.split_ttft:
        row["ttft_split"] = split_summary(result.ttft_split_by_request)
        row["ttft_split_separation"] = split_separation(result.ttft_split_by_request)
        row["ttft_split_recompute"] = split_by_recompute(result.ttft_split_by_request)
    return row


#: ``split_summary``'s groups of turns, by their TTFT's percentile rank in the run: around the
#: median, above the p99, and every turn.
SPLIT_GROUPS = {"p45-p55": (45.0, 55.0), "above p99": (99.0, 100.0), "all": (0.0, 100.0)}


def split_summary(splits: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per SPLIT_GROUPS group: the number of turns and the mean of each ``TTFT_SPLIT_KEYS`` part."""
    ttfts = [s["ttft_s"] for s in splits.values()]
    out: dict[str, dict[str, float]] = {}
    for group, (low, high) in SPLIT_GROUPS.items():
        lo_s, hi_s = percentiles(ttfts, (low, high), empty=0.0)
        members = [s for s in splits.values() if lo_s <= s["ttft_s"] <= hi_s]
        if low > 0 and high == 100.0:
            members = [s for s in members if s["ttft_s"] > lo_s]
        summary = {"turns": float(len(members))}
        for key in TTFT_SPLIT_KEYS:
            summary[key] = sum(s[key] for s in members) / len(members) if members else math.nan
        out[group] = summary
    return out


#: ``split_separation``'s share of a run's turns that counts as its longest waits.
SPLIT_TOP_SHARE = 0.01
#: ``split_separation``'s figures, in print order: whether the priced admission wait (``pred.
#: slot``) and the predicted TTFT order the turns as they went (``sim.des.ttft_split``'s parts).
SPLIT_SEPARATION_NAMES = (
    "rank corr. pred. slot ~ admission: KV",
    "the same over the turns that waited for KV",
    "rank corr. predicted ~ TTFT",
    "admission: KV of the top 1% by pred. slot",
    "admission: KV of the top 1% by admission: KV",
)


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long series (ties take their mean rank): 1 = the
    same order, 0 = unrelated; NaN for fewer than two values or a constant series."""
    if len(xs) != len(ys):
        raise ValueError(f"rank_correlation needs series of one length, got {len(xs)} and {len(ys)}")
    if len(xs) < 2:
        return math.nan
    rx, ry = _mean_ranks(xs), _mean_ranks(ys)
    if rx.std() == 0.0 or ry.std() == 0.0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def _mean_ranks(values: Sequence[float]) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    _, inverse, counts = np.unique(array, return_inverse=True, return_counts=True)
    # Rank of each distinct value = the mean of the positions its copies take in sorted order.
    ends = np.cumsum(counts)
    return ((ends - counts + 1 + ends) / 2.0)[inverse]


def top_share_mean(parts: Sequence[dict[str, float]], by: str, of: str, share: float) -> float:
    """Mean ``of`` over the ``share`` of ``parts`` (at least one) with the largest ``by`` (ties in
    their order); NaN without parts."""
    if not parts:
        return math.nan
    count = max(1, round(share * len(parts)))
    top = sorted(parts, key=lambda s: s[by], reverse=True)[:count]
    return sum(s[of] for s in top) / count


def split_separation(splits: dict[str, dict[str, float]]) -> dict[str, float]:
    """SPLIT_SEPARATION_NAMES' figures over a run's turns: the rank correlation of the priced
    admission wait with the measured KV wait (every turn, then only those that waited: most turns
    wait for nothing and every estimate gives them little, which alone makes a correlation high),
    of the predicted TTFT with the measured one, and the mean measured KV wait (seconds) of the
    SPLIT_TOP_SHARE of turns the estimate prices highest, beside that of the turns that waited
    longest (the most any estimate could pick)."""
    parts = list(splits.values())
    waited = [s for s in parts if s["admission_kv_s"] > 0.0]
    names = SPLIT_SEPARATION_NAMES
    return {
        names[0]: rank_correlation(
            [s["predicted_slot_s"] for s in parts], [s["admission_kv_s"] for s in parts]
        ),
        names[1]: rank_correlation(
            [s["predicted_slot_s"] for s in waited], [s["admission_kv_s"] for s in waited]
        ),
        names[2]: rank_correlation([s["predicted_s"] for s in parts], [s["ttft_s"] for s in parts]),
        names[3]: top_share_mean(parts, "predicted_slot_s", "admission_kv_s", SPLIT_TOP_SHARE),
        names[4]: top_share_mean(parts, "admission_kv_s", "admission_kv_s", SPLIT_TOP_SHARE),
    }


#: ``split_by_recompute``'s classes of turns, in print order.
SPLIT_RECOMPUTE_CLASSES = ("recompute", "cached")


def split_by_recompute(
    splits: dict[str, dict[str, float]], below: float = RECOMPUTE_BELOW
) -> dict[str, dict[str, float]]:
    """A run's turns in two classes by their best cached fraction when routed
    (``sim.des.SPLIT_CACHED_FRACTION_KEY``): "recompute" (below ``below``, the ``:recompute``
    gate's default: no engine held much of the prompt) and "cached"; per class SPLIT_RECOMPUTE_NAMES:
    turns, mean, p50 and max TTFT, and how many of the run's turns above its p99 (as
    ``split_summary``) and over TAIL_ABSOLUTE_S are in it."""
    ttfts = [s["ttft_s"] for s in splits.values()]
    (p99_s,) = percentiles(ttfts, (99.0,), empty=0.0)
    out: dict[str, dict[str, float]] = {}
    for name in SPLIT_RECOMPUTE_CLASSES:
        members = [
            s["ttft_s"]
            for s in splits.values()
            if (s[SPLIT_CACHED_FRACTION_KEY] < below) == (name == "recompute")
        ]
        (p50_s,) = percentiles(members, (50.0,), empty=math.nan)
        figures = (
            float(len(members)),
            sum(members) / len(members) if members else math.nan,
            p50_s,
            max(members, default=math.nan),
            float(sum(1 for t in members if t > p99_s)),
            float(sum(1 for t in members if t > TAIL_ABSOLUTE_S)),
        )
        out[name] = dict(zip(SPLIT_RECOMPUTE_NAMES, figures, strict=True))
    return out


def split_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One line per run and SPLIT_GROUPS group: mean measured parts of the TTFT against the
    predicted ones (``sim.des.ttft_split``), seconds."""
    out = [
        "| workload | storage | policy | engine scheduling | seed | turns | n | TTFT | queue (prefill)"
        " | admission: KV | admission: seqs | service | preemption | predicted | pred. wait | pred. slot"
        " | pred. read wait | pred. service |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for group, m in r.get("ttft_split", {}).items():
            figures = " | ".join(f"{m[key]:.2f}" for key in TTFT_SPLIT_KEYS)
            out.append(
                f"| {r['label']} | {r['storage']} | {r['policy']} | {r['scheduling']} | {r['seed']}"
                f" | {group} | {m['turns']:.0f} | {figures} |"
            )
    names = SPLIT_SEPARATION_NAMES
    out += [
        "",
        "| workload | storage | policy | engine scheduling | seed | " + " | ".join(names) + " |",
        "|---|---|---|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        separation = r.get("ttft_split_separation")
        if separation is not None:
            figures = " | ".join(f"{separation[name]:.2f}" for name in names)
            out.append(
                f"| {r['label']} | {r['storage']} | {r['policy']} | {r['scheduling']} | {r['seed']}"
                f" | {figures} |"
            )
    recompute_names = SPLIT_RECOMPUTE_NAMES
    counts = (recompute_names[0], recompute_names[4], recompute_names[5])
    out += [
        "",
        f"| workload | storage | policy | engine scheduling | seed | turns (recompute: no engine held"
        f" {RECOMPUTE_BELOW:g} of the prompt) | " + " | ".join(recompute_names) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(recompute_names),
    ]
    for r in rows:
        for group, m in r.get("ttft_split_recompute", {}).items():
            figures = " | ".join(format(m[k], ".0f" if k in counts else ".2f") for k in recompute_names)
            out.append(
                f"| {r['label']} | {r['storage']} | {r['policy']} | {r['scheduling']} | {r['seed']}"
                f" | {group} | {figures} |"
            )
    return "\n".join(out)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (label, storage, policy, scheduling): medians over seeds with [min-max]."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["label"], r["storage"], r["policy"], r.get("scheduling", "fcfs"))
        groups.setdefault(key, []).append(r)
    out = [
        "| workload | storage | policy | engine scheduling | seeds | TTFT p50 s | p90 s | p99 s"
        " | max s | turns/s | hit | bound hit | hit / bound | sticky LRU ref hit | TTFT floor p50 s"
        " | TTFT / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (label, storage, policy, scheduling), rs in groups.items():
        out.append(
            f"| {label} | {storage} | {policy} | {scheduling} | {len(rs)}"
            f" | {median_span([r['ttft_p50_s'] for r in rs], '.3f')}"
            f" | {median_span([r['ttft_p90_s'] for r in rs], '.3f')}"
            f" | {median_span([r['ttft_p99_s'] for r in rs], '.2f')}"
            f" | {median_span([r.get('ttft_max_s', math.nan) for r in rs], '.1f')}"
            f" | {median_span([r['turns_per_s'] for r in rs], '.2f')}"
            f" | {median_span([r['hit'] for r in rs], '.3f')}"
            f" | {median_span([r['bound_hit'] for r in rs], '.3f')}"
            f" | {median_span([r['hit'] / r['bound_hit'] if r['bound_hit'] else 0.0 for r in rs], '.2f')}"
            f" | {median_span([r.get('sticky_lru_hit', math.nan) for r in rs], '.3f')}"
            f" | {median_span([r['ttft_floor_p50_s'] for r in rs], '.3f')}"
            f" | {median_span([r.get('ttft_over_predicted', math.nan) for r in rs], '.2f')} |"
        )
    return "\n".join(out)


#: A turn "waits in the tail" past this many times its TTFT in the reference run, or past
#: TAIL_ABSOLUTE_S seconds (issue 27's tail table).
TAIL_FACTOR = 10.0
TAIL_ABSOLUTE_S = 30.0
#: ``split_by_recompute``'s figures per class, in print order.
SPLIT_RECOMPUTE_NAMES = (
    "n",
    "mean TTFT s",
    "p50 TTFT s",
    "max TTFT s",
    "of the run's turns above p99",
    f"over {TAIL_ABSOLUTE_S:g} s",
)


def tail_markdown(rows: Sequence[dict[str, Any]], reference: str) -> str:
    """Per (label, storage, policy, scheduling): turns whose TTFT exceeds TAIL_FACTOR x the same
    turn's TTFT in the ``reference`` run ("SPEC@SCHEDULING", same label, storage and seed), turns
    over TAIL_ABSOLUTE_S, and the largest TTFT; median [min-max] over seeds."""
    ref_spec, _, ref_sched = reference.partition("@")
    ref_sched = ref_sched or "fcfs"
    refs = {
        (r["label"], r["storage"], r["seed"]): r["ttft_by_request_s"]
        for r in rows
        if r["policy"] == ref_spec and r.get("scheduling", "fcfs") == ref_sched
    }
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["label"], r["storage"], r["policy"], r.get("scheduling", "fcfs")), []).append(r)
    out = [
        f"| workload | storage | policy | engine scheduling | seeds | turns"
        f" | over {TAIL_FACTOR:g}x their TTFT under {reference} | over {TAIL_ABSOLUTE_S:g} s | max TTFT s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (label, storage, policy, scheduling), rs in groups.items():
        over_ref: list[float] = []
        for r in rs:
            ref = refs.get((label, storage, r["seed"]))
            if ref is not None:
                mine = r["ttft_by_request_s"]
                over_ref.append(
                    float(sum(1 for k, t in mine.items() if k in ref and t > TAIL_FACTOR * ref[k]))
                )
        over_abs = [float(sum(1 for t in r["ttft_by_request_s"].values() if t > TAIL_ABSOLUTE_S)) for r in rs]
        out.append(
            f"| {label} | {storage} | {policy} | {scheduling} | {len(rs)}"
            f" | {median_span([float(len(r['ttft_by_request_s'])) for r in rs], '.0f')}"
            f" | {median_span(over_ref, '.0f') if over_ref else '-'} | {median_span(over_abs, '.0f')}"
            f" | {median_span([r['ttft_max_s'] for r in rs], '.1f')} |"
        )
    return "\n".join(out)


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def plan(args: argparse.Namespace) -> list[Cell]:
    cells: list[Cell] = []
    seeds = [int(s) for s in _list(args.seeds)]
    runs = policy_runs(args.policies, args.scheduling)
    for storage in _list(args.storage):
        parse_storage(storage)
    if args.tail_reference:
        spec, _, sched = args.tail_reference.partition("@")
        if (spec, sched or "fcfs") not in runs:
            raise ValueError(
                f"--tail-reference {args.tail_reference!r} is not one of the runs; add it to --policies"
            )
    if args.read == "steady" and args.trace:
        raise ValueError("--read steady reads ladder conversations by number: not for --trace")
    if args.trace:
        path = Path(args.trace)
        fmt = args.trace_format or ("agentic" if path.is_dir() or path.suffix == ".json" else "mooncake")
        label = f"{path.stem} {args.engines}e{' hetero' if args.fleet == 'hetero' else ''}"
        for storage in _list(args.storage):
            for policy, scheduling in runs:
                for seed in seeds:
                    cells.append(
                        Cell(
                            label,
                            storage,
                            policy,
                            seed,
                            scheduling=scheduling,
                            trace=args.trace,
                            trace_format=fmt,
                            engines=args.engines,
                            hetero=args.fleet == "hetero",
                            limit=args.limit,
                            stagger_s=args.stagger_s,
                            pool_observations=args.pool_observations,
                            shared_storage_calibration=args.shared_storage_calibration,
                            storage_spread=args.storage_spread,
                            split_ttft=args.split_ttft,
                        )
                    )
        return cells
    for c in [int(x) for x in _list(args.concurrency)]:
        if args.read == "steady":
            steady_window(c, ladder_conversations(c, args.conversations))
        for storage in _list(args.storage):
            for policy, scheduling in runs:
                for seed in seeds:
                    cells.append(
                        Cell(
                            f"{args.fleet} {c}{' steady' if args.read == 'steady' else ''}",
                            storage,
                            policy,
                            seed,
                            scheduling=scheduling,
                            concurrency=c,
                            engines=args.engines,
                            hetero=args.fleet == "hetero",
                            block_size=args.block_size,
                            conversations=args.conversations,
                            pool_observations=args.pool_observations,
                            shared_storage_calibration=args.shared_storage_calibration,
                            storage_spread=args.storage_spread,
                            split_ttft=args.split_ttft,
                            read=args.read,
                        )
                    )
    return cells


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_quality", description=__doc__.split("\n")[0])
    p.add_argument("--fleet", choices=["b1", "hetero"], default="b1")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--concurrency", default="64,128,192", help="ladder conversations (comma-separated)")
    p.add_argument(
        "--conversations", type=float, default=2.0, help="ladder: conversations per run / concurrency"
    )
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument(
        "--storage", default="none,1/4,1/2,unbounded", help="pool sizes: none, unbounded, fractions"
    )
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument(
        "--policies",
        default="horizon_cost,tier_cost,kv_fixed_credit",
        help="policy specs; SPEC@SCHEDULING runs that one with that engine scheduling only",
    )
    p.add_argument("--trace", help="Mooncake JSONL or agentic-session directory instead of the ladder")
    p.add_argument("--trace-format", choices=["mooncake", "agentic"])
    p.add_argument("--limit", type=int)
    p.add_argument("--stagger-s", type=float, default=30.0)
    p.add_argument(
        "--scheduling",
        default="fcfs",
        help="the engines' vLLM --scheduling-policy, comma-separated: fcfs, priority (the router"
        " then sends each request's shortest_first_priority), priority:STRETCH (0 = arrival order,"
        " larger = more shortest-first), priority:STRETCH:MAX_OVERTAKE_S (the bound; inf = none),"
        " priority:STRETCH:MAX_OVERTAKE_S:FCFS_FACTOR (the relative bound K >= 1; inf = none),"
        " priority:STRETCH:MAX_OVERTAKE_S:FCFS_FACTOR:WAIT (the router's priced wait: all = every"
        " queued prefill token, ahead = only what the engine serves first, overtake = that / (1 - the"
        " recent rate of earlier-deadline work), running = overtake with the prefill the engine serves"
        " ahead; default all); any of them followed by +admission: the router also prices the admission"
        " wait (the time until the sequences it placed on the engine free room for the whole prompt);"
        " +admission:held, +admission:ahead or +admission:overtake count that KV as SimConfig.admission_form"
        " says; +admission:FORM:recompute[:X] prices it only for turns every engine holds less than the"
        f" fraction X (default {RECOMPUTE_BELOW}) of (recomputes anyway); a priority spec may"
        " carry +recompute-k:KR[:X] before that: a turn every engine holds less than X of (default"
        f" {PRIORITY_RECOMPUTE_BELOW}) gets a deadline of at most min(K, KR) x its first-come TTFT;"
        " any spec may end in +hold:W[:ORDER[:PICK[:recompute[:X]][:max:M][:aged]]] (late binding: the"
        " router holds turns while no engine's predicted queue wait is below W seconds, releases them in"
        " ORDER fcfs or priority and routes each among all engines or only those with room; :recompute holds"
        f" only turns every engine holds less than X of, default {PRIORITY_RECOMPUTE_BELOW}; :max:M"
        " routes a turn held M seconds then; :aged counts a held turn's deadline on a priority engine from"
        " its arrival, not its release); a priority spec may carry +escalate:E[:PICK[:ABORT]] (a turn with no"
        " first token E seconds after it arrived is cancelled and sent again at priority 0, to the same"
        " engine or, with PICK route, wherever the policy routes it then, with PICK other, wherever it"
        " routes it among the other engines; ABORT now, the default: the"
        " engine drops the first request at once, as vLLM 0.32 and kvroute's sim server do; first_token: at"
        " its first token, a sensitivity check); any spec may carry +readq (the router books the traffic"
        " it places on the shared pool, STORAGE reads and the computed blocks the engines write through,"
        " at the pool's aggregate bandwidth, and prices a STORAGE read's wait behind it; +readq:reads"
        " books the reads only)",
    )
    p.add_argument(
        "--tail-reference",
        help="SPEC@SCHEDULING of one of the runs: also print the tail table (turns over 10x their TTFT"
        " in that run, over 30 s, max)",
    )
    p.add_argument(
        "--pool-observations",
        type=float,
        default=0.0,
        help="the router's costs.priors.calibration.pool_observations: twins share calibration"
        " evidence (0 = off, the default)",
    )
    p.add_argument(
        "--shared-storage-calibration",
        action="store_true",
        help="the router's costs.priors.calibration.shared_storage: the engines' STORAGE load bandwidth is"
        " the shared pool's, measured from all of them (off: each engine's own counters, the default)",
    )
    p.add_argument(
        "--storage-spread",
        type=float,
        default=math.inf,
        help="the router's costs.priors.calibration.storage_spread: each engine's STORAGE load bandwidth"
        " is its own, kept within this factor of the shared pool's one figure (>= 1; 1 ="
        " --shared-storage-calibration; default inf: off)",
    )
    p.add_argument(
        "--split-ttft",
        action="store_true",
        help="also print where each run's TTFT went (queued prefill, admission wait for KV blocks or"
        " slots, service, preemption) against the predicted parts, for the turns around the p50 and"
        " above the p99",
    )
    p.add_argument(
        "--read",
        choices=READS,
        default="all",
        help="the turns the TTFT figures are read over: all (default), or steady: only the ladder's"
        " conversations started after the first wave and before the last (needs --conversations 3"
        " or more; no synchronized cold start, no drain; the label gets ' steady')",
    )
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", help="markdown file (a .jsonl of raw rows is written next to it)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cells = plan(args)
    except ValueError as exc:
        print(f"bench_quality: {exc}", file=sys.stderr)
        return 2
    wall0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    raw = Path(args.out).with_suffix(".jsonl") if args.out else None
    if args.jobs > 1:
        with worker_pool(args.jobs) as pool:
            for row in pool.imap(run_cell, cells, chunksize=1):
                rows.append(row)
                _progress(row, len(rows), len(cells), raw)
    else:
        for cell in cells:
            rows.append(run_cell(cell))
            _progress(rows[-1], len(rows), len(cells), raw)
    table = markdown(rows)
    if args.tail_reference:
        table += "\n\n" + tail_markdown(rows, args.tail_reference)
    if args.split_ttft:
        table += "\n\n" + split_markdown(rows)
    cmd = "python -m loadtest.bench_quality " + " ".join(sys.argv[1:] if argv is None else argv)
    footer = f"{len(cells)} runs, wall {time.perf_counter() - wall0:.0f} s"
    print(table + "\n\n" + footer)
    if args.out:
        Path(args.out).write_text(f"`{cmd}`\n\n{table}\n\n{footer}\n")
    return 0


def _progress(row: dict[str, Any], n: int, total: int, raw: Path | None) -> None:
    print(
        f"[{n}/{total}] {row['label']} {row['storage']} {row['policy']} {row['scheduling']}"
        f" seed {row['seed']}: p50"
        f" {row['ttft_p50_s']:.3f} p99 {row['ttft_p99_s']:.2f} hit {row['hit']:.3f}"
        f" bound {row['bound_hit']:.3f} wall {row['wall_s']:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    if raw is not None:
        with raw.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
