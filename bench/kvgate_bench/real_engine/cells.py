"""Step 2 of :mod:`kvgate_bench.real_engine.__main__`: the cells, each through the four arms
against the running llama-server, with the baselines' sweep, and each cell's virtual rows.

A cell is a workload at a load (:func:`cells`); its schedule is seeded by ``--seed`` and offers
the load x the calibrated capacity (``isolation``: its total load,
:func:`kvgate_bench.effectiveness.workloads.isolation_load`). The arms run in turn on the same
schedule: ``none``, ``concurrency-cap``, ``token-bucket``, ``kvgate``
(:func:`kvgate_bench.real_engine.client.run_arm`). The first cell sweeps the two baselines'
settings (:func:`sweeps`) and keeps the best goodput's; the later cells reuse it. Each row is
:func:`kvgate_bench.real_engine.report.build_row`'s (:func:`cell_row`); the virtual rows come
from :func:`kvgate_bench.real_engine.virtual.virtual_rows`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate_bench.effectiveness.arms import ArmContext
from kvgate_bench.effectiveness.metrics import summarize
from kvgate_bench.effectiveness.workloads import Schedule, generate, isolation_load
from kvgate_bench.real_engine import calibration as cal
from kvgate_bench.real_engine.client import BUCKET, CAP, KVGATE, NONE, ArmRun, run_arm
from kvgate_bench.real_engine.report import best_setting, build_row, output_stats, row_text
from kvgate_bench.real_engine.virtual import arm_context, virtual_rows
from kvgate_bench.sim.steptime import StepTimeModel


def cells(short: bool) -> list[tuple[str, float]]:
    """(workload, load) cells; ``isolation``'s load is its noisy tenant's (x capacity)."""
    if short:
        return [("multi-tenant", 2.0), ("multi-tenant", 1.0), ("isolation", 3.0)]
    return [("multi-tenant", 2.0), ("multi-tenant", 1.0), ("multi-tenant", 3.0), ("isolation", 3.0)]


def sweeps(short: bool, parallel: int, ttft_slo_s: float) -> dict[str, list[dict[str, Any]]]:
    """The baselines' settings swept (step 2 of :mod:`kvgate_bench.real_engine.__main__`'s
    docstring)."""
    wait = round(ttft_slo_s, 3)
    caps = [{"cap": max(1, parallel // 2), "queue_timeout_s": wait}]
    caps.append({"cap": parallel, "queue_timeout_s": wait})
    buckets = [{"factor": 1.0, "burst_s": 10.0}, {"factor": 1.5, "burst_s": 10.0}]
    if not short:
        caps.append({"cap": 2 * parallel, "queue_timeout_s": wait})
        buckets.append({"factor": 2.0, "burst_s": 10.0})
    return {CAP: caps, BUCKET: buckets}


def cell_row(
    run: ArmRun,
    workload: str,
    load: float,
    arm: str,
    args: argparse.Namespace,
    slo: cal.Slo,
    tuned: str,
) -> dict[str, Any]:
    """The JSON row of one arm's run in a cell, scored under the calibrated ``slo``: the
    summary and what only a real engine has (:mod:`kvgate_bench.real_engine.report`); ``tuned``
    says how the setting was chosen (``swept``, ``reused`` or ``-``)."""
    s = summarize(run.result, slo.pair())
    extra = {
        "tuned": tuned,
        "timeouts": run.timeouts,
        "errors_5xx": run.errors_5xx,
        "statuses": run.statuses,
        "send_lag_p99_s": run.send_lag_p99_s,
        "kept_up": run.kept_up,
        "engine": run.engine.summary(),
        "loadavg_before": run.loadavg_before,
        "loadavg_after": run.loadavg_after,
        "wall_s": run.wall_s,
        **output_stats(run.output_tokens, run.finish),
    }
    return build_row(s, workload=workload, load=load, arm=arm, seed=args.seed, extra=extra)


@dataclass
class CellRunner:
    """Runs the cells against the llama-server at ``url`` on the calibration ``c``
    (:func:`kvgate_bench.real_engine.calibration_run.calibrate`'s result).

    Attributes:
        url: llama-server's base URL.
        args: the parsed options (:func:`kvgate_bench.real_engine.cli.parse_args`).
        c: the calibration: its ``slo``, ``steptime``, ``capacity_rps``, ``mean_total_tokens``.
        words: the prompts' text (:func:`kvgate_bench.real_engine.client.corpus`).
        workdir: where the sidecar's log and policy go.
        client_cpus: the CPUs the sidecar is pinned to (``taskset -c``), or None.
        tuned: arm -> the setting the sweep chose (filled by the first cell).
        rows, vrows: the real and the virtual rows so far, cell by cell.
    """

    url: str
    args: argparse.Namespace
    c: dict[str, Any]
    words: list[str]
    workdir: Path
    client_cpus: str | None
    tuned: dict[str, dict[str, Any]] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    vrows: list[dict[str, Any]] = field(default_factory=list)

    async def run(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every cell of :func:`cells` in order; (real rows, virtual rows)."""
        for workload, load in cells(self.args.short):
            await self.run_cell(workload, load)
        return self.rows, self.vrows

    async def run_cell(self, workload: str, load: float) -> None:
        """One cell: its schedule through each arm, then its virtual rows."""
        args, c = self.args, self.c
        slo: cal.Slo = c["slo"]
        fitted: StepTimeModel = c["steptime"]
        total = isolation_load(load) if workload == "isolation" else load
        rate = total * c["capacity_rps"]
        sched = generate(
            workload,
            rate,
            args.duration,
            args.seed,
            max_model_len=args.ctx // args.parallel,
            noisy_load=load,
        )
        ctx = arm_context(workload, args, c["capacity_rps"], c["mean_total_tokens"], slo)
        print(
            f"{workload} load {load:g} ({rate:.3f} req/s, {len(sched.requests)} "
            f"requests over {args.duration:g} s)",
            flush=True,
        )
        cell_rows: dict[str, dict[str, Any]] = {}
        none_run: ArmRun | None = None
        for arm in (NONE, CAP, BUCKET, KVGATE):
            run = await self._run_arm(sched, ctx, workload, load, arm, cell_rows)
            if run is not None:
                none_run = run
        self.rows += cell_rows.values()
        assert none_run is not None
        self.vrows += virtual_rows(
            sched, none_run, cell_rows, ctx, fitted, slo, workload=workload, load=load, args=args
        )

    async def _run_arm(
        self,
        sched: Schedule,
        ctx: ArmContext,
        workload: str,
        load: float,
        arm: str,
        cell_rows: dict[str, dict[str, Any]],
    ) -> ArmRun | None:
        """``arm`` on the cell's schedule at each of its settings (the sweep, the tuned one, or
        none); its best-goodput row into ``cell_rows``. Returns ``none``'s run, else None."""
        args, slo = self.args, self.c["slo"]
        settings: list[dict[str, Any]] = [{}]
        if arm in self.tuned:
            settings = [self.tuned[arm]]
        elif arm in (CAP, BUCKET):
            settings = sweeps(args.short, args.parallel, slo.ttft_s)[arm]
        found: list[tuple[dict[str, Any], float]] = []
        none_run: ArmRun | None = None
        for params in settings:
            run = await run_arm(
                self.url,
                sched,
                arm,
                ctx,
                params,
                max_tokens=args.max_tokens,
                drain_s=args.drain,
                words=self.words,
                workdir=self.workdir,
                client_cpus=self.client_cpus,
            )
            how = "swept" if len(settings) > 1 else ("reused" if params else "-")
            row = cell_row(run, workload, load, arm, args, slo, how)
            row["params"] = params
            found.append((params, row["goodput_tokens_per_s"]))
            if arm == NONE:
                none_run = run
            if len(settings) > 1:
                print(
                    f"    {arm} {params}: goodput {row['goodput_tokens_per_s']:.1f}",
                    flush=True,
                )
            if (
                arm not in cell_rows
                or row["goodput_tokens_per_s"] > cell_rows[arm]["goodput_tokens_per_s"]
            ):
                cell_rows[arm] = row
        if arm in (CAP, BUCKET) and arm not in self.tuned:
            self.tuned[arm] = best_setting(found)
        print(row_text(cell_rows[arm], cell_rows.get(NONE)), flush=True)
        return none_run
