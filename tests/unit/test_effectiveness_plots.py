"""The effectiveness plots (PNG files from a synthetic results list) and the CLI's progress
display (an injected clock, a string stream)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from kvgate_bench.effectiveness.report.plots import arm_order, series, write_plots
from kvgate_bench.effectiveness.report.progress import Progress

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(
    workload: str, load: float, arm: str, seed: int, goodput: float, **kw: Any
) -> dict[str, Any]:
    r: dict[str, Any] = {
        "workload": workload,
        "load": load,
        "arm": arm,
        "seed": seed,
        "goodput_tokens_per_s": goodput,
        "ttft_p99_s": 0.2 * load,
        "preemptions_per_1k": 0.0,
    }
    r.update(kw)
    return r


def results() -> list[dict[str, Any]]:
    rows = []
    for load in (0.5, 1.0, 2.0):
        for seed in (1, 2):
            rows.append(row("conversation", load, "none", seed, 1000 * load + seed))
            rows.append(row("multi-tenant", load, "none", seed, 900 * load))
            if load != 1.0:  # the cap is missing at load 1
                rows.append(row("conversation", load, "concurrency-cap", seed, 1100 * load))
    # No request served: no TTFT at all for this arm (left out of the TTFT figure).
    rows.append(row("conversation", 2.0, "kvgate-test", 1, 0.0, ttft_p99_s=None))
    return rows


def test_plots_are_pngs_per_workload_and_figure(tmp_path: Path) -> None:
    out = tmp_path / "plots"
    paths = write_plots(results(), out)
    names = sorted(p.name for p in paths)
    assert names == sorted(
        f"effectiveness-{w}-{f}.png"
        for w in ("conversation", "multi-tenant")
        for f in ("goodput", "ttft-p99", "preemptions")
    )
    for p in paths:
        data = p.read_bytes()
        assert p.parent == out and data[:8] == PNG_MAGIC and len(data) > 1000


def test_series_averages_seeds_and_leaves_gaps() -> None:
    rs = results()
    loads = [0.5, 1.0, 2.0]
    assert series(rs, "conversation", "none", "goodput_tokens_per_s", loads) == [
        501.5,
        1001.5,
        2001.5,
    ]
    cap = series(rs, "conversation", "concurrency-cap", "goodput_tokens_per_s", loads)
    assert cap[0] == 550.0 and math.isnan(cap[1]) and cap[2] == 2200.0
    assert all(
        math.isnan(y) for y in series(rs, "conversation", "kvgate-test", "ttft_p99_s", loads)
    )
    assert arm_order(["kvgate-test", "none", "concurrency-cap"]) == [
        "none",
        "concurrency-cap",
        "kvgate-test",
    ]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_counts_elapsed_and_eta() -> None:
    clock = Clock()
    out = io.StringIO()
    show = Progress(out, live=False, clock=clock)
    runs = show.phase("runs")
    clock.t = 110.0
    runs(0, 20)  # the phase starts at 110 s
    clock.t = 120.0
    runs(10, 20)  # 10 runs in 10 s: 10 s left
    clock.t = 130.0
    runs(15, 20)  # not a tenth boundary: not printed
    runs(20, 20)
    assert out.getvalue().splitlines() == [
        "runs 0/20, elapsed 10 s",
        "runs 10/20, elapsed 20 s, ETA 10 s",
        "runs 20/20, elapsed 30 s",
    ]
    assert show.line("replays", 1, 4) == "replays 1/4, elapsed 30 s, ETA 0 s"
    clock.t = 136.0
    assert show.line("replays", 2, 4) == "replays 2/4, elapsed 36 s, ETA 6 s"


def test_live_progress_rewrites_one_line() -> None:
    clock = Clock()
    out = io.StringIO()
    show = Progress(out, live=True, clock=clock)
    show("runs", 1, 3)
    show("runs", 3, 3)
    text = out.getvalue()
    assert text.count("\r\x1b[K") == 2 and text.endswith("runs 3/3, elapsed 0 s\n")
    assert "\n" not in text[:-1]
