"""The sweep over workload x load x arm x setting x seed, and picking each arm's best.

**Load** is set by the calibration (:mod:`kvgate_bench.effectiveness.calibration`).

**Tuning.** Every setting of :func:`kvgate_bench.effectiveness.arms.registry.candidates` runs on
the same schedules (same seeds) as the others; for each workload and load the setting with the
best goodput on the tuning seed alone (``--tune-seed``, by default the first seed, ``--seed``)
is reported for its arm, on every seed, each row flagged ``tuning_seed``; the printed figures
average the other seeds, the report seeds (with one seed, tuned on the very schedules it is
scored on: a generous tuning for the baselines). kvgate runs its one default policy.

**Replays.** Reject precision and the Retry-After error (defined in
:mod:`kvgate_bench.effectiveness.model.metrics`) are measured only for the reported rows (each
arm's best setting, every seed): :func:`replay_best` replays each of up to ``Task.replays`` sampled
rejections of such a row (:mod:`kvgate_bench.effectiveness.replay`) on the same process pool as
:func:`run_all`: one forced replay per sampled rejection and one probe replay per sampled
rejection that carried a Retry-After.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvgate_bench.effectiveness.arms.registry import ARM_NAMES, candidates, make_arm
from kvgate_bench.effectiveness.calibration import Calibration
from kvgate_bench.effectiveness.model.driver import simulate
from kvgate_bench.effectiveness.model.engines import Engine, engine_of
from kvgate_bench.effectiveness.model.gate import Arm
from kvgate_bench.effectiveness.model.metrics import summarize
from kvgate_bench.effectiveness.model.schedule import Schedule
from kvgate_bench.effectiveness.model.workloads import (
    DEFAULT_NOISY_LOAD,
    generate,
    isolation_load,
    tenants_of,
)
from kvgate_bench.effectiveness.replay import (
    DEFAULT_REPLAYS,
    precision,
    replay_forced,
    replay_probes,
    retry_after_error,
    sample_rejected,
)


@dataclass(frozen=True)
class Task:
    """One simulated run: an arm setting on one schedule."""

    workload: str
    load: float
    seed: int
    arm: str
    params: tuple[tuple[str, Any], ...]
    profile: str
    duration_s: float
    calibration: Calibration
    #: Rejections sampled for the replays (0: none).
    replays: int = DEFAULT_REPLAYS
    #: ``isolation``'s noisy offer, x capacity (``load`` is then ``isolation_load`` of it).
    noisy_load: float = DEFAULT_NOISY_LOAD


def arm_factory(task: Task) -> tuple[Schedule, Callable[[], Arm], Engine]:
    """(``task``'s schedule, a factory of fresh arms of its setting, its engine): what a run
    and each of its replays start from."""
    eng = engine_of(task.profile)
    cal = task.calibration
    ctx = cal.context(eng.steptime, task.workload, eng.config, eng.slo)
    sched = generate(
        task.workload,
        cal.rate(task.load),
        task.duration_s,
        task.seed,
        noisy_load=task.noisy_load,
        max_model_len=eng.config.max_model_len,
    )
    return sched, lambda: make_arm(task.arm, ctx, dict(task.params)), eng


#: The row key of the rejections sampled for the replays (removed by :func:`replay_best`).
SAMPLE_KEY = "replay_sample"


def run_task(task: Task) -> dict[str, Any]:
    """Simulate ``task``; its summary row (see
    :func:`kvgate_bench.effectiveness.model.metrics.summarize`) with ``workload``, ``load``,
    ``arm`` and ``seed``, and under :data:`SAMPLE_KEY` the rejections sampled for the replays:
    ``{"rejected": [rid, ...], "retry": {rid: Retry-After s}}``."""
    sched, make, eng = arm_factory(task)
    run = simulate(sched, make(), eng.steptime, eng.config)
    row: dict[str, Any] = {
        "workload": task.workload,
        "load": task.load,
        "arm": task.arm,
        "seed": task.seed,
        "profile": eng.name,
    }
    if task.workload == "isolation":
        row["noisy_load"] = task.noisy_load
    row.update(summarize(run, eng.score_slo))
    row["rate_rps"] = sched.rate_rps
    retry = sample_rejected(run.records, task.replays, task.seed, with_retry_after=True)
    row[SAMPLE_KEY] = {
        "rejected": [r.request.rid for r in sample_rejected(run.records, task.replays, task.seed)],
        "retry": {r.request.rid: float(r.retry_after_s or 0.0) for r in retry},
    }
    return row


def build_tasks(
    workloads: Iterable[str],
    loads: Iterable[float],
    seeds: Iterable[int],
    calibrations: dict[str, Calibration],
    prof: str,
    duration_s: float,
    short: bool,
    arms: Iterable[str] = ARM_NAMES,
    noisy_loads: Iterable[float] = (DEFAULT_NOISY_LOAD,),
) -> list[Task]:
    """Every (workload, load, seed, arm, setting) run, the heaviest (highest load) first.
    ``isolation`` runs at its ``noisy_loads`` (load ``isolation_load(K)``), not ``loads``."""
    tasks = []
    arm_list = list(arms)
    seqs = engine_of(prof).config.max_num_seqs
    for w in workloads:
        tenants = {t.name: t for t in tenants_of(w)}
        points = (
            [(isolation_load(k), k) for k in noisy_loads]
            if w == "isolation"
            else [(load, DEFAULT_NOISY_LOAD) for load in loads]
        )
        for load, noisy in points:
            for seed in seeds:
                for arm in arm_list:
                    for p in candidates(arm, tenants, short, seqs):
                        params = tuple(sorted(p.items()))
                        cal = calibrations[w]
                        tasks.append(
                            Task(
                                w, load, seed, arm, params, prof, duration_s, cal, noisy_load=noisy
                            )
                        )
    tasks.sort(key=lambda t: -t.load)
    return tasks


T = TypeVar("T")


def run_parallel(
    fn: Callable[[T], dict[str, Any]],
    tasks: list[T],
    jobs: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """``fn`` over ``tasks`` on ``jobs`` processes (1: in this process); rows in task order,
    ``progress(done, total)`` after each."""
    rows: list[dict[str, Any]] = []
    if jobs <= 1:
        for i, t in enumerate(tasks):
            rows.append(fn(t))
            if progress:
                progress(i + 1, len(tasks))
        return rows
    ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    with ctx.Pool(jobs) as pool:
        for i, row in enumerate(pool.imap(fn, tasks, chunksize=1)):
            rows.append(row)
            if progress:
                progress(i + 1, len(tasks))
    return rows


def run_all(
    tasks: list[Task], jobs: int, progress: Callable[[int, int], None] | None = None
) -> list[dict[str, Any]]:
    """Run ``tasks`` on ``jobs`` processes (1: in this process); rows in task order."""
    return run_parallel(run_task, tasks, jobs, progress)


def _key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


@dataclass(frozen=True)
class ReplayUnit:
    """One replay of a reported row: force request ``rid`` past the arm, or (``rid`` None)
    probe the rejections of ``suggested`` (id, Retry-After s; one per replay, so that the
    retries of one do not change what the arm decides on another)."""

    row: int
    task: Task
    rid: str | None = None
    suggested: tuple[tuple[str, float], ...] = ()


def run_replay(unit: ReplayUnit) -> tuple[int, str | None, Any, float]:
    """(row, rid, result, CPU s) of ``unit``: result = met its SLO (bool) for a forced replay,
    id -> actual wait (s or None) for a probe replay; the CPU seconds (process time) cover
    the whole unit (the schedule's generation and the arm's construction too)."""
    c0 = time.process_time()
    sched, make, eng = arm_factory(unit.task)
    if unit.rid is not None:
        met, _ = replay_forced(sched, make, eng.steptime, unit.rid, eng.config, eng.score_slo)
        return unit.row, unit.rid, met, time.process_time() - c0
    waits, _ = replay_probes(sched, make, eng.steptime, dict(unit.suggested), eng.config)
    return unit.row, None, waits, time.process_time() - c0


def replay_units(
    tasks: list[Task], rows: list[dict[str, Any]], chosen: list[dict[str, Any]]
) -> list[ReplayUnit]:
    """The replays of ``chosen`` (rows of ``rows``, which are ``tasks``' rows in order)."""
    by_key = {
        (r["workload"], r["load"], r["arm"], r["seed"], _key(r["params"])): t
        for r, t in zip(rows, tasks, strict=True)
    }
    units: list[ReplayUnit] = []
    for i, r in enumerate(chosen):
        task = by_key[(r["workload"], r["load"], r["arm"], r["seed"], _key(r["params"]))]
        sample = r.get(SAMPLE_KEY) or {"rejected": [], "retry": {}}
        units.extend(ReplayUnit(i, task, rid) for rid in sample["rejected"])
        units.extend(
            ReplayUnit(i, task, None, ((rid, ra),)) for rid, ra in sorted(sample["retry"].items())
        )
    return units


def replay_best(
    tasks: list[Task],
    rows: list[dict[str, Any]],
    chosen: list[dict[str, Any]],
    jobs: int,
    progress: Callable[[int, int], None] | None = None,
) -> float:
    """Fill ``reject_precision``, ``reject_replays``, ``retry_after_error_s``,
    ``retry_after_abs_error_s``, ``retry_after_samples``, ``retry_after_censored`` and
    ``replay_cpu_s`` of the ``chosen`` rows by replay, on ``jobs`` processes; drop
    :data:`SAMPLE_KEY` from every row. Returns the replays' CPU seconds."""
    units = replay_units(tasks, rows, chosen)
    met: dict[int, list[bool]] = {}
    waits: dict[int, dict[str, float | None]] = {}
    cpu: dict[int, float] = {}

    def take(res: tuple[int, str | None, Any, float]) -> None:
        i, rid, value, c = res
        cpu[i] = cpu.get(i, 0.0) + c
        if rid is not None:
            met.setdefault(i, []).append(bool(value))
        else:
            waits.setdefault(i, {}).update(value)

    if jobs <= 1:
        for k, u in enumerate(units):
            take(run_replay(u))
            if progress:
                progress(k + 1, len(units))
    else:
        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with ctx.Pool(jobs) as pool:
            for k, res in enumerate(pool.imap_unordered(run_replay, units, chunksize=1)):
                take(res)
                if progress:
                    progress(k + 1, len(units))
    for i, r in enumerate(chosen):
        sample = r.get(SAMPLE_KEY) or {"rejected": [], "retry": {}}
        r["reject_precision"] = precision(met.get(i, []))
        r["reject_replays"] = len(met.get(i, []))
        err = retry_after_error(sample["retry"], waits.get(i, {}))
        r["retry_after_error_s"] = err.median_s
        r["retry_after_abs_error_s"] = err.median_abs_s
        r["retry_after_samples"] = err.samples
        r["retry_after_censored"] = err.censored
        r["replay_cpu_s"] = cpu.get(i, 0.0)
    for r in rows:
        r.pop(SAMPLE_KEY, None)
    for r in chosen:
        r.pop(SAMPLE_KEY, None)
    return sum(cpu.values())


def tuning_seed_of(rows: Iterable[dict[str, Any]], tune_seed: int | None = None) -> int:
    """The seed the settings are chosen on: ``tune_seed``, or the first (lowest) seed of
    ``rows``. Raises ``ValueError`` when ``rows`` hold no run of it."""
    seeds = {int(r["seed"]) for r in rows}
    if not seeds:
        raise ValueError("no rows to choose settings from")
    seed = min(seeds) if tune_seed is None else tune_seed
    if seed not in seeds:
        raise ValueError(f"tuning seed {seed} is not one of the seeds run {sorted(seeds)}")
    return seed


def tuning_plan(seeds: list[int], tune_seed: int | None) -> tuple[int, list[int], str]:
    """A run's tuning from its options: (the tuning seed, ``tune_seed`` or the first of
    ``seeds``; the report seeds, the others, or the tuning seed alone when it is the only one;
    the rule in words, :func:`tuning_text`). Raises ``ValueError`` (the message names
    ``--tune-seed``) when the tuning seed is not one of ``seeds``."""
    tune = seeds[0] if tune_seed is None else tune_seed
    if tune not in seeds:
        raise ValueError(f"--tune-seed {tune} is not one of the seeds run {seeds}")
    report = [s for s in seeds if s != tune] or [tune]
    return tune, report, tuning_text(tune, report)


def tuning_text(tune_seed: int, report_seeds: list[int]) -> str:
    """The run's tuning rule in words (printed and in the JSON's ``meta.tuning``)."""
    if report_seeds == [tune_seed]:
        return f"settings chosen on seed {tune_seed} and reported on it (one seed)"
    return (
        f"settings chosen on seed {tune_seed}; reported on seeds {','.join(map(str, report_seeds))}"
    )


def report_rows(chosen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``chosen`` the report averages: those of the report seeds, or every row
    when only the tuning seed ran (one seed: tuned and reported on the same schedules)."""
    report = [r for r in chosen if not r.get("tuning_seed")]
    return report if report else chosen


def pick_best(
    rows: list[dict[str, Any]], tune_seed: int | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows of each arm's best setting per workload and load, every seed's, each flagged
    ``tuning_seed``: true on the tuning seed's row; the sweep: one entry per setting with its
    mean goodput, interactive goodput, SLO attainment and preemptions over all seeds, and its
    goodput on the tuning seed and mean goodput over the report seeds).

    The best setting is the one with the highest goodput on the tuning seed alone
    (``tune_seed``, by default the first seed of ``rows``; see :func:`tuning_seed_of`), so the
    seeds it is reported on take no part in choosing it. Raises ``ValueError`` when ``rows``
    hold no run of ``tune_seed``."""
    if not rows:
        return [], []
    tune = tuning_seed_of(rows, tune_seed)
    groups: dict[tuple[str, float, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["load"], r["arm"], _key(r["params"])), []).append(r)
    sweep = []
    for (w, load, arm, _), rs in groups.items():
        tuned = [r for r in rs if r["seed"] == tune]
        others = [r for r in rs if r["seed"] != tune]
        sweep.append(
            {
                "workload": w,
                "load": load,
                "arm": arm,
                "params": rs[0]["params"],
                "seeds": len(rs),
                "goodput_tokens_per_s": _mean(r["goodput_tokens_per_s"] for r in rs),
                "interactive_goodput_tokens_per_s": _mean(
                    r["interactive_goodput_tokens_per_s"] for r in rs
                ),
                "slo_attainment": _mean(r["slo_attainment"] for r in rs),
                "preemptions_per_1k": _mean(r["preemptions_per_1k"] for r in rs),
                "tuning_seed": tune,
                "tuning_goodput_tokens_per_s": _mean(r["goodput_tokens_per_s"] for r in tuned),
                "report_goodput_tokens_per_s": _mean(r["goodput_tokens_per_s"] for r in others),
                "report_interactive_goodput_tokens_per_s": _mean(
                    r["interactive_goodput_tokens_per_s"] for r in others
                ),
                "report_slo_attainment": _mean(r["slo_attainment"] for r in others),
            }
        )
    best: dict[tuple[str, float, str], dict[str, Any]] = {}
    for s in sweep:
        k = (s["workload"], s["load"], s["arm"])
        g = s["tuning_goodput_tokens_per_s"]
        if k not in best or (g is not None and _above(g, best[k]["tuning_goodput_tokens_per_s"])):
            best[k] = s
    chosen = [
        r
        for r in rows
        if _key(r["params"]) == _key(best[(r["workload"], r["load"], r["arm"])]["params"])
    ]
    for r in chosen:
        r["tuning_seed"] = r["seed"] == tune
    return chosen, sweep


def _above(g: float, than: float | None) -> bool:
    return than is None or g > than


def _mean(values: Iterable[Any]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None
