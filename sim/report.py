"""Tables and plots of simulator results: a markdown table per run set, per-tier stacked hit bars
per policy (where the prompt tokens came from: GPU, CPU, STORAGE or recomputed), and PNG curves of
TTFT p50 and throughput against concurrency, one line per policy (matplotlib, headless).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class ResultRow(Protocol):
    """What the table needs of a result (sim.des.SimResult satisfies it)."""

    policy: str
    label: str

    def as_dict(self) -> dict[str, Any]: ...


_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # header, field, format
    ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
    ("p90 s", "ttft_p90_s", "{:.3f}"),
    ("p99 s", "ttft_p99_s", "{:.3f}"),
    ("turns/s", "turns_per_s", "{:.3g}"),
    ("tok/s", "tokens_per_s", "{:,.0f}"),
    ("hit GPU", "hit_gpu", "{:.3f}"),
    ("CPU", "hit_cpu", "{:.3f}"),
    ("STORAGE", "hit_storage", "{:.3f}"),
    ("miss", "miss", "{:.3f}"),
    ("ideal", "ideal_hit", "{:.3f}"),
    ("hit/ideal", "fraction_of_ideal", "{:.3f}"),
    ("imbalance", "load_imbalance", "{:.2f}"),
    ("TTFT / predicted", "ttft_over_predicted", "{:.2f}"),
    ("requests", "requests", "{:d}"),
    ("rejected", "rejected", "{:d}"),
    ("wall s", "wall_s", "{:.1f}"),
)


def _fmt(fmt: str, value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return fmt.format(value)


def markdown_table(results: Sequence[ResultRow], *, label_header: str = "run") -> str:
    """One row per result: label, policy, the figures (fractions of prompt tokens for hit rates)."""
    head = [label_header, "policy", *(c[0] for c in _COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        d = r.as_dict()
        cells = [str(r.label), r.policy, *(_fmt(fmt, d[key]) for _, key, fmt in _COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_vs_concurrency(results: Sequence[ResultRow], out_dir: Path, *, title: str = "") -> list[Path]:
    """TTFT p50 and turns/s against concurrency (``label`` must be the concurrency), one line per
    policy. Returns the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    by_policy: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for r in results:
        by_policy.setdefault(r.policy, []).append((float(r.label), r.as_dict()))
    written = []
    for key, ylabel, fname, log in (
        ("ttft_p50_s", "TTFT p50 (s)", "ttft_p50.png", True),
        ("turns_per_s", "throughput (turns/s)", "throughput.png", False),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, rows in by_policy.items():
            rows.sort(key=lambda x: x[0])
            ax.plot([x for x, _ in rows], [d[key] for _, d in rows], marker="o", label=policy)
        ax.set_xlabel("concurrent conversations")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        if title:
            ax.set_title(title)
        path = out_dir / fname
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


#: Stack order and colours: the cheapest source at the bottom.
_TIERS = (
    ("hit_gpu", "GPU hit", "#2b8a3e"),
    ("hit_cpu", "CPU hit", "#74b816"),
    ("hit_storage", "STORAGE hit", "#f59f00"),
    ("miss", "recomputed", "#ced4da"),
)


def plot_hits_by_tier(
    results: Sequence[ResultRow], out_dir: Path, *, title: str = "", label_name: str = ""
) -> list[Path]:
    """Where each policy's prompt tokens came from, one stacked bar per policy (GPU, CPU, STORAGE
    hits, recomputed) and one panel per run label (e.g. concurrency), with TTFT p50 above each bar.
    A plain hit fraction hides the difference: with a shared STORAGE pool every policy hits almost
    everything, but a STORAGE hit costs a load that a GPU hit does not. Returns the PNG written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    labels: list[str] = []
    by_label: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for r in results:
        if str(r.label) not in by_label:
            labels.append(str(r.label))
        by_label.setdefault(str(r.label), []).append((r.policy, r.as_dict()))
    fig, axes = plt.subplots(
        1, len(labels), figsize=(max(6.0, 0.55 * len(results) + 2.5), 5.0), sharey=True, squeeze=False
    )
    for ax, label in zip(axes[0], labels, strict=True):
        rows = by_label[label]
        xs = range(len(rows))
        bottom = [0.0] * len(rows)
        for key, name, colour in _TIERS:
            values = [0.0 if math.isnan(d[key]) else d[key] for _, d in rows]
            ax.bar(xs, values, bottom=bottom, color=colour, label=name, width=0.75)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        for x, (_, d) in zip(xs, rows, strict=True):
            if not math.isnan(d["ttft_p50_s"]):
                ax.annotate(f"{d['ttft_p50_s']:.2g}s", (x, 1.0), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [p for p, _ in rows], rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{label_name} {label}".strip(), fontsize=9)
        ax.set_ylim(0, 1.08)
    axes[0][0].set_ylabel("share of prompt tokens (label: TTFT p50)")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles[::-1], names[::-1], loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    path = out_dir / "hits_by_tier.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
