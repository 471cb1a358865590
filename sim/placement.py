"""The DES's placement trace (issue 27, round q12): every routing decision with what the router
predicted on each engine and what was true there, and a forced choice for counterfactual runs.

``PlacementTracer`` wraps the simulated router's policy (``SimConfig.trace_placement``; off by
default, and a run with it on routes exactly as without: the wrapper only reads). Per decision it
records, for every engine, tier_cost's predicted TTFT parts (``TierCostPolicy.predict``: the
cost model the DES's router calibrates; and, where the router gives its queued turns, the
placement's externality, ``policies.costs.externality_s``) beside the truth the simulator knows:
the prompt tokens each engine would serve from each tier if it admitted the turn now (``EngineCore
.cached_prefix_tokens``), its queued prefill, waiting and running requests and free GPU blocks; and
the choice a second ("shadow") policy makes on the very same state. ``SimConfig.force_engines``
sends chosen turns to a given engine instead (everything else as the policy decides), so that a
single decision's counterfactual is the same seeded run with one turn placed elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from policies.base import Decision, FleetView, Policy, RouteRequest, prompt_tokens_of
from policies.costs import placement_externality_s
from policies.tier_cost import TierCostPolicy
from sim.hashing import HashChain

if TYPE_CHECKING:
    from sim.des import FleetSimulator

#: Per-engine lists of a trace record, in the fleet's engine order.
ENGINE_FIELDS = (
    "pred_total_s",
    "pred_wait_s",
    "pred_slot_s",
    "pred_service_s",
    "pred_cost_s",
    "pred_extern_s",
    "pred_hit",
    "true_gpu",
    "true_cpu",
    "true_storage",
    "router_queued",
    "in_flight",
    "true_queued",
    "waiting",
    "running",
    "free_blocks",
)


class PlacementTracer:
    """Wraps ``inner`` (the simulated router's policy); records each decision in ``records``.

    ``shadow``: a second policy asked on the same request and fleet view (its choice is recorded,
    never used). ``force``: request id -> engine id to send that turn to instead of the policy's
    choice (the decision keeps the policy's parts and scores; its fallbacks are the other engines)."""

    def __init__(
        self,
        inner: Policy,
        sim: FleetSimulator,
        *,
        shadow: Policy | None = None,
        force: Mapping[str, str] | None = None,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.uses_index = inner.uses_index
        self.sim = sim
        self.shadow = shadow
        self.force = dict(force or {})
        self._pricer = TierCostPolicy()
        #: One dict per routed turn, in routing order (``ENGINE_FIELDS`` lists per engine, and
        #: rid, conv, turn, t_s, prompt, choice, engine, shadow, forced; the DES adds the priority).
        self.records: list[dict[str, Any]] = []

    def choose(self, request: RouteRequest, fleet: FleetView) -> Decision:
        decision = self.inner.choose(request, fleet)
        sim = self.sim
        now = sim._route_now
        shadow = self.shadow.choose(request, fleet).engine_id if self.shadow is not None else None
        forced = self.force.get(request.request_id)
        record: dict[str, Any] = {
            "rid": request.request_id,
            "conv": request.session_key,
            # "conversation#turn", "!N" after it on the turn's N-th escalated re-send
            "turn": int(request.request_id.rpartition("#")[2].partition("!")[0]),
            "t_s": now,
            "prompt": request.prompt_tokens,
            "choice": decision.engine_id,
            "shadow": shadow,
            "engine": forced or decision.engine_id,
            "forced": forced is not None and forced != decision.engine_id,
        }
        lists: dict[str, list[float]] = {name: [] for name in ENGINE_FIELDS}
        hashes = self._hashes(request)
        costs = fleet.costs if fleet.costs is not None else self._pricer._own_costs
        by_id = {v.engine_id: v for v in fleet.engines}
        for engine_id, core in zip(sim.engine_ids, sim.cores, strict=True):
            view = by_id.get(engine_id)
            if view is not None:
                parts = self._pricer.predict(request, view, costs)
                decode_s, pressure_s = self._pricer.secondary_s(view)
                cost_s = parts.total_s + self._pricer.work_weight * parts.service_s + decode_s + pressure_s
                extern_s = placement_externality_s(
                    parts, view, request, prompt_tokens_of(request), costs.estimates(engine_id)
                )
                priced = (parts.total_s, parts.wait_s, parts.slot_s, parts.service_s, cost_s, extern_s)
                router = (
                    float(sum(parts.hit_tokens)),
                    float(view.queued_prefill_tokens),
                    float(view.in_flight),
                )
            else:  # not a candidate (pre-filtered out)
                priced = (float("nan"),) * 6
                router = (float("nan"),) * 3
            true = core.cached_prefix_tokens(hashes, request.prompt_tokens)
            values = (
                *priced,
                router[0],
                *true,
                router[1],
                router[2],
                core.pending_prefill_tokens(),
                core.num_waiting(),
                core.num_running(),
                core.free_gpu_blocks(),
            )
            for name, value in zip(ENGINE_FIELDS, values, strict=True):
                lists[name].append(float(value))
        record.update(lists)
        self.records.append(record)
        if forced is None or forced == decision.engine_id:
            return decision
        others = tuple(e for e in (decision.engine_id, *decision.fallbacks) if e != forced)
        return Decision(
            forced,
            decision.policy,
            f"forced to {forced} (the policy chose {decision.engine_id})",
            None,
            others,
            decision.parts,
        )

    def _hashes(self, request: RouteRequest) -> list[int]:
        """The prompt's full-block hashes as the engines compute them (trace mode: one id a block)."""
        sim = self.sim
        chain = HashChain(sim.fleet.engines[0].profile.hash_algo, sim.hash_cache)
        block_ids = sim._trace_block_ids
        if block_ids is None:
            raise ValueError("trace_placement needs trace-mode block ids (not token mode)")
        for block_id in block_ids[: request.prompt_tokens // sim.fleet.block_size]:
            chain.append((block_id,))
        return chain.hashes

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:
        self.inner.on_routed(request, decision)

    def on_finished(self, request: RouteRequest, engine_id: str, ok: bool) -> None:
        self.inner.on_finished(request, engine_id, ok)
