"""PNG plots of the effectiveness results: goodput, interactive TTFT p99 and preemptions against
load, one figure per workload and metric, one line per arm (its reported best setting; the mean
over seeds at each load). Rendered with matplotlib's non-interactive Agg backend (no display).

Arms past the tenth reuse matplotlib's ten colours with another line style (dashed, then
dotted), so that fifteen arms stay apart; the legend sits right of the axes.

An arm missing at a load (not run there, or its figure None, e.g. no request served) has a gap
in its line at that load; an arm with no value at all is left out of the figure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen
from matplotlib.ticker import FuncFormatter

from kvgate_bench.effectiveness.arms.registry import ARM_NAMES

#: Line styles by tens of arms (matplotlib's default colour cycle has ten colours).
LINE_STYLES: tuple[str, ...] = ("-", "--", ":")

#: (result key, y-axis label, file stem, log scale) of each figure.
FIGURES: tuple[tuple[str, str, str, bool], ...] = (
    ("goodput_tokens_per_s", "goodput (output tokens/s)", "goodput", False),
    ("ttft_p99_s", "interactive TTFT p99 (s, log scale)", "ttft-p99", True),
    ("preemptions_per_1k", "preemptions per 1,000 requests", "preemptions", False),
)


def _mean(values: Iterable[Any]) -> float:
    xs = [float(v) for v in values if v is not None]
    return sum(xs) / len(xs) if xs else math.nan


def arm_order(arms: Iterable[str]) -> list[str]:
    """``arms`` in report order: those of :data:`ARM_NAMES` first, then the others sorted."""
    present = set(arms)
    return [a for a in ARM_NAMES if a in present] + sorted(present - set(ARM_NAMES))


def series(
    results: Sequence[dict[str, Any]], workload: str, arm: str, key: str, loads: Sequence[float]
) -> list[float]:
    """Mean of ``key`` over the seeds of ``arm`` on ``workload`` at each of ``loads``; NaN
    where it has no value (a gap in the line)."""
    return [
        _mean(
            r.get(key)
            for r in results
            if r["workload"] == workload and r["arm"] == arm and r["load"] == load
        )
        for load in loads
    ]


def write_plots(results: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    """Write ``effectiveness-<workload>-<figure>.png`` under ``out`` (created) for each workload
    of ``results`` (rows with ``workload``, ``load``, ``arm`` and the keys of
    :data:`FIGURES`); returns the paths written, in order."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for w in sorted({r["workload"] for r in results}):
        at = [r for r in results if r["workload"] == w]
        loads = sorted({float(r["load"]) for r in at})
        arms = arm_order(r["arm"] for r in at)
        for key, label, stem, log in FIGURES:
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            drawn = 0
            for i, arm in enumerate(arms):
                ys = series(at, w, arm, key, loads)
                if log:
                    ys = [y if y > 0 else math.nan for y in ys]
                if all(math.isnan(y) for y in ys):
                    continue
                style = LINE_STYLES[(i // 10) % len(LINE_STYLES)]
                ax.plot(loads, ys, marker="o", linestyle=style, color=f"C{i % 10}", label=arm)
                drawn += 1
            if log and drawn:
                ax.set_yscale("log")
                plain = FuncFormatter(lambda y, _pos: f"{y:g}")
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(plain)
            ax.set_xticks(loads)
            ax.set_xlabel("load (x the none arm's goodput capacity)")
            ax.set_ylabel(label)
            ax.set_title(f"{w}: {label.split(' (')[0]}")
            ax.grid(True, alpha=0.3)
            if drawn:
                ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
            path = out / f"effectiveness-{w}-{stem}.png"
            fig.savefig(path, dpi=100, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
    return written
