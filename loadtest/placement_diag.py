"""Placement diagnosis (issue 27, round q12): two policies under the same engine ordering, decision
by decision, with the DES's true values (``sim.placement``).

    python -m loadtest.placement_diag --block-size 128 --conversations 1 --concurrency 128 \
        --storage none --seeds 100,101,102 --a tier_cost@priority:20:inf \
        --b kv_fixed_credit@priority:20:inf --counterfactuals 40 --jobs 2

For each seed it runs A with B as the shadow (B's choice on A's very state at each decision) and B
with A as the shadow, then prints: the turns by what placement did with their history (stayed on
the engine holding it, moved off it, or found it evicted) with their true TTFT parts; how A's
predicted TTFT on the chosen engine compares with the truth (cached prefix, waits, service); the
decisions where A and B disagree on the same state; and, for ``--counterfactuals`` N of them per
seed, the same seeded A run with that one turn sent to B's choice (its TTFT and its conversation's
later turns', measured).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcore.stats import percentiles
from loadtest.bench_quality import Cell, build, sim_config
from policies.costs import RECOMPUTE_BELOW
from sim.des import FleetSimulator
from sim.des_cli import parse_policy_spec, worker_pool

#: Turn classes by what placement did with the conversation's history (``turn_class``), in print order.
CLASSES = (
    "first turn",
    "stayed, history held",
    "stayed, history evicted",
    "moved off its history",
    "moved, history evicted",
)


def _cell(args: argparse.Namespace, entry: str, seed: int) -> Cell:
    spec, _, scheduling = entry.partition("@")
    return Cell(
        f"{args.fleet} {args.concurrency}",
        args.storage,
        spec,
        seed,
        concurrency=args.concurrency,
        engines=args.engines,
        hetero=args.fleet == "hetero",
        block_size=args.block_size,
        conversations=args.conversations,
        scheduling=scheduling or "fcfs",
        split_ttft=True,
    )


def traced_run(
    cell: Cell, shadow: str, force: dict[str, str] | None = None, stop_after: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One traced DES run of ``cell`` with ``shadow``'s choices recorded: its p50 / p99 / max TTFT,
    hit rate and placement records (``sim.des.SimResult.placement``)."""
    wl, fleet = build(cell)
    name, params = parse_policy_spec(cell.policy)
    shadow_name, shadow_params = parse_policy_spec(shadow.partition("@")[0])
    config = sim_config(
        cell,
        trace_placement=True,
        trace_shadow=shadow_name,
        trace_shadow_params=shadow_params,
        force_engines=force,
        stop_after=stop_after,
    )
    result = FleetSimulator(wl, name, fleet, config, policy_params=params).run()
    return {
        "policy": cell.policy,
        "scheduling": cell.scheduling,
        "label": f"{cell.policy}@{cell.scheduling}",
        "seed": cell.seed,
        "p50": result.ttft_p50_s,
        "p99": result.ttft_p99_s,
        "max": max(result.ttfts_s, default=math.nan),
        "hit": result.hit,
        "turns_per_s": result.turns_per_s,
        "records": result.placement,
    }


def _engine_index(record: dict[str, Any], engine_id: str) -> int:
    return int(engine_id.lstrip("e"))


def annotate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each record with ``prev`` (the engine of its conversation's previous turn, None for a first
    turn), ``held`` (that engine held at least RECOMPUTE_BELOW of the prompt in GPU or CPU when the
    turn was routed, true values), ``moved``, ``recompute`` (served less than RECOMPUTE_BELOW of its
    prompt from any tier) and its class (``CLASSES``)."""
    last: dict[str, str] = {}
    for r in sorted(records, key=lambda r: (r["conv"], r["turn"])):
        prev = last.get(r["conv"]) if r["turn"] > 0 else None
        last[r["conv"]] = r["engine"]
        r["prev"] = prev
        prompt = max(1, r["prompt"])
        r["recompute"] = sum(r["cached"]) / prompt < RECOMPUTE_BELOW
        if prev is None:
            r["held"] = False
            r["moved"] = False
            r["class"] = CLASSES[0]
            continue
        p = _engine_index(r, prev)
        r["held"] = (r["true_gpu"][p] + r["true_cpu"][p]) / prompt >= RECOMPUTE_BELOW
        r["moved"] = r["engine"] != prev
        r["class"] = CLASSES[1 + 2 * r["moved"] + (not r["held"])]
    return records


def _wait(r: dict[str, Any]) -> float:
    return r["split_queue_s"] + r["split_admission_kv_s"] + r["split_admission_seqs_s"]


def _service(r: dict[str, Any]) -> float:
    return r["split_service_s"] + r["split_preemption_s"]


def _true_cached(r: dict[str, Any], i: int) -> float:
    """Tokens of the turn's prompt engine ``i`` held in any tier when it was routed (true)."""
    return float(r["true_gpu"][i] + r["true_cpu"][i] + r["true_storage"][i])


def _pred_wait(r: dict[str, Any], i: int) -> float:
    """The predicted wait on engine ``i``: queued prefill and slot (or admission) wait."""
    return float(r["pred_wait_s"][i] + r["pred_slot_s"][i])


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def class_table(runs: Sequence[dict[str, Any]]) -> str:
    """Per policy and turn class, pooled over its runs (seeds): turns, realized recomputes, TTFT,
    measured wait and service, turns above the run's own p50 and above the other policy's median p50."""
    out = [
        "| policy | turns | n | share | recomputes | mean TTFT s | p50 TTFT s"
        " | mean wait s (queue + KV + seqs) | mean service s | above own p50 | over 30 s"
        " | predicted TTFT s (chosen engine) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy in dict.fromkeys(r["label"] for r in runs):
        mine = [run for run in runs if run["label"] == policy]
        total = sum(len(run["records"]) for run in mine)
        for name in CLASSES:
            rows = []
            above = 0
            for run in mine:
                members = [r for r in run["records"] if r["class"] == name and not math.isnan(r["ttft_s"])]
                above += sum(1 for r in members if r["ttft_s"] > run["p50"])
                rows += members
            if not rows:
                continue
            ttfts = [r["ttft_s"] for r in rows]
            (p50,) = percentiles(ttfts, (50,))
            chosen = [r["pred_total_s"][_engine_index(r, r["engine"])] for r in rows]
            out.append(
                f"| {policy} | {name} | {len(rows)} | {len(rows) / total:.3f}"
                f" | {sum(r['recompute'] for r in rows)} | {_mean(ttfts):.2f} | {p50:.2f}"
                f" | {_mean([_wait(r) for r in rows]):.2f} | {_mean([_service(r) for r in rows]):.2f}"
                f" | {above} | {sum(1 for t in ttfts if t > 30.0)} | {_mean(chosen):.2f} |"
            )
    return "\n".join(out)


def prediction_table(runs: Sequence[dict[str, Any]]) -> str:
    """Per policy and realized class (cached / recompute): tier_cost's predicted parts on the chosen
    engine against the truth: hit tokens (router's index, true at routing, served at admission),
    wait (predicted wait + slot against queue + KV + seqs) and service."""
    out = [
        "| policy | turns | n | pred. hit tokens | true hit at routing | served from cache | pred. wait s"
        " | measured wait s | pred. service s | measured service s | TTFT / predicted (sums) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy in dict.fromkeys(r["label"] for r in runs):
        rows = [
            r for run in runs if run["label"] == policy for r in run["records"] if not math.isnan(r["ttft_s"])
        ]
        for label, members in (
            ("cached", [r for r in rows if not r["recompute"]]),
            ("recompute", [r for r in rows if r["recompute"]]),
        ):
            if not members:
                continue
            idx = [_engine_index(r, r["engine"]) for r in members]
            pred_total = sum(r["pred_total_s"][i] for r, i in zip(members, idx, strict=True))
            out.append(
                f"| {policy} | {label} | {len(members)}"
                f" | {_mean([r['pred_hit'][i] for r, i in zip(members, idx, strict=True)]):.0f}"
                f" | {_mean([_true_cached(r, i) for r, i in zip(members, idx, strict=True)]):.0f}"
                f" | {_mean([sum(r['cached']) for r in members]):.0f}"
                f" | {_mean([_pred_wait(r, i) for r, i in zip(members, idx, strict=True)]):.2f}"
                f" | {_mean([_wait(r) for r in members]):.2f}"
                f" | {_mean([r['pred_service_s'][i] for r, i in zip(members, idx, strict=True)]):.2f}"
                f" | {_mean([_service(r) for r in members]):.2f}"
                f" | {sum(r['ttft_s'] for r in members) / pred_total:.2f} |"
            )
    return "\n".join(out)


#: Kinds of disagreement between a policy's choice and the shadow's on the same state.
KINDS = (
    "first turn",
    "A stays on held history, B moves",
    "A moves off held history, B stays",
    "both move off held history",
    "history evicted (nothing held)",
)


def disagreement_kind(r: dict[str, Any]) -> str:
    """``KINDS`` entry of a record where the choice and the shadow differ (annotated first)."""
    if r["prev"] is None:
        return KINDS[0]
    if not r["held"]:
        return KINDS[4]
    if r["choice"] == r["prev"]:
        return KINDS[1]
    if r["shadow"] == r["prev"]:
        return KINDS[2]
    return KINDS[3]


def disagreement_table(runs: Sequence[dict[str, Any]]) -> str:
    """Per policy: how often it and its shadow choose differently on the same state, by kind; with
    the true facts of the two engines (cached prefix, pending prefill) and the policy's own predicted
    advantage (tier_cost's predicted TTFT on the shadow's choice less on its own)."""
    out = [
        "| policy (A) | shadow (B) | kind | decisions | share of all | true cached on A's / B's choice"
        " | true pending prefill on A's / B's | free KV blocks on A's / B's | pred. TTFT on A's / B's s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for policy in dict.fromkeys(r["label"] for r in runs):
        rows = [r for run in runs if run["label"] == policy for r in run["records"]]
        shadow = next(run["shadow"] for run in runs if run["label"] == policy)
        differ = [r for r in rows if r["choice"] != r["shadow"]]
        out.append(
            f"| {policy} | {shadow} | all | {len(differ)} | {len(differ) / max(1, len(rows)):.3f} | | | | |"
        )
        for kind in KINDS:
            members = [r for r in differ if disagreement_kind(r) == kind]
            if not members:
                continue
            a = [_engine_index(r, r["choice"]) for r in members]
            b = [_engine_index(r, r["shadow"]) for r in members]

            def both(
                field: str, members: list[dict[str, Any]] = members, a: list[int] = a, b: list[int] = b
            ) -> str:
                if field == "cached":
                    fa = [_true_cached(r, i) for r, i in zip(members, a, strict=True)]
                    fb = [_true_cached(r, i) for r, i in zip(members, b, strict=True)]
                    return f"{_mean(fa):.0f} / {_mean(fb):.0f}"
                fa = [r[field][i] for r, i in zip(members, a, strict=True)]
                fb = [r[field][i] for r, i in zip(members, b, strict=True)]
                digits = 2 if field == "pred_total_s" else 0
                return f"{_mean(fa):.{digits}f} / {_mean(fb):.{digits}f}"

            out.append(
                f"| {policy} | {shadow} | {kind} | {len(members)} | {len(members) / max(1, len(rows)):.3f}"
                f" | {both('cached')} | {both('true_queued')} | {both('free_blocks')}"
                f" | {both('pred_total_s')} |"
            )
    return "\n".join(out)


def counterfactual_jobs(run: dict[str, Any], n: int) -> list[tuple[str, str, tuple[str, ...], str]]:
    """Up to ``n`` decisions of each kind (``KINDS``) of ``run`` where the policy and its shadow
    differ (evenly spaced over the run): (request id, the shadow's engine, the conversation's request
    ids from that turn on, the kind)."""
    differ = [r for r in run["records"] if r["choice"] != r["shadow"]]
    picked = []
    for kind in KINDS:
        members = [r for r in differ if disagreement_kind(r) == kind]
        if members and n > 0:
            picked += members[:: max(1, len(members) // n)][:n]
    by_conv: dict[str, list[dict[str, Any]]] = {}
    for r in run["records"]:
        by_conv.setdefault(r["conv"], []).append(r)
    jobs = []
    for r in picked:
        later = tuple(
            x["rid"] for x in sorted(by_conv[r["conv"]], key=lambda x: x["turn"]) if x["turn"] >= r["turn"]
        )
        jobs.append((r["rid"], r["shadow"], later, disagreement_kind(r)))
    return jobs


def _counterfactual(job: tuple[Cell, str, str, str, tuple[str, ...]]) -> dict[str, Any]:
    cell, shadow, rid, engine, later = job
    run = traced_run(cell, shadow, force={rid: engine}, stop_after=later)
    ttft = {r["rid"]: r["ttft_s"] for r in run["records"]}
    return {
        "policy": cell.policy,
        "seed": cell.seed,
        "rid": rid,
        "engine": engine,
        "ttft": {k: ttft.get(k, math.nan) for k in later},
    }


def counterfactual_table(results: Sequence[dict[str, Any]]) -> str:
    """Per kind: the measured effect of sending one turn to the shadow's engine instead of A's choice
    (same seed, everything before it identical): the turn's TTFT under A's choice and B's, A's
    predicted TTFT on both, how often A's choice was truly faster, and the conversation's later
    turns' TTFT sum (which diverge after the turn: noisy, their mean only)."""
    out = [
        "| kind | n | TTFT with A's choice s (mean, median) | with B's choice s (mean, median)"
        " | A truly faster | A's prediction on A's / B's s | A predicted faster and was"
        " | later turns' TTFT sum, A's / B's s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    kinds = list(dict.fromkeys(r["kind"] for r in results))
    for kind in [*KINDS, "all"]:
        members = [r for r in results if r["kind"] == kind] if kind != "all" else list(results)
        if not members or (kind == "all" and len(kinds) < 2):
            continue
        ta = [r["a_ttft"] for r in members]
        tb = [r["b_ttft"] for r in members]
        faster = sum(1 for x, y in zip(ta, tb, strict=True) if x < y)
        pred_right = sum(1 for r in members if (r["pred_a"] < r["pred_b"]) == (r["a_ttft"] < r["b_ttft"]))
        out.append(
            f"| {kind} | {len(members)} | {_mean(ta):.2f}, {statistics.median(ta):.2f}"
            f" | {_mean(tb):.2f}, {statistics.median(tb):.2f} | {faster} of {len(members)}"
            f" | {_mean([r['pred_a'] for r in members]):.2f} / {_mean([r['pred_b'] for r in members]):.2f}"
            f" | {pred_right} of {len(members)}"
            f" | {_mean([r['a_later'] for r in members]):.1f}"
            f" / {_mean([r['b_later'] for r in members]):.1f} |"
        )
    return "\n".join(out)


def divergence(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> str:
    """Where two runs of one seed first place a turn differently: "decision n (t s)" in routing
    order; until then they route the same turns at the same times to the same engines."""
    for n, (x, y) in enumerate(zip(a, b, strict=False)):
        if (x["rid"], x["engine"]) != (y["rid"], y["engine"]):
            return f"decision {n} ({min(x['t_s'], y['t_s']):.1f} s)"
    return "none"


def conversation_table(runs: Sequence[dict[str, Any]]) -> str:
    """The two policies' runs of each seed paired per conversation (the same conversations, prompts
    and think times; arrival times diverge with the TTFTs): per conversation, moves, recomputes and
    TTFT sum; how many conversations each policy serves faster."""
    out = [
        "| seed | A | B | first different placement | conversations | moves A / B (mean)"
        " | recomputes A / B (mean) | TTFT sum A / B s (mean) | conversations faster under A |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    seeds = sorted({run["seed"] for run in runs})
    policies = list(dict.fromkeys(run["label"] for run in runs))
    if len(policies) != 2:
        return ""
    for seed in seeds:
        pair = [next(r for r in runs if r["seed"] == seed and r["label"] == p) for p in policies]
        stats = []
        for run in pair:
            per: dict[str, list[float]] = {}
            for r in run["records"]:
                s = per.setdefault(r["conv"], [0.0, 0.0, 0.0])
                s[0] += r["moved"]
                s[1] += r["recompute"]
                s[2] += 0.0 if math.isnan(r["ttft_s"]) else r["ttft_s"]
            stats.append(per)
        first = divergence(pair[0]["records"], pair[1]["records"])
        convs = sorted(set(stats[0]) & set(stats[1]))
        faster = sum(1 for c in convs if stats[0][c][2] < stats[1][c][2])
        cols = [" / ".join(f"{_mean([st[c][k] for c in convs]):.2f}" for st in stats) for k in range(3)]
        out.append(
            f"| {seed} | {policies[0]} | {policies[1]} | {first} | {len(convs)} | {cols[0]} | {cols[1]}"
            f" | {cols[2]} | {faster} |"
        )
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.placement_diag", description=__doc__.split("\n")[0])
    p.add_argument("--fleet", choices=["b1", "hetero"], default="b1")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--conversations", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--storage", default="none")
    p.add_argument("--seeds", default="100,101,102")
    p.add_argument("--a", required=True, help="SPEC@SCHEDULING of the policy diagnosed")
    p.add_argument("--b", required=True, help="SPEC@SCHEDULING of the policy it is compared with")
    p.add_argument("--counterfactuals", type=int, default=0, help="forced single-decision runs per seed")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--save", help="JSON file for the traced runs and the counterfactuals' results")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wall0 = time.perf_counter()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    jobs = [
        (_cell(args, entry, seed), other)
        for seed in seeds
        for entry, other in ((args.a, args.b), (args.b, args.a))
    ]
    pool = worker_pool(args.jobs) if args.jobs > 1 else None
    try:
        starmap = pool.starmap if pool is not None else lambda f, xs: [f(*x) for x in xs]
        runs = starmap(traced_run, jobs)
        for run, (_, other) in zip(runs, jobs, strict=True):
            run["shadow"] = other.partition("@")[0]
            annotate(run["records"])
            print(
                f"{run['policy']}@{run['scheduling']} seed {run['seed']}: p50 {run['p50']:.3f} p99"
                f" {run['p99']:.2f} max {run['max']:.1f} hit {run['hit']:.3f}",
                file=sys.stderr,
                flush=True,
            )
        cf_jobs = []
        kinds: dict[tuple[str, int, str], tuple[str, dict[str, Any]]] = {}
        for run, (cell, other) in zip(runs, jobs, strict=True):
            for rid, engine, later, kind in counterfactual_jobs(run, args.counterfactuals):
                cf_jobs.append((cell, other, rid, engine, later))
                kinds[(cell.policy, cell.seed, rid)] = (kind, run)
        results: dict[str, list[dict[str, Any]]] = {}
        mapper = pool.imap if pool is not None else map
        for cf in mapper(_counterfactual, cf_jobs):
            kind, base = kinds[(cf["policy"], cf["seed"], cf["rid"])]
            record = next(r for r in base["records"] if r["rid"] == cf["rid"])
            ttft_base = {r["rid"]: r["ttft_s"] for r in base["records"]}
            following = list(cf["ttft"])[1:]
            results.setdefault(base["label"], []).append(
                {
                    "kind": kind,
                    "a_ttft": ttft_base[cf["rid"]],
                    "b_ttft": cf["ttft"][cf["rid"]],
                    "pred_a": record["pred_total_s"][_engine_index(record, record["choice"])],
                    "pred_b": record["pred_total_s"][_engine_index(record, record["shadow"])],
                    "a_later": sum(ttft_base[k] for k in following),
                    "b_later": sum(cf["ttft"][k] for k in following),
                }
            )
    finally:
        if pool is not None:
            pool.terminate()
    if args.save:
        Path(args.save).write_text(json.dumps({"runs": runs, "counterfactuals": results}))
    print(
        "\n".join(
            f"- {run['policy']}@{run['scheduling']} seed {run['seed']}: p50 {run['p50']:.3f}"
            f" p99 {run['p99']:.2f} max {run['max']:.1f} hit {run['hit']:.3f}"
            f" turns/s {run['turns_per_s']:.2f}"
            for run in runs
        )
    )
    print("\n" + class_table(runs))
    print("\n" + prediction_table(runs))
    print("\n" + disagreement_table(runs))
    print("\n" + conversation_table(runs))
    for policy, rows in results.items():
        shadow = next(run["shadow"] for run in runs if run["label"] == policy)
        print(f"\nCounterfactuals: A = {policy}'s run, one turn sent to B = {shadow}'s choice instead\n")
        print(counterfactual_table(rows))
    done = sum(len(rows) for rows in results.values())
    print(f"\n{len(runs)} traced runs, {done} counterfactuals, wall {time.perf_counter() - wall0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
