"""Tables and plots of simulator results: a markdown table per run set and PNG curves of TTFT p50
and throughput against concurrency, one line per policy (matplotlib, headless).
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
        ("fraction_of_ideal", "hit rate / ideal", "hit_fraction.png", False),
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
