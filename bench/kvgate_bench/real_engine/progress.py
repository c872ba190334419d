"""What a real-engine run has left (pure): the cells x seeds planned but not finished, the tune
seed's sweeps done and left, and the arm runs left with their estimated hours. Each invocation
prints the last two as ``left: N arm runs, about X h``; ``--report FILE`` says all of it.

* **Planned** (:func:`planned`): the cells and seeds given (``--cells``, ``--seeds``), else
  the verdict's (:data:`~kvgate_bench.real_engine.plan.DEFAULT_CELLS` on seeds 2, 3, 4; a
  ``--short`` file's :data:`~kvgate_bench.real_engine.plan.SHORT_CELLS` on seed 2) with
  those the file's invocations ran with (each records its ``cells`` and ``seeds``) and every
  cell and report seed the file already holds added: a file whose invocations asked for part
  of the verdict is not reported as having nothing left.
* **Sweeps**: per cell that tunes a planned one
  (:func:`~kvgate_bench.real_engine.plan.tuned_on`), the settings of
  :func:`~kvgate_bench.real_engine.plan.sweeps` the file has a row for, and those it lacks
  (none once the cell is tuned).
* **Estimate**: each arm run left is its cell's sized schedule at the calibrated capacity,
  plus the drain and the restart (:func:`~kvgate_bench.real_engine.plan.unit_estimate_s`): an
  upper bound. Without a calibration nothing can be sized: the runs are counted, the hours
  are unknown (None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvgate_bench.real_engine import plan, resume
from kvgate_bench.real_engine.calibration import Slo

#: The default report seeds (``--short``: the first).
DEFAULT_SEEDS = (2, 3, 4)


def planned(
    doc: Mapping[str, Any],
    cells: Sequence[tuple[str, float]] | None = None,
    seeds: Sequence[int] | None = None,
) -> tuple[list[tuple[str, float]], list[int]]:
    """The cells and report seeds ``doc`` is checked against (module docstring)."""
    short = bool((doc.get("config") or {}).get("short"))
    held = [*doc["cells"], *doc["runs"]]
    ran = [i for i in doc.get("invocations", ()) if isinstance(i, dict) and "cells" in i]
    if cells is None:
        names = [plan.SHORT_CELLS if short else plan.DEFAULT_CELLS]
        names += [x for i in ran for x in i["cells"]] + [str(c["cell"]) for c in held]
        out_cells: list[tuple[str, float]] = []
        for name in names:
            for cell in plan.parse_cells(name):
                if cell not in out_cells:
                    out_cells.append(cell)
    else:
        out_cells = list(cells)
    if seeds is None:
        tune = int(doc["tune_seed"])
        found = {int(c["seed"]) for c in held} | {int(x) for i in ran for x in i.get("seeds") or ()}
        found |= set(DEFAULT_SEEDS[:1] if short else DEFAULT_SEEDS)
        out_seeds = sorted(found - {tune})
    else:
        out_seeds = list(seeds)
    return out_cells, out_seeds


def _sized(
    doc: Mapping[str, Any], config: Mapping[str, Any], workload: str, load: float, seed: int
) -> float | None:
    """One arm run's estimate on this cell and seed, seconds; None without a calibration."""
    c = doc.get("calibration")
    if not c:
        return None
    sched = plan.configured_schedule(config, float(c["capacity_rps"]), workload, load, seed)
    return plan.unit_estimate_s(sched.duration_s, float(config["drain_s"]))


def work_left(
    doc: Mapping[str, Any],
    cells: Sequence[tuple[str, float]],
    seeds: Sequence[int],
    config: Mapping[str, Any],
) -> dict[str, Any]:
    """What ``cells`` x ``seeds`` leave to run on ``doc`` (module docstring), under ``config``
    (the run's options as :func:`kvgate_bench.real_engine.cli.run_config` gives them, a resume
    file's ``config``): ``planned`` (cells x seeds), ``missing`` (``cell@seed`` not finished),
    ``sweeps`` ({tuning cell: {"done", "left", "tuned"}}), ``arm_runs`` and ``seconds`` (None
    without a calibration)."""
    c = doc.get("calibration")
    ttft = Slo(**c["slo"]).ttft_s if c else 0.0
    settings = plan.sweeps(bool(config["short"]), int(config["parallel"]), ttft)
    tune_seed = int(doc["tune_seed"])
    units, secs = 0, 0.0
    sweeps: dict[str, dict[str, Any]] = {}
    for w, load in sorted({plan.tuned_on(w, load) for w, load in cells}):
        key = plan.cell_key(w, load)
        done = sum(1 for arm, ps in settings.items() for p in ps
                   if resume.sweep_row(doc, key, arm, p) is not None)  # fmt: skip
        tuned = key in doc["tuned"]
        left = 0 if tuned else sum(len(ps) for ps in settings.values()) - done
        sweeps[key] = {"done": done, "left": left, "tuned": tuned}
        est = _sized(doc, config, w, load, tune_seed) if left else 0.0
        units += left
        secs += left * (est or 0.0)
    finished = resume.finished(doc)
    missing: list[str] = []
    for seed in seeds:
        for w, load in cells:
            key = plan.cell_key(w, load)
            if (key, seed) in finished:
                continue
            missing.append(f"{key}@{seed}")
            arms = plan.arms_of(w)
            n = sum(1 for a in arms if resume.run_row(doc, key, seed, a) is None)
            est = _sized(doc, config, w, load, seed) if n else 0.0
            units += n
            secs += n * (est or 0.0)
    return {
        "planned": len(cells) * len(seeds),
        "missing": missing,
        "sweeps": sweeps,
        "arm_runs": units,
        "seconds": secs if c else None,
    }


def left_text(units: int, seconds: float | None) -> str:
    """``left: N arm runs, about X h`` (the hours ``unknown`` before the calibration)."""
    hours = "unknown until calibrated" if seconds is None else f"{seconds / 3600:.1f} h"
    return f"left: {units} arm runs, about {hours}"


def lines(left: Mapping[str, Any], tune_seed: int) -> list[str]:
    """The printed lines of :func:`work_left`'s document."""
    missing = left["missing"]
    out = [
        f"to do: {len(missing)} of {left['planned']} cells x seeds planned not finished"
        + (f" ({', '.join(missing)})" if missing else "")
    ]
    for key, s in left["sweeps"].items():
        state = "tuned" if s["tuned"] else f"{s['left']} left"
        out.append(f"  tune seed {tune_seed}, {key}: {s['done']} sweep runs done, {state}")
    out.append(f"  {left_text(left['arm_runs'], left['seconds'])} (at most; in invocations of "
               "--budget-minutes, 60 by default)")  # fmt: skip
    return out
