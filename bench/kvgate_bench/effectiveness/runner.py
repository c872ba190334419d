"""Calibration, the sweep over workload x load x arm x setting x seed, and picking each arm's best.

**Load.** Load L means an offered output-token rate of L x the ``none`` arm's goodput capacity:
``rate(L) = L x C / E[out]`` requests per second, where ``E[out]`` is the mean output a request
of the workload produces when served to the end (its true length capped by its max_tokens, or by
the engine's default when unset; over 20,000 seeded requests) and ``C`` is the largest goodput
(tokens/s) the ``none`` arm reaches over arrival rates: :func:`calibrate` doubles the rate from
1 request/s until goodput stops growing by 5 %, then narrows the peak by golden-section search
on the log of the rate (calibration schedules of ``duration_s``, seed ``seed``).

**Tuning.** Every setting of :func:`kvgate_bench.effectiveness.arms.candidates` runs on the same
schedules (same seeds) as the others; for each workload and load the setting with the best mean
goodput over seeds is reported for its arm (tuned on the very schedules it is scored on: a
generous tuning for the baselines). kvgate runs its one default policy.

**Replays.** Reject precision and the Retry-After error (defined in
:mod:`kvgate_bench.effectiveness.metrics`) are measured only for the reported rows (each arm's
best setting, every seed): :func:`replay_best` replays each of up to ``Task.replays`` sampled
rejections of such a row (:mod:`kvgate_bench.effectiveness.replay`) on the same process pool as
:func:`run_all`: one forced replay per sampled rejection and one probe replay per sampled
rejection that carried a Retry-After.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from kvgate_bench.effectiveness.arms import ARM_NAMES, ArmContext, candidates, make_arm
from kvgate_bench.effectiveness.driver import (
    Arm,
    engine_config,
    engine_default_max_tokens,
    simulate,
)
from kvgate_bench.effectiveness.metrics import summarize
from kvgate_bench.effectiveness.replay import (
    DEFAULT_REPLAYS,
    precision,
    replay_forced,
    replay_probes,
    retry_after_error,
    sample_rejected,
)
from kvgate_bench.effectiveness.sessions import planned_turns
from kvgate_bench.effectiveness.workloads import (
    DEFAULT_NOISY_LOAD,
    Schedule,
    calibration_workload,
    generate,
    isolation_load,
    served_output_tokens,
    tenants_of,
)
from kvgate_bench.sim.steptime import StepTimeModel, profile

#: Requests sampled for ``E[out]`` and ``E[prompt + out]``.
MEAN_SAMPLE = 20_000


@dataclass
class Calibration:
    """The ``none`` arm's goodput capacity for one workload and profile.

    Attributes:
        workload, profile: what was calibrated.
        capacity_goodput_tokens_per_s: ``C``, the largest goodput seen, output tokens/s.
        peak_rate_rps: the arrival rate at which it was seen, requests/s.
        mean_output_tokens: ``E[out]``, tokens per request.
        mean_total_tokens: ``E[prompt + out]``, tokens per request.
        probes: (rate requests/s, goodput tokens/s) of every calibration run.
    """

    workload: str
    profile: str
    capacity_goodput_tokens_per_s: float
    peak_rate_rps: float
    mean_output_tokens: float
    mean_total_tokens: float
    probes: list[tuple[float, float]] = field(default_factory=list)

    @property
    def load1_rate_rps(self) -> float:
        """Arrival rate at load 1, requests/s: ``C / E[out]``."""
        return self.capacity_goodput_tokens_per_s / self.mean_output_tokens

    def rate(self, load: float) -> float:
        """Arrival rate at ``load``, requests/s."""
        return load * self.load1_rate_rps

    def context(self, steptime: StepTimeModel, workload: str) -> ArmContext:
        """What the arms may know: the engine, the tenants and the capacity at load 1."""
        return ArmContext(
            engine_config(steptime),
            {t.name: t for t in tenants_of(workload)},
            self.load1_rate_rps,
            self.load1_rate_rps * self.mean_total_tokens,
        )


def mean_lengths(workload: str, seed: int) -> tuple[float, float]:
    """(E[out], E[prompt + out]) of ``workload``'s requests served to the end, tokens."""
    sched = generate(workload, 100.0, MEAN_SAMPLE / 100.0, seed + 7919)
    if sched.sessions is not None:  # every turn, each answer served whole
        turns = planned_turns(sched, engine_default_max_tokens)
        outs = [answered for _, answered in turns]
        totals = [o + r.prompt_tokens for r, o in turns]
        return sum(outs) / len(outs), sum(totals) / len(totals)
    outs = [served_output_tokens(r, engine_default_max_tokens) for r in sched.requests]
    totals = [o + r.prompt_tokens for o, r in zip(outs, sched.requests, strict=True)]
    return sum(outs) / len(outs), sum(totals) / len(totals)


def steptime_of(prof: str) -> StepTimeModel:
    """The step-time model named ``prof``: a profile name (``steptime.PROFILES``), optionally
    ``@`` a KV pool in tokens replacing the profile's (``h100-llama3-8b@65536``: the same GPU
    with less room for KV, e.g. a larger model's weights). Raises ``ValueError`` for an
    unknown profile or a pool that is not a positive integer."""
    name, _, pool = prof.partition("@")
    st = profile(name)
    if not pool:
        return st
    if not pool.isdigit() or int(pool) <= 0:
        raise ValueError(f"KV pool must be a positive number of tokens, got {pool!r}")
    return dataclasses.replace(st, kv_capacity_tokens=int(pool))


def none_goodput(workload: str, rate: float, duration_s: float, seed: int, prof: str) -> float:
    """Goodput of the ``none`` arm at ``rate`` requests/s, output tokens/s."""
    steptime = steptime_of(prof)
    run = simulate(
        generate(workload, rate, duration_s, seed), make_arm("none", _dummy(), {}), steptime
    )
    return float(summarize(run)["goodput_tokens_per_s"])


def _dummy() -> ArmContext:
    return ArmContext(engine_config(profile("constant")), {}, 1.0, 1.0)


def calibrate(workload: str, prof: str, duration_s: float, seed: int) -> Calibration:
    """Measure the ``none`` arm's goodput capacity (see the module docstring) on
    ``calibration_workload(workload)`` (``isolation`` is measured as ``conversation``)."""
    workload = calibration_workload(workload)
    probes: dict[float, float] = {}

    def g(rate: float) -> float:
        if rate not in probes:
            probes[rate] = none_goodput(workload, rate, duration_s, seed, prof)
        return probes[rate]

    rate = 1.0
    while g(2 * rate) > 1.05 * g(rate) and rate < 4096:
        rate *= 2
    # The peak lies in [rate / 2, 4 rate]: golden-section search on log(rate).
    lo, hi = math.log(rate / 2), math.log(rate * 4)
    phi = (math.sqrt(5) - 1) / 2
    a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    for _ in range(5):
        if g(math.exp(a)) >= g(math.exp(b)):
            hi, b = b, a
            a = hi - phi * (hi - lo)
        else:
            lo, a = a, b
            b = lo + phi * (hi - lo)
    peak_rate = max(probes, key=lambda r: probes[r])
    mean_out, mean_total = mean_lengths(workload, seed)
    return Calibration(
        workload,
        prof,
        probes[peak_rate],
        peak_rate,
        mean_out,
        mean_total,
        sorted(probes.items()),
    )


def _calibrate_args(args: tuple[str, str, float, int]) -> Calibration:
    return calibrate(*args)


def calibrate_all(
    workloads: list[str], prof: str, duration_s: float, seed: int, jobs: int
) -> list[Calibration]:
    """:func:`calibrate` each of ``workloads``, on up to ``jobs`` processes; in order (a
    workload measured as another, :func:`calibration_workload`, shares its calibration)."""
    unique = list(dict.fromkeys(calibration_workload(w) for w in workloads))
    work = [(w, prof, duration_s, seed) for w in unique]
    if jobs <= 1 or len(work) == 1:
        found = [_calibrate_args(a) for a in work]
    else:
        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with ctx.Pool(min(jobs, len(work))) as pool:
            found = pool.map(_calibrate_args, work)
    by_name = dict(zip(unique, found, strict=True))
    return [by_name[calibration_workload(w)] for w in workloads]


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


def arm_factory(task: Task) -> tuple[Schedule, Callable[[], Arm], StepTimeModel]:
    """(``task``'s schedule, a factory of fresh arms of its setting, its step-time model): what
    a run and each of its replays start from."""
    steptime = steptime_of(task.profile)
    cal = task.calibration
    ctx = cal.context(steptime, task.workload)
    sched = generate(
        task.workload, cal.rate(task.load), task.duration_s, task.seed, noisy_load=task.noisy_load
    )
    return sched, lambda: make_arm(task.arm, ctx, dict(task.params)), steptime


#: The row key of the rejections sampled for the replays (removed by :func:`replay_best`).
SAMPLE_KEY = "replay_sample"


def run_task(task: Task) -> dict[str, Any]:
    """Simulate ``task``; its summary row (see :func:`kvgate_bench.effectiveness.metrics.summarize`)
    with ``workload``, ``load``, ``arm`` and ``seed``, and under :data:`SAMPLE_KEY` the
    rejections sampled for the replays: ``{"rejected": [rid, ...], "retry": {rid: Retry-After
    s}}``."""
    sched, make, steptime = arm_factory(task)
    run = simulate(sched, make(), steptime)
    row: dict[str, Any] = {
        "workload": task.workload,
        "load": task.load,
        "arm": task.arm,
        "seed": task.seed,
    }
    if task.workload == "isolation":
        row["noisy_load"] = task.noisy_load
    row.update(summarize(run))
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
                    for p in candidates(arm, tenants, short):
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
    sched, make, steptime = arm_factory(unit.task)
    if unit.rid is not None:
        met, _ = replay_forced(sched, make, steptime, unit.rid)
        return unit.row, unit.rid, met, time.process_time() - c0
    waits, _ = replay_probes(sched, make, steptime, dict(unit.suggested))
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


def pick_best(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows of each arm's best setting per workload and load, the sweep: one entry per
    setting with its mean goodput, interactive goodput and SLO attainment over seeds)."""
    groups: dict[tuple[str, float, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["load"], r["arm"], _key(r["params"])), []).append(r)
    sweep = []
    for (w, load, arm, _), rs in groups.items():
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
            }
        )
    best: dict[tuple[str, float, str], dict[str, Any]] = {}
    for s in sweep:
        k = (s["workload"], s["load"], s["arm"])
        if k not in best or s["goodput_tokens_per_s"] > best[k]["goodput_tokens_per_s"]:
            best[k] = s
    chosen = [
        r
        for r in rows
        if _key(r["params"]) == _key(best[(r["workload"], r["load"], r["arm"])]["params"])
    ]
    return chosen, sweep


def _mean(values: Iterable[Any]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def calibration_json(cal: Calibration) -> dict[str, Any]:
    """``cal`` as JSON-ready data, with the load-1 rate."""
    d = asdict(cal)
    d["load1_rate_rps"] = cal.load1_rate_rps
    return d
