"""Issue 27's corner, point by point: bench_quality's raw rows (.jsonl) -> per cell, every
``POLICY@priority:S:H`` candidate's ratios to the cell's REF (the best kv_fixed_credit on fcfs
engines) and to kv_fixed_credit with the same order, on the seeds' medians and per seed.

    python -m loadtest.frontier RAW.jsonl [RAW.jsonl ...] --md frontier.md --csv runs.csv --png frontier.png
    python -m loadtest.frontier RAW.jsonl ... --near   # the points within NEAR of the corner, per seed

The corner (issue 27): p50 gain over REF >= TARGET_REF, p50 gain over kv_fixed_credit with the same
order >= TARGET_SAME, p99 and max TTFT no worse than REF's. REF is chosen as tune27's T0: of the
kv_fixed_credit settings run on fcfs engines, the lowest median p50 (within 1%: the lower median p99).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import random
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcore.stats import median_span, percentiles
from loadtest.bench_quality import parse_scheduling

#: issue 27's targets: p50 gains (REF's p50 / the point's), and the tail ratios' ceiling.
TARGET_REF = 1.2
TARGET_SAME = 1.1
TAIL_CEILING = 1.0
#: "within 10% of the corner": each gain >= target x (1 - NEAR), each tail ratio <= 1 + NEAR.
NEAR = 0.1
#: the baseline every candidate is compared with at its own order, and REF's family.
BASELINE = "kv_fixed_credit"
#: REF ties: median p50s within this fraction are broken by the lower median p99.
TIE = 0.01
#: a verdict on fewer seeds than this is marked with its seed count.
SEEDS = 3
#: per-run figures written to the CSV (besides the keys).
FIGURES = ("ttft_p50_s", "ttft_p99_s", "ttft_max_s", "turns_per_s", "hit", "preemptions")

Key = tuple[str, str]  # (policy spec, scheduling)
Cell = tuple[str, str]  # (label, storage)


@dataclass(frozen=True)
class Ratios:
    """A point's four ratios: p50 gains (> 1 = the point faster) and tail ratios (> 1 = worse)."""

    g_ref: float
    g_same: float
    r99: float
    rmax: float

    @property
    def miss(self) -> float:
        """The largest factor by which one part misses the corner (<= 1: the corner is met)."""
        return max(
            TARGET_REF / self.g_ref,
            TARGET_SAME / self.g_same,
            self.r99 / TAIL_CEILING,
            self.rmax / TAIL_CEILING,
        )

    def meets(self, slack: float = 0.0) -> bool:
        return (
            self.g_ref >= TARGET_REF * (1 - slack)
            and self.g_same >= TARGET_SAME * (1 - slack)
            and self.r99 <= TAIL_CEILING + slack
            and self.rmax <= TAIL_CEILING + slack
        )


@dataclass(frozen=True)
class Point:
    cell: Cell
    policy: str
    scheduling: str
    stretch: float
    bound_s: float
    seeds: tuple[int, ...]
    medians: tuple[float, float, float]  # p50, p99, max
    on_medians: Ratios
    per_seed: dict[int, Ratios]

    @property
    def worst(self) -> Ratios:
        """Per ratio, its worst seed's value."""
        rs = list(self.per_seed.values())
        return Ratios(
            min(r.g_ref for r in rs),
            min(r.g_same for r in rs),
            max(r.r99 for r in rs),
            max(r.rmax for r in rs),
        )

    @property
    def every_seed(self) -> bool:
        return all(r.meets() for r in self.per_seed.values())


def _run_key(r: dict[str, Any]) -> tuple[str, str, str, str, int]:
    """A raw row's (label, storage, policy, scheduling, seed); rows from before engine scheduling
    was recorded ran on fcfs engines."""
    return (r["label"], r["storage"], r["policy"], r.get("scheduling", "fcfs"), r["seed"])


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Raw rows, each (cell, policy, scheduling, seed) once (the last file's wins)."""
    rows: dict[tuple[str, str, str, str, int], dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows[_run_key(r)] = r
    return list(rows.values())


def _figures(r: dict[str, Any]) -> tuple[float, float, float]:
    return r["ttft_p50_s"], r["ttft_p99_s"], r["ttft_max_s"]


def _medians(by_seed: dict[int, tuple[float, float, float]]) -> tuple[float, float, float]:
    columns = list(zip(*by_seed.values(), strict=True))
    return (statistics.median(columns[0]), statistics.median(columns[1]), statistics.median(columns[2]))


def _ratios(
    point: tuple[float, float, float], ref: tuple[float, float, float], same: tuple[float, float, float]
) -> Ratios:
    return Ratios(ref[0] / point[0], same[0] / point[0], point[1] / ref[1], point[2] / ref[2])


def grouped(rows: Sequence[dict[str, Any]]) -> dict[Cell, dict[Key, dict[int, tuple[float, float, float]]]]:
    out: dict[Cell, dict[Key, dict[int, tuple[float, float, float]]]] = {}
    for r in rows:
        label, storage, policy, scheduling, seed = _run_key(r)
        out.setdefault((label, storage), {}).setdefault((policy, scheduling), {})[seed] = _figures(r)
    return out


def first_come(
    configs: dict[Key, dict[int, tuple[float, float, float]]],
) -> dict[Key, dict[int, tuple[float, float, float]]]:
    """REF's candidates: the kv_fixed_credit settings run on fcfs engines."""
    return {k: v for k, v in configs.items() if k[1] == "fcfs" and k[0].split(":")[0] == BASELINE}


def reference(configs: dict[Key, dict[int, tuple[float, float, float]]]) -> Key:
    """tune27's T0: the kv_fixed_credit setting on fcfs engines with the lowest median p50 (ties
    within TIE: the lower median p99); only settings run on the most seeds compete."""
    fcfs = first_come(configs)
    if not fcfs:
        raise ValueError("no kv_fixed_credit run on fcfs engines: no REF")
    most = max(len(v) for v in fcfs.values())
    meds = {k: _medians(v) for k, v in fcfs.items() if len(v) == most}
    best_p50 = min(m[0] for m in meds.values())
    tied = [k for k, m in meds.items() if m[0] <= best_p50 * (1 + TIE)]
    return min(tied, key=lambda k: (meds[k][1], meds[k][0]))


def points(rows: Sequence[dict[str, Any]]) -> tuple[dict[Cell, Key], list[Point]]:
    """Per cell its REF, and every priority:S:H point (kv_fixed_credit's too: its g_same is 1)
    that has REF and kv_fixed_credit at the same order on a common seed."""
    refs: dict[Cell, Key] = {}
    out: list[Point] = []
    for cell, configs in grouped(rows).items():
        ref_key = reference(configs)
        refs[cell] = ref_key
        ref = configs[ref_key]
        for (policy, scheduling), by_seed in configs.items():
            if not scheduling.startswith("priority"):
                continue
            same = configs.get((BASELINE, scheduling), {})
            seeds = tuple(sorted(s for s in by_seed if s in ref and s in same))
            if not seeds:
                continue
            _, stretch, bound_s, _, _ = parse_scheduling(scheduling)
            pick = {s: by_seed[s] for s in seeds}
            med = _medians(pick)
            out.append(
                Point(
                    cell,
                    policy,
                    scheduling,
                    stretch,
                    bound_s,
                    seeds,
                    med,
                    _ratios(med, _medians({s: ref[s] for s in seeds}), _medians({s: same[s] for s in seeds})),
                    {s: _ratios(by_seed[s], ref[s], same[s]) for s in seeds},
                )
            )
    out.sort(key=lambda p: (p.cell, p.policy, p.stretch, p.bound_s, p.scheduling))
    return refs, out


def near(pts: Sequence[Point], seed: int, slack: float = NEAR) -> list[Point]:
    """Candidates (not kv_fixed_credit) within ``slack`` of the corner on ``seed``."""
    return [p for p in pts if p.policy != BASELINE and seed in p.per_seed and p.per_seed[seed].meets(slack)]


def _fmt_h(h: float) -> str:
    return "inf" if math.isinf(h) else f"{h:g}"


#: A scheduling spec's order with its S and H ("priority:20:inf"), up to a ':' or '+' after them.
_ORDER_S_H = re.compile(r"[^:+]*(?::[^:+]*){0,2}")


def _beyond_bound(scheduling: str) -> str:
    """What a scheduling spec sets past its S:H (the relative bound K, the priced wait, ...), shown
    after H so that points differing only there are told apart: "" when nothing."""
    rest = scheduling[_ORDER_S_H.match(scheduling).end() :]  # type: ignore[union-attr]
    return f" (+ {rest})" if rest else ""


def markdown(rows: Sequence[dict[str, Any]], refs: dict[Cell, Key], pts: Sequence[Point]) -> str:
    cfg = grouped(rows)
    out: list[str] = []
    for cell, ref_key in refs.items():
        ref_med = _medians(cfg[cell][ref_key])
        out += [
            "",
            f"### {cell[0]}, storage {cell[1]}: REF = {ref_key[0]}@{ref_key[1]}, medians p50 {ref_med[0]:.3f}"
            f" / p99 {ref_med[1]:.2f} / max {ref_med[2]:.1f} s (seeds {len(cfg[cell][ref_key])})",
            "",
            "| policy | S | H s | seeds | p50 / p99 / max s (medians) | p50 gain vs REF"
            " | vs KFC same S:H | p99 / REF | max / REF | worst seed: gain REF, gain same, p99, max"
            " | corner: medians | every seed | miss factor (medians) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in pts:
            if p.cell != cell:
                continue
            m, w = p.on_medians, p.worst
            cand = p.policy != BASELINE
            few = "" if len(p.seeds) >= SEEDS else f" ({len(p.seeds)} seed{'s' if len(p.seeds) > 1 else ''})"
            out.append(
                f"| {p.policy} | {p.stretch:g} | {_fmt_h(p.bound_s)}{_beyond_bound(p.scheduling)}"
                f" | {len(p.seeds)}"
                f" | {p.medians[0]:.3f} / {p.medians[1]:.2f} / {p.medians[2]:.1f}"
                f" | {m.g_ref:.2f}x | {m.g_same:.2f}x | {m.r99:.2f} | {m.rmax:.2f}"
                f" | {w.g_ref:.2f}x, {w.g_same:.2f}x, {w.r99:.2f}, {w.rmax:.2f}"
                f" | {('**yes**' if m.meets() else 'no') + few if cand else '-'}"
                f" | {('**yes**' if p.every_seed else 'no') + few if cand else '-'}"
                f" | {f'{m.miss:.3f}' if cand else '-'} |"
            )
    return "\n".join(out).lstrip("\n") + "\n"


def monotonic(values: Sequence[float]) -> str:
    """ "up", "down", "flat" (all equal) or "no" for a sequence read in order."""
    steps = [b - a for a, b in itertools.pairwise(values)]
    if all(s == 0 for s in steps):
        return "flat"
    if all(s >= 0 for s in steps):
        return "up"
    if all(s <= 0 for s in steps):
        return "down"
    return "no"


def shape(pts: Sequence[Point]) -> str:
    """Per cell, policy and bound H: the medians of p50, p99 and max along the stretch S (ascending),
    and whether each moves one way; then the same along H at each S."""
    out = [
        "| cell | policy | along | at | p50 s | p99 s | max s | p50 / p99 / max monotonic |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[Cell, str, str, float], list[Point]] = {}
    for p in pts:
        groups.setdefault((p.cell, p.policy, "S", p.bound_s), []).append(p)
        groups.setdefault((p.cell, p.policy, "H", p.stretch), []).append(p)
    for (cell, policy, along, at), ps in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3])
    ):
        ps.sort(key=lambda p: p.stretch if along == "S" else p.bound_s)
        axis = ", ".join(f"{p.stretch:g}" if along == "S" else _fmt_h(p.bound_s) for p in ps)
        cols = [[p.medians[i] for p in ps] for i in range(3)]
        seeds = min(len(p.seeds) for p in ps)
        out.append(
            f"| {cell[0]} {cell[1]} | {policy} | {along} = {axis}"
            f" | {'H' if along == 'S' else 'S'} = {_fmt_h(at)} ({seeds} seeds)"
            + "".join(" | " + " / ".join(format(v, ".3g") for v in c) for c in cols)
            + " | "
            + ", ".join(monotonic(c) for c in cols)
            + " |"
        )
    return "\n".join(out) + "\n"


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("label", "storage", "policy", "scheduling", "seed", *FIGURES))
        for r in sorted(rows, key=_run_key):
            w.writerow((*_run_key(r), *(r.get(k, "") for k in FIGURES)))


def plot(pts: Sequence[Point], refs: dict[Cell, Key], path: Path) -> None:
    """Per cell, on the medians: p50 gain over REF (x) against the worse of p99 / REF and max / REF
    (y); filled when the p50 gain over kv_fixed_credit at the same order reaches TARGET_SAME. A
    candidate meets the corner when it is filled, right of x = TARGET_REF and below y = 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(refs)
    cols = min(2, len(cells))
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 4.4 * rows), squeeze=False)
    colours = {"tier_cost": "tab:blue", "horizon_cost": "tab:green", BASELINE: "tab:grey"}
    for ax, cell in zip(axes.flat, cells, strict=False):
        for p in pts:
            if p.cell != cell:
                continue
            c = colours.get(p.policy, "tab:red")
            m = p.on_medians
            y = max(m.r99, m.rmax)
            filled = p.policy != BASELINE and m.g_same >= TARGET_SAME
            ax.scatter(m.g_ref, y, s=22, edgecolors=c, facecolors=c if filled else "none")
            ax.annotate(f"{p.stretch:g}:{_fmt_h(p.bound_s)}", (m.g_ref, y), fontsize=6, color=c)
        ax.axvline(TARGET_REF, color="k", lw=0.6, ls="--")
        ax.axhline(TAIL_CEILING, color="k", lw=0.6, ls="--")
        ax.set_title(f"{cell[0]}, storage {cell[1]} (REF {refs[cell][0]}@{refs[cell][1]})", fontsize=9)
        ax.set_xlabel("p50 gain over REF (medians)")
        ax.set_ylabel("worse of p99 / REF, max / REF")
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=k) for k, c in colours.items()]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8)
    fig.suptitle(
        f"filled: p50 gain over kv_fixed_credit at the same S:H >= {TARGET_SAME:g}", y=0.005, fontsize=8
    )
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def spread(rows: Sequence[dict[str, Any]], refs: dict[Cell, Key], k: int, draws: int = 4000) -> str:
    """How much the corner's ratios move from seed to seed: per priority configuration with
    kv_fixed_credit at its order (and per other first-come setting, REF's null comparison), its
    per-seed ratios (``_ratios``: median [min-max]) and what a report on ``k`` seeds would read for
    the max TTFT - the ratios of the medians over ``k`` seeds drawn without replacement (``draws``
    draws, a fixed generator: the same rows print the same table) - as its 10th/50th/90th
    percentiles and the share of draws at or under REF's."""
    cfg = grouped(rows)
    rng = random.Random(0)
    out: list[str] = []
    for cell, ref_key in refs.items():
        configs = cfg[cell]
        ref = configs[ref_key]
        out += [
            "",
            f"### {cell[0]}, storage {cell[1]}: REF = {ref_key[0]}@{ref_key[1]}; per-seed ratios"
            f" and {k}-seed reports of the max TTFT ({draws} draws)",
            "",
            "| configuration | seeds | p50 gain vs REF, per seed | vs KFC same order, per seed"
            " | p99 / REF, per seed | max / REF, per seed"
            f" | {k}-seed max / REF: p10 / p50 / p90 | {k}-seed draws with max <= REF's |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for key, by_seed in configs.items():
            first_come = key[1] == "fcfs"
            # a first-come setting has no same-order baseline: its own figures stand in (g_same 1)
            same = by_seed if first_come else configs.get((BASELINE, key[1]), {})
            seeds = sorted(s for s in by_seed if s in ref and s in same)
            if key == ref_key or len(seeds) < k:
                continue  # REF itself; too few seeds (none: a priority run without its baseline)
            per_seed = [_ratios(by_seed[s], ref[s], same[s]) for s in seeds]
            reports = [
                _ratios(
                    _medians({s: by_seed[s] for s in pick}),
                    _medians({s: ref[s] for s in pick}),
                    _medians({s: same[s] for s in pick}),
                ).rmax
                for pick in (rng.sample(seeds, k) for _ in range(draws))
            ]
            q = percentiles(reports, (10, 50, 90))
            g_same = "-" if first_come else median_span([r.g_same for r in per_seed], ".2f")
            out.append(
                f"| {key[0]}@{key[1]} | {len(seeds)} | {median_span([r.g_ref for r in per_seed], '.2f')}"
                f" | {g_same} | {median_span([r.r99 for r in per_seed], '.2f')}"
                f" | {median_span([r.rmax for r in per_seed], '.2f')}"
                f" | {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f}"
                f" | {sum(r <= TAIL_CEILING for r in reports) / draws:.0%} |"
            )
    return "\n".join(out).lstrip("\n") + "\n"


def _judged(
    pick: Sequence[int],
    fcfs: dict[Key, dict[int, tuple[float, float, float]]],
    point: dict[int, tuple[float, float, float]],
    same: dict[int, tuple[float, float, float]],
) -> Ratios:
    """A report on the seeds ``pick``: REF chosen by ``reference`` among the first-come settings on
    those seeds, then the ratios of the medians."""
    ref_key = reference({key: {s: by_seed[s] for s in pick} for key, by_seed in fcfs.items()})
    return _ratios(
        _medians({s: point[s] for s in pick}),
        _medians({s: fcfs[ref_key][s] for s in pick}),
        _medians({s: same[s] for s in pick}),
    )


def resolution(rows: Sequence[dict[str, Any]], k: int, draws: int = 4000) -> str:
    """What a report on ``k`` seeds can tell, read from runs on many more: per priority
    configuration with kv_fixed_credit at its order, its verdict on every seed (REF chosen on all
    of them), then over ``draws`` reports of ``k`` seeds drawn without replacement (a fixed
    generator), each judged as a report is - REF chosen by ``reference`` on its own seeds, ratios
    of its medians - the share meeting the whole corner, the share meeting the placement part
    (>= TARGET_SAME over kv_fixed_credit at the same order) and that ratio's 10th/50th/90th
    percentiles."""
    rng = random.Random(0)
    out: list[str] = []
    for cell, configs in grouped(rows).items():
        fcfs = first_come(configs)
        if not fcfs:
            continue
        ref_all = reference(configs)
        out += [
            "",
            f"### {cell[0]}, storage {cell[1]}: every seed (REF = {ref_all[0]}@{ref_all[1]}) and"
            f" {k}-seed reports ({draws} draws, REF chosen in each)",
            "",
            "| configuration | seeds | every seed: p50 vs REF, vs same order, p99 / REF, max / REF | corner"
            f" | {k}-seed reports meeting the corner | meeting placement (>= {TARGET_SAME:g}x)"
            f" | {k}-seed placement: p10 / p50 / p90 |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, by_seed in configs.items():
            same = configs.get((BASELINE, key[1]))
            if key[1] == "fcfs" or same is None:
                continue
            seeds = sorted(
                s for s in by_seed if s in same and all(s in ref_seeds for ref_seeds in fcfs.values())
            )
            if len(seeds) < k:
                continue

            every = _judged(seeds, fcfs, by_seed, same)
            reports = [_judged(rng.sample(seeds, k), fcfs, by_seed, same) for _ in range(draws)]
            q = percentiles([r.g_same for r in reports], (10, 50, 90))
            out.append(
                f"| {key[0]}@{key[1]} | {len(seeds)} | {every.g_ref:.2f}x, {every.g_same:.2f}x,"
                f" {every.r99:.2f}, {every.rmax:.2f} | {'**met**' if every.meets() else 'missed'}"
                f" | {sum(r.meets() for r in reports) / draws:.0%}"
                f" | {sum(r.g_same >= TARGET_SAME for r in reports) / draws:.0%}"
                f" | {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} |"
            )
    return "\n".join(out).lstrip("\n") + "\n"


def _emit(text: str, md: Path | None) -> None:
    """A table to ``md``, or to stdout without one."""
    if md:
        md.write_text(text)
    else:
        print(text)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.frontier", description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", nargs="+", type=Path, help="bench_quality .jsonl files")
    ap.add_argument("--md", type=Path)
    ap.add_argument("--csv", type=Path)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--shape", type=Path, help="markdown: the medians along S and along H")
    ap.add_argument(
        "--near", type=int, metavar="SEED", help="print the points within NEAR of the corner on SEED"
    )
    ap.add_argument(
        "--spread",
        type=int,
        metavar="K",
        help="markdown instead: per-seed ratios and what a K-seed report would read (see ``spread``)",
    )
    ap.add_argument(
        "--resolution",
        type=int,
        metavar="K",
        help="markdown instead: each configuration's verdict on every seed and what K-seed reports"
        " drawn from them would read (see ``resolution``)",
    )
    args = ap.parse_args(argv)
    rows = load(args.raw)
    if args.resolution is not None:
        _emit(resolution(rows, args.resolution), args.md)
        return 0
    refs, pts = points(rows)
    if args.near is not None:
        for p in near(pts, args.near):
            print(f"{p.cell[0]}\t{p.cell[1]}\t{p.policy}@{p.scheduling}")
        return 0
    _emit(markdown(rows, refs, pts) if args.spread is None else spread(rows, refs, args.spread), args.md)
    if args.csv:
        write_csv(rows, args.csv)
    if args.shape:
        args.shape.write_text(shape(pts))
    if args.png:
        plot(pts, refs, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
